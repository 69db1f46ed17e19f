"""The module surface of kvdd.llm_datadist (PYPKG.md §1.1-§1.3, §5.5): names, enum values and
str() forms, the legacy names, import effects, statuses, the toplevel alias."""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys

import pytest

import kvdd.llm_datadist as pkg
from kvdd.llm_datadist import (
    DataType,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Memtype,
    Placement,
    RegisterMemStatus,
    Status,
    toplevel,
)
from kvdd.llm_datadist.status import code_2_status, handle_llm_status, raise_if_false, raise_if_true
from kvdd.llm_datadist.utils.log import LOGGER_NAME, level_from_env
from kvdd.llm_datadist.v2.llm_types import PushType, int_to_mem_status_dict

V2_NAMES = [
    "LLMDataDist", "LLMStatusCode", "LLMException", "Status", "LLMClusterInfo", "LLMRole",
    "LlmConfig", "LLMConfig", "DataType", "KvCache", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex",
    "BlocksCacheKey", "Placement", "RegisterMemStatus", "Cache", "LayerSynchronizer",
    "TransferConfig", "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
]


def test_names_and_all() -> None:
    assert sorted(pkg.v2_list) == sorted(V2_NAMES) and len(pkg.v2_list) == 23
    assert pkg.__all__ == pkg.v2_list + ["TensorDesc", "Tensor", "KvCacheManager"]
    for name in pkg.v2_list:
        assert getattr(pkg, name) is not None
    assert pkg.LLMConfig is pkg.LlmConfig
    assert issubclass(LLMException, RuntimeError)


@pytest.mark.parametrize("name", ["TensorDesc", "Tensor", "KvCacheManager"])
def test_legacy_names_raise_module_not_found_naming_the_legacy_package(name: str) -> None:
    with pytest.raises(ModuleNotFoundError, match="llm_datadist_v1") as exc:
        getattr(pkg, name)
    assert exc.value.name == "llm_datadist_v1"


def test_other_missing_attribute_is_attribute_error() -> None:
    with pytest.raises(AttributeError):
        getattr(pkg, "NoSuchName")
    assert not hasattr(pkg, "KvCacheManagerX")


def test_star_import_fails_without_the_legacy_package() -> None:
    with pytest.raises(ImportError, match="llm_datadist_v1"):
        exec("from kvdd.llm_datadist import *", {})


IMPORT_PROBE = """
import os
import kvdd.llm_datadist.data_type as d
lazy_before = len(d._lazy)
_ = d.dtype_to_np_dtype
print("AUTO_USE_UC_MEMORY=" + os.environ["AUTO_USE_UC_MEMORY"])
print("lazy=%d,%d" % (lazy_before, len(d._lazy)))
from kvdd.llm_datadist.status import raise_if_false
try:
    raise_if_false(False, "boom-msg")
except Exception:
    pass
import logging
logging.getLogger("LLM_DATADIST").info("info-msg")
"""


def test_import_effects_in_a_fresh_process() -> None:
    """AUTO_USE_UC_MEMORY=0 when unset; the numpy maps are built on first access; the logger
    prints on stdout at the ASCEND_GLOBAL_LOG_LEVEL level and raise_if_* records once."""
    env = {k: v for k, v in os.environ.items() if k != "AUTO_USE_UC_MEMORY"}
    env["ASCEND_GLOBAL_LOG_LEVEL"] = "1"
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "AUTO_USE_UC_MEMORY=0" in out
    assert "lazy=0,3" in out
    assert out.count("boom-msg") == 1
    assert "info-msg" in out


def test_auto_use_uc_memory_is_kept_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTO_USE_UC_MEMORY", "1")
    importlib.reload(pkg)
    assert os.environ["AUTO_USE_UC_MEMORY"] == "1"
    monkeypatch.delenv("AUTO_USE_UC_MEMORY")
    importlib.reload(pkg)
    assert os.environ["AUTO_USE_UC_MEMORY"] == "0"
    assert pkg.LLMDataDist is pkg.v2.llm_datadist.LLMDataDist  # reloading rebinds the same classes


def test_log_levels() -> None:
    assert [level_from_env(v) for v in ("0", "1", "2", "3", None, "7", "x")] == [
        logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.ERROR, logging.ERROR,
        logging.ERROR]


def test_records_propagate_once_when_logging_is_configured(caplog: pytest.LogCaptureFixture,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.ERROR, logger=LOGGER_NAME), pytest.raises(LLMException):
        raise_if_true(True, "configured-msg")
    assert [r.getMessage() for r in caplog.records] == ["configured-msg"]
    assert "configured-msg" not in capsys.readouterr().out


def test_enum_values() -> None:
    assert [(m.name, m.value) for m in LLMRole] == [("PROMPT", 1), ("DECODER", 2), ("MIX", 3)]
    assert str(LLMRole.DECODER) == "LLMRole.DECODER" and f"{LLMRole.MIX}" == "LLMRole.MIX"
    assert [(m.name, m.value) for m in Placement] == [("HOST", 0), ("DEVICE", 1)]
    assert [(m.name, m.value) for m in RegisterMemStatus] == [("OK", 0), ("PREPARING", 1), ("FAILED", 2)]
    assert [(m.name, m.value) for m in Memtype] == [("MEM_TYPE_DEVICE", 0), ("MEM_TYPE_HOST", 1)]
    assert [(m.name, m.value) for m in PushType] == [("NO_CACHE_KEY", 0), ("BLOCKS_CACHE_KEY", 1),
                                                      ("CACHE_KEY_BY_ID", 2)]
    assert {m.name: m.value for m in DataType} == {
        "DT_FLOAT": 0, "DT_FLOAT16": 1, "DT_INT8": 2, "DT_INT32": 3, "DT_UINT8": 4, "DT_INT16": 6,
        "DT_UINT16": 7, "DT_UINT32": 8, "DT_INT64": 9, "DT_UINT64": 10, "DT_DOUBLE": 11, "DT_BOOL": 12,
        "DT_STRING": 13, "DT_BF16": 27}
    assert not isinstance(DataType.DT_FLOAT16, int)  # a plain Enum
    assert isinstance(Placement.DEVICE, int) and not isinstance(RegisterMemStatus.OK, int)
    assert int_to_mem_status_dict == {0: RegisterMemStatus.OK, 1: RegisterMemStatus.PREPARING,
                                      2: RegisterMemStatus.FAILED}


STATUS_VALUES = {
    "LLM_SUCCESS": 0, "LLM_FAILED": 0xFFFFFFFF, "LLM_WAIT_PROCESS_TIMEOUT": 0x5010B001,
    "LLM_KV_CACHE_NOT_EXIST": 0x5010B002, "LLM_REPEAT_REQUEST": 0x5010B003,
    "LLM_REQUEST_ALREADY_COMPLETED": 0x5010B004, "LLM_PARAM_INVALID": 0x5010B005,
    "LLM_ENGINE_FINALIZED": 0x5010B006, "LLM_NOT_YET_LINK": 0x5010B007, "LLM_ALREADY_LINK": 0x5010B008,
    "LLM_LINK_FAILED": 0x5010B009, "LLM_UNLINK_FAILED": 0x5010B00A,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 0x5010B00B, "LLM_CLUSTER_NUM_EXCEED_LIMIT": 0x5010B00C,
    "LLM_PROCESSING_LINK": 0x5010B00D, "LLM_DEVICE_OUT_OF_MEMORY": 0x5010B00E,
    "LLM_PREFIX_ALREADY_EXIST": 0x5010B00F, "LLM_PREFIX_NOT_EXIST": 0x5010B010,
    "LLM_SEQ_LENOVERLIMIT": 0x5010B011, "LLM_NO_FREE_BLOCK": 0x5010B012,
    "LLM_BLOCKS_OUT_OF_MEMORY": 0x5010B013, "LLM_EXIST_LINK": 0x5010B018,
    "LLM_FEATURE_NOT_ENABLED": 0x5010B019, "LLM_TIMEOUT": 0x5010B01A, "LLM_LINK_BUSY": 0x5010B01B,
    "LLM_OUT_OF_MEMORY": 0x5010B01C, "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057, "LLM_UNKNOWN_ERROR": -1,
}


def test_status_code_values_and_str() -> None:
    assert {m.name: m.value for m in LLMStatusCode} == STATUS_VALUES
    assert str(LLMStatusCode.LLM_TIMEOUT) == "LLMStatusCode.LLM_TIMEOUT"
    assert f"{LLMStatusCode.LLM_TIMEOUT}" == "LLMStatusCode.LLM_TIMEOUT"
    assert f"{LLMStatusCode.LLM_TIMEOUT:#x}" == "0x5010b01a"


def test_code_2_status_unknown_codes_are_failed() -> None:
    for name, value in STATUS_VALUES.items():
        if name != "LLM_UNKNOWN_ERROR":
            assert code_2_status(value) is LLMStatusCode[name]
    for raw in (-1, 1, 507000, 507054, 0x5010B014, 0x5010B01D, 2**40):
        assert code_2_status(raw) is LLMStatusCode.LLM_FAILED


def test_llm_exception_status_message_and_pickle() -> None:
    assert LLMException("x").status_code is LLMStatusCode.LLM_SUCCESS
    with pytest.raises(LLMException) as exc:
        handle_llm_status(0x5010B002, "pull_blocks", "cache_id=3")
    assert exc.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert str(exc.value) == ("pull_blocks failed, error code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "
                              "cache_id=3.")
    handle_llm_status(0, "ok", "")  # success does not raise
    with pytest.raises(LLMException) as exc2:
        handle_llm_status(12345, "f", "i")
    assert exc2.value.status_code is LLMStatusCode.LLM_FAILED
    again = pickle.loads(pickle.dumps(exc.value))
    assert isinstance(again, LLMException) and again.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert again.args == exc.value.args


def test_raise_if_helpers_and_status() -> None:
    raise_if_false(True, "never")
    raise_if_true(False, "never")
    with pytest.raises(LLMException) as exc:
        raise_if_false(False, "m")
    assert exc.value.status_code is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as exc:
        raise_if_true(True, "m", status_code=LLMStatusCode.LLM_TIMEOUT)
    assert exc.value.status_code is LLMStatusCode.LLM_TIMEOUT
    assert Status(LLMStatusCode.LLM_SUCCESS).is_ok()
    assert not Status(LLMStatusCode.LLM_FAILED).is_ok()
    assert Status(LLMStatusCode.LLM_FAILED).status_code is LLMStatusCode.LLM_FAILED


def test_data_type_maps_are_lazy_and_bf16_is_float16() -> None:
    import numpy as np

    from kvdd.llm_datadist import data_type as d

    assert d.dtype_to_np_dtype[DataType.DT_BF16] == np.float16
    assert d.dtype_to_np_dtype[DataType.DT_FLOAT] == np.float32
    assert d.np_dtype_to_dtype[np.dtype(np.float16)] is DataType.DT_FLOAT16
    assert np.dtype(np.int64) in d.valid_np_dtypes
    assert d.python_dtype_2_dwrapper_dtype[DataType.DT_BF16] == 27
    assert d.get_python_dtype_from_wrapper_dtype(9) is DataType.DT_INT64
    with pytest.raises(AttributeError):
        getattr(d, "nothing_here")


def test_reachable_submodules() -> None:
    import kvdd.llm_datadist.configs as configs
    import kvdd.llm_datadist.metadef_wrapper as metadef
    import kvdd.llm_datadist.utils.utils as utils
    import kvdd.llm_datadist.v2.cache_manager as cm
    import kvdd.llm_datadist.v2.llm_datadist as dd
    import kvdd.llm_datadist.v2.llm_types as types
    import kvdd.llm_datadist.v2.llm_utils as llm_utils

    assert configs.LLMConfig is pkg.LLMConfig and dd.LLMDataDist is pkg.LLMDataDist
    assert cm.CacheManager.__name__ == "CacheManager" and types.CacheDesc is pkg.CacheDesc
    assert callable(types.check_layer_range) and callable(llm_utils.layer_range_to_tensor_indices)
    assert callable(utils.check_uint64) and callable(utils.check_isinstance)
    assert (metadef.DT_FLOAT16, metadef.DT_BF16, metadef.DT_STRING) == (1, 27, 13)


def test_toplevel_alias_gives_the_same_module_objects() -> None:
    assert "llm_datadist" not in sys.modules
    with toplevel.installed() as top:
        assert toplevel.is_installed()
        top_pkg = importlib.import_module("llm_datadist")
        top_cm = importlib.import_module("llm_datadist.v2.cache_manager")
        top_status = importlib.import_module("llm_datadist.status")
        exec_ns: dict[str, object] = {}
        exec("from llm_datadist.status import LLMException", exec_ns)

        import kvdd.llm_datadist.status
        import kvdd.llm_datadist.v2.cache_manager

        assert top is top_pkg is pkg
        assert exec_ns["LLMException"] is LLMException is kvdd.llm_datadist.status.LLMException
        assert top_status is kvdd.llm_datadist.status
        assert top_cm is kvdd.llm_datadist.v2.cache_manager
        assert top_pkg.CacheDesc is pkg.CacheDesc
        assert pkg.__spec__ is not None and pkg.__spec__.name == "kvdd.llm_datadist"
        assert top_cm.__spec__ is not None and top_cm.__spec__.name == "kvdd.llm_datadist.v2.cache_manager"
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("llm_datadist.no_such_module")
        with pytest.raises(ModuleNotFoundError, match="llm_datadist_v1"):
            exec("from llm_datadist import KvCacheManager", {})
        toplevel.install()  # idempotent
        assert sys.meta_path.count(toplevel._finder) == 1
    assert not toplevel.is_installed()
    assert not [n for n in sys.modules if n == "llm_datadist" or n.startswith("llm_datadist.")]
    # without the finder the name is no longer kvdd's (under pytest, tests/ is on sys.path and
    # tests/llm_datadist/ would be found as a namespace package)
    try:
        after = importlib.import_module("llm_datadist")
    except ModuleNotFoundError:
        pass
    else:
        assert after is not pkg
        del sys.modules["llm_datadist"]


def test_toplevel_after_the_thin_package_replaced_itself() -> None:
    """What the cann-root package does: install(), then sys.modules['llm_datadist'] = kvdd's."""
    toplevel.install()
    sys.modules["llm_datadist"] = pkg
    try:
        sub = importlib.import_module("llm_datadist.v2.llm_types")
        assert sub is importlib.import_module("kvdd.llm_datadist.v2.llm_types")
        assert sub.CacheDesc is pkg.CacheDesc
    finally:
        toplevel.uninstall()
    assert "llm_datadist" not in sys.modules and "llm_datadist.v2.llm_types" not in sys.modules


def test_native_wrapper_module_constants_and_functions() -> None:
    from pkg_fake import use_fake

    import kvdd.llm_datadist.llm_datadist_wrapper as native

    assert (native.kSuccess, native.kFailed, native.kParamInvalid, native.kLinKFailed) == (
        0, 0xFFFFFFFF, 0x5010B005, 0x5010B009)
    assert native.dict_to_vector({3: 1, 1: 0}) == [(3, 1), (1, 0)]
    with use_fake() as fake:
        assert native.initialize_v2(5, {"a": "b"}) == 0
        assert native.unlink(4) == 0
        assert native.register_cache((1, 1, -1, [2], 1, False), [8], [], True) == (0, (1, [[8]]))
        assert native.calc_tensor_size([2, 3], 1) == fake.tensor_size
    assert fake.names() == ["initialize_v2", "unlink", "register_cache"]
    with pytest.raises(AttributeError):
        getattr(native, "no_such_function")
