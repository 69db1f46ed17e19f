"""kvdd.widths.check_int_seq: its compiled fast path (kvdd._native._runs.ints_within) accepts exactly
what the item-by-item check accepts, and everything else still gets the item-by-item errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdd._native._runs import ints_within
from kvdd.widths import INT32, INT64, UINT8, UINT32, UINT64, check_int, check_int_seq

WIDTHS = (INT32, UINT8, UINT32, INT64, UINT64)

#: values around every width's edges, plus non-int items
edge = st.sampled_from([0, 1, -1, 255, 256, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32 - 1, 2**32,
                        2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 2**80, -(2**80)])
item = st.one_of(edge, st.integers(), st.just(True), st.just(False), st.just(1.0), st.just(np.int64(3)),
                 st.just(np.uint64(2**64 - 1)), st.just(None), st.just("1"))


def _itemwise(value: list[object] | tuple[object, ...], width: tuple[int, int]) -> tuple[int, ...] | type[Exception]:
    try:
        return tuple(check_int(f"x[{i}]", v, width) for i, v in enumerate(value))
    except (TypeError, ValueError) as exc:
        return type(exc)


@settings(max_examples=400, deadline=None)
@given(st.lists(item, max_size=12), st.sampled_from(WIDTHS), st.booleans())
def test_fast_path_agrees_with_the_item_by_item_check(items: list[object], width: tuple[int, int],
                                                      as_tuple: bool) -> None:
    value: list[object] | tuple[object, ...] = tuple(items) if as_tuple else items
    want = _itemwise(value, width)
    fast = ints_within(value, width[0], width[1])
    if fast:  # only ever says yes when every item is a plain int inside the width
        assert want == tuple(value) and all(type(v) is int for v in value)
    elif all(type(v) is int for v in value):
        assert isinstance(want, type)  # a plain-int list it refuses must have an item out of range
    if isinstance(want, type):
        with pytest.raises(want):
            check_int_seq("x", value, width)
    else:
        got = check_int_seq("x", value, width)
        assert got == want and type(got) is tuple and all(type(v) is int for v in got)


def test_fast_path_only_for_plain_lists_and_tuples() -> None:
    class MyList(list[int]):
        pass

    assert ints_within([1, 2, 3], *UINT8)
    assert ints_within((), *UINT8)
    for other in (MyList([1, 2]), np.array([1, 2]), range(3), [1, True], [np.int64(1)], "12"):
        assert not ints_within(other, *UINT64)
    assert check_int_seq("x", MyList([1, 2]), UINT8) == (1, 2)
    assert check_int_seq("x", [np.int64(1), 2], UINT8) == (1, 2)
    with pytest.raises(ValueError, match=r"x\[1\]=256 does not fit"):
        check_int_seq("x", [1, 256], UINT8)
    with pytest.raises(TypeError, match=r"x\[0\] must be an integer, not bool"):
        check_int_seq("x", (True, 2), UINT64)
    assert not ints_within([1], -(2**64), 0) and not ints_within([1], 0, 2**65)  # bounds it cannot take
