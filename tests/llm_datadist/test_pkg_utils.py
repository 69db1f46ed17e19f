"""llm_datadist.utils.utils: the argument checks (PYPKG.md §1.1, §2.1): TypeError for a type,
ValueError outside the C type's range, exact bounds accepted, None and bool as PYPKG.md says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvdd.llm_datadist.utils import utils as u

INTEGER_CHECKS: list[tuple[Callable[..., None], int, int]] = [
    (u.check_uint8, 0, 2**8 - 1), (u.check_uint16, 0, 2**16 - 1), (u.check_uint32, 0, 2**32 - 1),
    (u.check_uint64, 0, 2**64 - 1), (u.check_int32, -(2**31), 2**31 - 1), (u.check_int64, -(2**63), 2**63 - 1),
]
LIST_CHECKS: list[tuple[Callable[[str, Any], None], int, int]] = [
    (u.check_list_int32, -(2**31), 2**31 - 1), (u.check_list_int64, -(2**63), 2**63 - 1),
    (u.check_list_uint64, 0, 2**64 - 1),
]


@pytest.mark.parametrize("check, low, high", INTEGER_CHECKS)
def test_integer_bounds(check: Callable[..., None], low: int, high: int) -> None:
    for ok in (low, high, 0, low + 1, high - 1):
        check("value", ok)
    for bad in (low - 1, high + 1, -(2**128), 2**128):
        with pytest.raises(ValueError, match="value"):
            check("value", bad)
    for wrong in (None, "1", 1.0, [], object()):
        with pytest.raises(TypeError, match="device_id"):
            check("device_id", wrong)
    check("flag", True)  # bool passes as int (PYPKG.md §2.1)
    check("maybe", None, allow_none=True)


@pytest.mark.parametrize("check, low, high", LIST_CHECKS)
def test_list_bounds(check: Callable[[str, Any], None], low: int, high: int) -> None:
    values = [low, 0, high]
    check("ids", values)
    assert values == [low, 0, high]
    accepted: list[Any] = [[], (), (low, high)]
    for ok in accepted:
        check("ids", ok)
    for bad in ([0, low - 1], [0, high + 1]):
        with pytest.raises(ValueError, match="ids"):
            check("ids", bad)
    wrong_items: list[Any] = [None, "1", 1.0, []]
    for wrong in wrong_items:
        for index in range(3):
            items: list[Any] = [0, 1, 2]
            items[index] = wrong
            with pytest.raises(TypeError, match="ids"):
                check("ids", items)
    check("ids", {0, 1})  # any iterable, as upstream


def test_check_isinstance() -> None:
    value = [1, 2]
    assert u.check_isinstance("values", value, list) is value
    assert u.check_isinstance("values", (1,), [list, tuple]) == (1,)
    assert u.check_isinstance("values", None, list) is None
    with pytest.raises(TypeError, match="values"):
        u.check_isinstance("values", None, list, allow_none=False)
    with pytest.raises(TypeError) as exc:
        u.check_isinstance("values", 1.5, [list, tuple], extra_fmt="RegisterMem: ")
    for fragment in ("RegisterMem: ", "values", "list", "tuple", "float"):
        assert fragment in str(exc.value)
    assert u.check_isinstance("values", [0, 1], list, inner_class=int) == [0, 1]
    with pytest.raises(TypeError, match="values"):
        u.check_isinstance("values", [0, "1"], [list, tuple], inner_class=int)
    with pytest.raises(TypeError, match="values"):
        u.check_isinstance("values", 1, list, inner_class=int)
    assert u.check_isinstance("flag", True, int) is True  # bool passes as int


def test_check_dict_and_inner() -> None:
    u.check_dict("options", {}, str, list, int)
    u.check_dict("options", {"a": [1], "b": [2, 3]}, str, list, int)
    u.check_dict("options", {"a": [1, "two"]}, str, list)  # inner check optional
    with pytest.raises(TypeError, match="options.*key"):
        u.check_dict("options", {"a": [1], 2: [2]}, str, list)
    with pytest.raises(TypeError, match="options.*value"):
        u.check_dict("options", {"a": [1], "b": 2}, str, list)
    with pytest.raises(TypeError, match="dict value"):
        u.check_dict("options", {"a": [1], "b": [2, "3"]}, str, list, int)
    with pytest.raises(TypeError):
        u.check_dict("options", [("a", 1)], str, int)
    u.check_inner("values", (), int)
    with pytest.raises(TypeError, match="values"):
        u.check_inner("values", [0, "1"], int)


def test_check_positive_or_set_default() -> None:
    assert u.check_positive_or_set_default("size", None) == -1
    assert u.check_positive_or_set_default("size", None, default=128) == 128
    assert u.check_positive_or_set_default("size", 0, default=128) == 0
    assert u.check_positive_or_set_default("size", 2**63 - 1) == 2**63 - 1
    for bad in (-1, -(2**63), 2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="size"):
            u.check_positive_or_set_default("size", bad)
    wrong_sizes: list[Any] = ["1", 1.0, []]
    for wrong in wrong_sizes:
        with pytest.raises(TypeError, match="size"):
            u.check_positive_or_set_default("size", wrong)


def test_find_caller_names_the_first_frame_outside_the_package() -> None:
    import threading

    from kvdd.llm_datadist.utils.log import _find_caller

    assert _find_caller()[2] == "test_find_caller_names_the_first_frame_outside_the_package"
    found: list[tuple[str, int, str]] = []

    def inner() -> None:
        found.append(_find_caller())

    thread = threading.Thread(target=inner)
    thread.start()
    thread.join()
    assert found[0][2] == "inner" and found[0][0] == __file__
