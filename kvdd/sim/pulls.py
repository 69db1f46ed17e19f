"""PullKvCache and PullKvBlocks (SEMANTICS.md §3.10, §3.11), check by check in upstream's order.

The comments name the step.  Every check raises :class:`kvdd.sim.checks.Rejected`; the functions
return the status of the copy.

The compiled path of in-process calls (:mod:`kvdd.sim._fastpath`) restates when these checks all
pass, and declines every other call to this module: a change to a check here changes it there too
(tests/sim/test_fastpath.py compares the two on random calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..status import PARAM_INVALID, S_OK
from ..types import Cache, CacheIndex, KvCacheExtParam
from . import faults
from .checks import (
    REQUEST_LIMIT,
    reject,
    require_ext,
    require_initialized,
    require_inside_remote,
    require_layer_multiple,
    require_link,
    require_local_cache,
    require_not_ragged,
    require_remote_tensors,
    require_tensor_count,
)
from .runs import Runs, row_run
from .transfers import lookup_remote, run

if TYPE_CHECKING:
    from .engine import SimBackend
    from .entries import CacheEntry, Entity

__all__ = ["pull_kv_cache", "pull_kv_blocks"]


def _pull_common(backend: SimBackend, idx: CacheIndex, dst_cache: Cache, batch_index: int, size: int,
                 ext: KvCacheExtParam) -> tuple[CacheEntry, Entity, range | None, range | None]:
    """PullKvCache steps 4-11 (shared by PullKvBlocks)."""
    t = ext.tensor_num_per_layer
    (s0, s1), (d0, d1) = ext.src_layer_range, ext.dst_layer_range
    src_list = dst_list = None
    if s0 >= 0 and d0 >= 0:  # 4
        src_list = range(s0 * t, (s1 + 1) * t)
        dst_list = range(d0 * t, (d1 + 1) * t)
    if t <= 0:  # 5
        reject(PARAM_INVALID, "tensor_num_per_layer must be > 0")
    if idx.cluster_id == backend.cluster_id:  # 6
        reject(PARAM_INVALID, "cannot pull from own cluster")
    local = require_local_cache(backend.caches, dst_cache.cache_id)  # 7
    if batch_index >= local.B:  # 8
        reject(PARAM_INVALID, f"batch_index {batch_index} >= local batch size {local.B}")
    if size > 0 and size > local.S:  # 9
        reject(PARAM_INVALID, f"size {size} > local stride {local.S} bytes")
    if dst_list is not None and src_list is not None:  # 10
        require_layer_multiple(local, t)
        if len(dst_list) > local.n or dst_list[0] >= local.n or dst_list[-1] >= local.n:
            reject(PARAM_INVALID, f"dst layer range {ext.dst_layer_range} exceeds the local {local.n} tensors")
        if len(src_list) != len(dst_list):
            reject(PARAM_INVALID, "src and dst layer ranges differ in length")
    entity = require_link(backend.entities, idx.cluster_id)  # 11
    return local, entity, src_list, dst_list


def pull_kv_cache(backend: SimBackend, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int,
                  size: int, ext_param: KvCacheExtParam) -> int:
    """§3.10 PullKvCache."""
    require_initialized(backend.initialized)  # 1
    if not (size == -1 or size > 0):  # 2
        reject(PARAM_INVALID, f"size {size} must be -1 or > 0")
    require_ext(ext_param, equal_len=False)  # 3
    local, entity, src_list, dst_list = _pull_common(
        backend, src_cache_index, dst_cache, batch_index, size, ext_param)  # 4-11
    K = len(dst_list) if dst_list is not None else local.n
    if 120 + 16 * (K + 2) > REQUEST_LIMIT:  # 12
        reject(PARAM_INVALID, "transfer request exceeds 2 MiB")
    with entity.lock:
        rc = lookup_remote(entity, src_cache_index.cache_id)  # 13
        require_tensor_count(src_list, rc, local)  # 14
        nbytes = size if size > 0 else local.S  # 15
        if nbytes > rc.stride_nbytes:
            reject(PARAM_INVALID, f"{nbytes} bytes per tensor > remote stride {rc.stride_nbytes}")
        require_not_ragged(local, rc)  # kvdd rule 10
        remote_tensors: Sequence[int] = src_list if src_list is not None else range(local.n)
        require_remote_tensors(remote_tensors, rc)  # kvdd rule 1 (§7.8)
        src_off = src_cache_index.batch_index * local.S  # quirk: local stride
        require_inside_remote(src_off + nbytes > rc.tensor_nbytes,  # kvdd rule 1
                              f"remote batch_index {src_cache_index.batch_index} reads")
        local_tensors: Sequence[int] = dst_list if dst_list is not None else range(local.n)
        status = faults.on_transfer(backend, "pull_kv_cache", src_cache_index.cluster_id, entity,
                                    len(local_tensors) * nbytes)
        if status != S_OK:
            return status
        return run(entity, local, rc, True, backend.sync_wait_ms, local_tensors, remote_tensors,
                   *row_run(batch_index * local.S, src_off, nbytes))


def pull_kv_blocks(backend: SimBackend, src_cache_index: CacheIndex, dst_cache: Cache,
                   src_blocks: Sequence[int], dst_blocks: Sequence[int], ext_param: KvCacheExtParam) -> int:
    """§3.11 PullKvBlocks."""
    require_initialized(backend.initialized)  # 1
    if src_cache_index.batch_index != 0:  # 2
        reject(PARAM_INVALID, "src_cache_index.batch_index must be 0 for blocks")
    require_ext(ext_param, equal_len=False)  # 3
    if len(src_blocks) == 0:  # 4
        reject(PARAM_INVALID, "src_blocks is empty (pull from a non-block cache is not supported)")
    if len(src_blocks) != len(dst_blocks):  # 5
        reject(PARAM_INVALID, f"{len(src_blocks)} src blocks but {len(dst_blocks)} dst blocks")
    local, entity, src_list, dst_list = _pull_common(
        backend, src_cache_index, dst_cache, 0, -1, ext_param)  # 6
    runs = Runs(src_blocks, dst_blocks)  # 7
    K = len(dst_list) if dst_list is not None else local.n
    if 120 + 16 * (K + 2 * len(runs)) > REQUEST_LIMIT:  # 8
        reject(PARAM_INVALID, f"transfer request with {len(runs)} block runs exceeds 2 MiB")
    runs.require_below(runs.d0, runs.d_last, local.B, "dst block", "local block count")  # 9
    with entity.lock:
        rc = lookup_remote(entity, src_cache_index.cache_id)  # 10
        require_tensor_count(src_list, rc, local)
        S = local.S
        if S == 0:
            reject(PARAM_INVALID, "local stride is 0 (ragged sub-byte cache, kvdd rule 10)")
        remote_blocks = -(-rc.tensor_nbytes // S)
        runs.require_below(runs.s0, runs.s0, remote_blocks, "src block", "remote block count")  # 11
        longest = runs.longest()
        if longest * S > rc.tensor_nbytes:
            reject(PARAM_INVALID, f"a run of {longest} blocks exceeds the remote tensor")
        require_not_ragged(local, rc)  # kvdd rule 10
        remote_tensors: Sequence[int] = src_list if src_list is not None else range(local.n)
        require_remote_tensors(remote_tensors, rc)  # kvdd rule 1
        # all indices are now < 2**32 (bounded by B or by the remote block count)
        tail = rc.tensor_nbytes % S  # quirk §3.11: the last group copies only R.T % L.S bytes
        src_off, dst_off, lengths, nbytes, src_end, _ = runs.byte_plan(S, tail)
        require_inside_remote(src_end > rc.tensor_nbytes, "a block run reads")  # kvdd rule 1
        local_tensors: Sequence[int] = dst_list if dst_list is not None else range(local.n)
        status = faults.on_transfer(backend, "pull_kv_blocks", src_cache_index.cluster_id, entity,
                                    len(local_tensors) * nbytes)
        if status != S_OK:
            return status
        return run(entity, local, rc, True, backend.sync_wait_ms, local_tensors, remote_tensors,
                   dst_off, src_off, lengths)
