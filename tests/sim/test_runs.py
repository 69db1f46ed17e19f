"""kvdd.sim.runs: the block runs of PullKvBlocks / PushKvBlocks, planned with Python integers for
small requests, in C (kvdd._native._runs) for long lists and tuples of ints, and with numpy for
anything else: all three paths must give the same runs, bound checks and byte runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdd.sim import runs as runs_mod
from kvdd.sim.checks import Rejected
from kvdd.sim.runs import Runs

U64 = (1 << 64) - 1

#: block indices near 0 and near the uint64 wrap, so that consecutive pairs and wraps both occur
index = st.one_of(st.integers(0, 12), st.integers(U64 - 3, U64))
pairs = st.lists(st.tuples(index, index), min_size=1, max_size=80)


def _native_runs(src: list[int], dst: list[int], monkeypatch: pytest.MonkeyPatch) -> Runs:
    """The compiled path: lists of ints longer than SMALL."""
    with monkeypatch.context() as m:
        m.setattr(runs_mod, "SMALL", 0)
        return Runs(src, dst)


def _numpy_runs(src: list[int], dst: list[int], monkeypatch: pytest.MonkeyPatch) -> Runs:
    """The numpy path: arrays longer than SMALL (never planned in C)."""
    with monkeypatch.context() as m:
        m.setattr(runs_mod, "SMALL", 0)
        arrays = np.array(src, dtype=np.uint64), np.array(dst, dtype=np.uint64)
        return Runs(*cast(tuple[Sequence[int], Sequence[int]], arrays))


def _as_list(col: object) -> list[int]:
    return [int(x) for x in col]  # type: ignore[attr-defined]


def _reference(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src, first dst, length) per maximal run where both indices step by +1 (mod 2**64)."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and (out[-1][0] + out[-1][2]) & U64 == s and (out[-1][1] + out[-1][2]) & U64 == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


@settings(max_examples=200, deadline=None)
@given(pairs, st.integers(1, 16), st.integers(0, 20))
def test_small_native_and_numpy_paths_agree(p: list[tuple[int, int]], block: int, bound: int) -> None:
    src, dst = [s for s, _ in p], [d for _, d in p]
    with pytest.MonkeyPatch.context() as mp:
        native = _native_runs(src, dst, mp)
        numpy_ = _numpy_runs(src, dst, mp)
    small = Runs(src, dst)
    assert isinstance(small.ln, list) == (len(p) <= runs_mod.SMALL)
    assert isinstance(native.ln, np.ndarray) and isinstance(numpy_.ln, np.ndarray)
    ref = _reference(src, dst)
    for r in (small, native, numpy_):
        assert len(r) == len(ref)
        assert list(zip(_as_list(r.s0), _as_list(r.d0), _as_list(r.ln))) == ref
        assert _as_list(r.s_last) == [(s + n - 1) & U64 for s, _, n in ref]
        assert _as_list(r.d_last) == [(d + n - 1) & U64 for _, d, n in ref]
        assert r.d_max == max(dst) and r.longest() == max(n for _, _, n in ref)
    for first, last in (("s0", "s_last"), ("d0", "d_last"), ("s0", "s0")):
        a = small.first_at_or_above(getattr(small, first), getattr(small, last), bound)
        for other in (native, numpy_):
            assert other.first_at_or_above(getattr(other, first), getattr(other, last), bound) == a
        for r in (small, native, numpy_):
            if a is None:
                r.require_below(getattr(r, first), getattr(r, last), bound, "block", "count")
            else:
                with pytest.raises(Rejected, match=f"block {a} >= count {bound}"):
                    r.require_below(getattr(r, first), getattr(r, last), bound, "block", "count")
    if max(src + dst) < 1 << 32:  # byte runs are computed after the indices were bounded
        tail = block // 2
        for r in (small, native, numpy_):
            so, do, ln, ptotal, src_end, dst_end = r.byte_plan(block, tail)
            assert [x.dtype for x in (so, do, ln)] == [np.int64] * 3
            assert so.tolist() == [s * block for s, _, _ in ref]
            assert do.tolist() == [d * block for _, d, _ in ref]
            assert ln.tolist() == [n * block for _, _, n in ref][:-1] + [tail or ref[-1][2] * block]
            assert ptotal == sum(ln.tolist()) == runs_mod.total(ln)
            assert src_end == max(o + n for o, n in zip(so.tolist(), ln.tolist()))
            assert dst_end == max(o + n for o, n in zip(do.tolist(), ln.tolist()))


@pytest.mark.parametrize("src", [[2**32 + 5], [2**40, 2**40 + 1], list(range(2**33, 2**33 + 70))])
def test_huge_block_indices_give_ends_a_bound_check_refuses(src: list[int]) -> None:
    """Source indices of 2**32 or more (allowed by a remote announcing that many blocks) never make
    the plan raise or wrap: its ends are exact, or 2**64-1 when they do not fit 64 bits."""
    dst = list(range(len(src)))
    for block in (1, 4096, 2**31 - 1):
        *_, total, src_end, dst_end = Runs(src, dst).byte_plan(block, 0)
        want_end = max(s + 1 for s in src) * block
        assert src_end == (want_end if want_end < 2**64 else 2**64 - 1)
        assert dst_end == len(src) * block and total == len(src) * block
    *_, src_end, _ = Runs([2**63], [0]).byte_plan(2, 0)
    assert src_end == 2**64 - 1


def test_invalid_indices_take_the_numpy_path() -> None:
    """Indices that are not uint64 values fall to numpy, which raises as before."""
    with pytest.raises(OverflowError):
        Runs([-1], [0])
    r = Runs(np.array([3, 4, 9], dtype=np.uint64).tolist(), [0, 1, 2])
    assert r.ln == [2, 1] and r.s0 == [3, 9]


def test_the_index_after_the_last_wraps_to_zero() -> None:
    for r in (Runs([U64, 0, 1], [5, 6, 8]), Runs([7, 8], [U64, 0])):
        assert len(r) == 2 if r.d0[0] == 5 else len(r) == 1
    r = Runs([U64, 0, 1], [5, 6, 8])
    assert (r.s0, r.d0, r.ln, r.s_last, r.d_last) == ([U64, 1], [5, 8], [2, 1], [0, 1], [6, 8])


def test_row_run_is_one_read_only_run() -> None:
    a, b, n = runs_mod.row_run(4096, 8192, 100)
    assert [x.tolist() for x in (a, b, n)] == [[4096], [8192], [100]]
    assert all(x.dtype == np.int64 and not x.flags.writeable for x in (a, b, n))
    with pytest.raises(ValueError):
        a[0] = 0
    assert runs_mod.row_run(4096, 8192, 100)[0] is a  # cached


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=50))
def test_total_of_an_int64_array_is_computed_in_c(length: list[int]) -> None:
    ln = np.array(length, dtype=np.int64)
    assert runs_mod.total(ln) == int(ln.sum()) == sum(length)
