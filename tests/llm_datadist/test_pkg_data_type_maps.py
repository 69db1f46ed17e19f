"""``DataType`` and the numpy maps of ``llm_datadist.data_type`` as upstream builds them
(PYPKG.md §1.1, §1.2): members in upstream's definition order, numpy *types* as values (not
``np.dtype`` instances), DT_STRING as ``np.bytes_``, ``valid_np_dtypes`` listing every value
(float16 twice, for FLOAT16 and BF16), ``np_dtype_to_dtype`` keyed by ``np.dtype`` without BF16;
an unknown engine data type is a ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from kvdd.llm_datadist import DataType
from kvdd.llm_datadist import data_type as d


def test_member_order() -> None:
    assert [m.name for m in DataType] == [
        "DT_FLOAT", "DT_FLOAT16", "DT_BF16", "DT_INT8", "DT_INT16", "DT_UINT16", "DT_UINT8",
        "DT_INT32", "DT_INT64", "DT_UINT32", "DT_UINT64", "DT_BOOL", "DT_DOUBLE", "DT_STRING"]


def test_numpy_maps() -> None:
    to_np = d.dtype_to_np_dtype
    assert len(to_np) == 14 and to_np[DataType.DT_FLOAT] is np.float32
    assert to_np[DataType.DT_BF16] is np.float16 and to_np[DataType.DT_STRING] is np.bytes_
    assert to_np[DataType.DT_BOOL] is np.bool_ and to_np[DataType.DT_DOUBLE] is np.double
    assert d.valid_np_dtypes == list(to_np.values())
    back = d.np_dtype_to_dtype
    assert len(back) == 13 and back[np.dtype(np.bytes_)] is DataType.DT_STRING
    assert back[np.dtype(np.float16)] is DataType.DT_FLOAT16
    assert all(isinstance(k, np.dtype) for k in back)


def test_unknown_wrapper_data_type_is_a_value_error() -> None:
    assert d.get_python_dtype_from_wrapper_dtype(27) is DataType.DT_BF16
    with pytest.raises(ValueError):
        d.get_python_dtype_from_wrapper_dtype(5)
