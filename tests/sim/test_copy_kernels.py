"""Copy kernels of the simulator (kvdd._native._copy): exact bytes against a numpy reference model.

All memory lives in one numpy "arena" per test; regions are spans of it. The reference applies the
runs in order on a copy of the arena, each run through a temporary (memmove semantics), and every test
compares the *whole* arena, so bytes that must not change are checked as well as the bytes moved.
Every path is exercised on small data by forcing it: streaming on/off (threshold), each vector ISA the
CPU has, one and two threads (small work items so runs are split between threads). The C kernels are
also checked in C (tests/sim/copy_impl_check.c): natively, as the plain memcpy build, and for aarch64
NEON with a cross compiler under qemu-user when those are installed.
"""

from __future__ import annotations

import gc
import multiprocessing
import pickle
import platform
import shutil
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from kvdd._native import _copy
from kvdd._native._copy import Region, copy_runs, plan_runs

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


class Arena:
    """Random bytes; regions are spans of them."""

    def __init__(self, nbytes: int, seed: int = 0) -> None:
        self.buf: U8 = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        self.base = int(self.buf.ctypes.data)

    def region(self, off: int, nbytes: int) -> Region:
        return Region(self.base + off, nbytes, self.buf)

    def snapshot(self) -> U8:
        out: U8 = self.buf.copy()
        return out


def reference(mem: U8, src_base: Sequence[int], dst_base: Sequence[int],
              so: Sequence[int], do: Sequence[int], ln: Sequence[int]) -> U8:
    """The specified result, computed independently: in order, k outer, j inner, memmove each run."""
    out: U8 = mem.copy()
    for sb, db in zip(src_base, dst_base):
        for s, d, n in zip(so, do, ln):
            out[db + d:db + d + n] = out[sb + s:sb + s + n].copy()
    return out


def arr(values: Sequence[int] | I64) -> I64:
    return np.asarray(values, dtype=np.int64)


def run(arena: Arena, src: Sequence[tuple[int, int]], dst: Sequence[tuple[int, int]],
        so: Sequence[int], do: Sequence[int], ln: Sequence[int], threads: int = 1) -> int:
    """copy_runs on spans (offset, nbytes) of `arena`; asserts the whole arena equals the reference."""
    before = arena.snapshot()
    expected = reference(before, [o for o, _ in src], [o for o, _ in dst], so, do, ln)
    n = copy_runs([arena.region(o, m) for o, m in src], [arena.region(o, m) for o, m in dst],
                  arr(so), arr(do), arr(ln), threads=threads)
    assert n == len(src) * int(sum(ln))
    mismatch = np.flatnonzero(arena.buf != expected)
    assert mismatch.size == 0, f"{mismatch.size} bytes differ, first at arena offset {mismatch[:8]}"
    return n


# ---- paths ----------------------------------------------------------------------------------------

ISAS = _copy.available_isas()
#: (isa, streaming) pairs: every vector ISA with regular and streaming stores, and plain memcpy
PATHS = [("memcpy", False)] + [(isa, s) for isa in ISAS if isa != "memcpy" for s in (False, True)]


@pytest.fixture
def restore_tuning() -> Iterator[None]:
    prev = (_copy.get_isa(), _copy.get_streaming_threshold(), _copy.get_threads_threshold(),
            _copy.get_chunk_size())
    try:
        yield
    finally:
        _copy.set_isa(prev[0])
        _copy.set_streaming_threshold(prev[1])
        _copy.set_threads_threshold(prev[2])
        _copy.set_chunk_size(prev[3])


@pytest.fixture(params=PATHS, ids=[f"{i}-{'stream' if s else 'regular'}" for i, s in PATHS])
def path(request: pytest.FixtureRequest, restore_tuning: None) -> tuple[str, bool]:
    isa, streaming = request.param
    _copy.set_isa(isa)
    _copy.set_streaming_threshold(0 if streaming else 1 << 62)
    _copy.set_chunk_size(3000)  # work items smaller than most runs: runs are split between threads
    return isa, streaming


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def threads(request: pytest.FixtureRequest) -> int:
    n: int = request.param
    return n


def blocks(rng: np.random.Generator, count: int, capacity: int, size: int) -> I64:
    """`count` distinct block offsets (random order) among `capacity` blocks of `size` bytes."""
    return rng.choice(capacity, count, replace=False).astype(np.int64) * size


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


# ---- inputs accepted ----------------------------------------------------------------------------------

def test_offset_arrays_uint64_strided_readonly() -> None:
    arena = Arena(8192, seed=12)
    before = arena.snapshot()
    so = np.array([0, -1, 100, -1], dtype=np.int64)[::2]                             # strided
    do = np.array([50, 300], dtype=np.uint64)                                    # uint64
    ln = np.array([40, 60], dtype=np.int64)
    ln.flags.writeable = False                                                   # read-only
    assert copy_runs([arena.region(0, 1000)], [arena.region(4000, 1000)], so, do, ln) == 100
    expected = reference(before, [0], [4000], [0, 100], [50, 300], [40, 60])
    np.testing.assert_array_equal(arena.buf, expected)
    rev = arr([700, 600, 500])[::-1]                                             # negative stride
    assert copy_runs([arena.region(0, 1000)], [arena.region(2000, 1000)], rev, arr([0, 10, 20]),
                     arr([5, 5, 5])) == 15
    np.testing.assert_array_equal(arena.buf, reference(expected, [0], [2000], [500, 600, 700], [0, 10, 20],
                                                       [5, 5, 5]))


def test_regions_as_any_sequence() -> None:
    arena = Arena(4096, seed=13)
    before = arena.snapshot()
    src = (arena.region(0, 100),)
    dst = [arena.region(1000, 100)]

    class Seq:
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> Region:
            if i >= 1:
                raise IndexError(i)
            return dst[0]

    assert copy_runs(src, Seq(), arr([0]), arr([0]), arr([100])) == 100  # type: ignore[arg-type]
    np.testing.assert_array_equal(arena.buf, reference(before, [0], [1000], [0], [0], [100]))


def test_default_thresholds_choose_paths() -> None:
    arena = Arena(16, seed=14)
    r = [arena.region(0, 8)], [arena.region(8, 8)]
    small = plan_runs(*r, arr([0]), arr([0]), arr([8]))
    assert (small.streaming, small.threads, small.nogil) == (False, 1, False)
    assert small.isa == _copy.get_isa() and small.nbytes == 8
    assert _copy.get_streaming_threshold() == _copy.DEFAULT_STREAMING_THRESHOLD
    assert _copy.get_threads_threshold() == _copy.DEFAULT_THREADS_THRESHOLD is None  # by measured cost
    assert (1 << 20) <= _copy.DEFAULT_STREAMING_THRESHOLD <= (4 << 20)
    model = _copy.threads_model()
    assert model["extra_us"] > 0 and model["one_thread_gbps"] > 0
    assert model["min_bytes"] >= 256 << 10
    assert "CopyPlan(" in repr(small)


def test_automatic_threads_follow_the_measured_cost(restore_tuning: None) -> None:
    # a call below the model's size stays on one thread, but for the probes (one call in 32 of at
    # least 256 KiB re-measures the helper); below 256 KiB never; a fixed threshold of 0 asks for two
    arena = Arena(4 << 20, seed=15)
    r = [arena.region(0, 2 << 20)], [arena.region(2 << 20, 2 << 20)]
    below = int(_copy.threads_model()["min_bytes"]) - 64
    if below < 2 << 20:
        plans = [plan_runs(*r, arr([0]), arr([0]), arr([below])).threads for _ in range(64)]
        assert plans.count(2) <= 2 and plans.count(1) >= 62
    assert all(plan_runs(*r, arr([0]), arr([0]), arr([(256 << 10) - 64])).threads == 1 for _ in range(64))
    assert _copy.set_threads_threshold(0) is None
    assert plan_runs(*r, arr([0]), arr([0]), arr([4096]), threads=1).threads == 1
    assert plan_runs(*r, arr([0]), arr([0]), arr([4096]), threads=2).threads == 2
    assert _copy.set_threads_threshold(None) == 0
    assert _copy.get_threads_threshold() is None


# ---- refused requests: nothing copied -------------------------------------------------------------------

BIG = 2**63 - 1


@pytest.mark.parametrize("so,do,ln", [
    ([-1], [0], [1]),                       # negative source offset
    ([0], [-5], [1]),                       # negative destination offset
    ([0], [0], [-1]),                       # negative length
    ([0, 90], [0, 0], [10, 11]),            # source run past the end (last run only)
    ([0, 0], [0, 95], [10, 10]),            # destination run past the end
    ([100], [0], [1]),                      # source offset at the end with a length
    ([101], [0], [0]),                      # zero length, offset past the end
    ([BIG], [0], [1]),                      # off + len overflows int64
    ([1], [0], [BIG]),
    ([0], [BIG - 3], [10]),
    ([0] * 40 + [0], [0] * 40 + [60], [10] * 40 + [41]),   # only the last of many runs is bad
], ids=["neg-src", "neg-dst", "neg-len", "src-past-end", "dst-past-end", "src-at-end", "zero-past-end",
        "overflow-off", "overflow-len", "overflow-dst", "last-of-many"])
def test_out_of_bounds_raises_and_copies_nothing(so: list[int], do: list[int], ln: list[int],
                                                 threads: int) -> None:
    arena = Arena(1000, seed=15)
    before = arena.snapshot()
    with pytest.raises(ValueError, match="copy_runs: run"):
        copy_runs([arena.region(0, 100)], [arena.region(500, 100)], arr(so), arr(do), arr(ln),
                  threads=threads)
    np.testing.assert_array_equal(arena.buf, before)


def test_bounds_use_the_smallest_region_on_each_side(threads: int) -> None:
    """A run must fit every tensor: tensor 1 is shorter, so a run valid for tensor 0 is refused."""
    arena = Arena(4000, seed=16)
    before = arena.snapshot()
    src = [arena.region(0, 1000), arena.region(1000, 500)]
    dst = [arena.region(2000, 1000), arena.region(3000, 1000)]
    with pytest.raises(ValueError, match="src region 1"):
        copy_runs(src, dst, arr([0, 400]), arr([0, 0]), arr([10, 200]), threads=threads)
    dst[1] = arena.region(3000, 300)
    with pytest.raises(ValueError, match="dst region 1"):
        copy_runs(src[:1] * 2, dst, arr([0]), arr([250]), arr([100]), threads=threads)
    np.testing.assert_array_equal(arena.buf, before)


def test_uint64_values_above_int64_are_refused() -> None:
    arena = Arena(1000)
    before = arena.snapshot()
    u = np.array([2**64 - 1], dtype=np.uint64)
    with pytest.raises(ValueError):
        copy_runs([arena.region(0, 100)], [arena.region(500, 100)], u, np.zeros(1, np.uint64),
                  np.ones(1, np.uint64))
    with pytest.raises(ValueError):
        copy_runs([arena.region(0, 100)], [arena.region(500, 100)], np.zeros(1, np.uint64),
                  np.zeros(1, np.uint64), u)
    np.testing.assert_array_equal(arena.buf, before)


def test_mismatched_lengths_raise() -> None:
    arena = Arena(1000)
    before = arena.snapshot()
    a, b = [arena.region(0, 100)], [arena.region(500, 100)]
    with pytest.raises(ValueError, match="equal lengths"):
        copy_runs(a, b, arr([0, 1]), arr([0]), arr([1]))
    with pytest.raises(ValueError, match="equal lengths"):
        copy_runs(a, b, arr([0]), arr([0]), arr([1, 2]))
    with pytest.raises(ValueError, match="source regions"):
        copy_runs(a * 2, b, arr([0]), arr([0]), arr([1]))
    with pytest.raises(ValueError, match="source regions"):
        copy_runs([], b, arr([0]), arr([0]), arr([1]))
    np.testing.assert_array_equal(arena.buf, before)


@pytest.mark.parametrize("bad", [
    [0],                                          # a list, not an array
    np.array([0], dtype=np.int32),
    np.array([0.0]),
    np.array([[0]], dtype=np.int64),              # 2-D
    np.array([0], dtype=">i8"),                   # non-native byte order
    b"\0" * 8,                                    # a buffer of bytes
    None,
], ids=["list", "int32", "float64", "2d", "big-endian", "bytes", "none"])
def test_wrong_array_types_raise_type_error(bad: Any) -> None:
    arena = Arena(1000)
    before = arena.snapshot()
    a, b = [arena.region(0, 100)], [arena.region(500, 100)]
    for args in ((bad, arr([0]), arr([1])), (arr([0]), bad, arr([1])), (arr([0]), arr([0]), bad)):
        with pytest.raises(TypeError):
            copy_runs(a, b, *args)
    np.testing.assert_array_equal(arena.buf, before)


def test_wrong_region_types_raise_type_error() -> None:
    arena = Arena(1000)
    before = arena.snapshot()
    r = arena.region(0, 100)
    z, one = arr([0]), arr([1])
    for src, dst in [([arena.base], [r]), ([r], [(arena.base, 100)]), ([r], [None]), (r, [r]),
                     ([r], 5), ("ab", [r, r]), ([r], b"x")]:
        with pytest.raises(TypeError):
            copy_runs(src, dst, z, z, one)  # type: ignore[arg-type]
    np.testing.assert_array_equal(arena.buf, before)


def test_bad_threads_argument() -> None:
    arena = Arena(1000)
    before = arena.snapshot()
    a, b = [arena.region(0, 100)], [arena.region(500, 100)]
    for t in (-1, 3):
        with pytest.raises(ValueError, match="threads"):
            copy_runs(a, b, arr([0]), arr([0]), arr([1]), threads=t)
    for bad in ("2", 2.0, None):
        with pytest.raises(TypeError):
            copy_runs(a, b, arr([0]), arr([0]), arr([1]), threads=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        copy_runs(a, b, arr([0]), arr([0]), arr([1]), 1)  # type: ignore[call-arg]
    np.testing.assert_array_equal(arena.buf, before)


# ---- Region ---------------------------------------------------------------------------------------

def test_region_validation_and_attributes() -> None:
    a = np.zeros(16, dtype=np.uint8)
    r = Region(a.ctypes.data, a.nbytes, a)
    assert (r.addr, r.nbytes, r.owner is a) == (a.ctypes.data, 16, True)
    assert "Region(addr=0x" in repr(r)
    with pytest.raises(AttributeError):
        r.addr = 5  # type: ignore[misc]
    r.__init__(4096, 10**6)  # type: ignore[call-arg]  # validated once, in __cinit__: cannot re-point
    assert (r.addr, r.nbytes) == (a.ctypes.data, 16)
    with pytest.raises(TypeError):
        Region.__new__(Region)  # type: ignore[call-arg]
    for addr, n in [(0, 1), (-8, 1), (2**64, 1), (2**64 - 8, 16), (4096, -1), (4096, 2**63)]:
        with pytest.raises(ValueError):
            Region(addr, n)
    for addr2, n2 in [(1.5, 1), (4096, "1"), (None, 1)]:
        with pytest.raises(TypeError):
            Region(addr2, n2)  # type: ignore[arg-type]
    assert Region(4096, 0).owner is None


def test_region_keeps_owner_alive_and_is_not_picklable() -> None:
    class Owner:
        pass

    o = Owner()
    ref = weakref.ref(o)
    r = Region(4096, 0, o)
    del o
    gc.collect()
    assert ref() is not None
    del r
    gc.collect()
    assert ref() is None
    with pytest.raises(TypeError):
        pickle.dumps(Region(4096, 0))


def test_region_is_final() -> None:
    with pytest.raises(TypeError):
        type("Sub", (Region,), {})


# ---- helpers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [_copy.memcpy_bench, _copy.stream_bench], ids=["memcpy", "stream"])
def test_bench_copies(fn: Any, restore_tuning: None) -> None:
    for isa in ISAS:
        _copy.set_isa(isa)
        arena = Arena(20000, seed=17)
        before = arena.snapshot()
        fn(arena.region(10001, 9000), arena.region(3, 9000), 9000)
        np.testing.assert_array_equal(arena.buf, reference(before, [3], [10001], [0], [0], [9000]))
        after = arena.snapshot()
        with pytest.raises(ValueError):
            fn(arena.region(0, 10), arena.region(100, 20), 11)
        with pytest.raises(ValueError):
            fn(arena.region(0, 10), arena.region(100, 20), -1)
        np.testing.assert_array_equal(arena.buf, after)


def test_bench_overlap_is_memmove(restore_tuning: None) -> None:
    for fn in (_copy.memcpy_bench, _copy.stream_bench):
        arena = Arena(20000, seed=18)
        before = arena.snapshot()
        fn(arena.region(10, 9000), arena.region(3, 9000), 9000)
        np.testing.assert_array_equal(arena.buf, reference(before, [3], [10], [0], [0], [9000]))


def test_isa_selection(restore_tuning: None) -> None:
    assert ISAS[0] == "memcpy" and _copy.get_isa() == ISAS[-1]
    for isa in ISAS:
        _copy.set_isa(isa)
        assert _copy.get_isa() == isa
    assert _copy.set_isa("best") == ISAS[-1]
    assert _copy.get_isa() == ISAS[-1]
    with pytest.raises(ValueError, match="unknown"):
        _copy.set_isa("altivec")
    for isa in {"sse2", "avx2", "avx512", "neon"} - set(ISAS):
        with pytest.raises(ValueError, match="cannot run"):
            _copy.set_isa(isa)


def test_tuning_setters(restore_tuning: None) -> None:
    prev = _copy.set_streaming_threshold(123)
    assert _copy.set_streaming_threshold(prev) == 123
    assert _copy.set_threads_threshold(0) == _copy.DEFAULT_THREADS_THRESHOLD
    assert _copy.set_threads_threshold(None) == 0
    assert _copy.set_chunk_size(4096) == _copy.DEFAULT_CHUNK_SIZE and _copy.get_chunk_size() == 4096
    for setter in (_copy.set_streaming_threshold, _copy.set_threads_threshold, _copy.set_chunk_size):
        with pytest.raises(ValueError):
            setter(-1)
        with pytest.raises(TypeError):
            setter(1.5)  # type: ignore[arg-type]


def test_cache_sizes() -> None:
    sizes = _copy.cache_sizes()
    assert set(sizes) == {"l2", "llc"} and all(isinstance(v, int) and v >= 0 for v in sizes.values())
    assert sizes["llc"] >= sizes["l2"]
    if sizes["l2"]:  # the streaming threshold follows the L2 size
        assert _copy.DEFAULT_STREAMING_THRESHOLD == min(max(2 * sizes["l2"], 1 << 20), 4 << 20)


def test_cpu_features() -> None:
    f = _copy.cpu_features()
    assert f and all(isinstance(k, str) and isinstance(v, bool) for k, v in f.items())
    assert f.get("avx512f", False) == ("avx512" in ISAS)
    assert f.get("avx2", False) == ("avx2" in ISAS)
    s = _copy.thread_stats()
    assert set(s) == {"calls", "chunks", "helper_chunks", "stalls", "jobs", "job_ns", "post_ns", "wait_ns", "moves",
                      "wakes"}
    assert isinstance(_copy.job_ns(), int) and _copy.job_ns() == _copy.thread_stats()["job_ns"] >= s["job_ns"]


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



# ---- the compiled block-run planner (kvdd/sim/runs.py's small path; tests/sim/test_runs.py compares it
# with the numpy path) ------------------------------------------------------------------------------------

def test_group_small_runs_declines_what_it_cannot_plan() -> None:
    """None (the caller plans with numpy) for anything but 1..max_pairs pairs of plain uint64 ints."""
    u64 = (1 << 64) - 1
    for src, dst, cap in (([], [], 8), ([1, 2], [1], 8), ([1, 2, 3], [1, 2, 3], 2), ([-1], [0], 8),
                          ([u64 + 1], [0], 8), ([0], [u64 + 1], 8), ([1.0], [1], 8), ([True], [1], 8),
                          (np.array([1]), [1], 8), ("ab", "ab", 8), ([1] * 257, [1] * 257, 1000)):
        assert _copy.group_small_runs(src, dst, cap) is None, (src, dst, cap)
    assert _copy.group_small_runs((u64, 0, 5), [3, 4, 9], 8) == ([u64, 5], [3, 9], [2, 1], [0, 5], [4, 9], 9)
    assert _copy.group_small_runs([7] * 256, list(range(256)), 256) == ([7] * 256, list(range(256)), [1] * 256,
                                                                   [7] * 256, list(range(256)), 255)


def test_small_byte_plan_offsets_tail_and_bounds() -> None:
    so, do, ln, total, src_end, dst_end = _copy.small_byte_plan([3, 0], [1, 9], [2, 1], 4096, 0)
    assert (so.tolist(), do.tolist(), ln.tolist()) == ([12288, 0], [4096, 36864], [8192, 4096])
    assert (total, src_end, dst_end) == (12288, 20480, 40960)
    assert _copy.small_byte_plan([3, 0], [1, 9], [2, 1], 4096, 100)[2].tolist() == [8192, 100]
    big = (1 << 32) - 1
    assert _copy.small_byte_plan([big], [0], [1], (1 << 31) - 1, 0)[4] == (big + 1) * ((1 << 31) - 1)
    for args in (([1 << 32], [0], [1], 8, 0), ([0], [1 << 32], [1], 8, 0), ([0], [0], [1 << 32], 8, 0),
                 ([0], [0], [1], 1 << 31, 0), ([0], [0], [1], -1, 0), ([0], [0], [1], 8, -1),
                 ([0, 1], [0], [1], 8, 0), ([], [], [], 8, 0)):
        with pytest.raises(ValueError):
            _copy.small_byte_plan(*args)
    with pytest.raises(ValueError, match="overflows"):
        _copy.small_byte_plan([0] * 3, [0] * 3, [big] * 3, (1 << 31) - 1, 0)


# ---- every kernel path in C, including the ones this machine cannot force from Python ----------------

IMPL_DIR = Path(__file__).resolve().parent.parent.parent / "kvdd" / "_native"
CHECK_C = Path(__file__).resolve().parent / "copy_impl_check.c"


def _build(cc: str, out: Path, *flags: str) -> None:
    proc = subprocess.run([cc, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *flags, f"-I{IMPL_DIR}",
                           "-o", str(out), str(CHECK_C), "-lpthread"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def _run_check(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok "), proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(not (IMPL_DIR / "_copy_impl.c").is_file(), reason="needs the source tree (kvdd/_native)")
@pytest.mark.parametrize("variant", ["native", "no-simd"])
def test_c_kernels_on_this_machine(variant: str, tmp_path: Path) -> None:
    """Every implementation this CPU runs (and, with KVDD_NO_SIMD, the plain memcpy build), regular and
    streaming, 1 and 2 threads, checked byte for byte in C."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "check"
    _build(cc, exe, *(["-DKVDD_NO_SIMD"] if variant == "no-simd" else []))
    out = _run_check([str(exe)])
    mask = int(out.split("isa mask ")[1], 16)
    if variant == "no-simd":
        assert mask == 1
    else:
        assert mask == sum(1 << i for i, name in enumerate(("memcpy", "sse2", "avx2", "avx512", "neon"))
                           if name in ISAS)


@pytest.mark.skipif(not (IMPL_DIR / "_copy_impl.c").is_file(), reason="needs the source tree (kvdd/_native)")
def test_c_kernels_aarch64_neon(tmp_path: Path) -> None:
    """The aarch64 NEON path: cross-compiled (aarch64-linux-gnu-gcc, Debian package gcc-aarch64-linux-gnu)
    and run under qemu-user (qemu-aarch64-static, package qemu-user-static) when they are installed."""
    if platform.machine() in ("aarch64", "arm64"):
        pytest.skip("native aarch64: test_c_kernels_on_this_machine covers NEON")
    cc = shutil.which("aarch64-linux-gnu-gcc")
    if cc is None:
        pytest.skip("no aarch64 cross compiler (apt install gcc-aarch64-linux-gnu)")
    exe = tmp_path / "check-aarch64"
    _build(cc, exe, "-static")
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.skip("compiled for aarch64; no qemu-aarch64 to run it (apt install qemu-user-static)")
    out = _run_check([qemu, str(exe)])
    assert int(out.split("isa mask ")[1], 16) == 1 | (1 << 4)  # memcpy and neon
