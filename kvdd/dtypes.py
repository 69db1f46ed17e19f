"""``ge::DataType``: the values, element sizes and tensor byte sizes of docs/spec/SEMANTICS.md §5.

:func:`tensor_nbytes` is T of docs/spec/SEMANTICS.md §2.1 (upstream's CalcTensorMemSize), with
upstream's int32 narrowing of sub-byte sizes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from .widths import INT64

__all__ = ["DataType", "element_size", "tensor_nbytes"]

# value -> element size; ints are bytes, ("bits", n) are sub-byte types (SEMANTICS.md §5).
_DT_TABLE: dict[str, tuple[int, int | tuple[str, int] | None]] = {
    "DT_FLOAT": (0, 4), "DT_FLOAT16": (1, 2), "DT_INT8": (2, 1), "DT_INT32": (3, 4),
    "DT_UINT8": (4, 1), "DT_INT16": (6, 2), "DT_UINT16": (7, 2), "DT_UINT32": (8, 4),
    "DT_INT64": (9, 8), "DT_UINT64": (10, 8), "DT_DOUBLE": (11, 8), "DT_BOOL": (12, 1),
    "DT_STRING": (13, 16), "DT_DUAL_SUB_INT8": (14, 1), "DT_DUAL_SUB_UINT8": (15, 1),
    "DT_COMPLEX64": (16, 8), "DT_COMPLEX128": (17, 16), "DT_QINT8": (18, 1), "DT_QINT16": (19, 2),
    "DT_QINT32": (20, 4), "DT_QUINT8": (21, 1), "DT_QUINT16": (22, 2), "DT_RESOURCE": (23, 8),
    "DT_STRING_REF": (24, 16), "DT_DUAL": (25, 5), "DT_VARIANT": (26, 8), "DT_BF16": (27, 2),
    "DT_UNDEFINED": (28, None), "DT_INT4": (29, ("bits", 4)), "DT_UINT1": (30, ("bits", 1)),
    "DT_INT2": (31, ("bits", 2)), "DT_UINT2": (32, ("bits", 2)), "DT_COMPLEX32": (33, 4),
    "DT_HIFLOAT8": (34, 1), "DT_FLOAT8_E5M2": (35, 1), "DT_FLOAT8_E4M3FN": (36, 1),
    "DT_FLOAT8_E8M0": (37, 1), "DT_FLOAT6_E3M2": (38, ("bits", 6)),
    "DT_FLOAT6_E2M3": (39, ("bits", 6)), "DT_FLOAT4_E2M1": (40, ("bits", 4)),
    "DT_FLOAT4_E1M2": (41, ("bits", 4)), "DT_HIFLOAT4": (42, ("bits", 4)),
}

_NUMPY_NAMES: dict[str, str] = {
    "DT_FLOAT": "float32", "DT_FLOAT16": "float16", "DT_INT8": "int8", "DT_INT32": "int32",
    "DT_UINT8": "uint8", "DT_INT16": "int16", "DT_UINT16": "uint16", "DT_UINT32": "uint32",
    "DT_INT64": "int64", "DT_UINT64": "uint64", "DT_DOUBLE": "float64", "DT_BOOL": "bool",
    "DT_COMPLEX64": "complex64", "DT_COMPLEX128": "complex128",
}
_ML_DTYPES_NAMES: dict[str, str] = {
    "DT_BF16": "bfloat16", "DT_FLOAT8_E5M2": "float8_e5m2", "DT_FLOAT8_E4M3FN": "float8_e4m3fn",
    "DT_FLOAT8_E8M0": "float8_e8m0fnu",
}

class DataType(enum.IntEnum):
    """``ge::DataType``: every value of docs/spec/SEMANTICS.md §5 (``DT_BF16 == 27``, ``DT_UNDEFINED == 28``).

    Reserved value 5, ``DT_UNDEFINED`` and values outside the table are invalid for registration
    (PARAM_INVALID); dtype fields of the value types still take any int32.
    """

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_DUAL_SUB_INT8 = 14
    DT_DUAL_SUB_UINT8 = 15
    DT_COMPLEX64 = 16
    DT_COMPLEX128 = 17
    DT_QINT8 = 18
    DT_QINT16 = 19
    DT_QINT32 = 20
    DT_QUINT8 = 21
    DT_QUINT16 = 22
    DT_RESOURCE = 23
    DT_STRING_REF = 24
    DT_DUAL = 25
    DT_VARIANT = 26
    DT_BF16 = 27
    DT_UNDEFINED = 28
    DT_INT4 = 29
    DT_UINT1 = 30
    DT_INT2 = 31
    DT_UINT2 = 32
    DT_COMPLEX32 = 33
    DT_HIFLOAT8 = 34
    DT_FLOAT8_E5M2 = 35
    DT_FLOAT8_E4M3FN = 36
    DT_FLOAT8_E8M0 = 37
    DT_FLOAT6_E3M2 = 38
    DT_FLOAT6_E2M3 = 39
    DT_FLOAT4_E2M1 = 40
    DT_FLOAT4_E1M2 = 41
    DT_HIFLOAT4 = 42

    @property
    def itemsize_bits(self) -> int | None:
        """Element size in bits (16 for DT_BF16, 4 for DT_INT4); None for DT_UNDEFINED."""
        size = _DT_TABLE[self.name][1]
        if size is None:
            return None
        if isinstance(size, tuple):
            return size[1]
        return size * 8

    @property
    def numpy_dtype(self) -> np.dtype[Any] | None:
        """The numpy (or ml_dtypes) dtype; None for sub-byte types and types without one."""
        if self.name in _NUMPY_NAMES:
            return np.dtype(_NUMPY_NAMES[self.name])
        if self.name in _ML_DTYPES_NAMES:
            import ml_dtypes

            attr = getattr(ml_dtypes, _ML_DTYPES_NAMES[self.name], None)
            return None if attr is None else np.dtype(attr)
        return None

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy (or ml_dtypes) dtype, for typed code: :attr:`numpy_dtype` without the None.

        Returns
        -------
        numpy.dtype
            ``np.dtype(np.float16)`` for DT_FLOAT16, ``ml_dtypes.bfloat16`` for DT_BF16, ...

        Raises
        ------
        ValueError
            The type has no numpy dtype (sub-byte types such as DT_INT4, DT_UNDEFINED, ...); the
            message names it and its element size.
        """
        dt = self.numpy_dtype
        if dt is None:
            bits = self.itemsize_bits
            size = "no element size" if bits is None else f"{bits}-bit elements"
            raise ValueError(f"{self.name} has no numpy dtype ({size}); use numpy_dtype, which is None "
                             "for such types, or allocate bytes (np.uint8)")
        return dt


def element_size(data_type: int) -> int | tuple[str, int] | None:
    """Element size of a raw dtype value (docs/spec/SEMANTICS.md §5).

    Parameters
    ----------
    data_type : int
        A ``ge::DataType`` value.

    Returns
    -------
    int or ("bits", int) or None
        Bytes per element; ``("bits", n)`` for sub-byte types; None for ``DT_UNDEFINED``, the
        reserved value 5 and values outside the table.
    """
    try:
        return _DT_TABLE[DataType(data_type).name][1]
    except ValueError:
        return None


def _wrap32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - 2**32 if v >= 2**31 else v


def tensor_nbytes(shape: Sequence[int], data_type: int) -> int:
    """T of docs/spec/SEMANTICS.md §2.1 (upstream's CalcTensorMemSize): bytes of one tensor.

    Parameters
    ----------
    shape : Sequence[int]
        The tensor's dims (int64).
    data_type : int
        A ``ge::DataType`` value.

    Returns
    -------
    int
        Product of the dims x element size; sub-byte types are rounded up to whole bytes after
        upstream's int32 narrowing (§5).

    Raises
    ------
    ValueError
        With the reason, where upstream returns PARAM_INVALID: empty shape, a dim <= 0, int64
        overflow, an invalid or undefined dtype.
    """
    if not shape:
        raise ValueError("shape is empty")
    elements = 1
    for i, dim in enumerate(shape):
        if dim <= 0:
            raise ValueError(f"shape[{i}]={dim} is not positive")
        elements *= dim
        if elements > INT64[1]:
            raise ValueError("element count overflows int64")
    size = element_size(data_type)
    if size is None:
        raise ValueError(f"data_type {data_type} has no element size (invalid or undefined)")
    if isinstance(size, tuple):
        # upstream: CeilDiv(int32(elements * bits), 8) — narrowed to int32 first (SEMANTICS.md §5).
        bits = elements * size[1]
        if bits > INT64[1]:
            raise ValueError("bit count overflows int64")
        # CeilDiv(int32 a, 8) is `a / 8`, plus one when inexact: no `a + 7` that could overflow.
        narrowed = _wrap32(bits)
        nbytes = -(-narrowed // 8) if narrowed >= 0 else 0  # negative: T undefined (below)
        if nbytes <= 0:
            raise ValueError(f"sub-byte size overflows int32 upstream ({bits} bits)")
        return nbytes
    nbytes = elements * size
    if nbytes > INT64[1]:
        raise ValueError("byte size overflows int64")
    return nbytes
