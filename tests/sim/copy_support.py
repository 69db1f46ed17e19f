"""Shared set-up of the copy-kernel tests (test_copy_kernels.py, test_copy_requests.py,
test_copy_tuning.py). All memory lives in one numpy "arena" per test; regions are spans of it. The
reference applies the runs in order on a copy of the arena, each run through a temporary (memmove
semantics), and every test compares the *whole* arena, so bytes that must not change are checked as
well as the bytes moved. Every path is exercised on small data by forcing it: streaming on/off
(threshold), each vector ISA the CPU has, one and two threads (small work items so runs are split
between threads)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt
import pytest

from kvdd._native import _copy
from kvdd._native._copy import Region, copy_runs

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
