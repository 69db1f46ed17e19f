"""Copy kernels of the simulator (kvdd._native._copy): exact bytes against a numpy reference model,
on every path (each vector ISA the CPU has, streaming on and off, one and two threads), and from
several Python threads and after fork. The reference model and the path fixtures are in
copy_support.py; the requests refused, the tuning and the C checks of every kernel path are in
test_copy_requests.py and test_copy_tuning.py.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from typing import Any

import numpy as np
import pytest

from kvdd._native import _copy
from kvdd._native._copy import Region, copy_runs, plan_runs

from copy_support import Arena, reference, arr, run, blocks, restore_tuning, path, threads


# ---- bytes moved ------------------------------------------------------------------------------------

def test_many_random_runs_disjoint(path: tuple[str, bool], threads: int) -> None:
    """Block runs at random distinct offsets, 3 tensors; with threads=2 the 2-thread path runs."""
    rng = np.random.default_rng(1)
    bs, cap, count, K = 1536, 64, 40, 3
    size = bs * cap
    arena = Arena(2 * K * size + 64, seed=2)
    src = [(k * size + 1, size) for k in range(K)]                 # odd base addresses
    dst = [((K + k) * size + 7, size) for k in range(K)]
    so, do = blocks(rng, count, cap, bs), blocks(rng, count, cap, bs)
    ln = rng.integers(1, bs + 1, count)
    ln[:3] = [bs, 1, 2]
    p = plan_runs([arena.region(*s) for s in src], [arena.region(*d) for d in dst], so, do, arr(ln),
                  threads=threads)
    assert p.threads == threads and p.streaming == path[1]
    run(arena, src, dst, list(so), list(do), list(ln), threads)


@pytest.mark.parametrize("per_k", [(256 << 10) // 3 + 1, (700 << 10) // 3 + 13, (3 << 20) // 3 - 5])
def test_two_thread_work_items_cover_every_byte_once(path: tuple[str, bool], per_k: int) -> None:
    """The automatic work items of the 2-thread path (items of total / 32, the last two items'
    worth in quarters) cut runs and tensors anywhere, odd sizes included: every byte lands once."""
    _copy.set_chunk_size(0)  # automatic items (the path fixture fixes 3000 bytes)
    rng = np.random.default_rng(per_k)
    K, J = 3, 7
    cuts = np.sort(rng.choice(np.arange(1, per_k), J - 1, replace=False))
    ln = [int(x) for x in np.diff(np.concatenate(([0], cuts, [per_k])))]
    do = [sum(ln[:j]) for j in range(J)]  # destination: the runs in order
    order = [int(x) for x in rng.permutation(J)]  # source: the same runs in another order
    so = [0] * J
    pos = 0
    for j in order:
        so[j] = pos
        pos += ln[j]
    src = [(3 + k * per_k, per_k) for k in range(K)]  # odd bases
    dst = [(K * per_k + 69 + k * per_k, per_k) for k in range(K)]
    arena = Arena(2 * K * per_k + 192, seed=per_k % 97)
    p = plan_runs([arena.region(*x) for x in src], [arena.region(*x) for x in dst], arr(so), arr(do), arr(ln),
                  threads=2)
    assert p.threads == 2
    before = _copy.thread_stats()
    run(arena, src, dst, so, do, ln, threads=2)
    assert _copy.thread_stats()["chunks"] - before["chunks"] >= 2


def test_many_random_runs_overlapping_destinations(path: tuple[str, bool], threads: int) -> None:
    """Arbitrary offsets and lengths, destinations overlapping each other: in-order result."""
    rng = np.random.default_rng(3)
    J, size = 300, 20000
    arena = Arena(4 * size, seed=4)
    ln = rng.integers(1, 1200, J)
    so = [int(rng.integers(0, size - n + 1)) for n in ln]
    do = [int(rng.integers(0, size - n + 1)) for n in ln]
    src, dst = [(3, size), (size + 5, size)], [(2 * size + 1, size), (3 * size, size)]
    p = plan_runs([arena.region(*s) for s in src], [arena.region(*d) for d in dst], arr(so), arr(do),
                  arr(ln), threads=threads)
    assert p.threads == 1  # not independent: the 2-thread request falls back to in-order
    run(arena, src, dst, so, do, list(ln), threads)


def test_duplicate_destination_last_wins(path: tuple[str, bool], threads: int) -> None:
    arena = Arena(3 * 8192, seed=5)
    src, dst = [(0, 8192)], [(8192 + 3, 8192)]
    so, do, ln = [0, 4096, 1000, 2000], [100, 100, 5000, 5000], [4000, 4000, 3000, 3000]
    run(arena, src, dst, so, do, ln, threads)
    d = arena.buf[8192 + 3:]
    np.testing.assert_array_equal(d[100:4100], arena.buf[4096:8096])
    np.testing.assert_array_equal(d[5000:8000], arena.buf[2000:5000])


@pytest.mark.parametrize("shift", [1, -1, 7, -63, 64, -64, 65, 200, -513, 4096])
def test_overlapping_source_and_destination_is_memmove(path: tuple[str, bool], threads: int,
                                                       shift: int) -> None:
    """One region registered as source and destination (the same memory): each run is a memmove."""
    size = 48000
    arena = Arena(size, seed=6)
    reg = [(0, size)]
    so = [5000, 20000, 30001]
    ln = [9000, 513, 6000]
    do = [s + shift for s in so]
    run(arena, reg, reg, so, do, ln, threads)


def test_chained_runs_apply_in_order(path: tuple[str, bool], threads: int) -> None:
    """Run j writes what run j+1 reads (same memory): only in-order execution gives the reference."""
    size = 64 * 1024
    arena = Arena(size, seed=7)
    reg = [(0, size)]
    so = [0, 8192, 16384, 24576]
    do = [8192, 16384, 24576, 32768]
    p = plan_runs([arena.region(0, size)], [arena.region(0, size)], arr(so), arr(do), arr([8192] * 4),
                  threads=threads)
    assert p.threads == 1
    run(arena, reg, reg, so, do, [8192] * 4, threads)
    for k in range(1, 5):
        np.testing.assert_array_equal(arena.buf[k * 8192:(k + 1) * 8192], arena.buf[:8192])


def test_source_region_overlapping_another_tensors_destination(path: tuple[str, bool], threads: int) -> None:
    """Tensor 1 reads what tensor 0 writes (k outer order)."""
    arena = Arena(40000, seed=8)
    src = [(0, 10000), (10000, 10000)]
    dst = [(10000, 10000), (20000, 10000)]
    run(arena, src, dst, [0, 5000], [0, 5000], [5000, 5000], threads)
    np.testing.assert_array_equal(arena.buf[20000:30000], arena.buf[10000:20000])


@pytest.mark.parametrize("n", [1, 2, 3, 7, 15, 31, 33, 63, 64, 65, 127, 128, 129, 200])
def test_unaligned_small_runs(path: tuple[str, bool], threads: int, n: int) -> None:
    rng = np.random.default_rng(n)
    arena = Arena(8192, seed=n)
    src, dst = [(1, 3000)], [(4099, 3000)]
    so = [int(x) for x in rng.integers(0, 3000 - n + 1, 9)]
    do = [int(x) * n % (3000 - n + 1) for x in range(1, 10)]  # distinct odd/even offsets
    run(arena, src, dst, so, do, [n] * 9, threads)


@pytest.mark.parametrize("n", [255, 511, 512, 513, 1000, 4095, 4097, 65537])
@pytest.mark.parametrize("soff,doff", [(0, 0), (1, 0), (0, 1), (13, 61), (63, 3)])
def test_unaligned_long_runs(path: tuple[str, bool], threads: int, n: int, soff: int, doff: int) -> None:
    """Head/aligned body/tail of the vector loops: every alignment of source and destination."""
    arena = Arena(2 * n + 256, seed=n + soff)
    run(arena, [(soff, n + 64)], [(n + 128 + doff, n + 64)], [0, 1], [0, 50], [n, n - 50], threads)


@pytest.mark.parametrize("n", [4 * 4096 - 1, 4 * 4096, 4 * 4096 + 1, 8 * 4096 + 4095, 20 * 4096 + 77])
@pytest.mark.parametrize("soff,doff", [(0, 0), (1, 63), (4095, 17), (64, 4032)])
@pytest.mark.parametrize("chunk", [0, 20000], ids=["items-auto", "items-20000"])
def test_page_interleaved_runs(path: tuple[str, bool], threads: int, n: int, soff: int, doff: int,
                               chunk: int) -> None:
    """Runs of at least 4 pages (the page-interleaved streaming loop), their tails below a page group,
    every alignment class, and 2-thread work items that cut a run inside a page group."""
    _copy.set_chunk_size(chunk)
    arena = Arena(2 * n + 8192 + 256, seed=n + soff)
    run(arena, [(soff, n + 64)], [(n + 4096 + doff, n + 64)], [0, 3], [0, 40], [n, n - 40], threads)


def test_zero_length_runs_are_refused(path: tuple[str, bool], threads: int) -> None:
    """A zero-length run is a request the engine did not validate (it never plans one): refused,
    nothing copied, even when the other runs are fine."""
    arena = Arena(4096, seed=9)
    before = arena.snapshot()
    for lengths in ([0, 0, 0], [0, 700, 5], [700, 5, 0]):
        with pytest.raises(ValueError, match="must be > 0"):
            copy_runs([arena.region(0, 1000)], [arena.region(2000, 1000)], arr([0, 10, 20]),
                      arr([0, 20, 40]), arr(lengths), threads=threads)
        np.testing.assert_array_equal(arena.buf, before)


def test_empty_requests(threads: int) -> None:
    arena = Arena(1024)
    before = arena.snapshot()
    e = np.zeros(0, dtype=np.int64)
    assert copy_runs([arena.region(0, 10)], [arena.region(10, 10)], e, e, e, threads=threads) == 0
    assert copy_runs([], [], arr([0]), arr([0]), arr([5]), threads=threads) == 0
    for bad in (-5, 0):  # still checked without tensors
        with pytest.raises(ValueError):
            copy_runs([], [], arr([0]), arr([0]), arr([bad]), threads=threads)
    assert copy_runs((), (), e, e, e, threads=threads) == 0
    np.testing.assert_array_equal(arena.buf, before)


def test_large_two_thread_copy(restore_tuning: None) -> None:
    """A multi-MiB independent copy over the default 2-thread work items, both threads busy."""
    rng = np.random.default_rng(10)
    bs, cap, count = 64 * 1024, 96, 64
    arena = Arena(2 * cap * bs, seed=11)
    so, do = blocks(rng, count, cap, bs), blocks(rng, count, cap, bs)
    src, dst = [(0, cap * bs)], [(cap * bs, cap * bs)]
    before = _copy.thread_stats()
    p = plan_runs([arena.region(*src[0])], [arena.region(*dst[0])], so, do, arr([bs] * count), threads=2)
    assert p.threads == 2 and p.nogil
    run(arena, src, dst, list(so), list(do), [bs] * count, threads=2)
    after = _copy.thread_stats()
    assert after["calls"] == before["calls"] + 1 and after["chunks"] > before["chunks"]
    assert after["jobs"] == before["jobs"] + 1 and after["job_ns"] > before["job_ns"]



# ---- threads and processes ------------------------------------------------------------------------------

def test_concurrent_calls_from_python_threads(threads: int) -> None:
    """The kernels are reentrant: 4 Python threads copy into their own destinations at once."""
    size = 256 * 1024
    arena = Arena(5 * size, seed=19)
    src = arena.region(0, size)
    before = arena.snapshot()
    so = arr(np.arange(0, size, 4096))
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(20):
                copy_runs([src], [arena.region((i + 1) * size, size)], so, so[::-1].copy(),
                          arr([4096] * len(so)), threads=threads)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    expected = reference(before, [0], [size], list(so), list(so[::-1]), [4096] * len(so))[size:2 * size]
    for i in range(4):
        np.testing.assert_array_equal(arena.buf[(i + 1) * size:(i + 2) * size], expected)


def _child_copy(q: Any) -> None:
    a = np.arange(1 << 20, dtype=np.uint8)
    b = np.zeros_like(a)
    off = arr(np.arange(0, 1 << 20, 1 << 16))
    copy_runs([Region(a.ctypes.data, a.nbytes, a)], [Region(b.ctypes.data, b.nbytes, b)], off, off,
              arr([1 << 16] * len(off)), threads=2)
    q.put(bool((a == b).all()))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_two_thread_path_works_after_fork() -> None:
    """No thread pool survives a call, so a forked child can use the 2-thread path (OpenMP cannot)."""
    a = np.arange(1 << 20, dtype=np.uint8)
    b = np.zeros_like(a)
    off = arr(np.arange(0, 1 << 20, 1 << 16))
    copy_runs([Region(a.ctypes.data, a.nbytes, a)], [Region(b.ctypes.data, b.nbytes, b)], off, off,
              arr([1 << 16] * len(off)), threads=2)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_copy, args=(q,))
    p.start()
    p.join(60)
    if p.is_alive():  # pragma: no cover
        p.kill()
        pytest.fail("child process hung in the 2-thread path after fork")
    assert p.exitcode == 0 and q.get(timeout=5) is True



def test_resident_helper_sleeps_and_wakes() -> None:
    """After each call the resident helper spins briefly, then sleeps on a futex (Linux) or a condition
    variable: calls spaced wider than the spin must wake it (a lost wake would leave every chunk to
    the caller: the bytes would still be right, so the helper's share is checked too)."""
    size = 4 << 20
    a = np.frombuffer(np.random.default_rng(7).bytes(size), dtype=np.uint8)
    b = np.zeros_like(a)
    src, dst = [Region(a.ctypes.data, a.nbytes, a)], [Region(b.ctypes.data, b.nbytes, b)]
    z = arr([0])
    copy_runs(src, dst, z, z, arr([size]), threads=2)  # the helper exists
    before = _copy.thread_stats()
    for i in range(20):
        b[:] = 0
        threading.Event().wait(0.005)  # well past the helper's spin: it is asleep
        assert copy_runs(src, dst, z, z, arr([size - i]), threads=2) == size - i
        np.testing.assert_array_equal(b[:size - i], a[:size - i])
        assert not b[size - i:].any()
    after = _copy.thread_stats()
    assert after["calls"] == before["calls"] + 20
    assert after["wakes"] > before["wakes"] and after["helper_chunks"] > before["helper_chunks"]
