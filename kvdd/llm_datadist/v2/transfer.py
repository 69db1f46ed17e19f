"""``transfer_cache_async``: the checks and the worker thread (PYPKG.md §4.10).

The worker walks the source layers in order; for each layer it asks the
:class:`~kvdd.llm_datadist.v2.llm_types.LayerSynchronizer` once (``timeout_in_millis=None``) and
then sends that layer of every config whose ``src_layer_range`` contains it, one
``transfer_cache_v2`` call per config.  Upstream's behaviours are kept: a synchronizer returning
False marks the waiting configs LLM_PARAM_INVALID and stops the job; the first engine failure is
recorded and stops the job; a config's SUCCESS is recorded after its last layer; results are keyed
by ``dst_cluster_id``; the destination layer of a keyed config is ``list(dst_layer_range)[l]``
with ``l`` the **absolute** source layer, so a source range not starting at 0 raises
``IndexError`` in the worker, which ends it and leaves its results unrecorded — counted as success
by ``CacheTask.synchronize``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from .._seam import TransferCfgTuple, Wrapper
from ..status import LLMStatusCode, code_2_status, raise_if_false
from ..utils.log import logger
from ..utils.utils import check_isinstance, check_uint64
from .llm_keys import BlocksCacheKey
from .llm_types import (
    Cache,
    CacheTask,
    LayerSynchronizer,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from .llm_utils import pack_cache_key

__all__ = ["transfer_cache_async", "next_task_id"]

_task_ids = itertools.count(0)
_task_id_lock = threading.Lock()

#: tensors per layer of transfer_cache_async (fixed upstream)
TENSORS_PER_LAYER = 2


def next_task_id() -> int:
    """A process-wide task id for ``transfer_cache_v2``."""
    with _task_id_lock:
        return next(_task_ids)


def _check_index_list(name: str, values: Any) -> None:
    # every item's type (TypeError), then every value's range (ValueError), as upstream
    if values is None:
        return
    check_isinstance(name, values, (list, tuple), inner_class=int)
    for v in values:
        check_uint64(f"{name} item", v)


def transfer_cache_async(wrapper: Wrapper, remote_accessible_mode: bool, src_cache: Any,
                         layer_synchronizer: Any, transfer_configs: Any, src_block_indices: Any,
                         dst_block_indices: Any, dst_block_memory_size: Any) -> CacheTask:
    """The Python checks of ``CacheManager.transfer_cache_async`` in upstream's order, then the
    worker thread. Raises ``TypeError`` / ``ValueError`` / LLM_PARAM_INVALID as PYPKG.md §4.10.

    As upstream, an **empty** ``src_block_indices`` means "the source is not sent as blocks" and
    an empty ``dst_block_indices`` "the destination is not blocks" (the lists are tested for
    truth, not for None); the destination list is checked before the source list."""
    check_isinstance("src_cache", src_cache, Cache, allow_none=False)
    raise_if_false(src_cache.cache_desc.placement != Placement.HOST,
                   "transfer_cache_async does not send from a HOST cache.")
    _check_index_list("dst_block_indices", dst_block_indices)
    _check_index_list("src_block_indices", src_block_indices)
    check_uint64("dst_block_memory_size", dst_block_memory_size, allow_none=True)
    if src_block_indices:
        raise_if_false(bool(dst_block_indices), "sending blocks into a non-blocks cache is not supported "
                       "(src_block_indices needs dst_block_indices).")
        raise_if_false(len(dst_block_indices) == len(src_block_indices),
                       f"src_block_indices ({len(src_block_indices)}) and dst_block_indices "
                       f"({len(dst_block_indices)}) differ in length.")
    elif dst_block_indices:
        raise_if_false(dst_block_memory_size is not None,
                       "dst_block_memory_size is required to send a cache into blocks.")
    check_isinstance("layer_synchronizer", layer_synchronizer, LayerSynchronizer, allow_none=False)
    expected = TransferWithCacheKeyConfig if remote_accessible_mode else TransferConfig
    check_isinstance("transfer_configs", transfer_configs, (list, tuple), allow_none=False)
    for config in transfer_configs:
        if not isinstance(config, expected):
            raise TypeError(f"transfer_configs must all be {expected.__name__} in this mode, "
                            f"but got {type(config).__name__}.")
    raise_if_false(bool(dst_block_indices) or dst_block_memory_size in (None, 0),
                   f"dst_block_memory_size ({dst_block_memory_size}) must be None or 0 without "
                   "dst_block_indices.")
    num_tensors = src_cache.cache_desc.num_tensors
    raise_if_false(num_tensors % TENSORS_PER_LAYER == 0,
                   f"num_tensors must be even for transfer_cache_async, but got {num_tensors}.")
    num_layers = num_tensors // TENSORS_PER_LAYER
    for config in transfer_configs:
        if config.src_layer_range is None:
            config.src_layer_range = range(0, num_layers)
        src_range: range = config.src_layer_range
        if src_block_indices:
            raise_if_false(config.src_batch_index == 0, "src_batch_index must be 0 with src blocks.")
        raise_if_false(0 <= src_range.start and src_range.stop <= num_layers,
                       f"src_layer_range {src_range!r} is outside [0, {num_layers}].")
        if isinstance(config, TransferConfig):
            raise_if_false(len(config.dst_addrs) == TENSORS_PER_LAYER * len(src_range),
                           f"dst_addrs must hold {TENSORS_PER_LAYER} addresses per layer.")
    block_cfg = (dst_block_memory_size or 0, list(src_block_indices or []), list(dst_block_indices or []))
    results: dict[int, LLMStatusCode] = {}
    configs = list(transfer_configs)
    thread = threading.Thread(
        target=_worker, name="llm_datadist-transfer_cache_async", daemon=True,
        args=(wrapper, next_task_id(), src_cache.cache_id, num_layers, layer_synchronizer, configs,
              block_cfg, results))
    thread.start()
    return CacheTask(thread, results, configs)


def _layer_cfg(src_id: int, layer: int, config: TransferConfig | TransferWithCacheKeyConfig) -> TransferCfgTuple:
    src_range = config.src_layer_range
    assert src_range is not None
    if isinstance(config, TransferConfig):
        pos = layer - src_range.start
        addrs = list(config.dst_addrs[TENSORS_PER_LAYER * pos:TENSORS_PER_LAYER * (pos + 1)])
        return (src_id, config.src_batch_index, layer, addrs, config.dst_cluster_id, 0, 0, 0, layer,
                TENSORS_PER_LAYER)
    key = config.cache_key
    assert key is not None
    # absolute index, as upstream; a range set back to None means "the same layer"
    dst_layer = layer if config.dst_layer_range is None else list(config.dst_layer_range)[layer]
    packed = pack_cache_key(key)
    if isinstance(key, BlocksCacheKey):  # a blocks destination always takes source batch 0
        return (src_id, 0, layer, [], packed[0], packed[5], 0, 1, dst_layer, TENSORS_PER_LAYER)
    return (src_id, config.src_batch_index, layer, [], packed[0], packed[1], packed[2], 2, dst_layer,
            TENSORS_PER_LAYER)


def _worker(wrapper: Wrapper, task_id: int, src_id: int, num_layers: int, synchronizer: LayerSynchronizer,
            configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
            block_cfg: tuple[int, list[int], list[int]], results: dict[int, LLMStatusCode]) -> None:
    try:
        for layer in range(num_layers):
            waiting = [c for c in configs if c.src_layer_range is not None and layer in c.src_layer_range]
            if not waiting:
                continue
            if not synchronizer.synchronize_layer(layer, None):
                for config in waiting:
                    results[config.dst_cluster_id] = LLMStatusCode.LLM_PARAM_INVALID
                return
            for config in waiting:
                status = wrapper.transfer_cache_v2(task_id, _layer_cfg(src_id, layer, config), block_cfg)
                if status != 0:
                    results[config.dst_cluster_id] = code_2_status(status)
                    logger.error("transfer_cache_async layer %d to cluster %d failed: %s", layer,
                                 config.dst_cluster_id, code_2_status(status))
                    return
                src_range = config.src_layer_range
                assert src_range is not None
                if layer == src_range[-1]:
                    results[config.dst_cluster_id] = LLMStatusCode.LLM_SUCCESS
    except Exception:  # upstream's worker dies with the exception; its results stay unrecorded
        logger.exception("transfer_cache_async worker stopped")
