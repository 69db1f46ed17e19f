"""C++ integer widths and the one check that a Python value fits one (docs/spec/API.md "Value types").

The value types (:mod:`kvdd.types`), the facade (:mod:`kvdd.datadist`) and the native binding
all check integers with :func:`check_int`, so the rule and its messages are written once: ``int``
and numpy integers (anything with ``__index__``) are accepted, ``bool`` is not, and a value that
does not fit the C++ field is a ``ValueError`` naming the type and its range.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._native._runs import ints_within

__all__ = ["check_int", "check_int_seq", "INT32", "UINT8", "UINT16", "UINT32", "INT64", "UINT64"]

# (min, max) of the C++ integer types used by the API.
INT32 = (-(2**31), 2**31 - 1)
UINT8 = (0, 2**8 - 1)
UINT16 = (0, 2**16 - 1)
UINT32 = (0, 2**32 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)

_CTYPE_NAMES = {INT32: "int32", UINT8: "uint8", UINT16: "uint16", UINT32: "uint32",
                INT64: "int64", UINT64: "uint64"}


def check_int(name: str, value: object, width: tuple[int, int]) -> int:
    """Return ``value`` as a Python int if it is an integer (not bool) within ``width``.

    This is kvdd's one width check: the value types, the facade and the native binding all use it.

    Parameters
    ----------
    name : str
        The argument or field name, for the message.
    value : object
        An ``int`` or anything with ``__index__`` (numpy integers).
    width : (int, int)
        Inclusive (min, max), one of :data:`INT32`, :data:`UINT8`, ... :data:`UINT64`.

    Returns
    -------
    int
        ``operator.index(value)``.

    Raises
    ------
    TypeError
        ``value`` is not an integer (``bool`` and ``numpy.bool_`` included).
    ValueError
        ``value`` does not fit the C++ field; the message names the C++ type and its range.
    """
    # fast path (bool is not int here); the checks below give the same answers, so removing
    # it or narrowing its range changes nothing (widening it, or letting bool in, does: tested)
    if type(value) is int and width[0] <= value <= width[1]:  # mutation: equivalent(skip, boundary)
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, not bool")
    try:
        ivalue = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}") from None
    lo, hi = width
    if not lo <= ivalue <= hi:
        raise ValueError(
            f"{name}={ivalue} does not fit the C++ field ({_CTYPE_NAMES.get(width, 'int')}: "
            f"{lo}..{hi})"
        )
    return ivalue


def check_int_seq(name: str, value: object, width: tuple[int, int]) -> tuple[int, ...]:
    """Return a sequence of integers (list, tuple, 1-D integer numpy array) as a tuple of ints.

    Parameters
    ----------
    name : str
        The argument name, for messages (items are named ``name[i]``).
    value : object
        The sequence.
    width : (int, int)
        Inclusive (min, max) of every item, as in :func:`check_int`.

    Returns
    -------
    tuple of int

    Raises
    ------
    TypeError
        Not a sequence (``str``/``bytes`` included), a non-integer item or dtype.
    ValueError
        An array that is not 1-D, or an item outside ``width``.
    """
    if type(value) is list:  # one snapshot: the items checked are the items returned, even
        value = tuple(value)  # when another thread changes the list meanwhile
    # fast path, one pass in C: a list or tuple of plain ints within the width (e.g. the 1024
    # block ids of a block-table pull); the checks below give the same answers
    if ints_within(value, width[0], width[1]):  # mutation: equivalent(skip)
        return value  # type: ignore[return-value]
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got an array of shape {value.shape}")
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {value.dtype}")
        items: Sequence[Any] = value.tolist()
    elif isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of integers, not {type(value).__name__}")
    else:
        items = value
    return tuple(check_int(f"{name}[{i}]", v, width) for i, v in enumerate(items))
