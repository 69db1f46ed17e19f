"""``DataType`` and its maps (PYPKG.md §1.2, §5.6).

Values are metadef's ``ge::DataType`` numbers.  The numpy maps ``dtype_to_np_dtype``,
``valid_np_dtypes`` and ``np_dtype_to_dtype`` are built on first access (numpy is imported then);
``DT_BF16`` maps to ``np.float16`` (numpy has no bfloat16), and ``np.float16`` maps back to
``DT_FLOAT16``; values are numpy scalar types (``np.float32``), as upstream's.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = [
    "DataType",
    "python_dtype_2_dwrapper_dtype",
    "dwrapper_dtype_2_python_dtype",
    "get_python_dtype_from_wrapper_dtype",
    "dtype_to_np_dtype",
    "valid_np_dtypes",
    "np_dtype_to_dtype",
]


class DataType(Enum):
    """Element type of a cache tensor (a plain ``Enum``, not an ``IntEnum``); members in
    upstream's definition order (iteration order is observable)."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_BF16 = 27
    DT_INT8 = 2
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT8 = 4
    DT_INT32 = 3
    DT_INT64 = 9
    DT_UINT32 = 8
    DT_UINT64 = 10
    DT_BOOL = 12
    DT_DOUBLE = 11
    DT_STRING = 13


#: DataType -> the int the engine takes
python_dtype_2_dwrapper_dtype: dict[DataType, int] = {dt: dt.value for dt in DataType}
#: engine int -> DataType
dwrapper_dtype_2_python_dtype: dict[int, DataType] = {dt.value: dt for dt in DataType}


def get_python_dtype_from_wrapper_dtype(wrapper_dtype: int) -> DataType:
    """The :class:`DataType` of an engine data-type int (``ValueError`` for an unknown one)."""
    dtype = dwrapper_dtype_2_python_dtype.get(wrapper_dtype)
    if dtype is None:
        raise ValueError(f"The data type {wrapper_dtype} is not supported.")
    return dtype


#: numpy type names of each DataType (BF16 has none: float16 stands in; STRING is bytes_)
_NP_NAMES: dict[DataType, str] = {
    DataType.DT_FLOAT: "float32",
    DataType.DT_FLOAT16: "float16",
    DataType.DT_BF16: "float16",
    DataType.DT_INT8: "int8",
    DataType.DT_INT16: "int16",
    DataType.DT_UINT16: "uint16",
    DataType.DT_UINT8: "uint8",
    DataType.DT_INT32: "int32",
    DataType.DT_INT64: "int64",
    DataType.DT_UINT32: "uint32",
    DataType.DT_UINT64: "uint64",
    DataType.DT_BOOL: "bool_",
    DataType.DT_DOUBLE: "double",
    DataType.DT_STRING: "bytes_",
}

_lazy: dict[str, Any] = {}


def _build() -> None:
    import numpy as np

    # numpy scalar types as values (upstream's), np.dtype instances as the inverse map's keys
    to_np = {dt: getattr(np, name) for dt, name in _NP_NAMES.items()}
    _lazy["dtype_to_np_dtype"] = to_np
    _lazy["valid_np_dtypes"] = list(to_np.values())
    _lazy["np_dtype_to_dtype"] = {np.dtype(v): k for k, v in to_np.items() if k is not DataType.DT_BF16}


def __getattr__(name: str) -> Any:
    if name in ("dtype_to_np_dtype", "valid_np_dtypes", "np_dtype_to_dtype"):
        if not _lazy:
            _build()
        return _lazy[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
