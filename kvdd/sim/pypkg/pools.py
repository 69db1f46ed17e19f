"""Memory pools of CANN's Python package: ``allocate_*``, ``deallocate_*``, ``remove_cache_key``.

docs/spec/PYPKG.md §4.3, §2.3 (``llm.MemPoolConfig`` / ``llm.HostMemPoolConfig``: JSON
``{"memory_size": bytes, "page_shift": [10, 31)}``, 64 KiB pages by default).  A pool is host
memory of this process (:func:`kvdd.empty`: a same-host peer process maps it and copies without
system calls), carved into page-aligned tensors first-fit; an allocated cache is
an *owned* entry of the instance's cache table (remote-accessible: the pool is registered with the
transport as a whole) holding one reference for its id and one per key; it is freed when the last
reference goes.  Pulls consume keys only in the two-sided mode: :func:`consume_key`, run by the
peer of a two-sided pull (:mod:`.twosided`).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ...shm import empty
from ...status import PARAM_INVALID, Status
from ..checks import CACHE_TABLE_LIMIT, reject
from ..entries import CacheEntry
from ..fabric import KIND_BLOCKS, KIND_CACHE
from .keys import drop_keys, identity, index_keys
from .registry import MAX_DIMS, calc_tensor_size

if TYPE_CHECKING:
    from ...llm_datadist._seam import CacheDescTuple, CacheKeyTuple
    from ..caches import CacheTable
    from ..engine import SimBackend
    from .instance import PkgInstance
    from .protocols import PkgEngine

__all__ = ["Pool", "allocate", "deallocate", "remove_cache_key", "has_pool", "consume_key"]

HOST, DEVICE = 0, 1
NO_POOL = "memory pool is not enabled (llm.MemPoolConfig / llm.HostMemPoolConfig)"


class Pool:
    """``memory_size`` bytes in pages of ``1 << page_shift``; first-fit, coalescing frees."""

    def __init__(self, memory_size: int, page_shift: int) -> None:
        self.page = 1 << page_shift
        self.pages = memory_size // self.page
        self.buffer = empty(self.pages * self.page + self.page, np.uint8)  # room to align
        base = int(self.buffer.ctypes.data)
        self.base = -(-base // self.page) * self.page
        self._free: list[tuple[int, int]] = [(0, self.pages)] if self.pages else []  # (page, count)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        """The address of ``nbytes`` (rounded up to pages), or None when no run of pages fits."""
        need = max(1, -(-nbytes // self.page))
        with self._lock:
            for i, (start, count) in enumerate(self._free):
                if count >= need:
                    if count == need:
                        del self._free[i]
                    else:
                        self._free[i] = (start + need, count - need)
                    return self.base + start * self.page
        return None

    def free(self, addr: int, nbytes: int) -> None:
        start, count = (addr - self.base) // self.page, max(1, -(-nbytes // self.page))
        with self._lock:
            runs = sorted(self._free + [(start, count)])
            merged: list[tuple[int, int]] = []
            for s, c in runs:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + c)
                else:
                    merged.append((s, c))
            self._free = merged


def _parse(text: str) -> Pool | None:
    """A pool for a (validated) config string; None for an empty one."""
    if not text:
        return None
    try:
        obj = json.loads(text)
        size, shift = int(obj["memory_size"]), int(obj.get("page_shift", 16))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if size < 0 or not 10 <= shift < 31:
        return None
    return Pool(size, shift)


@dataclass
class _Owned:
    """An allocated cache's memory and references."""

    pool: Pool
    addrs: list[int]
    nbytes: int
    id_ref: bool = True
    keys: set[tuple[tuple[int, int], bool]] = field(default_factory=set)
    pulled: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # key -> tensors pulled


@dataclass
class _Pools:
    device: Pool | None
    host: Pool | None
    owned: dict[int, _Owned] = field(default_factory=dict)


_pools: weakref.WeakKeyDictionary[object, _Pools] = weakref.WeakKeyDictionary()
_guard = threading.Lock()


def _of(engine: PkgEngine) -> _Pools:
    """The engine's pools (made from its options on first use, kept as long as its instance)."""
    with _guard:
        got = _pools.get(engine.instance)
        if got is None:
            got = _pools[engine.instance] = _Pools(_parse(engine.mem_pool_config),
                                                   _parse(engine.host_mem_pool_config))
        return got


def has_pool(engine: PkgEngine) -> bool:
    return bool(engine.mem_pool_config or engine.host_mem_pool_config)


def allocate(engine: PkgEngine, cache_desc: CacheDescTuple,
             cache_keys: Sequence[CacheKeyTuple]) -> tuple[int, list[int]]:
    """``DataCacheEngine::Allocate`` (PYPKG.md §4.3): ``(cache id, tensor addresses)``."""
    num_tensors, data_type, _seq_len_dim, shape, placement, is_blocks = cache_desc
    if not has_pool(engine):
        reject(Status.LLM_FEATURE_NOT_ENABLED, NO_POOL)
    pools = _of(engine)
    pool = pools.device if placement == DEVICE else pools.host if placement == HOST else None
    if pool is None:
        reject(PARAM_INVALID, "placement must match a configured memory pool")
    if len(shape) == 0 or len(shape) >= MAX_DIMS:
        reject(PARAM_INVALID, f"shape must have 1..{MAX_DIMS - 1} dims, has {len(shape)}")
    table = engine.instance.cache_table
    with table.lock:
        cache_id = table.take_id()  # consumed from here on
        T = calc_tensor_size(shape, data_type)
        if T < 0:
            reject(PARAM_INVALID, f"cannot size a tensor of shape {list(shape)}")
        addrs: list[int] = []
        for _ in range(num_tensors):
            a = pool.alloc(T)
            if a is None:
                for got in addrs:
                    pool.free(got, T)
                reject(Status.LLM_OUT_OF_MEMORY, f"the memory pool has no {T} bytes left "
                       f"({len(addrs)} of {num_tensors} tensors allocated)")
            addrs.append(a)
        try:
            _check_keys(table, shape, cache_keys)
        except BaseException:
            for got in addrs:
                pool.free(got, T)
            raise
        rows = int(shape[0])
        owners = (pool.buffer,)
        if is_blocks:
            entry = CacheEntry(cache_id, len(addrs), T, 1, int(placement), addrs, owners,
                               KIND_BLOCKS, rows, True)
        else:
            entry = CacheEntry(cache_id, len(addrs), T, rows & 0xFFFFFFFF, int(placement), addrs,
                               owners, KIND_CACHE, 0, True)
        index_keys(table, entry, cache_keys, bool(is_blocks))
        owned = pools.owned[cache_id] = _Owned(pool, addrs, T)
        for key in cache_keys:
            ident, is_prefix = identity(key)
            keymap = table.prefix_keys if is_prefix else table.req_keys
            if keymap.get(ident, (None,))[0] == cache_id:
                owned.keys.add((ident, is_prefix))
        size = table.insert(entry)
        if engine.remote_accessible and size > CACHE_TABLE_LIMIT:
            reject(PARAM_INVALID, f"cache table would be {size} bytes (> 1 MiB)")
        return cache_id, addrs


def _check_keys(table: CacheTable, shape: Sequence[int], cache_keys: Sequence[CacheKeyTuple]) -> None:
    """``CheckCacheKeys``: at most shape[0] keys, none already bound, no duplicates."""
    if len(cache_keys) > int(shape[0]):
        reject(PARAM_INVALID, f"{len(cache_keys)} cache_keys > batch size {shape[0]}")
    seen: set[tuple[tuple[int, int], bool]] = set()
    for key in cache_keys:
        ident, is_prefix = identity(key)
        keymap = table.prefix_keys if is_prefix else table.req_keys
        if ident in keymap:
            reject(PARAM_INVALID, f"cache_key {ident} is already bound to cache {keymap[ident][0]}")
        if (ident, is_prefix) in seen:
            reject(PARAM_INVALID, f"cache_key {ident} occurs twice in the request")
        seen.add((ident, is_prefix))


def _free_if_unreferenced(engine: PkgEngine, cache_id: int) -> None:
    _free_unreferenced(engine.instance, _of(engine), cache_id)


def _free_unreferenced(instance: SimBackend, pools: _Pools, cache_id: int) -> None:
    owned = pools.owned.get(cache_id)
    if owned is None or owned.id_ref or owned.keys:
        return
    del pools.owned[cache_id]
    table = instance.cache_table
    with table.lock:
        drop_keys(table, cache_id)
        entry = table.take(cache_id)
    if entry is not None:
        table.retire(cache_id, entry)  # waits for transfers holding it
    for a in owned.addrs:
        owned.pool.free(a, owned.nbytes)


def deallocate(engine: PkgEngine, cache_id: int) -> int:
    """No pool -> FEATURE_NOT_ENABLED; unknown id or a registered cache -> success, nothing
    happens; an allocated cache drops its id reference (freed now, or with its last key)."""
    if not has_pool(engine):
        reject(Status.LLM_FEATURE_NOT_ENABLED, NO_POOL)
    owned = _of(engine).owned.get(cache_id)
    if owned is not None:
        owned.id_ref = False
        _free_if_unreferenced(engine, cache_id)
    return 0


def remove_cache_key(engine: PkgEngine, cache_key: CacheKeyTuple) -> int:
    """No pool -> FEATURE_NOT_ENABLED; an unknown key or a registered cache's key -> success,
    nothing happens; an allocated cache's key is removed (the cache freed with its last
    reference)."""
    if not has_pool(engine):
        reject(Status.LLM_FEATURE_NOT_ENABLED, NO_POOL)
    ident, is_prefix = identity(cache_key)
    table = engine.instance.cache_table
    pools = _of(engine)
    with table.lock:
        keymap = table.prefix_keys if is_prefix else table.req_keys
        bound = keymap.get(ident)
        owned = None if bound is None else pools.owned.get(bound[0])
        if bound is None or owned is None:
            return 0
        del keymap[ident]
        entry = table.caches.get(bound[0])
        if entry is not None and not is_prefix:
            entry.keys[:] = [k for k in entry.keys if (k[0], k[1]) != ident]
            table.publish()
        owned.keys.discard((ident, is_prefix))
    _free_if_unreferenced(engine, bound[0])
    return 0


def consume_key(instance: PkgInstance, cache_id: int, ident: tuple[int, int],
                tensors: list[int] | None, n: int) -> None:
    """A two-sided pull through the non-prefix key ``ident`` served cache ``cache_id``'s bytes
    (PYPKG.md §4.4, upstream ``RemoveCacheKey`` after ``SendState``): an owned cache's key is
    removed (the cache freed when it was its last reference); with layer ranges (``tensors``)
    only once every one of its ``n`` tensor indices was pulled.  A registered cache's key stays."""
    with _guard:
        pools = _pools.get(instance)
    if pools is None:
        return
    table = instance.cache_table
    with table.lock:
        owned = pools.owned.get(cache_id)
        if owned is None or table.req_keys.get(ident, (None,))[0] != cache_id:
            return
        if tensors is not None:
            got = owned.pulled.setdefault(ident, set())
            got.update(tensors)
            if len(got) < n:
                return
        owned.pulled.pop(ident, None)
        del table.req_keys[ident]
        entry = table.caches.get(cache_id)
        if entry is not None:
            entry.keys[:] = [k for k in entry.keys if (k[0], k[1]) != ident]
            table.publish()
        owned.keys.discard((ident, False))
        free = not owned.id_ref and not owned.keys
    if free:  # the lease of this pull still holds the cache: free it once that ends
        threading.Thread(target=_free_unreferenced, args=(instance, pools, cache_id),
                         name="kvdd-sim-pool-free", daemon=True).start()
