"""Local copies of CANN's Python package (the pool calls: :mod:`.pools`).

docs/spec/PYPKG.md §4.11 (``copy_cache``, ``copy_blocks``, ``swap_blocks``,
``remap_registered_memory``) and §4.3 (pool-backed ``allocate_*`` / ``deallocate_*`` /
``remove_cache_key``).  Copies run between registered regions with leases held on both caches
(an unregister waits for them); everything is checked before the first byte moves (upstream
queues its copies while it checks: kvdd never writes part of a request it then refuses).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...status import NOT_EXIST, NOT_YET_LINK, PARAM_INVALID, S_OK, Status
from ..checks import reject
from ..memory import Region, copy_runs, first_inaccessible
from ..runs import Runs

if TYPE_CHECKING:
    from ...llm_datadist._seam import CopyParamTuple, MemInfoTuple
    from ..entries import CacheEntry
    from .protocols import PkgEngine

__all__ = ["copy_cache", "copy_blocks", "swap_blocks", "remap_registered_memory",
           "check_capacity"]

_I64 = np.int64


def _entry(engine: PkgEngine, cache_id: int, what: str) -> CacheEntry:
    entry = engine.instance.caches.get(cache_id)
    if entry is None:
        reject(NOT_EXIST, f"{what} cache {cache_id} is not registered")
    return entry


def _copy(src: CacheEntry, dst: CacheEntry, src_off: np.ndarray, dst_off: np.ndarray,
          length: np.ndarray) -> int:
    """Every tensor's runs from ``src`` to ``dst`` under leases on both caches."""
    if not src.acquire():
        reject(NOT_EXIST, f"cache {src.cache_id} was unregistered")
    try:
        if dst is not src and not dst.acquire():
            reject(NOT_EXIST, f"cache {dst.cache_id} was unregistered")
        try:
            copy_runs(src.regions, dst.regions, src_off, dst_off, length)
        finally:
            if dst is not src:
                dst.release()
    finally:
        src.release()
    return S_OK


def copy_cache(engine: PkgEngine, param: CopyParamTuple) -> int:
    """``CacheManager::CopyCache`` for contiguous caches (PYPKG.md §4.11): ``m`` bytes of row
    ``bs`` (from ``offset``) of every source tensor into row ``bd`` of the destination's."""
    src_id, dst_id, src_batch, dst_batch, offset, size, _req_id = param
    src = _entry(engine, src_id, "src")
    dst = _entry(engine, dst_id, "dst")
    if src.n != dst.n:
        reject(PARAM_INVALID, f"num_tensors differ: src {src.n}, dst {dst.n}")
    if src_batch >= src.B:
        reject(PARAM_INVALID, f"src_batch_index {src_batch} is out of range [0, {src.B})")
    if dst_batch >= dst.B:
        reject(PARAM_INVALID, f"dst_batch_index {dst_batch} is out of range [0, {dst.B})")
    if offset > 0:
        if offset >= src.S:
            reject(PARAM_INVALID, f"offset {offset} is outside the src stride {src.S}")
        if offset >= dst.S:
            reject(PARAM_INVALID, f"offset {offset} is outside the dst stride {dst.S}")
    m = size if size != -1 else src.S - offset
    if m < 0 or m > src.S - offset:
        reject(PARAM_INVALID, f"{m} bytes from offset {offset} exceed the src stride {src.S}")
    if m > dst.S - offset:
        reject(PARAM_INVALID, f"{m} bytes from offset {offset} exceed the dst stride {dst.S}")
    if m == 0:
        return S_OK
    return _copy(src, dst, np.array([src_batch * src.S + offset], _I64),
                 np.array([dst_batch * dst.S + offset], _I64), np.array([m], _I64))


def copy_blocks(engine: PkgEngine, cache_id: int, pairs: Sequence[tuple[int, int]]) -> int:
    """``copy_blocks``: block ``s`` to block ``d`` of every tensor of one cache, per pair
    (``CopyCacheForBlocks`` with the cache as source and destination)."""
    entry = _entry(engine, cache_id, "the")
    N = entry.N if entry.N > 0 else entry.B
    for s, d in pairs:
        if not 0 <= s < N:
            reject(PARAM_INVALID, f"src block {s} is out of range [0, {N})")
        if not 0 <= d < N:
            reject(PARAM_INVALID, f"dst block {d} is out of range [0, {N})")
    if not pairs:
        return S_OK
    S = entry.S
    src_off = np.array([s for s, _ in pairs], _I64) * S
    dst_off = np.array([d for _, d in pairs], _I64) * S
    return _copy(entry, entry, src_off, dst_off, np.full(len(pairs), S, _I64))


def _num_blocks(engine: PkgEngine, cache_id: int) -> int:
    """``ResolveSwapNumBlocks``: 0 (unchecked) for an address-only view (id < 0)."""
    if cache_id < 0:
        return 0
    entry = _entry(engine, cache_id, "swap")
    n = entry.N if entry.N > 0 else entry.B
    if n <= 0:
        reject(PARAM_INVALID, f"cache {cache_id} has no blocks")
    return n


def swap_blocks(engine: PkgEngine, src: tuple[int, Sequence[Sequence[int]]],
                dst: tuple[int, Sequence[Sequence[int]]], block_size: int, swap_type: int,
                block_mapping: Sequence[tuple[int, int]]) -> int:
    """``DataCacheEngine::SwapBlocks`` / ``SwapImpl::SwapBlocksV2`` (PYPKG.md §4.11): per tensor
    and per run of the mapping, ``block_size`` bytes per block between the two address lists.

    Both sides are registered caches (ids >= 0, their block counts bound the indices) or both
    address-only views (id -1, e.g. ``Cache.create_cpu_cache``).  kvdd's rule (SEMANTICS.md §10
    rule 4): every byte range touched must be readable and writable memory of this process, and
    a registered side's ranges must lie inside its registered tensors (LLM_PARAM_INVALID)."""
    (src_id, src_addrs), (dst_id, dst_addrs) = src, dst
    if (src_id < 0) != (dst_id < 0):
        reject(PARAM_INVALID, f"src/dst must both be registered caches or both address-only "
               f"views, got ids {src_id} and {dst_id}")
    src_n = _num_blocks(engine, src_id)
    dst_n = _num_blocks(engine, dst_id)
    if len(src_addrs) != 1 or len(dst_addrs) != 1:
        reject(PARAM_INVALID, "only caches on one device are supported")
    srcs, dsts = list(src_addrs[0]), list(dst_addrs[0])
    if len(srcs) != len(dsts):
        reject(PARAM_INVALID, f"{len(srcs)} src addresses but {len(dsts)} dst addresses")
    if not srcs:
        reject(PARAM_INVALID, "src and dst addresses must be non-empty")
    if block_size <= 0:
        reject(PARAM_INVALID, f"block_size must be > 0, got {block_size}")
    for s, d in block_mapping:
        for index, count, name in ((s, src_n, "src"), (d, dst_n, "dst")):
            if index < 0:
                reject(PARAM_INVALID, f"{name} block index {index} must be >= 0")
            if count and index >= count:
                reject(PARAM_INVALID, f"{name} block index {index} is out of range [0, {count})")
    if not block_mapping:
        return S_OK
    runs = Runs([s for s, _ in block_mapping], [d for _, d in block_mapping])
    src_off, dst_off, length, _total, src_end, dst_end = runs.byte_plan(block_size)
    regions = []
    for side_id, addrs, end in ((src_id, srcs, src_end), (dst_id, dsts, dst_end)):
        if side_id >= 0:
            entry = engine.instance.caches[side_id]
            inside = {a for a in entry.addrs}
            if end > entry.T or any(a not in inside for a in addrs):
                reject(PARAM_INVALID, f"the swap reaches past the registered tensors of cache "
                       f"{side_id}; {HARDWARE}")
        bad = first_inaccessible(addrs, end)
        if bad >= 0:
            reject(PARAM_INVALID, f"[0x{addrs[bad]:x}, +{end}) is not readable and writable "
                   f"memory of this process; {HARDWARE}")
        regions.append([Region(a, end, ()) for a in addrs])
    copy_runs(regions[0], regions[1], src_off, dst_off, length)
    return S_OK


HARDWARE = "unchecked on hardware (undefined there); the simulator refuses it"


def remap_registered_memory(engine: PkgEngine, mem_infos: Sequence[MemInfoTuple]) -> int:
    """``RemapRegisteredMemory`` (documented as unsupported): empty -> PARAM_INVALID, no link ->
    NOT_YET_LINK; otherwise a no-op in the simulator (no device page tables to remap)."""
    if not mem_infos:
        reject(PARAM_INVALID, "mem_infos is empty")
    if not engine.instance.entities:
        reject(NOT_YET_LINK, "no link: nothing to remap")
    return S_OK


def check_capacity(engine: PkgEngine, size: int) -> int:
    """``CheckCapacity`` needs a device pool: FEATURE_NOT_ENABLED without one."""
    if not engine.mem_pool_config:
        reject(Status.LLM_FEATURE_NOT_ENABLED, "the device memory pool is not enabled "
               "(llm.MemPoolConfig)")
    return S_OK
