"""Argument checks of CANN's ``llm_datadist`` package (PYPKG.md §2.1 "Setters validate").

A wrong type raises ``TypeError``; an integer outside its C type's range raises ``ValueError``.
``None`` passes :func:`check_isinstance` unless ``allow_none=False``, and ``bool`` passes as
``int`` (as upstream).  Semantic checks (``LLMException(LLM_PARAM_INVALID)``) are
:func:`kvdd.llm_datadist.status.raise_if_false` / ``raise_if_true``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = [
    "check_isinstance",
    "check_inner",
    "check_uint8",
    "check_list_int32",
    "check_list_int64",
    "check_list_uint64",
    "check_positive_or_set_default",
    "check_int_range",
    "check_uint16",
    "check_uint32",
    "check_int32",
    "check_uint64",
    "check_int64",
    "check_list_of",
    "check_dict",
    "UINT16_MAX",
    "UINT32_MAX",
    "INT32_MAX",
    "INT32_MIN",
    "UINT64_MAX",
    "INT64_MAX",
    "INT64_MIN",
]

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
UINT64_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def _as_types(types: type | tuple[type, ...] | list[type]) -> type | tuple[type, ...]:
    return tuple(types) if isinstance(types, list) else types


def _type_names(types: type | tuple[type, ...] | list[type]) -> str:
    types = _as_types(types)
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__


def check_isinstance(name: str, value: Any, types: type | tuple[type, ...] | list[type],
                     inner_class: type | tuple[type, ...] | None = None, extra_fmt: str = "",
                     allow_none: bool = True) -> Any:
    """``TypeError`` unless ``value`` is an instance of ``types`` (a class, or a tuple or list of
    classes), or None when allowed; with ``inner_class``, every item must be one too.  Returns
    ``value``.  Positional parameters in upstream's order (name, value, classes, inner_class,
    extra_fmt, allow_none)."""
    if value is None and allow_none:
        return value
    if not isinstance(value, _as_types(types)):
        raise TypeError(f"{extra_fmt}{name} only supports {_type_names(types)}, but got {type(value).__name__}.")
    if inner_class is not None:
        check_inner(name, value, inner_class, extra_fmt)
    return value


def check_inner(name: str, values: Any, item_types: type | tuple[type, ...] | list[type],
                extra_fmt: str = "") -> None:
    """``TypeError`` unless every item of ``values`` is an instance of ``item_types``."""
    types = _as_types(item_types)
    if all(isinstance(item, types) for item in values):
        return
    for i, item in enumerate(values):
        if not isinstance(item, types):
            raise TypeError(f"{extra_fmt}{name}[{i}] only supports {_type_names(item_types)}, "
                            f"but got {type(item).__name__}.")


def check_int_range(name: str, value: Any, low: int, high: int, type_name: str,
                    allow_none: bool = False) -> None:
    """``TypeError`` unless ``value`` is an int; ``ValueError`` unless ``low <= value <= high``."""
    check_isinstance(name, value, int, allow_none=allow_none)
    if value is None:
        return
    if not low <= value <= high:
        raise ValueError(f"{name} must be in range of {type_name} [{low}, {high}], but got {value}.")


def check_uint16(name: str, value: Any, allow_none: bool = False) -> None:
    """int in [0, 2**16 - 1]."""
    check_int_range(name, value, 0, UINT16_MAX, "uint16", allow_none)


def check_uint32(name: str, value: Any, allow_none: bool = False) -> None:
    """int in [0, 2**32 - 1]."""
    check_int_range(name, value, 0, UINT32_MAX, "uint32", allow_none)


def check_int32(name: str, value: Any, allow_none: bool = False) -> None:
    """int in [-2**31, 2**31 - 1]."""
    check_int_range(name, value, INT32_MIN, INT32_MAX, "int32", allow_none)


def check_uint64(name: str, value: Any, allow_none: bool = False) -> None:
    """int in [0, 2**64 - 1]."""
    check_int_range(name, value, 0, UINT64_MAX, "uint64", allow_none)


def check_int64(name: str, value: Any, allow_none: bool = False) -> None:
    """int in [-2**63, 2**63 - 1]."""
    check_int_range(name, value, INT64_MIN, INT64_MAX, "int64", allow_none)


def check_list_of(name: str, value: Any, item_types: type | tuple[type, ...],
                  container: type | tuple[type, ...] = (list, tuple), allow_none: bool = False) -> None:
    """``TypeError`` unless ``value`` is a ``container`` whose items are all ``item_types``."""
    check_isinstance(name, value, container, allow_none=allow_none)
    if value is not None:
        check_inner(name, value, item_types)


def check_dict(name: str, value: Any, key_types: type | tuple[type, ...] | list[type],
               value_types: type | tuple[type, ...] | list[type],
               inner_types: type | tuple[type, ...] | list[type] | None = None, allow_none: bool = False) -> None:
    """``TypeError`` unless ``value`` is a dict with keys ``key_types`` and values
    ``value_types`` (and, with ``inner_types``, every item of every value of that type)."""
    check_isinstance(name, value, dict, allow_none=allow_none)
    if value is None:
        return
    for k, v in value.items():
        if not isinstance(k, _as_types(key_types)):
            raise TypeError(f"{name} key {k!r} only supports {_type_names(key_types)}, but got {type(k).__name__}.")
        if not isinstance(v, _as_types(value_types)):
            raise TypeError(f"{name} value of {k!r} only supports {_type_names(value_types)}, "
                            f"but got {type(v).__name__}.")
        if inner_types is not None:
            check_inner(f"{name} dict value of {k!r}", v, inner_types)


def check_uint8(name: str, value: Any, allow_none: bool = False) -> None:
    """int in [0, 255]."""
    check_int_range(name, value, 0, 255, "uint8", allow_none)


def _check_list_range(name: str, values: Any, low: int, high: int, type_name: str) -> None:
    # item by item, type and range together, over any iterable (as upstream)
    for i, v in enumerate(values):
        check_int_range(f"{name}[{i}]", v, low, high, type_name)


def check_list_int32(name: str, values: Any) -> None:
    """A list/tuple of int32."""
    _check_list_range(name, values, INT32_MIN, INT32_MAX, "int32")


def check_list_int64(name: str, values: Any) -> None:
    """A list/tuple of int64."""
    _check_list_range(name, values, INT64_MIN, INT64_MAX, "int64")


def check_list_uint64(name: str, values: Any) -> None:
    """A list/tuple of uint64."""
    _check_list_range(name, values, 0, UINT64_MAX, "uint64")


def check_positive_or_set_default(name: str, value: Any, default: int = -1) -> int:
    """``default`` for None; else an int64 >= 0 (``TypeError`` / ``ValueError``)."""
    if value is None:
        return default
    check_int64(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, but got {value}.")
    result: int = value
    return result


def all_in_range(values: Iterable[int], low: int, high: int) -> bool:
    """True when every value is in [low, high]."""
    return all(low <= v <= high for v in values)
