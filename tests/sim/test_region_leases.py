"""The leases of kvdd._native._copy.RegionTable:
CacheEntry.acquire/release/retire delegate to the table; a table after close; release without a
lease; concurrent and timed retire; memory shared by both instances (overlapping copies)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, LlmRole, tensor_addrs
from kvdd._native._copy import Region, RegionTable
from kvdd.sim.entries import CacheEntry

from fastpath_support import both_ways, fast
from test_fastpath_equivalence import U8, Side, link, make_side


def _entry(n: int = 2, T: int = 64) -> tuple[np.ndarray, CacheEntry]:
    a = np.zeros(n * T, np.uint8)
    return a, CacheEntry(7, n, T, 4, 1, [a.ctypes.data + k * T for k in range(n)], (a,))


def test_release_without_a_lease_raises_and_keeps_the_count() -> None:
    _, e = _entry()
    with pytest.raises(RuntimeError, match="without a lease"):
        e.release()
    assert e.inflight == 0
    assert e.acquire() and e.inflight == 1
    e.release()
    with pytest.raises(RuntimeError):
        e.release()
    assert e.inflight == 0 and e.acquire()  # still usable
    e.release()


def test_a_table_after_close() -> None:
    a = np.zeros(64, np.uint8)
    t = RegionTable([Region(a.ctypes.data, 64, a)])
    assert t.acquire()
    first, second = threading.Event(), threading.Event()
    assert t.close(first) is first and not first.is_set()
    assert t.close(second) is first  # idempotent: the first Event is kept
    assert not t.acquire() and t.inflight == 1
    t.release()
    assert first.is_set() and not second.is_set() and t.inflight == 0
    with pytest.raises(RuntimeError):
        t.release()
    assert not t.acquire() and t.closed


def test_concurrent_retire_callers_all_wait_for_the_last_lease() -> None:
    _, e = _entry()
    table = e.table
    assert e.acquire() and e.acquire()
    done: list[bool] = []
    threads = [threading.Thread(target=lambda: done.append(e.retire())) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert done == [] and not e.acquire() and not e.add_drain(lambda: None)
    e.release()
    time.sleep(0.05)
    assert done == []
    e.release()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert done == [True] * 4 and table.inflight == 0 and e.inflight == 0 and e.regions == []
    assert e.retire(0) is True and not e.acquire()  # a later caller returns at once


def test_retire_with_a_timeout_then_without() -> None:
    _, e = _entry()
    regions = list(e.regions)
    assert e.acquire()
    t0 = time.monotonic()
    assert e.retire(0.05) is False
    assert time.monotonic() - t0 < 5
    assert e.regions == regions and e.inflight == 1 and not e.acquire()  # still held, closed
    e.release()
    assert e.inflight == 0 and e.retire(0.05) is True and e.regions == []


def test_drains_run_once_after_leases_are_refused() -> None:
    _, e = _entry()
    seen: list[bool] = []
    assert e.add_drain(lambda: seen.append(e.acquire()))
    assert e.retire() and seen == [False]
    assert e.retire() and seen == [False]


@pytest.fixture
def shared() -> Iterator[tuple[Side, Side, np.ndarray, int, int]]:
    """Both instances register the same host memory (4 tensors of 8 x 32 bytes)."""
    p, d = make_side(1, LlmRole.PROMPT), make_side(2, LlmRole.DECODER)
    arena = np.zeros(4 * 256, np.uint8)
    desc = CacheDesc(4, U8, (8, 32))
    addrs = tensor_addrs([arena[k * 256:(k + 1) * 256] for k in range(4)])
    rid = p.dd.register_kv_cache(desc, addrs)
    lid = d.dd.register_kv_cache(desc, addrs)
    p.arenas[rid] = arena  # fill() and memory() see it (twice: the same bytes)
    p.descs[rid] = desc
    d.descs[lid] = desc
    link(d, p)
    try:
        yield p, d, arena, rid, lid
    finally:
        d.dd.finalize()
        p.dd.finalize()


@pytest.mark.parametrize("src, dst", [([0, 1, 2], [1, 2, 3]), ([1, 2, 3], [0, 1, 2]), ([0, 2, 4], [1, 3, 5]),
                                      ([3, 0], [0, 3]), ([5], [5])])
def test_overlapping_copies_on_shared_memory(shared: tuple[Side, Side, np.ndarray, int, int],
                                             src: list[int], dst: list[int]) -> None:
    """Runs that read what an earlier run of the same call wrote: same bytes both ways."""
    p, d, arena, rid, lid = shared
    took, out = both_ways((p, d), lambda: d.dd.pull_kv_blocks(CacheIndex(1, rid, 0), Cache(lid), src, dst))
    assert took, out
    assert both_ways((p, d), lambda: d.dd.push_kv_blocks(Cache(lid, (), d.descs[lid]), CacheIndex(1, rid, 0),
                                                       src, dst))[0]
    assert both_ways((p, d), lambda: d.dd.pull_kv_cache(CacheIndex(1, rid, 3), Cache(lid), 3))[0]


def test_python_path_leases_count_in_the_same_table(shared: tuple[Side, Side, np.ndarray, int, int]) -> None:
    """A lease taken the Python way (CacheEntry.acquire, what the fabric's servers take) blocks the
    compiled path's unregister exactly as a compiled lease does."""
    p, d, arena, rid, lid = shared
    entry = p.dd.backend.caches[rid]  # type: ignore[attr-defined]
    assert entry.acquire()
    done = threading.Event()

    def unregister() -> None:
        p.dd.unregister_kv_cache(rid)
        done.set()

    threading.Thread(target=unregister, daemon=True).start()
    assert not done.wait(0.1)
    taken = fast(d).taken
    with pytest.raises(kvdd.LLMKvCacheNotExistError):  # closed: the compiled path declines
        d.dd.pull_kv_cache(CacheIndex(1, rid, 0), Cache(lid))
    assert fast(d).taken == taken
    entry.release()
    assert done.wait(10)


def test_a_dropped_instance_and_its_compiled_path_are_collected() -> None:
    """FastTransfers and its backend reference each other: the cycle must be collectable."""
    import gc
    import weakref

    for _ in range(3):
        side = make_side(9, LlmRole.PROMPT)
        side.register(2, (4, 16))
        ref = weakref.ref(side.dd.backend)
        side.dd.finalize()
        del side
        gc.collect()
        assert ref() is None
