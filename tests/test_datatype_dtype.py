"""``DataType.dtype``: the numpy dtype without ``None`` for typed code; a clear ValueError for the
types numpy cannot hold."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kvdd import DataType

WRITTEN_OUT = {
    DataType.DT_FLOAT: np.dtype(np.float32), DataType.DT_FLOAT16: np.dtype(np.float16),
    DataType.DT_BF16: np.dtype(ml_dtypes.bfloat16), DataType.DT_INT8: np.dtype(np.int8),
    DataType.DT_UINT8: np.dtype(np.uint8), DataType.DT_INT64: np.dtype(np.int64),
    DataType.DT_BOOL: np.dtype(np.bool_), DataType.DT_DOUBLE: np.dtype(np.float64),
}


@pytest.mark.parametrize("dt", list(DataType), ids=lambda d: d.name)
def test_dtype_is_numpy_dtype_or_a_value_error(dt: DataType) -> None:
    if dt.numpy_dtype is not None:
        assert dt.dtype == dt.numpy_dtype
    else:
        with pytest.raises(ValueError, match=f"^{dt.name} has no numpy dtype"):
            _ = dt.dtype


@pytest.mark.parametrize("dt, expected", list(WRITTEN_OUT.items()), ids=lambda x: getattr(x, "name", ""))
def test_the_common_kv_cache_dtypes(dt: DataType, expected: np.dtype) -> None:
    assert dt.dtype == expected
    assert np.zeros(4, dt.dtype).nbytes == 4 * expected.itemsize


def test_sub_byte_types_say_their_width() -> None:
    with pytest.raises(ValueError, match=r"^DT_INT4 has no numpy dtype \(4-bit elements\)"):
        _ = DataType.DT_INT4.dtype
    with pytest.raises(ValueError, match=r"^DT_UNDEFINED has no numpy dtype \(no element size\)"):
        _ = DataType.DT_UNDEFINED.dtype
