"""PushKvCache and PushKvBlocks (SEMANTICS.md §3.12, §3.13), check by check in upstream's order.

The comments name the step.  Every check raises :class:`kvdd.sim.checks.Rejected`; the functions
return the status of the copy.  Unlike every other call, a multi-layer push writes the layers
before its first failing layer (§3.12 step 7).

The compiled path of in-process calls (:mod:`kvdd.sim._fastpath`) restates when these checks all
pass, and declines every other call to this module: a change to a check here changes it there too
(tests/sim/test_fastpath.py compares the two on random calls).
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
from .runs import BytePlan, Runs, row_run, total
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
        n_ok, failed = _layers_passing(local, rc, src_layers, ld0, remote_layers, t, check_layer)
        if n_ok:
            src_off, dst_off, length = offsets(local, rc)
            status = faults.on_transfer(backend, kind, idx.cluster_id, entity,
                                        t * n_ok * total(length))
            if status != S_OK:
                return status
            # the layers that passed are consecutive on both sides: their tensors are two ranges
            # (the copy takes each side's regions as one slice, whatever the tensor count)
            ls0 = src_layers.start
            run(entity, local, rc, False, backend.sync_wait_ms, range(ls0 * t, (ls0 + n_ok) * t),
                range(ld0 * t, (ld0 + n_ok) * t), src_off, dst_off, length)
        if failed is not None:
            raise failed
        return S_OK


def _layers_passing(local: CacheEntry, rc: RemoteCache, src_layers: range, ld0: int, remote_layers: int,
                    t: int, check_layer: Callable[[CacheEntry, RemoteCache, int], None]
                    ) -> tuple[int, Rejected | None]:
    """How many planned layers pass their checks before the first failing one, and its rejection.

    Upstream checks layer ``i`` (source ``src_layers[i]``, destination ``ld0 + i``) in order: layer
    0 runs every check (e-h, kvdd rules 10 and 1); a later layer can fail only d (destination layer
    below the remote layer count) or f (source layer below the local one), both monotonic in ``i``
    (the layers are consecutive on both sides), so the first failing layer is found in O(1) and
    its checks run once, in upstream's order, for the exact rejection."""
    if len(src_layers) == 0:
        return 0, None
    try:
        check_layer(local, rc, src_layers[0])  # e-h, kvdd rules 10 and 1
    except Rejected as exc:
        return 0, exc
    # first i >= 1 failing d (ld0 + i >= remote_layers) or f (src_layers[i] >= local.n // t)
    first = min(len(src_layers), max(1, remote_layers - ld0), max(1, local.n // t - src_layers[0]))
    if first == len(src_layers):
        return first, None
    try:
        _require_dst_layer(ld0 + first, remote_layers)  # d
        _push_local_checks(local, t, src_layers[first])  # f (g passed at layer 0)
    except Rejected as exc:
        return first, exc
    raise AssertionError(f"layer {first} was computed to fail check d or f")  # pragma: no cover


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
    planned: dict[int, BytePlan] = {}  # by block size: check_layer's plan, reused by offsets

    def check_layer(local: CacheEntry, rc: RemoteCache, ls: int) -> None:
        if runs.d_max >= rc.batch_size:
            reject(PARAM_INVALID, f"dst block {runs.d_max} >= remote block count {rc.batch_size}")
        _push_local_checks(local, t, ls)
        runs.require_below(runs.s0, runs.s_last, local.B, "src block", "local block count")
        require_not_ragged(local, rc)  # kvdd rule 10
        # indices are now < 2**32; block size = local stride on both sides (§3.13, §7.4)
        plan = runs.byte_plan(local.S)
        planned[local.S] = plan
        require_inside_remote(plan[5] > rc.tensor_nbytes, "a block run would be written")  # kvdd rule 1

    def offsets(local: CacheEntry, rc: RemoteCache) -> Offsets:
        plan = planned.get(local.S)
        if plan is None:
            plan = runs.byte_plan(local.S)
        return plan[0], plan[1], plan[2]

    return _push_layers(backend, "push_kv_blocks", src_cache, dst_cache_index, plan, t,
                        check_layer, offsets)  # 8

