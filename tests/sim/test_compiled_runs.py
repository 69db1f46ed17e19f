"""The compiled block-run helpers (kvdd/_native/_runs.pyx, _copy_runs.pxi).

Their input is the local user's: they must never crash or read out of bounds, never accept what the
item-by-item check refuses (bools, floats, numpy scalars, int subclasses, out-of-width ints), and
give exactly the numpy path's runs and bytes (int64 wrapping included) on every input they accept.
Called directly with the inputs the callers never give them too (wrong types, lengths, strided
and read-only arrays, values at 2**32 / 2**63 / 2**64), and fuzzed against plain-Python models.
"""

from __future__ import annotations

import enum
import gc
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdd._native._copy import GROUP_SMALL_RUNS_MAX, group_small_runs, small_byte_plan
from kvdd._native._runs import block_runs, byte_runs, ints_within, sum_int64
from kvdd.widths import INT32, INT64, UINT8, UINT16, UINT32, UINT64, check_int_seq

U64 = (1 << 64) - 1
MASK = U64


class MyInt(int):
    pass


class Color(enum.IntEnum):
    RED = 1


#: items the compiled paths must refuse (the caller then takes its general path)
NOT_PLAIN: list[object] = [True, False, 1.0, np.int64(1), np.uint64(1), MyInt(1), Color.RED, None, "1"]


def _ref_runs(src: list[int], dst: list[int]) -> tuple[list[int], ...]:
    """(s0, d0, ln, s_last, d_last) of maximal runs where both indices step by +1 mod 2**64."""
    s0: list[int] = []
    d0: list[int] = []
    ln: list[int] = []
    for s, d in zip(src, dst):
        if ln and (s0[-1] + ln[-1]) & MASK == s and (d0[-1] + ln[-1]) & MASK == d:
            ln[-1] += 1
        else:
            s0.append(s)
            d0.append(d)
            ln.append(1)
    s_last = [(s + n - 1) & MASK for s, n in zip(s0, ln)]
    d_last = [(d + n - 1) & MASK for d, n in zip(d0, ln)]
    return s0, d0, ln, s_last, d_last


def _wrap64(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def _ref_bytes(s0: list[int], d0: list[int], ln: list[int], block: int,
               tail: int) -> tuple[list[int], list[int], list[int], int, int, int]:
    """byte_runs' contract, item by item: every product and sum exact, or 2**64-1 (saturated)
    when it does not fit 64 bits; the arrays hold those values as int64 (two's complement)."""
    def sat(x: int) -> int:
        return x if x < 2**64 else 2**64 - 1

    xs = [sat(s * block) for s in s0]
    xd = [sat(d * block) for d in d0]
    xl = [sat(n * block) for n in ln]
    if tail > 0:
        xl[-1] = tail
    total = 0
    for n in xl:
        total = sat(total + n)
    return ([_wrap64(x) for x in xs], [_wrap64(x) for x in xd], [_wrap64(x) for x in xl], total,
            max(sat(a + n) for a, n in zip(xs, xl)), max(sat(a + n) for a, n in zip(xd, xl)))


index = st.one_of(st.integers(0, 6), st.integers(U64 - 2, U64), st.integers(0, U64),
                  st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(index, index), min_size=1, max_size=300), st.booleans())
def test_both_compiled_groupings_match_the_model(p: list[tuple[int, int]], as_tuple: bool) -> None:
    src = [s for s, _ in p]
    dst = [d for _, d in p]
    want = _ref_runs(src, dst)
    a, b = (tuple(src), tuple(dst)) if as_tuple else (src, dst)
    grouped = block_runs(a, b)
    assert grouped is not None
    cols, d_max, maxima = grouped[:5], grouped[5], grouped[6]
    assert [c.tolist() for c in cols] == list(want)
    assert [c.dtype for c in cols] == [np.uint64, np.uint64, np.int64, np.uint64, np.uint64]
    assert d_max == max(dst) and list(maxima) == [max(c) for c in want]
    small = group_small_runs(a, b, 1 << 20)
    if len(p) <= GROUP_SMALL_RUNS_MAX:
        assert small is not None
        assert [list(c) for c in small[:5]] == list(want) and small[5] == max(dst)
        assert all(type(x) is int for c in small[:5] for x in c)
    else:
        assert small is None
    assert group_small_runs(a, b, len(p) - 1) is None  # over the caller's limit: numpy


@pytest.mark.parametrize("bad", NOT_PLAIN + [-1, U64 + 1, -(2**63), 2**64 + 5, 2**200])
@pytest.mark.parametrize("where", [0, 1, 299])
def test_compiled_groupings_refuse_what_is_not_a_uint64_int(bad: object, where: int) -> None:
    for n in (where + 1, 300):
        src: list[object] = list(range(n))
        dst: list[object] = list(range(n))
        src[where] = bad
        assert block_runs(src, dst) is None and block_runs(dst, src) is None
        assert group_small_runs(src, dst, 1000) is None and group_small_runs(dst, src, 1000) is None


def test_compiled_groupings_refuse_wrong_shapes_and_types() -> None:
    class MyList(list[int]):
        pass

    for a, b in [([], []), ([1], []), ([1, 2], [1]), (MyList([1]), [1]), ([1], MyList([1])),
                 (np.array([1], dtype=np.uint64), [1]), (range(3), range(3)), ("ab", "ab"),
                 ({1: 1}, {1: 1}), (None, None)]:
        assert block_runs(a, b) is None
        assert group_small_runs(a, b, 64) is None
    assert group_small_runs([1] * 257, [1] * 257, 1000) is None  # at most 256, whatever the limit
    assert group_small_runs([1], [2], 0) is None


@pytest.mark.parametrize("width", [INT32, UINT8, UINT16, UINT32, INT64, UINT64])
@pytest.mark.parametrize("bad", NOT_PLAIN)
def test_ints_within_refuses_every_non_plain_item(width: tuple[int, int], bad: object) -> None:
    for pos in (0, 5, 1023):
        items: list[object] = [1] * 1024
        items[pos] = bad
        assert not ints_within(items, *width) and not ints_within(tuple(items), *width)
    # and the item-by-item path still gives its answer (ints for index-able items, else TypeError)
    if isinstance(bad, (bool, np.bool_)) or not hasattr(bad, "__index__"):
        with pytest.raises(TypeError):
            check_int_seq("x", [1, bad, 2], width)
    else:
        got = check_int_seq("x", [1, bad, 2], width)
        assert got == (1, 1, 2) and all(type(v) is int for v in got)


@pytest.mark.parametrize("width", [INT32, UINT8, UINT16, UINT32, INT64, UINT64])
def test_ints_within_edges(width: tuple[int, int]) -> None:
    lo, hi = width
    assert ints_within([lo, hi, lo, hi], lo, hi)
    for out in (lo - 1, hi + 1, lo - (1 << 70), hi + (1 << 70)):
        assert not ints_within([lo, out], lo, hi)
        with pytest.raises(ValueError, match="does not fit"):
            check_int_seq("x", [lo, out], width)


def test_ints_within_on_a_million_items_then_one_bad() -> None:
    big = list(range(1 << 20))
    assert ints_within(big, *UINT32)
    big[-1] = True
    assert not ints_within(big, *UINT32)
    big[-1] = 1 << 32
    assert not ints_within(big, *UINT32)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, U64), st.integers(0, U64), st.integers(1, 2**40)),
                min_size=1, max_size=40),
       st.one_of(st.integers(1, 2**31 - 1), st.sampled_from([1, 2**20, 2**31 - 1, 2**32 + 1])),
       st.integers(0, 2**62), st.booleans())
def test_byte_runs_match_numpy_wrapping_anywhere(runs: list[tuple[int, int, int]], block: int,
                                                 tail: int, strided: bool) -> None:
    """byte_runs on any uint64 indices (even past the bounds its callers check first) and on
    strided or read-only arrays: exact sums, saturated at 2**64-1 past 64 bits (so a bound check
    refuses them), and numpy's int64 results wherever nothing saturates."""
    s0 = [r[0] for r in runs]
    d0 = [r[1] for r in runs]
    ln = [r[2] for r in runs]
    tail = tail if tail % 3 else 0
    arrs = [np.array(s0, np.uint64), np.array(d0, np.uint64), np.array(ln, np.int64)]
    if strided:
        arrs = [np.repeat(a, 2)[::2] for a in arrs]
        for a in arrs:
            a.flags.writeable = False
    so, do, lo, total, s_end, d_end = byte_runs(arrs[0], arrs[1], arrs[2], block, tail)
    want = _ref_bytes(s0, d0, ln, block, tail)
    assert (so.tolist(), do.tolist(), lo.tolist(), total, s_end, d_end) == want
    if max(s0 + d0) < 2**32 and max(ln) < 2**32 and block < 2**31:  # nothing saturates: numpy's
        nso = arrs[0].astype(np.int64) * block                       # own arithmetic agrees
        nlo = arrs[2] * block
        if tail:
            nlo[-1] = tail
        assert nso.tolist() == so.tolist() and nlo.tolist() == lo.tolist()
        if sum(nlo.tolist()) < 2**63:  # (runs below 2**63 each can still sum past int64)
            assert sum_int64(nlo) == sum_int64(np.repeat(nlo, 3)[::3]) == total


def test_byte_runs_refuses_mismatched_or_empty_columns() -> None:
    u = np.zeros(3, np.uint64)
    i = np.zeros(3, np.int64)
    for args in [(u[:2], u, i), (u, u[:1], i), (u, u, i[:2]), (u[:0], u[:0], i[:0])]:
        with pytest.raises(ValueError):
            byte_runs(*args, 8, 0)
    with pytest.raises((ValueError, TypeError)):  # wrong dtypes are refused, not reinterpreted
        byte_runs(np.zeros(3, np.int32), u, i, 8, 0)
    assert sum_int64(np.zeros(0, np.int64)) == 0
    assert sum_int64(np.array([2**63 - 1, 1], np.int64)) == -(2**63)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                          st.integers(1, 2**32 - 1)), min_size=1, max_size=256),
       st.integers(0, 2**31 - 1), st.integers(0, 2**40))
def test_small_byte_plan_matches_byte_runs(runs: list[tuple[int, int, int]], block: int,
                                           tail: int) -> None:
    """Within its documented domain (indices and lengths < 2**32, block < 2**31) the small plan
    gives byte_runs' arrays, total and exact ends; it refuses (ValueError) a total past int64,
    and Runs.byte_plan then takes byte_runs."""
    s0 = [r[0] for r in runs]
    d0 = [r[1] for r in runs]
    ln = [r[2] for r in runs]
    want = _ref_bytes(s0, d0, ln, block, tail)
    if want[3] > 2**63 - 1:  # a total past int64: the small plan refuses, Runs.byte_plan then
        with pytest.raises(ValueError, match="overflows"):  # takes byte_runs
            small_byte_plan(s0, d0, ln, block, tail)
        return
    so, do, lo, total, s_end, d_end = small_byte_plan(s0, d0, ln, block, tail)
    assert (so.tolist(), do.tolist(), lo.tolist(), total, s_end, d_end) == want
    other = byte_runs(np.array(s0, np.uint64), np.array(d0, np.uint64), np.array(ln, np.int64),
                      block, tail)
    assert [a.tolist() for a in other[:3]] == [so.tolist(), do.tolist(), lo.tolist()]
    assert other[3:] == (total, s_end, d_end)


@pytest.mark.parametrize("args", [
    ([2**32], [0], [1], 8, 0), ([0], [2**32], [1], 8, 0), ([0], [0], [2**32], 8, 0),
    ([0], [0], [1], 2**31, 0), ([0], [0], [1], -1, 0), ([0], [0], [1], 8, -1),
    ([], [], [], 8, 0), ([0] * 257, [0] * 257, [1] * 257, 8, 0), ([0], [0, 1], [1], 8, 0),
])
def test_small_byte_plan_refuses_out_of_domain(args: tuple[list[int], list[int], list[int], int,
                                                           int]) -> None:
    with pytest.raises(ValueError):
        small_byte_plan(*args)


@pytest.mark.parametrize("bad", [-1, 2**64, 2**200, 1.5, None, "1"])
def test_small_byte_plan_refuses_non_uint64_items(bad: object) -> None:
    with pytest.raises((ValueError, TypeError, OverflowError)):
        s0: list[Any] = [0, bad]
        small_byte_plan(s0, [0, 0], [1, 1], 8, 0)


def test_no_reference_leaks_in_the_compiled_helpers() -> None:
    """A thousand calls of each helper: the reference counts of the items (ints that are not
    cached small ints) and of the lists, and the number of live objects, come back."""
    big = [2**62 + i for i in (0, 1, 2, 7, 8)]
    src = list(big)
    dst = list(big)
    s0, d0, ln = [2**31 + 1, 5], [9, 2**31 + 3], [2**31 + 5, 3]
    watched = [*big, src, dst, s0[0], d0[1], ln[0], s0, ln]
    gc.collect()
    before = [sys.getrefcount(x) for x in watched]
    objects = len(gc.get_objects())
    for _ in range(1000):
        assert ints_within(src, *UINT64) and not ints_within(src, *UINT32)
        assert block_runs(src, dst) is not None
        assert group_small_runs(src, dst, 64) is not None
        small_byte_plan(s0, d0, ln, 3, 0)
    gc.collect()
    assert [sys.getrefcount(x) for x in watched] == before
    assert len(gc.get_objects()) <= objects + 10


def test_the_checked_items_are_the_items_returned_while_another_thread_mutates() -> None:
    """check_int_seq's compiled fast path (ints_within, then a copy) must return the items it
    checked: a list another thread mutates between the check and the copy must not slip a bool
    (or an out-of-width int) into the 'checked' tuple.  Checking before copying returns
    unchecked items ~70 times a second under this load; kvdd/widths.py copies first and checks
    the copy."""
    lst: list[object] = [1] * 8
    stop = threading.Event()

    def pause() -> None:  # a call: a point where the interpreter may switch threads
        pass

    def mutate() -> None:
        while not stop.is_set():
            lst[0] = True
            pause()
            lst[0] = 1
            pause()
            lst[0] = 2**64
            pause()
            lst[0] = 1
            pause()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=mutate, daemon=True)
    t.start()
    wrong: list[tuple[int, ...]] = []
    refused = 0
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end and not wrong:
            try:
                got = check_int_seq("x", lst, UINT64)
            except (TypeError, ValueError):
                refused += 1
                continue
            if any(type(v) is not int or not 0 <= v <= U64 for v in got):
                wrong.append(got)
    finally:
        stop.set()
        t.join(5)
        sys.setswitchinterval(old)
    assert refused > 0  # the other thread did run in between
    assert not wrong, wrong[0]


def test_the_byte_plans_agree_on_ends_past_int64() -> None:
    """Both plans (short list and numpy) give the exact end past int64."""
    s0, d0, ln, block = [0], [4], [2**32 - 1], 2**31 - 1
    small = small_byte_plan(s0, d0, ln, block, 0)
    big = byte_runs(np.array(s0, np.uint64), np.array(d0, np.uint64), np.array(ln, np.int64),
                    block, 0)
    assert small[3:] == big[3:]
