"""``transfer_cache_v2``: one layer of ``push_cache`` (type 2), ``push_blocks`` (type 1) or
``transfer_cache_async`` (types 0-2) of CANN's Python package, check by check.

docs/spec/PYPKG.md §4.8 (native order and bytes), §4.10 (the raw-address variant).  The order is
``LLMDataDistV2::TransferCache`` (``t > 0``, then the engine-wide transfer lock),
``DataCacheEngine::TransferCache`` (local cache, link), ``LayerWiseTransferJob::TransferCache``
(local remote-accessible flag, the remote lookup and ``ValidateRemoteCache``, then ``Prepare``:
source layer, tensor multiple, and the C2C / C2B / B2B task checks).  Pushes are serialized
engine-wide (upstream's ``transfer_mutex_``) and per link.

Where upstream writes outside the remote tensor (a C2C row of the local stride past the remote
tensor, a block run past it) the simulator refuses with ``LLM_PARAM_INVALID`` (PYPKG.md §9.8).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...status import NOT_EXIST, PARAM_INVALID, S_OK, Status
from .. import faults
from ..checks import reject, require_inside_remote, require_not_ragged
from ..runs import Runs, row_run
from ..transfers import run
from .keys import NO_ID, find_remote
from .pulls import link_entity, require_live_link

if TYPE_CHECKING:
    from ...llm_datadist._seam import BlockCfgTuple, TransferCfgTuple
    from ..entries import CacheEntry, Entity
    from ..fabric import RemoteCache
    from .protocols import PkgEngine

__all__ = ["transfer_cache_v2", "PUSH_RAW", "PUSH_BLOCKS", "PUSH_CACHE"]

PUSH_RAW, PUSH_BLOCKS, PUSH_CACHE = 0, 1, 2
_KINDS = {PUSH_RAW: "transfer_cache_async", PUSH_BLOCKS: "push_blocks", PUSH_CACHE: "push_cache"}
_I64 = np.int64

_locks: weakref.WeakKeyDictionary[object, threading.Lock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def _transfer_lock(instance: object) -> threading.Lock:
    """The engine-wide transfer lock (one per simulator instance)."""
    with _locks_guard:
        lock = _locks.get(instance)
        if lock is None:
            lock = _locks[instance] = threading.Lock()
        return lock


def transfer_cache_v2(engine: PkgEngine, task_id: int, cfg: TransferCfgTuple,
                      block_cfg: BlockCfgTuple) -> int:
    """One layer ``ls -> ld`` (PYPKG.md §4.8): a status; checks raise
    :class:`kvdd.sim.checks.Rejected`."""
    t = cfg[9]
    if t <= 0:
        reject(PARAM_INVALID, "tensor_num_per_layer must be > 0")
    with _transfer_lock(engine.instance):
        return _transfer(engine, cfg, block_cfg)


def _transfer(engine: PkgEngine, cfg: TransferCfgTuple, block_cfg: BlockCfgTuple) -> int:
    src_id, src_batch, ls, dst_addrs, cluster, model_or_id, dst_batch, push_type, ld, t = cfg
    instance = engine.instance
    local = instance.caches.get(src_id)
    if local is None:
        reject(Status.LLM_KV_CACHE_NOT_EXIST, f"local cache {src_id} is not registered")
    entity = link_entity(engine, cluster)
    with entity.lock:
        require_live_link(engine, cluster, entity)
        bms, src_blocks, dst_blocks = block_cfg
        if not engine.remote_accessible:
            # two-sided engine: upstream writes the config's raw destination addresses without a
            # table lookup; a cache-key config has none and fails the address-count check
            _layer_checks(local, t, ls, len(dst_addrs), t)
            plan = _prepare(local, 0, None, src_batch, src_blocks, dst_blocks, bms)
            return _raw_write(engine, entity, local, t, ls, dst_addrs, plan, cluster)
        if not local.remote_accessible:
            reject(PARAM_INVALID, f"local cache {local.cache_id} is not remote accessible")
        rc = _find(entity.peer.snapshot(), push_type, model_or_id)
        _validate_remote(rc, t, ld, dst_batch, dst_blocks, bms)
        _layer_checks(local, t, ls, len(dst_addrs) + t, t)
        require_not_ragged(local, rc)  # kvdd rule 10
        plan = _prepare(local, dst_batch * rc.stride_nbytes, rc.tensor_nbytes, src_batch,
                        src_blocks, dst_blocks, bms)
        local_off, remote_off, length = plan
        nbytes = int(np.asarray(length).sum()) * t
        status = faults.on_transfer(instance, _KINDS.get(push_type, "push_cache"), cluster, entity,
                                    nbytes)
        if status != S_OK:
            return status
        return run(entity, local, rc, False, engine.sync_wait_ms, range(ls * t, (ls + 1) * t),
                   range(ld * t, (ld + 1) * t), local_off, remote_off, length)


def _raw_write(engine: PkgEngine, entity: Entity, local: CacheEntry, t: int, ls: int,
               dst_addrs: Sequence[int], plan: tuple[np.ndarray, np.ndarray, np.ndarray],
               cluster: int) -> int:
    """Type 0 (``transfer_cache_async`` with ``TransferConfig``): the layer's tensor ``i`` goes to
    the raw address ``dst_addrs[i]``.  Upstream writes there unchecked; the simulator writes only
    when every byte lands inside one tensor of a cache the peer serves over this link (registered
    before the link, remote-accessible), else LLM_PARAM_INVALID (PYPKG.md §9.8)."""
    local_off, remote_off, length = plan
    lo = int(np.min(remote_off))
    hi = int(np.max(remote_off + length))
    peer = entity.peer
    served = [(rc, peer.addresses(cid)) for cid, rc in peer.snapshot().items()
              if rc.remote_accessible]
    targets: list[tuple[RemoteCache, int, int]] = []
    for i, addr in enumerate(dst_addrs):
        found = next(((rc, k, base) for rc, addrs in served for k, base in enumerate(addrs)
                      if base <= addr + lo and addr + hi <= base + rc.tensor_nbytes), None)
        if found is None:
            reject(PARAM_INVALID, f"destination address {i} (0x{addr:x}) + [{lo}, {hi}) is not "
                   f"inside a tensor cluster {cluster} registered before this link; unchecked on "
                   "hardware (undefined there); the simulator refuses it")
        targets.append(found)
    status = faults.on_transfer(engine.instance, "transfer_cache_async", cluster, entity,
                                t * int(np.asarray(length).sum()))
    if status != S_OK:
        return status
    for i, (rc, k, base) in enumerate(targets):
        run(entity, local, rc, False, engine.sync_wait_ms, range(ls * t + i, ls * t + i + 1),
            range(k, k + 1), local_off, remote_off + (dst_addrs[i] - base), length)
    return S_OK


def _find(snapshot: dict[int, RemoteCache], push_type: int, model_or_id: int) -> RemoteCache:
    """``FillRemoteLayerAddrs``' lookup in the link's snapshot with upstream's request defaults
    (``cache_id = -1``, ``req_id = 0``, ``model_id = 0``): type 1 by the identity
    ``(2**64-1, model_id)``; type 2 by cache id when it is > 0, else (upstream's quirk) by the
    identity ``(0, 0)``, i.e. a ``CacheKey(req_id=0, model_id=0)`` cache; type 0 likewise."""
    if push_type == PUSH_BLOCKS:
        key = (0, -1, 0, NO_ID, NO_ID, model_or_id, True)
        what = f"blocks key model_id={model_or_id}"
    elif push_type == PUSH_CACHE and model_or_id > 0:
        key = (0, model_or_id, 0, NO_ID, NO_ID, 0, False)
        what = f"cache id {model_or_id}"
    else:
        key = (0, -1, 0, 0, NO_ID, 0, False)
        what = f"cache id {model_or_id} (looked up as the key req_id=0, model_id=0)"
    rc = find_remote(snapshot, key)
    if rc is None:
        reject(NOT_EXIST, f"{what} is not in the peer's cache table as this link saw it")
    return rc


def _validate_remote(rc: RemoteCache, t: int, ld: int, dst_batch: int, dst_blocks: Sequence[int],
                     bms: int) -> None:
    """``ValidateRemoteCache``."""
    if not rc.remote_accessible:
        reject(PARAM_INVALID, f"remote cache {rc.cache_id} is not remote accessible")
    layers = rc.num_tensors // t
    if ld < 0 or ld >= layers:
        reject(PARAM_INVALID, f"dst layer {ld} is out of range [0, {layers})")
    if not dst_blocks:
        if dst_batch >= rc.batch_size:
            reject(PARAM_INVALID, f"dst batch index {dst_batch} is out of range "
                   f"[0, {rc.batch_size}) of the remote cache")
    else:
        top = max(dst_blocks)
        if top >= rc.blocks:
            reject(PARAM_INVALID, f"dst block {top} is out of range [0, {rc.blocks})")
        if bms != 0 and bms != rc.stride_nbytes:
            reject(PARAM_INVALID, f"dst_block_memory_size {bms} differs from the remote stride "
                   f"{rc.stride_nbytes}")


def _layer_checks(local: CacheEntry, t: int, ls: int, dst_addrs: int, layer: int) -> None:
    """``Prepare``'s first checks: the source layer, the tensor multiple, and as many destination
    addresses as tensors in a source layer (a cache-key config adds the remote layer's ``t``
    addresses to the ones it carries, which should be none)."""
    layers = local.n // t
    if ls < 0 or ls >= layers:
        reject(PARAM_INVALID, f"src layer {ls} is out of range [0, {layers})")
    if local.n % t != 0:
        reject(PARAM_INVALID, f"the local tensor count {local.n} is not a multiple of "
               f"tensor_num_per_layer {t}")
    if dst_addrs != layer:
        reject(PARAM_INVALID, f"{dst_addrs} destination addresses for a layer of {layer} tensors")


def _prepare(local: CacheEntry, row: int, remote_T: int | None, src_batch: int,
             src_blocks: Sequence[int], dst_blocks: Sequence[int], bms: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``Prepare``'s task generators: the byte runs ``(local_off, remote_off, length)``, the
    remote offsets from each destination tensor's address (which starts at byte ``row`` of the
    remote tensor); with ``remote_T`` (the remote tensor's size) every run must end inside it
    (kvdd's refusal where upstream would write past it; raw addresses are mapped later)."""
    S = local.S
    if not dst_blocks:  # C2C: L.S bytes of the source row (no L.S <= R.S check upstream)
        if src_batch >= local.B:
            reject(PARAM_INVALID, f"src batch index {src_batch} is out of range [0, {local.B})")
        if remote_T is not None:
            require_inside_remote(row + S > remote_T, f"the {S}-byte row would be written")
        return row_run(src_batch * S, row, S)
    if not src_blocks:  # C2B: the source row split into bms-byte chunks
        if not 0 < bms < local.T:
            reject(PARAM_INVALID, f"dst_block_memory_size {bms} must be > 0 and < the tensor size "
                   f"{local.T} to push a contiguous cache into blocks")
        if src_batch >= local.B:
            reject(PARAM_INVALID, f"src batch index {src_batch} is out of range [0, {local.B})")
        chunks = -(-local.T // bms)
        n = len(dst_blocks)
        if chunks < n:
            reject(PARAM_INVALID, f"the source splits into {chunks} chunks of {bms} bytes, fewer "
                   f"than the {n} dst blocks")
        local_off = src_batch * S + np.arange(n, dtype=_I64) * bms
        remote_off = row + np.asarray(dst_blocks, dtype=_I64) * bms
        length = np.full(n, bms, dtype=_I64)
        if local.T % bms:
            length[-1] = local.T % bms
        if int((local_off + length).max()) > local.T:
            reject(PARAM_INVALID, f"the source chunks run past the {local.T}-byte local tensor; "
                   "unchecked on hardware (undefined there); the simulator refuses it")
        if remote_T is not None:
            require_inside_remote(int((remote_off + length).max()) > remote_T,
                                  "a block would be written")
        return local_off, remote_off, length
    # B2B
    if local.N <= 0:
        reject(PARAM_INVALID, "push_blocks needs a blocks source cache")
    if len(src_blocks) != len(dst_blocks):
        reject(PARAM_INVALID, f"{len(src_blocks)} src blocks but {len(dst_blocks)} dst blocks")
    runs = Runs(src_blocks, dst_blocks)
    if bms > 0 and bms != S:
        reject(PARAM_INVALID, f"dst_block_memory_size {bms} differs from the local stride {S}")
    runs.require_below(runs.s0, runs.s_last, local.N, "src block", "local block count")
    src_off, dst_off, length, _total, _src_end, dst_end = runs.byte_plan(S)
    if remote_T is not None:
        require_inside_remote(row + dst_end > remote_T, "a block run would be written")
    if row:
        dst_off = dst_off + row
    return src_off, dst_off, length
