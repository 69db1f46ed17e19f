"""Helpers of the package's submodules that PYPKG.md §1.1 lists as reachable, with upstream's
signatures and results: ``v2.llm_types.check_layer_range(name, layer_range, allow_none=True)``,
``v2.llm_utils.parse_listen_ip_info`` (port as an int), ``layer_range_to_tensor_indices`` (two
tensors per layer by default), ``is_valid_id`` / ``is_invalid_id`` and the key packers."""

from __future__ import annotations

import pytest

from kvdd.llm_datadist import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex, LLMException, MemInfo, Memtype
from kvdd.llm_datadist.v2 import llm_types, llm_utils

NONE_ID = 2**64 - 1


def test_check_layer_range_signature() -> None:
    llm_types.check_layer_range("src_layer_range", None)
    llm_types.check_layer_range("src_layer_range", range(0, 2))
    with pytest.raises(TypeError):
        llm_types.check_layer_range("src_layer_range", None, False)
    with pytest.raises(LLMException, match="dst_layer_range"):
        llm_types.check_layer_range("dst_layer_range", range(0, 4, 2))


def test_llm_utils_helpers() -> None:
    assert llm_utils.parse_listen_ip_info("1.2.3.4:26000") == ("1.2.3.4", 26000)
    assert llm_utils.layer_range_to_tensor_indices(range(1, 2), None) == ([2, 3], [])
    assert llm_utils.is_valid_id(0) and llm_utils.is_invalid_id(NONE_ID) and llm_utils.is_invalid_id(-1)
    assert llm_utils.pack_cache_key(CacheKey(1, 2, 3, 4)) == (1, -1, 0, 2, 4, 3, False)
    assert llm_utils.pack_cache_key_by_id(CacheKeyByIdAndIndex(1, 5, 2)) == (1, 5, 2, NONE_ID, NONE_ID, 0, False)
    assert llm_utils.pack_block_cache_key(BlocksCacheKey(1, 7)) == (1, -1, 0, NONE_ID, NONE_ID, 7, True)
    assert llm_utils.pack_mem_info(MemInfo(Memtype.MEM_TYPE_DEVICE, 16, 32)) == (0, 16, 32)


def test_raise_helpers_take_format_arguments() -> None:
    from kvdd.llm_datadist.status import LLMStatusCode, raise_if_false, raise_if_true

    with pytest.raises(LLMException, match="^size 5 of 7$") as exc:
        raise_if_false(False, "size {0} of {n}", 5, n=7)
    assert exc.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as exc:
        raise_if_true(True, "{0}", 1, status_code=LLMStatusCode.LLM_FAILED)
    assert exc.value.status_code is LLMStatusCode.LLM_FAILED and str(exc.value) == "1"
    with pytest.raises(LLMException, match=r"^\{1: 0\}$"):  # no arguments: the text as given
        raise_if_false(False, "{1: 0}")


def test_a_hand_set_engine_double_is_used_under_upstreams_attribute_name() -> None:
    """Upstream-style tests set ``_llm_datadist`` (the native module an instance drives) by hand."""
    from unittest.mock import MagicMock

    from kvdd.llm_datadist import LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode
    from kvdd.llm_datadist.v2.cache_manager import CacheManager

    dd = LLMDataDist(LLMRole.MIX, 100)
    dd._is_initialized = True
    dd._enable_cache_mgr = True
    dd._engine_options = {"llm.LocalCommRes": "{}"}
    engine = MagicMock()
    engine.link_clusters_v2.return_value = (0, [0])
    dd._llm_datadist = engine
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    assert dd.link_clusters([info], 5000) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    engine.link_clusters_v2.assert_called_once_with([(1, 0, [], [])], 5000)
    cm = CacheManager(engine, {})
    engine.unregister_cache.return_value = 0
    cm.unregister_cache(3)
    engine.unregister_cache.assert_called_once_with(3)
    assert cm._llm_datadist is engine


def test_cache_desc_size_asks_the_native_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdd.llm_datadist import CacheDesc, DataType, llm_datadist_wrapper

    monkeypatch.setattr(llm_datadist_wrapper, "calc_tensor_size", lambda shape, dtype: 1234)
    assert CacheDesc(1, [2, 3], DataType.DT_INT8).size == 1234


def test_a_non_numeric_listen_port_is_int_s_value_error_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"invalid literal for int\(\).*'abc'.*llm.listenIpInfo '1.2.3.4:abc'"):
        llm_utils.parse_listen_ip_info("1.2.3.4:abc")
