"""Stand-in for CANN's native ``metadef_wrapper``: the 14 ``DT_*`` constants (PYPKG.md §0.2)."""

from __future__ import annotations

from .data_type import DataType

DT_FLOAT = DataType.DT_FLOAT.value
DT_FLOAT16 = DataType.DT_FLOAT16.value
DT_INT8 = DataType.DT_INT8.value
DT_INT32 = DataType.DT_INT32.value
DT_UINT8 = DataType.DT_UINT8.value
DT_INT16 = DataType.DT_INT16.value
DT_UINT16 = DataType.DT_UINT16.value
DT_UINT32 = DataType.DT_UINT32.value
DT_INT64 = DataType.DT_INT64.value
DT_UINT64 = DataType.DT_UINT64.value
DT_DOUBLE = DataType.DT_DOUBLE.value
DT_BOOL = DataType.DT_BOOL.value
DT_STRING = DataType.DT_STRING.value
DT_BF16 = DataType.DT_BF16.value
