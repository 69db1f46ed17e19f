"""kvdd._native._copy.RegionTable: a registered cache's regions in C memory, their leases, and
copies between tables (the compiled in-process transfer path's copy)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvdd._native._copy import Region, RegionTable, copy_tables

I64 = np.int64


def _tables(n: int, nbytes: int) -> tuple[np.ndarray, np.ndarray, RegionTable, RegionTable]:
    a = np.arange(n * nbytes, dtype=np.uint8)
    b = np.zeros(n * nbytes, dtype=np.uint8)
    ra = [Region(a.ctypes.data + k * nbytes, nbytes, a) for k in range(n)]
    rb = [Region(b.ctypes.data + k * nbytes, nbytes, b) for k in range(n)]
    return a, b, RegionTable(ra), RegionTable(rb)


def _runs(*runs: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    so, do, ln = zip(*runs)
    return np.array(so, I64), np.array(do, I64), np.array(ln, I64)


@pytest.mark.parametrize("K", [1, 3, 9, 12])  # up to and past the module's small-pair buffer (8)
def test_copy_between_table_slices(K: int) -> None:
    n, T = 12, 256
    a, b, ta, tb = _tables(n, T)
    s_first, d_first = n - K, 0
    assert copy_tables(ta, s_first, tb, d_first, K, *_runs((10, 0, 20), (100, 50, 7))) == K * 27
    want = np.zeros_like(b)
    for k in range(K):
        src = (s_first + k) * T
        want[k * T: k * T + 20] = a[src + 10: src + 30]
        want[k * T + 50: k * T + 57] = a[src + 100: src + 107]
    np.testing.assert_array_equal(b, want)


@pytest.mark.parametrize("s_first, d_first, K", [(-1, 0, 1), (0, -1, 1), (3, 0, 2), (0, 4, 1), (0, 0, -1),
                                                 (0, 0, 5)])
def test_tensors_outside_a_table_copy_nothing(s_first: int, d_first: int, K: int) -> None:
    a, b, ta, tb = _tables(4, 64)
    with pytest.raises(ValueError, match="nothing was copied"):
        copy_tables(ta, s_first, tb, d_first, K, *_runs((0, 0, 8)))
    assert not b.any()


@pytest.mark.parametrize("run", [(57, 0, 8), (0, 57, 8), (-1, 0, 1), (0, 0, 0), (0, 0, 65)])
def test_runs_outside_the_regions_copy_nothing(run: tuple[int, int, int]) -> None:
    a, b, ta, tb = _tables(4, 64)
    with pytest.raises(ValueError, match="nothing was copied"):
        copy_tables(ta, 0, tb, 0, 4, *_runs((0, 0, 8), run))  # the first run is fine
    assert not b.any()


def test_the_smallest_region_bounds_every_run() -> None:
    a = np.zeros(300, np.uint8)
    t = RegionTable([Region(a.ctypes.data, 100, a), Region(a.ctypes.data + 100, 60, a)])
    assert (t.n, t.nbytes, len(t)) == (2, 60, 2)
    assert RegionTable(()).nbytes == 0
    with pytest.raises(TypeError, match="Region"):
        RegionTable([a.ctypes.data])  # type: ignore[list-item]


def test_leases() -> None:
    _, _, t, _ = _tables(1, 8)
    assert (t.inflight, t.closed) == (0, False)
    assert t.acquire() and t.acquire()
    assert t.inflight == 2
    drained = t.close(threading.Event())
    assert t.closed and not drained.is_set()
    assert not t.acquire()  # refused once closed
    t.release()
    assert not drained.is_set()
    t.release()
    assert drained.is_set() and t.inflight == 0
    with pytest.raises(RuntimeError, match="without a lease"):
        t.release()
    assert t.close(threading.Event()) is drained  # idempotent: the first Event is kept


def test_closing_an_idle_table_drains_at_once() -> None:
    _, _, t, _ = _tables(1, 8)
    assert t.close(threading.Event()).is_set()


def test_run_arrays_are_checked_as_in_copy_runs() -> None:
    a, b, ta, tb = _tables(2, 64)
    so, do, ln = _runs((0, 0, 8), (8, 8, 8))
    with pytest.raises(ValueError, match="equal lengths"):
        copy_tables(ta, 0, tb, 0, 2, so, do[:1], ln)
    with pytest.raises(TypeError, match="int64 or uint64"):
        copy_tables(ta, 0, tb, 0, 2, so.astype(np.int32), do, ln)  # type: ignore[arg-type]
    assert not b.any()
    assert copy_tables(ta, 0, tb, 0, 2, so, do, ln) == 32  # more runs than the one-run buffer
    np.testing.assert_array_equal(b[:16], a[:16])
    np.testing.assert_array_equal(b[64:80], a[64:80])
