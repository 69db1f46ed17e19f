"""PushKvCache and PushKvBlocks (SEMANTICS.md §3.12, §3.13), check by check in upstream's order.

The comments name the step.  Every check raises :class:`kvdd.sim.checks.Rejected`; the functions
return the status of the copy.  Unlike every other call, a multi-layer push writes the layers
before its first failing layer (§3.12 step 7).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..status import PARAM_INVALID, S_OK
from ..types import Cache, CacheIndex, CachePlacement, KvCacheExtParam
from . import faults
from .checks import (
    Rejected,
    reject,
    require_ext,
    require_initialized,
    require_inside_remote,
    require_layer_multiple,
    require_link,
    require_local_cache,
    require_not_ragged,
)
from .runs import Runs, ends_past, int64_arrays, row_run
from .transfers import lookup_remote, run

if TYPE_CHECKING:
    from .engine import SimBackend
    from .entries import CacheEntry
    from .fabric import RemoteCache

__all__ = ["push_kv_cache", "push_kv_blocks"]

Plan = tuple[range, int]
Offsets = tuple[np.ndarray, np.ndarray, np.ndarray]


def _push_plan(src_cache: Cache, ext: KvCacheExtParam) -> Plan:
    """§3.12 step 6: the source layers in order and the destination of the first one (the
    others follow consecutively).  Lazy: a plan of 2**31 layers costs nothing until a layer
    fails its checks."""
    t = ext.tensor_num_per_layer
    (s0, s1), (d0, _d1) = ext.src_layer_range, ext.dst_layer_range
    if s0 >= 0 and s0 == s1:  # single layer
        return range(s0, s0 + 1), d0
    if s0 == -1:  # all layers l -> l (dst range ignored)
        u = src_cache.cache_desc.num_tensors
        if u < t:
            m = 0
        elif u % t == 0:
            m = u // t - 1
        else:
            m = u // t  # the partial last layer is planned and fails check g
        return range(0, m + 1), 0
    return range(s0, s1 + 1), d0  # range: l -> d0 + (l - s0)


def _push_prologue(src_cache: Cache, ext: KvCacheExtParam) -> Plan:
    require_ext(ext, equal_len=True)
    s0 = ext.src_layer_range[0]
    if not s0 >= 0 and not (s0 == -1 and src_cache.cache_desc.num_tensors > 0):
        reject(PARAM_INVALID, "pushing all layers needs src_cache.cache_desc.num_tensors > 0")
    return _push_plan(src_cache, ext)


def _require_dst_layer(ld: int, remote_layers: int) -> None:
    """Check d: a negative layer is a huge unsigned index."""
    if ld < 0 or ld >= remote_layers:
        reject(PARAM_INVALID, f"dst layer {ld} is not below the remote layer count {remote_layers}")


def _push_local_checks(local: CacheEntry, t: int, ls: int) -> None:
    if ls >= local.n // t:  # f
        reject(PARAM_INVALID, f"src layer {ls} is not below the local layer count {local.n // t}")
    require_layer_multiple(local, t)  # g


def _push_layers(backend: SimBackend, kind: str, src_cache: Cache, idx: CacheIndex, plan: Plan, t: int,
                 check_layer: Callable[[CacheEntry, RemoteCache, int], None],
                 offsets: Callable[[CacheEntry, RemoteCache], Offsets]) -> int:
    """§3.12 step 7 / §3.13 step 8: the per-layer loop.

    Upstream checks and writes layer by layer, stopping at the first failing layer with the
    earlier layers written.  The checks do not depend on the bytes moved, so every planned
    layer is checked first, in the same order; the layers before the first failing one are
    then written in one copy, and that layer's rejection is raised.
    """
    src_layers, ld0 = plan
    local = require_local_cache(backend.caches, src_cache.cache_id)  # a
    entity = require_link(backend.entities, idx.cluster_id)  # b
    rc = lookup_remote(entity, idx.cache_id)  # c
    remote_layers = rc.num_tensors // t
    _require_dst_layer(ld0, remote_layers)  # d
    with entity.lock:
        ok: list[tuple[int, int]] = []
        failed: Rejected | None = None
        for i, ls in enumerate(src_layers):
            ld = ld0 + i
            try:
                if i == 0:
                    check_layer(local, rc, ls)  # e-h, kvdd rules 10 and 1
                else:
                    # Later layers: only d and f depend on the layer; every other check passed above.
                    _require_dst_layer(ld, remote_layers)  # d
                    _push_local_checks(local, t, ls)  # f (g passed at layer 0)
            except Rejected as exc:
                failed = exc
                break
            ok.append((ls, ld))
        if ok:
            src_off, dst_off, length = offsets(local, rc)
            status = faults.on_transfer(backend, kind, idx.cluster_id, entity,
                                        t * len(ok) * int(length.sum()))
            if status != S_OK:
                return status
            local_tensors = [ls * t + k for ls, _ in ok for k in range(t)]
            remote_tensors = [ld * t + k for _, ld in ok for k in range(t)]
            run(entity, local, rc, False, backend.sync_wait_ms, local_tensors, remote_tensors,
                src_off, dst_off, length)
        if failed is not None:
            raise failed
        return S_OK


def _require_push_source(backend: SimBackend, src_cache: Cache) -> None:
    require_initialized(backend.initialized)  # 1
    if src_cache.cache_desc.placement != CachePlacement.DEVICE:  # 2
        reject(PARAM_INVALID, "src_cache.cache_desc.placement must be DEVICE for push")


def push_kv_cache(backend: SimBackend, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int,
                  size: int, ext_param: KvCacheExtParam) -> int:
    """§3.12 PushKvCache."""
    _require_push_source(backend, src_cache)  # 1, 2
    if size != -1:  # 3
        reject(PARAM_INVALID, f"size must be -1 for push, got {size}")
    plan = _push_prologue(src_cache, ext_param)  # 4-6
    t = ext_param.tensor_num_per_layer
    bd = dst_cache_index.batch_index

    def check_layer(local: CacheEntry, rc: RemoteCache, ls: int) -> None:
        if bd >= rc.batch_size:  # e
            reject(PARAM_INVALID, f"dst batch_index {bd} >= remote batch size {rc.batch_size}")
        _push_local_checks(local, t, ls)  # f, g
        if src_batch_index >= local.B:  # h
            reject(PARAM_INVALID, f"src_batch_index {src_batch_index} >= local batch size {local.B}")
        require_not_ragged(local, rc)  # kvdd rule 10
        require_inside_remote(bd * rc.stride_nbytes + local.S > rc.tensor_nbytes,  # kvdd rule 1
                              f"the {local.S}-byte row would be written")

    def offsets(local: CacheEntry, rc: RemoteCache) -> Offsets:
        # exactly L.S bytes of the source row land at the remote row's offset (§3.12, §7.5)
        return row_run(src_batch_index * local.S, bd * rc.stride_nbytes, local.S)

    return _push_layers(backend, "push_kv_cache", src_cache, dst_cache_index, plan, t,
                        check_layer, offsets)  # 7


def push_kv_blocks(backend: SimBackend, src_cache: Cache, dst_cache_index: CacheIndex,
                   src_blocks: Sequence[int], dst_blocks: Sequence[int], ext_param: KvCacheExtParam) -> int:
    """§3.13 PushKvBlocks."""
    _require_push_source(backend, src_cache)  # 1, 2
    if len(src_blocks) == 0:  # 3
        reject(PARAM_INVALID, "src_blocks is empty")
    if len(src_blocks) != len(dst_blocks):  # 4
        reject(PARAM_INVALID, f"{len(src_blocks)} src blocks but {len(dst_blocks)} dst blocks")
    if dst_cache_index.batch_index != 0:  # 5
        reject(PARAM_INVALID, "dst_cache_index.batch_index must be 0 for blocks")
    plan = _push_prologue(src_cache, ext_param)  # 6, 7
    t = ext_param.tensor_num_per_layer
    runs = Runs(src_blocks, dst_blocks)

    def check_layer(local: CacheEntry, rc: RemoteCache, ls: int) -> None:
        if runs.d_max >= rc.batch_size:
            reject(PARAM_INVALID, f"dst block {runs.d_max} >= remote block count {rc.batch_size}")
        _push_local_checks(local, t, ls)
        runs.require_below(runs.s0, runs.s_last, local.B, "src block", "local block count")
        require_not_ragged(local, rc)  # kvdd rule 10
        # indices are now < 2**32; block size = local stride on both sides (§3.13, §7.4)
        _, d_off, length = runs.byte_offsets(local.S)
        require_inside_remote(ends_past(d_off, length, rc.tensor_nbytes),
                              "a block run would be written")  # kvdd rule 1

    def offsets(local: CacheEntry, rc: RemoteCache) -> Offsets:
        return int64_arrays(*runs.byte_offsets(local.S))

    return _push_layers(backend, "push_kv_blocks", src_cache, dst_cache_index, plan, t,
                        check_layer, offsets)  # 8

