"""Stand-in for CANN's native ``llm_datadist_wrapper`` (PYPKG.md §1.4): its status constants and
its engine functions, each forwarded to the engine :func:`kvdd.llm_datadist._engine.wrapper`
returns at call time (the simulator's process-wide engine).

:class:`~kvdd.llm_datadist.LLMDataDist` takes its engine from the name ``llm_datadist_wrapper`` of
:mod:`kvdd.llm_datadist.v2.llm_datadist`, which is this module, as upstream's takes the native
module: a test may replace that name with a double, as upstream's tests do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from . import _engine
from ._seam import (
    BlockCfgTuple,
    CacheDescTuple,
    CacheKeyTuple,
    ClusterTuple,
    CopyParamTuple,
    MemInfoTuple,
    PullParamTuple,
    TransferCfgTuple,
)
from .status import LLMStatusCode

kSuccess = int(LLMStatusCode.LLM_SUCCESS)
kFailed = int(LLMStatusCode.LLM_FAILED)
kParamInvalid = int(LLMStatusCode.LLM_PARAM_INVALID)
kAlreadyLink = int(LLMStatusCode.LLM_ALREADY_LINK)
kLinKFailed = int(LLMStatusCode.LLM_LINK_FAILED)
kUnlinkFailed = int(LLMStatusCode.LLM_UNLINK_FAILED)
kNotifyPromptUnlinkFailed = int(LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED)
kProcessingLink = int(LLMStatusCode.LLM_PROCESSING_LINK)
kDeviceOutOfMemory = int(LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)
kPrefixAlreadyExist = int(LLMStatusCode.LLM_PREFIX_ALREADY_EXIST)
kPrefixNotExist = int(LLMStatusCode.LLM_PREFIX_NOT_EXIST)
kLLMWaitProcessTimeOut = int(LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT)
kLLMKVCacheNotExist = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
kLLMRepeatRequest = int(LLMStatusCode.LLM_REPEAT_REQUEST)
kLLMRequestAlreadyCompleted = int(LLMStatusCode.LLM_REQUEST_ALREADY_COMPLETED)
kLLMEngineFinalized = int(LLMStatusCode.LLM_ENGINE_FINALIZED)
kLLMNotYetLink = int(LLMStatusCode.LLM_NOT_YET_LINK)
kLLMClusterNumExceedLimit = int(LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT)
kLLMSeqLenOverLimit = int(LLMStatusCode.LLM_SEQ_LENOVERLIMIT)
kLLMNoFreeBlock = int(LLMStatusCode.LLM_NO_FREE_BLOCK)
kLLMBlocksOutOfMemory = int(LLMStatusCode.LLM_BLOCKS_OUT_OF_MEMORY)
kLLMExistLink = int(LLMStatusCode.LLM_EXIST_LINK)
kLLMFeatureNotEnabled = int(LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
kLLMTimeout = int(LLMStatusCode.LLM_TIMEOUT)
kLLMLinkBusy = int(LLMStatusCode.LLM_LINK_BUSY)
kLLMOutOfMemory = int(LLMStatusCode.LLM_OUT_OF_MEMORY)
kLLMDeviceMemError = int(LLMStatusCode.LLM_DEVICE_MEM_ERROR)
kLLMSuspectRemoteError = int(LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR)


def dict_to_vector(d: Mapping[int, int]) -> list[tuple[int, int]]:
    """A dict's pairs in insertion order."""
    return list(d.items())


def last_error_detail() -> str | None:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().last_error_detail()


def calc_tensor_size(shape: Sequence[int], data_type: int) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().calc_tensor_size(shape, data_type)


def initialize_v2(cluster_id: int, options: Mapping[str, str]) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().initialize_v2(cluster_id, options)


def finalize_v2() -> None:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    _engine.wrapper().finalize_v2()


def link(comm_name: str, cluster_rank_info: Sequence[tuple[int, int]], rank_table: str) -> tuple[int, int]:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().link(comm_name, cluster_rank_info, rank_table)


def unlink(comm_id: int) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().unlink(comm_id)


def query_register_mem_status(comm_id: int) -> tuple[int, int]:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().query_register_mem_status(comm_id)


def link_clusters_v2(clusters: Sequence[ClusterTuple], timeout_ms: int) -> tuple[int, list[int]]:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().link_clusters_v2(clusters, timeout_ms)


def unlink_clusters_v2(clusters: Sequence[ClusterTuple], timeout_ms: int,
                       force: bool) -> tuple[int, list[int]]:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().unlink_clusters_v2(clusters, timeout_ms, force)


def switch_role_v2(role: str, options: Mapping[str, str]) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().switch_role_v2(role, options)


def register_cache(cache_desc: CacheDescTuple, addrs: Sequence[int], cache_keys: Sequence[CacheKeyTuple],
                   remote_accessible: bool) -> tuple[int, tuple[int, list[list[int]]]]:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().register_cache(cache_desc, addrs, cache_keys, remote_accessible)


def unregister_cache(cache_id: int) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().unregister_cache(cache_id)


def allocate_cache_v2(cache_desc: CacheDescTuple,
                      cache_keys: Sequence[CacheKeyTuple]) -> tuple[int, tuple[int, list[list[int]]]]:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().allocate_cache_v2(cache_desc, cache_keys)


def deallocate_cache_v2(cache_id: int) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().deallocate_cache_v2(cache_id)


def remove_cache_key_v2(cache_key: CacheKeyTuple) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().remove_cache_key_v2(cache_key)


def pull_cache_v2(dst_cache_id: int, cache_key: CacheKeyTuple, param: PullParamTuple) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().pull_cache_v2(dst_cache_id, cache_key, param)


def transfer_cache_v2(task_id: int, cfg: TransferCfgTuple, block_cfg: BlockCfgTuple = (0, [], [])) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().transfer_cache_v2(task_id, cfg, block_cfg)


def copy_cache_v2(param: CopyParamTuple) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().copy_cache_v2(param)


def copy_blocks_v2(cache_id: int, copy_block_info: Sequence[tuple[int, int]]) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().copy_blocks_v2(cache_id, copy_block_info)


def swap_blocks_v2(src: tuple[int, Sequence[Sequence[int]]], dst: tuple[int, Sequence[Sequence[int]]],
                   block_size: int, swap_type: int, block_mapping: Sequence[tuple[int, int]]) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().swap_blocks_v2(src, dst, block_size, swap_type, block_mapping)


def check_capacity_v2(size: int) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().check_capacity_v2(size)


def remap_registered_memory(mem_infos: Sequence[MemInfoTuple]) -> int:
    """Forwarded to the engine (PYPKG.md §1.4)."""
    return _engine.wrapper().remap_registered_memory(mem_infos)
