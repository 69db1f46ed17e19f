"""Two-sided pulls of CANN's Python package: the requester's request and the peer's live lookup.

docs/spec/PYPKG.md §0.6, §4.4 (the two-sided table), §4.5 and §4.6 ("two-sided"), §9.6.  An
engine that is not remote-cache-accessible pulls by asking the peer: the peer looks the source up
**live** in its own maps (no snapshot), runs its checks (upstream's ``SendState`` on the peer's
FSM thread) and answers with a status.  Here the request travels as a *resolved lease* over the
link's authenticated connection (a LEASE whose cache id is 0, :class:`kvdd.sim.fabric.leases.
LeaseResolver`; a direct call for a peer in this process): on success the peer grants a lease on
the entry it found and tells the requester its geometry and the source offset; the requester then
reads under that lease, every run checked by the peer against that entry (kvdd rule 1), so a peer
serves its registered and allocated tensors only, whatever the requester asks.  Once the bytes
are served, the peer consumes the key of an owned (pool-allocated) cache pulled through a
non-prefix key, with layer ranges only once every tensor index was pulled (PYPKG.md §4.4).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...status import NOT_EXIST, PARAM_INVALID, S_OK, TIMEOUT, Status
from .. import faults
from ..checks import reject
from ..runs import Runs, row_run
from . import pools
from .keys import NO_ID

if TYPE_CHECKING:
    from ...llm_datadist._seam import CacheKeyTuple, PullParamTuple
    from ..caches import CacheTable
    from ..entries import CacheEntry, Entity
    from ..fabric.leases import Resolved
    from .instance import PkgInstance
    from .protocols import PkgEngine

__all__ = ["REQUEST", "ANSWER", "pull", "resolve"]

HOST = 0  # Placement.HOST
_I64 = np.int64

#: The request (upstream's TransferCacheReq, the fields the peer reads): cache_id (int64, -1 for
#: a CacheKey), batch_index, req_id, prefix_id, model_id, is_pull_block, block_size (the
#: destination's block size in bytes, 0 for a contiguous destination), num_tensors (K),
#: src_tensor_start_index, src_tensor_indices_size (0: none), pull_size, max_block_index,
#: dst_placement.
REQUEST = struct.Struct("<qQQQQBQIIIQQB")
#: The peer's answer after the lease id: the source entry's tensor count, bytes per tensor,
#: stride, block count, and the source offset (bytes) the lookup gave.
ANSWER = struct.Struct("<IQQQQ")


# ---- the peer's side ------------------------------------------------------------------------

def _fail(status: int) -> Resolved:
    return status, None, b"", None


def _key_of_row(table: CacheTable, cache_id: int, batch: int) -> tuple[int, int] | None:
    """The req-map key bound to ``(cache_id, batch)`` (upstream's id/batch -> key map), if any."""
    for ident, bound in table.req_keys.items():
        if bound == (cache_id, batch):
            return ident
    return None


def resolve(instance: PkgInstance, request: bytes) -> Resolved:
    """The peer's side of a two-sided pull (``SendState::Prepare``, PYPKG.md §4.4-§4.6): the
    source looked up live in ``instance``'s maps, then the peer's checks, in upstream's order:

    * blocks pull: identity ``(req_id, model_id)`` in the req map, else KV_CACHE_NOT_EXIST;
      block size 0 -> PARAM_INVALID;
    * ``cache_id >= 0``: the key bound to ``(cache_id, batch_index)`` if any, else the entry by
      id with ``batch_index < B`` (else KV_CACHE_NOT_EXIST), offset ``batch_index * S``;
    * ``cache_id < 0`` (a CacheKey): ``(prefix_id, model_id)`` in the prefix map when the prefix
      is valid, else ``(req_id, model_id)`` in the req map; offset = the key's batch position x S;
    * ``CheckParam``: tensor count, blocks pull <=> blocks source, ``max(src) < N``, ``pull_size
      <= S`` (contiguous destination) or the padded stride (host block destination), the source
      tensor range inside the entry; then HOST -> HOST is LLM_FEATURE_NOT_ENABLED.

    Answers :data:`kvdd.sim.fabric.leases.Resolved`: the entry to lease (not yet acquired), the
    :data:`ANSWER` bytes, and the key consumption to run once the bytes were served."""
    try:
        (cache_id, batch, req_id, prefix_id, model_id, pull_block, block_size, num_tensors,
         src_start, src_count, pull_size, max_block, dst_placement) = REQUEST.unpack(request)
    except struct.error:
        return _fail(PARAM_INVALID)
    if instance.remote_accessible or not instance.initialized:  # this peer serves one-sided only
        return _fail(NOT_EXIST)
    table = instance.cache_table
    consume: tuple[int, int] | None = None
    with table.lock:
        if pull_block:
            bound = table.req_keys.get((req_id, model_id))
            entry = None if bound is None else table.caches.get(bound[0])
            if entry is None:
                return _fail(NOT_EXIST)
            if block_size == 0:
                return _fail(PARAM_INVALID)
            offset = 0
        else:
            is_prefix = False
            ident: tuple[int, int] | None
            if cache_id >= 0:
                ident = _key_of_row(table, cache_id, batch)
            else:
                is_prefix = prefix_id != NO_ID
                ident = (prefix_id if is_prefix else req_id, model_id)
            if ident is None:
                entry = table.caches.get(cache_id)
                if entry is None or batch >= entry.B:
                    return _fail(NOT_EXIST)
                offset = batch * entry.S
            else:
                bound = (table.prefix_keys if is_prefix else table.req_keys).get(ident)
                entry = None if bound is None else table.caches.get(bound[0])
                if bound is None or entry is None:
                    return _fail(NOT_EXIST)
                offset = bound[1] * entry.S
                if not is_prefix:
                    consume = ident
        # CheckParam
        if (src_count or entry.n) != num_tensors:
            return _fail(PARAM_INVALID)
        if bool(pull_block) != (entry.N != 0):
            return _fail(PARAM_INVALID)
        if pull_block:
            if max_block != 0 and max_block >= entry.N:
                return _fail(PARAM_INVALID)
        elif block_size > 0:
            if dst_placement == HOST:
                padded = -(-entry.S // block_size) * block_size
                if pull_size > padded:
                    return _fail(PARAM_INVALID)
        elif pull_size > entry.S:
            return _fail(PARAM_INVALID)
        if src_count:
            if src_start >= entry.n or src_start + src_count - 1 >= entry.n:
                return _fail(PARAM_INVALID)
        elif src_start >= entry.n:
            return _fail(PARAM_INVALID)
        if entry.placement == HOST and dst_placement == HOST:
            return _fail(Status.LLM_FEATURE_NOT_ENABLED)
        answer = ANSWER.pack(entry.n, entry.T, entry.S, entry.N, offset)
    on_served: Callable[[list[int]], None] | None = None
    if consume is not None:
        key, cid, n, ranged = consume, entry.cache_id, entry.n, bool(src_count)

        def on_served(tensors: list[int]) -> None:
            pools.consume_key(instance, cid, key, tensors if ranged else None, n)

    return S_OK, entry, answer, on_served


# ---- the requester's side -------------------------------------------------------------------

def pull(engine: PkgEngine, entity: Entity, local: CacheEntry, key: CacheKeyTuple,
         param: PullParamTuple, runs: Runs | None) -> int:
    """A two-sided pull into ``local`` (caller holds ``entity.lock`` and ran the local checks
    and ``ConstructTransferInfo``): the request, the peer's status, then the bytes as PYPKG.md
    §4.5 / §4.6 say, the source offset the peer's lookup gave.  LLM_TIMEOUT when the peer does
    not answer within ``llm.SyncKvCacheWaitTime`` (the link is then broken, kvdd rule 8)."""
    size, batch_index, src_blocks, dst_blocks, src_idx, dst_idx, _so, _do, _t = param
    S = local.S
    K = len(dst_idx) if dst_idx else local.n
    s0 = src_idx[0] if src_idx else 0
    pull_block = bool(src_blocks) and bool(dst_blocks)
    m = size if size > 0 and not dst_blocks else S
    try:
        request = REQUEST.pack(int(key[1]), int(key[2]), int(key[3]), int(key[4]), int(key[5]),
                               int(pull_block), S if dst_blocks else 0, K, s0, len(src_idx), m,
                               max(src_blocks) if pull_block else 0, int(local.placement))
    except struct.error:  # a field outside what the request carries (upstream's field widths)
        reject(PARAM_INVALID, f"the key {tuple(key)} or a block index does not fit the request")
    acquire = getattr(entity.peer, "acquire_resolved", None)
    if acquire is None:  # kvdd's C++ face never links a two-sided engine (flags must match)
        reject(Status.LLM_FEATURE_NOT_ENABLED, "the peer does not serve two-sided pulls")
    kind = "pull_blocks" if dst_blocks else "pull_cache"
    status = faults.on_transfer(engine.instance, kind, int(key[0]), entity, K * m)
    if status != S_OK:
        return status
    if entity.broken:
        reject(TIMEOUT, "the link timed out earlier; unlink and link again (kvdd rule 8)")
    if not local.acquire():
        reject(NOT_EXIST, f"local cache {local.cache_id} was unregistered")
    try:
        wait = engine.sync_wait_ms
        status, lease, answer = acquire(request, wait)
        if status != S_OK:
            if status == TIMEOUT:
                entity.broken = True
            reject(status, _why(status, key))
        try:
            try:
                r_n, r_T, r_S, _r_N, offset = ANSWER.unpack(answer)
            except struct.error:
                reject(TIMEOUT, "the peer answered a malformed lookup")
            l_off, r_off, length = _plan(local, batch_index, dst_blocks, runs, m, offset, r_T)
            d0 = dst_idx[0] if dst_idx else 0
            if d0 + K > local.n or s0 + K > r_n:  # the memory-safe refusal (§9.8)
                reject(PARAM_INVALID, f"tensors [{s0}, {s0 + K}) of a {r_n}-tensor source into "
                       f"[{d0}, {d0 + K}) of {local.n} local tensors")
            status = entity.peer.read(lease, range(s0, s0 + K), r_off, local.regions[d0:d0 + K],
                                      l_off, length, wait)
            if status == TIMEOUT:
                entity.broken = True
            if status != S_OK:
                reject(status, "the peer refused the transfer (a run outside its cache)"
                       if status == PARAM_INVALID else "the transfer failed")
            return S_OK
        finally:
            entity.peer.release(lease)
    finally:
        local.release()


def _plan(local: CacheEntry, batch_index: int, dst_blocks: Sequence[int],
          runs: Runs | None, m: int, offset: int, r_T: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local offsets, remote offsets, lengths) of the copy: C2C one row of ``m`` bytes from
    ``offset``; C2B block i from ``offset + i * L.S`` into ``dst[i]``; B2B the runs with the
    local stride on both sides (PYPKG.md §4.5, §4.6)."""
    S = local.S
    if not dst_blocks:
        l_off, r_off, length = row_run(batch_index * S, offset, m)
        return l_off, r_off, length
    if runs is None:  # C2B
        n = len(dst_blocks)
        r_off = offset + np.arange(n, dtype=_I64) * S
        l_off = np.asarray(dst_blocks, dtype=_I64) * S
        length = np.full(n, S, dtype=_I64)
        if int((r_off + length).max()) > r_T:  # the memory-safe refusal (§9.8)
            reject(PARAM_INVALID, f"{n} blocks of {S} bytes from offset {offset} exceed the "
                   f"{r_T}-byte source tensor")
        return l_off, r_off, length
    tail = r_T % S if S else 0
    r_off, l_off, length, _nbytes, src_end, _ = runs.byte_plan(S, tail)
    if src_end > r_T:
        reject(PARAM_INVALID, f"a block run reads past the {r_T}-byte source tensor")
    return l_off, r_off, length


def _why(status: int, key: CacheKeyTuple) -> str:
    if status == NOT_EXIST:
        what = (f"cache id {key[1]} (batch {key[2]})" if int(key[1]) >= 0 else
                f"key (req_id={key[3]}, prefix_id={key[4]}, model_id={key[5]})")
        return f"{what} is not on cluster {key[0]} (looked up there now)"
    if status == TIMEOUT:
        return f"cluster {key[0]} did not answer within llm.SyncKvCacheWaitTime"
    if status == Status.LLM_FEATURE_NOT_ENABLED:
        return "a HOST source into a HOST destination is not supported (two-sided, as upstream)"
    if status == PARAM_INVALID:
        return f"cluster {key[0]} refused the request (tensor count, size, block or tensor range)"
    return f"cluster {key[0]} answered status {status}"
