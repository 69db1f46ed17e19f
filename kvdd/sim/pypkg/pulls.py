"""``pull_cache_v2``: ``pull_cache`` and ``pull_blocks`` of CANN's Python package, check by check.

docs/spec/PYPKG.md §4.5 (pull_cache), §4.6 (pull_blocks), §4.7 (tensor indices), §4.4 (remote
lookup).  The numbered comments follow the internal engine's order: ``LLMDataDistV2::PullCache``
(``t > 0``, own cluster), ``DataCacheEngine::PullCache`` / ``CheckParam`` / ``CheckTensorIndices``
(local checks), the link checks, then the one-sided client (``ConstructTransferInfo``,
``FindCacheEntry``, the remote-accessible flags) and the read job (tensor count, per-group bounds).

Where upstream reads outside the remote tensor (a source layer range past the peer's tensors, a
remote row past its batch, a block run past the tensor) the simulator refuses with
``LLM_PARAM_INVALID`` instead (PYPKG.md §9.8, SEMANTICS.md §10 rule 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...status import NOT_EXIST, NOT_YET_LINK, PARAM_INVALID, S_OK, Status
from .. import faults
from ..checks import REQUEST_LIMIT, reject, require_inside_remote, require_not_ragged
from ..fabric import KIND_BLOCKS, KIND_MIX
from ..runs import Runs, row_run
from ..transfers import run
from .keys import find_remote

if TYPE_CHECKING:
    from ...llm_datadist._seam import CacheKeyTuple, PullParamTuple
    from ..entries import CacheEntry, Entity
    from .protocols import PkgEngine

__all__ = ["pull_cache_v2", "check_tensor_indices", "link_entity", "HOST"]

HOST = 0  # Placement.HOST
_I64 = np.int64


def check_tensor_indices(local: CacheEntry, t: int, src_idx: Sequence[int],
                         dst_idx: Sequence[int]) -> None:
    """``CheckTensorIndices`` (PYPKG.md §4.7): ``local`` is the destination."""
    n = local.n
    if (src_idx or dst_idx) and n % t != 0:
        reject(PARAM_INVALID, f"with layer ranges the local tensor count {n} must be a multiple "
               f"of tensor_num_per_layer {t}")
    for name, idx in (("src", src_idx), ("dst", dst_idx)):
        # upstream: distinct, and together one run of consecutive values (any order)
        if idx and (len(set(idx)) != len(idx) or max(idx) - min(idx) + 1 != len(idx)):
            reject(PARAM_INVALID, f"{name}_tensor_indices are not continuous")
    if dst_idx:
        if len(dst_idx) > n:
            reject(PARAM_INVALID, f"{len(dst_idx)} dst tensor indices for {n} local tensors")
        if not (0 <= dst_idx[0] < n and 0 <= dst_idx[-1] < n):
            reject(PARAM_INVALID, f"dst tensor indices [{dst_idx[0]}, {dst_idx[-1]}] are outside "
                   f"the local tensors [0, {n})")
    if src_idx and dst_idx:
        if len(src_idx) != len(dst_idx):
            reject(PARAM_INVALID, f"{len(src_idx)} src but {len(dst_idx)} dst tensor indices "
                   "(the layer ranges differ in length)")
    elif src_idx and len(src_idx) != n:
        reject(PARAM_INVALID, f"a src layer range of {len(src_idx)} tensors without a dst range "
               f"needs the local tensor count {n}")


def link_entity(engine: PkgEngine, cluster_id: int) -> Entity:
    """The link entity for ``cluster_id``, else LLM_NOT_YET_LINK (no link, or a rank-table link
    whose memory preparation has not finished, PYPKG.md §3.3)."""
    entity = engine.instance.entities.get(cluster_id)
    if entity is None:
        reject(NOT_YET_LINK, f"not linked with cluster {cluster_id}")
    return entity


def require_live_link(engine: PkgEngine, cluster_id: int, entity: Entity) -> None:
    """Under the entity's lock: still this link (not unlinked meanwhile), prepared."""
    if engine.instance.entities.get(cluster_id) is not entity:
        reject(NOT_YET_LINK, f"the link with cluster {cluster_id} was removed")
    if engine.link_pending(cluster_id):
        reject(NOT_YET_LINK, f"the rank-table link with cluster {cluster_id} is still preparing: "
               "wait until query_register_mem_status returns OK")


def _local_checks(local: CacheEntry, size: int, batch_index: int, src_blocks: Sequence[int],
                  dst_blocks: Sequence[int], t: int, src_idx: Sequence[int],
                  dst_idx: Sequence[int]) -> None:
    """``CheckParam`` (PYPKG.md §4.5, §4.6): the destination cache's own checks."""
    if batch_index >= local.B:
        reject(PARAM_INVALID, f"batch_index {batch_index} is out of range [0, {local.B})")
    if not dst_blocks:
        if not (local.N == 0 or local.kind == KIND_MIX):
            reject(PARAM_INVALID, "pull_cache needs a non-blocks destination cache")
        if size >= 0 and size > local.S:
            reject(PARAM_INVALID, f"size {size} > the destination stride {local.S} bytes")
    elif local.N <= 0:
        reject(PARAM_INVALID, "pull_blocks needs a blocks destination cache")
    if local.placement == HOST and local.kind == KIND_BLOCKS:
        for b in dst_blocks:
            if b >= local.N:
                reject(PARAM_INVALID, f"dst block {b} is out of range [0, {local.N})")
        if src_blocks and len(src_blocks) != len(dst_blocks):
            reject(PARAM_INVALID, f"{len(src_blocks)} src blocks but {len(dst_blocks)} dst blocks")
    check_tensor_indices(local, t, src_idx, dst_idx)


def pull_cache_v2(engine: PkgEngine, dst_cache_id: int, key: CacheKeyTuple,
                  param: PullParamTuple) -> int:
    """One ``pull_cache`` (no dst blocks) or ``pull_blocks`` into local cache ``dst_cache_id``
    from the peer the key's cluster id names (PYPKG.md §4.5, §4.6): a status; checks raise
    :class:`kvdd.sim.checks.Rejected`."""
    size, batch_index, src_blocks, dst_blocks, src_idx, dst_idx, _so, _do, t = param
    instance = engine.instance
    cluster = int(key[0])
    if t <= 0:
        reject(PARAM_INVALID, "tensor_num_per_layer must be > 0")
    if cluster == instance.cluster_id:
        reject(PARAM_INVALID, f"cannot pull from the own cluster {cluster}")
    local = instance.caches.get(dst_cache_id)
    if local is None:
        reject(Status.LLM_KV_CACHE_NOT_EXIST, f"local cache {dst_cache_id} is not registered")
    _local_checks(local, size, batch_index, src_blocks, dst_blocks, t, src_idx, dst_idx)
    entity = link_entity(engine, cluster)
    with entity.lock:  # pulls are serialized per link (PYPKG.md §0.4, §9.11)
        require_live_link(engine, cluster, entity)
        if not engine.remote_accessible:
            if local.placement == HOST:
                reject(PARAM_INVALID, "a HOST destination needs a device memory pool in the "
                       "two-sided mode (not simulated)")
            _construct(local, param)  # the request is built as in the one-sided mode
            reject(Status.LLM_FEATURE_NOT_ENABLED, "this pull is two-sided (the engine is not "
                   "remote-cache-accessible): it needs the peer's device-side request handler, "
                   "which the simulator does not model; set enable_remote_cache_accessible=True "
                   "on both sides")
        return _pull_one_sided(engine, entity, local, key, param)


def _construct(local: CacheEntry, param: PullParamTuple) -> Runs | None:
    """``ConstructTransferInfo`` (both modes): the groups, the request size, the destination
    bounds; the B2B runs (None for C2C and C2B)."""
    _size, _batch, src_blocks, dst_blocks, _src_idx, dst_idx, _so, _do, _t = param
    if src_blocks and not dst_blocks:
        reject(PARAM_INVALID, "pulling blocks into a contiguous cache is not supported")
    runs: Runs | None = None
    if not dst_blocks:
        groups = 1  # C2C
    elif not src_blocks:
        groups = len(dst_blocks)  # C2B: one group (i, dst[i]) per destination block
    else:
        if len(src_blocks) != len(dst_blocks):
            reject(PARAM_INVALID, f"{len(src_blocks)} src blocks but {len(dst_blocks)} dst blocks")
        runs = Runs(src_blocks, dst_blocks)
        groups = len(runs)
    K = len(dst_idx) if dst_idx else local.n
    if 120 + 16 * (K + 2 * groups) > REQUEST_LIMIT:
        reject(PARAM_INVALID, f"transfer request with {groups} block groups exceeds 2 MiB")
    if runs is not None:
        runs.require_below(runs.d0, runs.d_last, local.N, "dst block", "local block count")
    elif dst_blocks:
        for b in dst_blocks:
            if b >= local.N:
                reject(PARAM_INVALID, f"dst block {b} is out of range [0, {local.N})")
    return runs


def _pull_one_sided(engine: PkgEngine, entity: Entity, local: CacheEntry, key: CacheKeyTuple,
                    param: PullParamTuple) -> int:
    size, batch_index, src_blocks, dst_blocks, src_idx, dst_idx, _so, _do, _t = param
    kind = "pull_blocks" if dst_blocks else "pull_cache"
    runs = _construct(local, param)
    K = len(dst_idx) if dst_idx else local.n
    # FindCacheEntry on the link's snapshot, then the remote-accessible flags (local first)
    rc = find_remote(entity.peer.snapshot(), key)
    if rc is None:
        what = f"cache id {key[1]}" if key[1] > 0 else f"key (req_id={key[3]}, model_id={key[5]})"
        reject(NOT_EXIST, f"{what} is not in cluster {key[0]}'s cache table as this link saw it "
               "(registered after the link, or never)")
    if not local.remote_accessible:
        reject(PARAM_INVALID, f"local cache {local.cache_id} is not remote accessible")
    if not rc.remote_accessible:
        reject(PARAM_INVALID, f"remote cache {rc.cache_id} is not remote accessible")
    # the read job: tensor count, then per group the source bounds and lengths
    src_n = len(src_idx) if src_idx else rc.num_tensors
    if src_n != K:
        reject(PARAM_INVALID, f"{src_n} source tensors but {K} destination tensors")
    require_not_ragged(local, rc)  # kvdd rule 10
    s0 = src_idx[0] if src_idx else 0
    if s0 + K > rc.num_tensors:  # undefined upstream: the memory-safe refusal (§9.8)
        reject(PARAM_INVALID, f"the source layer range reaches tensor {s0 + K - 1} of a "
               f"{rc.num_tensors}-tensor remote cache")
    S = local.S
    if not dst_blocks:  # C2C: block = the remote stride, one group from the key's row
        m = size if size > 0 else S
        if m > rc.stride_nbytes:
            reject(PARAM_INVALID, f"{m} bytes per tensor > the remote stride {rc.stride_nbytes}")
        # the remote offset uses the local stride (upstream); the row is not range-checked there
        src_off = (int(key[2]) * S) if local.kind != KIND_BLOCKS else 0
        require_inside_remote(src_off + m > rc.tensor_nbytes, f"remote batch_index {key[2]} reads")
        l_off, r_off, length = row_run(batch_index * S, src_off, m)
        nbytes = m
    else:
        remote_blocks = -(-rc.tensor_nbytes // S)
        tail = rc.tensor_nbytes % S  # upstream: the last group copies only R.T % block bytes
        if runs is None:  # C2B
            n = len(dst_blocks)
            # group 0 fails the length check before any later group fails its source index
            if S > rc.stride_nbytes:
                reject(PARAM_INVALID, f"a {S}-byte block > the remote stride {rc.stride_nbytes}")
            if n > remote_blocks:
                reject(PARAM_INVALID, f"src block {remote_blocks} is out of range "
                       f"[0, {remote_blocks})")
            r_off = np.arange(n, dtype=_I64) * S
            l_off = np.asarray(dst_blocks, dtype=_I64) * S
            length = np.full(n, S, dtype=_I64)
            if tail:
                length[-1] = tail
            require_inside_remote(int((r_off + length).max()) > rc.tensor_nbytes,
                                  "a source block reads")
            nbytes = int(length.sum())
        else:  # B2B
            runs.require_below(runs.s0, runs.s0, remote_blocks, "src block", "remote block count")
            longest = runs.longest()
            if longest * S > rc.tensor_nbytes:
                reject(PARAM_INVALID, f"a run of {longest} blocks exceeds the remote tensor")
            r_off, l_off, length, nbytes, src_end, _ = runs.byte_plan(S, tail)
            require_inside_remote(src_end > rc.tensor_nbytes, "a block run reads")
    d0 = dst_idx[0] if dst_idx else 0
    if d0 + K > local.n:  # an unordered index list starting high: the memory-safe refusal (§9.8)
        reject(PARAM_INVALID, f"the destination tensors [{d0}, {d0 + K}) exceed the local "
               f"{local.n} tensors")
    local_tensors = range(d0, d0 + K)
    remote_tensors = range(s0, s0 + K)
    status = faults.on_transfer(engine.instance, kind, int(key[0]), entity, K * nbytes)
    if status != S_OK:
        return status
    return run(entity, local, rc, True, engine.sync_wait_ms, local_tensors, remote_tensors,
               l_off, r_off, length)
