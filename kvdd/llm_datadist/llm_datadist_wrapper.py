"""Stand-in for CANN's native ``llm_datadist_wrapper`` (PYPKG.md §1.4): the status constants and
the engine functions as module-level functions over the process's engine
(:func:`kvdd.llm_datadist._engine.wrapper`).  The package's own classes call the engine through
:class:`~kvdd.llm_datadist._seam.Wrapper`, not through this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import _engine
from ._seam import BlockCfgTuple, CacheDescTuple, CacheKeyTuple, PullParamTuple, TransferCfgTuple
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


def calc_tensor_size(shape: Sequence[int], dtype: int) -> int:
    """Bytes of one tensor, or -1."""
    return _engine.wrapper().calc_tensor_size(shape, dtype)


def dict_to_vector(d: Mapping[int, int]) -> list[tuple[int, int]]:
    """A dict's pairs in insertion order."""
    return list(d.items())


def initialize_v2(cluster_id: int, options: Mapping[str, str]) -> int:
    """Create the process's engine."""
    return _engine.wrapper().initialize_v2(cluster_id, options)


def finalize_v2() -> None:
    """Tear the engine down."""
    _engine.wrapper().finalize_v2()


def register_cache(cache_desc: CacheDescTuple, addrs: Sequence[int], cache_keys: Sequence[CacheKeyTuple],
                   remote_accessible: bool) -> tuple[int, tuple[int, list[list[int]]]]:
    """Register a cache: ``(status, (cache_id, [addrs]))``."""
    return _engine.wrapper().register_cache(cache_desc, addrs, cache_keys, remote_accessible)


def unregister_cache(cache_id: int) -> int:
    """Unregister a cache."""
    return _engine.wrapper().unregister_cache(cache_id)


def pull_cache_v2(dst_cache_id: int, cache_key: CacheKeyTuple, param: PullParamTuple) -> int:
    """One pull (cache or blocks)."""
    return _engine.wrapper().pull_cache_v2(dst_cache_id, cache_key, param)


def transfer_cache_v2(task_id: int, cfg: TransferCfgTuple, block_cfg: BlockCfgTuple = (0, [], [])) -> int:
    """One layer of a push."""
    return _engine.wrapper().transfer_cache_v2(task_id, cfg, block_cfg)


_DELEGATED = ("link", "unlink", "query_register_mem_status", "link_clusters_v2", "unlink_clusters_v2",
              "switch_role_v2", "allocate_cache_v2", "deallocate_cache_v2", "remove_cache_key_v2",
              "copy_cache_v2", "copy_blocks_v2", "swap_blocks_v2", "check_capacity_v2",
              "remap_registered_memory")


def __getattr__(name: str) -> Any:
    if name in _DELEGATED:
        return getattr(_engine.wrapper(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
