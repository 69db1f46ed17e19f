"""Copy kernels of the simulator (kvdd._native._copy): what a request may be (array types, region
sequences, default paths), what is refused with nothing copied (out of bounds, wrong types, bad
lengths), and Region itself."""

from __future__ import annotations

import gc
import pickle
import weakref
from typing import Any

import numpy as np
import pytest

from kvdd._native import _copy
from kvdd._native._copy import Region, copy_runs, plan_runs

from copy_support import Arena, reference, arr, restore_tuning, threads


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
