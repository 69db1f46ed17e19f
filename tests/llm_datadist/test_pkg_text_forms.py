"""Text forms and module constants clients and logs see (PYPKG.md §1.4, §5.2, §5.3, §5.7): the
native module's ``kLLM*`` status constants, ``repr`` of caches, keys and transfer configs, and
how positional and keyword key arguments combine."""

from __future__ import annotations

import logging

import pytest

from kvdd.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMException,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
    llm_datadist_wrapper,
)
from kvdd.llm_datadist.status import code_2_status, handle_llm_status, raise_if_false


def test_native_module_has_every_status_constant() -> None:
    names = {
        "kSuccess": "LLM_SUCCESS", "kFailed": "LLM_FAILED", "kParamInvalid": "LLM_PARAM_INVALID",
        "kLLMWaitProcessTimeOut": "LLM_WAIT_PROCESS_TIMEOUT", "kLLMKVCacheNotExist": "LLM_KV_CACHE_NOT_EXIST",
        "kLLMRepeatRequest": "LLM_REPEAT_REQUEST", "kLLMRequestAlreadyCompleted": "LLM_REQUEST_ALREADY_COMPLETED",
        "kLLMEngineFinalized": "LLM_ENGINE_FINALIZED", "kLLMNotYetLink": "LLM_NOT_YET_LINK",
        "kAlreadyLink": "LLM_ALREADY_LINK", "kLinKFailed": "LLM_LINK_FAILED", "kUnlinkFailed": "LLM_UNLINK_FAILED",
        "kNotifyPromptUnlinkFailed": "LLM_NOTIFY_PROMPT_UNLINK_FAILED",
        "kLLMClusterNumExceedLimit": "LLM_CLUSTER_NUM_EXCEED_LIMIT", "kProcessingLink": "LLM_PROCESSING_LINK",
        "kDeviceOutOfMemory": "LLM_DEVICE_OUT_OF_MEMORY", "kPrefixAlreadyExist": "LLM_PREFIX_ALREADY_EXIST",
        "kPrefixNotExist": "LLM_PREFIX_NOT_EXIST", "kLLMSeqLenOverLimit": "LLM_SEQ_LENOVERLIMIT",
        "kLLMNoFreeBlock": "LLM_NO_FREE_BLOCK", "kLLMBlocksOutOfMemory": "LLM_BLOCKS_OUT_OF_MEMORY",
        "kLLMExistLink": "LLM_EXIST_LINK", "kLLMFeatureNotEnabled": "LLM_FEATURE_NOT_ENABLED",
        "kLLMTimeout": "LLM_TIMEOUT", "kLLMLinkBusy": "LLM_LINK_BUSY", "kLLMOutOfMemory": "LLM_OUT_OF_MEMORY",
        "kLLMDeviceMemError": "LLM_DEVICE_MEM_ERROR", "kLLMSuspectRemoteError": "LLM_SUSPECT_REMOTE_ERROR",
    }
    for const, member in names.items():
        value = getattr(llm_datadist_wrapper, const)
        assert type(value) is int and value == LLMStatusCode[member], const
        assert code_2_status(value) is LLMStatusCode[member]


def test_cache_repr_is_its_str_and_kv_cache_has_one() -> None:
    d = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.HOST)
    cache = Cache.create_cpu_cache(d, [16, 32])
    assert repr(cache) == str(cache) == "Cache(cache_id = -1, device_tensor_addrs = 2, is_blocks_cache = True)"
    kv = KvCache.create_cpu_cache(d, [[16, 32], [48, 64]])
    assert repr(kv) == str(kv) == "KvCache(cache_id = -1, num_devices = 2)"


def test_cache_key_repr_and_positional_arguments_win() -> None:
    assert repr(CacheKey(prompt_cluster_id=1, req_id=2, model_id=3)) == (
        f"CacheKey(cluster_id=1, req_id=2, prefix_id={2**64 - 1}, model_id=3)")
    # a positional argument overwrites a keyword of the same name (no "multiple values" error)
    assert CacheKey(1, 2, cluster_id=9).cluster_id == 1
    assert BlocksCacheKey(1, cluster_id=9).cluster_id == 1
    assert repr(BlocksCacheKey(1, model_id=4)) == "BlocksCacheKey(cluster_id=1, model_id=4)"


def test_transfer_config_reprs() -> None:
    cfg = TransferConfig(1, [2, 3], range(0, 1), 0)
    assert repr(cfg) == str(cfg) == ("TransferConfig(dst_cluster_id=1, dst_addrs=[2, 3], "
                                     "src_layer_range=range(0, 1), src_batch_index=0)")
    keyed = TransferWithCacheKeyConfig(BlocksCacheKey(cluster_id=2, model_id=0), range(0, 1), range(1, 2))
    assert repr(keyed) == ("TransferWithCacheKeyConfig(cache_key=BlocksCacheKey(cluster_id=2, model_id=0), "
                           "src_layer_range=range(0, 1), dst_layer_range=range(1, 2), src_batch_index=0)")


def test_an_engine_failure_is_raised_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    # upstream logs the Python-side checks (raise_if_*) but not an engine status it raises: a
    # client that catches and retries a failed pull sees no ERROR records from the package
    caplog.set_level(logging.DEBUG, logger="LLM_DATADIST")
    with pytest.raises(LLMException):
        handle_llm_status(0x5010B01A, "pull_blocks", "cache_id=3")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    with pytest.raises(LLMException):
        raise_if_false(False, "a Python-side check")
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == [logging.ERROR]


def test_name_lists_in_upstreams_order() -> None:
    import kvdd.llm_datadist as pkg

    v2 = ["LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig",
          "DataType", "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache",
          "BlocksCacheKey", "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer",
          "TransferConfig", "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo"]
    assert pkg.v2_list == v2
    assert pkg.__all__ == [*v2, "TensorDesc", "Tensor", "KvCacheManager"]
