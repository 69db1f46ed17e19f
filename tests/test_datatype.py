"""DataType (SEMANTICS.md §5) and CacheDesc sizes (§2.1, §5, §6): the members, element sizes and
numpy dtypes, and ``tensor_nbytes`` / ``batch_size`` / ``stride_nbytes`` including the sub-byte,
narrowing, truncation and overflow cases.

Every expected number here is written out from the spec text, never computed by kvdd.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kvdd import CacheDesc, DataType

# ---------------------------------------------------------------------------------------------
# DataType: SEMANTICS.md §5, written out (name, value, element size in bits)

DATA_TYPES: list[tuple[str, int, int]] = [
    ("DT_FLOAT", 0, 32),
    ("DT_FLOAT16", 1, 16),
    ("DT_INT8", 2, 8),
    ("DT_INT32", 3, 32),
    ("DT_UINT8", 4, 8),
    ("DT_INT16", 6, 16),
    ("DT_UINT16", 7, 16),
    ("DT_UINT32", 8, 32),
    ("DT_INT64", 9, 64),
    ("DT_UINT64", 10, 64),
    ("DT_DOUBLE", 11, 64),
    ("DT_BOOL", 12, 8),
    ("DT_STRING", 13, 128),
    ("DT_DUAL_SUB_INT8", 14, 8),
    ("DT_DUAL_SUB_UINT8", 15, 8),
    ("DT_COMPLEX64", 16, 64),
    ("DT_COMPLEX128", 17, 128),
    ("DT_QINT8", 18, 8),
    ("DT_QINT16", 19, 16),
    ("DT_QINT32", 20, 32),
    ("DT_QUINT8", 21, 8),
    ("DT_QUINT16", 22, 16),
    ("DT_RESOURCE", 23, 64),
    ("DT_STRING_REF", 24, 128),
    ("DT_DUAL", 25, 40),
    ("DT_VARIANT", 26, 64),
    ("DT_BF16", 27, 16),
    ("DT_INT4", 29, 4),
    ("DT_UINT1", 30, 1),
    ("DT_INT2", 31, 2),
    ("DT_UINT2", 32, 2),
    ("DT_COMPLEX32", 33, 32),
    ("DT_HIFLOAT8", 34, 8),
    ("DT_FLOAT8_E5M2", 35, 8),
    ("DT_FLOAT8_E4M3FN", 36, 8),
    ("DT_FLOAT8_E8M0", 37, 8),
    ("DT_FLOAT6_E3M2", 38, 6),
    ("DT_FLOAT6_E2M3", 39, 6),
    ("DT_FLOAT4_E2M1", 40, 4),
    ("DT_FLOAT4_E1M2", 41, 4),
    ("DT_HIFLOAT4", 42, 4),
]
SUB_BYTE = {"DT_INT4", "DT_UINT1", "DT_INT2", "DT_UINT2", "DT_FLOAT6_E3M2", "DT_FLOAT6_E2M3",
            "DT_FLOAT4_E2M1", "DT_FLOAT4_E1M2", "DT_HIFLOAT4"}


def test_datatype_members_are_exactly_the_table() -> None:
    expected = {name: value for name, value, _ in DATA_TYPES} | {"DT_UNDEFINED": 28}
    assert {m.name: int(m) for m in DataType} == expected
    bf16: int = DataType.DT_BF16
    undefined: int = DataType.DT_UNDEFINED
    assert bf16 == 27 and undefined == 28
    with pytest.raises(ValueError):
        DataType(5)  # reserved


@pytest.mark.parametrize(("name", "value", "bits"), DATA_TYPES, ids=[n for n, _, _ in DATA_TYPES])
def test_datatype_value_and_itemsize(name: str, value: int, bits: int) -> None:
    dt = DataType[name]
    assert int(dt) == value
    assert dt.itemsize_bits == bits


def test_undefined_has_no_itemsize() -> None:
    assert DataType.DT_UNDEFINED.itemsize_bits is None
    assert DataType.DT_UNDEFINED.numpy_dtype is None


NUMPY_DTYPES: dict[str, Any] = {
    "DT_FLOAT": np.float32,
    "DT_FLOAT16": np.float16,
    "DT_INT8": np.int8,
    "DT_INT32": np.int32,
    "DT_UINT8": np.uint8,
    "DT_INT16": np.int16,
    "DT_UINT16": np.uint16,
    "DT_UINT32": np.uint32,
    "DT_INT64": np.int64,
    "DT_UINT64": np.uint64,
    "DT_DOUBLE": np.float64,
    "DT_BOOL": np.bool_,
    "DT_COMPLEX64": np.complex64,
    "DT_COMPLEX128": np.complex128,
    "DT_BF16": ml_dtypes.bfloat16,
    "DT_FLOAT8_E5M2": ml_dtypes.float8_e5m2,
    "DT_FLOAT8_E4M3FN": ml_dtypes.float8_e4m3fn,
    "DT_FLOAT8_E8M0": ml_dtypes.float8_e8m0fnu,
}
# Types with no numpy/ml_dtypes equivalent (besides the sub-byte ones, which are always None).
NO_DTYPE = {"DT_STRING", "DT_STRING_REF", "DT_RESOURCE", "DT_VARIANT", "DT_DUAL", "DT_COMPLEX32",
            "DT_HIFLOAT8", "DT_UNDEFINED"}


@pytest.mark.parametrize("dt", list(DataType), ids=lambda d: d.name)
def test_numpy_dtype(dt: DataType) -> None:
    got = dt.numpy_dtype
    if dt.name in NUMPY_DTYPES:
        assert got == np.dtype(NUMPY_DTYPES[dt.name])
    elif dt.name in SUB_BYTE or dt.name in NO_DTYPE:
        assert got is None
    # any dtype given (e.g. for the quantized types) has the element size of §5
    if got is not None:
        assert isinstance(got, np.dtype)
        assert got.itemsize * 8 == dt.itemsize_bits


# ---------------------------------------------------------------------------------------------
# CacheDesc.tensor_nbytes / batch_size / stride_nbytes: SEMANTICS.md §2.1, §5, §6

# (data_type, shape, T, B, S)
SIZES: list[tuple[int, tuple[int, ...], int, int, int]] = [
    (DataType.DT_INT32, (4, 16), 256, 4, 64),          # §6 standard cache
    (DataType.DT_INT32, (1,), 4, 1, 4),
    (DataType.DT_STRING, (3,), 48, 3, 16),             # 16 bytes per element (LLM override)
    (DataType.DT_STRING_REF, (2, 2), 64, 2, 32),
    (DataType.DT_DUAL, (2, 3), 30, 2, 15),             # 5 bytes per element
    (DataType.DT_BF16, (8, 4, 2), 128, 8, 16),
    (DataType.DT_COMPLEX128, (1, 1), 16, 1, 16),
    (DataType.DT_INT4, (1,), 1, 1, 1),                 # 4 bits -> 1 byte
    (DataType.DT_INT4, (3,), 2, 3, 0),                 # 12 bits -> 2 bytes
    (DataType.DT_INT4, (2, 5), 5, 2, 2),               # §10.10 ragged: T not a multiple of S
    (DataType.DT_INT4, (16, 1), 8, 16, 0),             # §10.10: S == 0
    (DataType.DT_UINT1, (3,), 1, 3, 0),
    (DataType.DT_UINT1, (9,), 2, 9, 0),
    (DataType.DT_INT2, (4, 4), 4, 4, 1),
    (DataType.DT_FLOAT6_E3M2, (4,), 3, 4, 0),          # 24 bits
    (DataType.DT_FLOAT6_E2M3, (5,), 4, 5, 0),          # 30 bits -> 4 bytes
    (DataType.DT_FLOAT4_E2M1, (8, 2), 8, 8, 1),
    (DataType.DT_INT32, (1,) * 30 + (2,), 8, 1, 8),    # 31 dims are fine
    (DataType.DT_INT8, (4294967299,), 4294967299, 3, 1431655766),  # B = shape[0] truncated to uint32
    # int32 narrowing before the ceiling division (§5): 2^31-1 bits is still exact ...
    (DataType.DT_UINT1, (2147483647,), 268435456, 2147483647, 0),
    # ... beyond it the bit count wraps: (2^30+4) x 4 bits = 2^32+16 bits -> 16 bits -> 2 bytes
    (DataType.DT_INT4, (1073741828,), 2, 1073741828, 0),
]


@pytest.mark.parametrize(("dtype", "shape", "t", "b", "s"), SIZES)
def test_derived_sizes(dtype: int, shape: tuple[int, ...], t: int, b: int, s: int) -> None:
    desc = CacheDesc(num_tensors=2, data_type=dtype, shape=shape)
    assert desc.tensor_nbytes == t
    assert desc.batch_size == b
    assert desc.stride_nbytes == s


def test_all_byte_types_multiply_elements_by_size() -> None:
    for name, _, bits in DATA_TYPES:
        if name in SUB_BYTE:
            continue
        desc = CacheDesc(1, DataType[name], (3, 5))
        assert desc.tensor_nbytes == 15 * bits // 8
        assert desc.stride_nbytes == 5 * bits // 8


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (DataType.DT_INT32, ()),                        # empty shape
        (DataType.DT_INT32, (4, 0)),                    # a dim of 0
        (DataType.DT_INT32, (-1, 16)),                  # negative dim
        (DataType.DT_INT32, (0,)),
        (DataType.DT_UNDEFINED, (4, 16)),               # the struct default
        (5, (4, 16)),                                   # reserved value
        (-1, (4, 16)),                                  # negative dtype
        (43, (4, 16)),                                  # >= DT_MAX
        (2147483647, (4, 16)),
        (DataType.DT_INT8, (2**32, 2**31)),             # element count overflows int64
        (DataType.DT_INT8, (2**62, 2, 2)),
        (DataType.DT_INT64, (2**61,)),                  # 2^61 x 8 bytes overflows int64
        (DataType.DT_INT4, (2**62,)),                   # 2^62 x 4 bits overflows int64
        (DataType.DT_INT4, (2**29,)),                   # 2^31 bits narrow to a negative int32
        (DataType.DT_UINT1, (2**32,)),                  # 2^32 bits narrow to 0
    ],
)
def test_undefined_sizes_raise_value_error(dtype: int, shape: tuple[int, ...]) -> None:
    desc = CacheDesc(num_tensors=1, data_type=dtype, shape=shape)
    for prop in ("tensor_nbytes", "batch_size", "stride_nbytes"):
        with pytest.raises(ValueError):
            getattr(desc, prop)


def test_largest_int64_size_is_fine() -> None:
    assert CacheDesc(1, DataType.DT_INT8, (9223372036854775807,)).tensor_nbytes == 9223372036854775807
    assert CacheDesc(1, DataType.DT_INT64, (1152921504606846975,)).tensor_nbytes == 9223372036854775800


def test_batch_size_zero_after_uint32_truncation() -> None:
    desc = CacheDesc(1, DataType.DT_INT8, (4294967296, 2))
    assert desc.tensor_nbytes == 8589934592
    assert desc.batch_size == 0
    with pytest.raises(ValueError):
        desc.stride_nbytes
