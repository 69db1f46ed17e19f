"""Value types (API.md "Value types"), DataType (SEMANTICS.md §5) and CacheDesc sizes (§2.1).

Every expected number here is written out from the spec text, never computed by kvdd.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import kvdd
from kvdd import (
    Cache,
    CacheDesc,
    CacheIndex,
    CachePlacement,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmRole,
    RegisterCfg,
)

# C++ widths of API.md, written out.
INT32 = (-2147483648, 2147483647)
UINT8 = (0, 255)
UINT16 = (0, 65535)
UINT32 = (0, 4294967295)
INT64 = (-9223372036854775808, 9223372036854775807)
UINT64 = (0, 18446744073709551615)

# ---------------------------------------------------------------------------------------------
# scalar integer fields: (class, other required kwargs, field, width)

SCALAR_FIELDS: list[tuple[type[Any], dict[str, Any], str, tuple[int, int]]] = [
    (IpInfo, {"ip": "127.0.0.1"}, "port", UINT16),
    (ClusterInfo, {}, "remote_cluster_id", UINT64),
    (ClusterInfo, {}, "remote_role_type", INT32),
    (CacheDesc, {}, "num_tensors", UINT32),
    (CacheDesc, {}, "data_type", INT32),
    (CacheDesc, {}, "placement", UINT32),
    (Cache, {}, "cache_id", INT64),
    (CacheIndex, {"cluster_id": 0, "cache_id": 0}, "cluster_id", UINT64),
    (CacheIndex, {"cluster_id": 0, "cache_id": 0}, "cache_id", INT64),
    (CacheIndex, {"cluster_id": 0, "cache_id": 0}, "batch_index", UINT32),
    (KvCacheExtParam, {}, "tensor_num_per_layer", UINT8),
]
SCALAR_IDS = [f"{c.__name__}.{f}" for c, _, f, _ in SCALAR_FIELDS]


def _make(cls: type[Any], base: dict[str, Any], field: str, value: object) -> Any:
    return cls(**{**base, field: value})


def _np_int(value: int) -> object:
    if value <= INT64[1]:
        return np.int64(value)
    return np.uint64(value)


def _mk(cls: type[Any], **kwargs: Any) -> Any:
    """Construct with untyped arguments (the tests pass wrong types on purpose)."""
    return cls(**kwargs)


@pytest.mark.parametrize(("cls", "base", "field", "width"), SCALAR_FIELDS, ids=SCALAR_IDS)
def test_scalar_field_accepts_both_ends_of_its_width(
    cls: type[Any], base: dict[str, Any], field: str, width: tuple[int, int]
) -> None:
    for value in width:
        obj = _make(cls, base, field, value)
        got = getattr(obj, field)
        assert got == value
        assert isinstance(got, int) and not isinstance(got, bool)


@pytest.mark.parametrize(("cls", "base", "field", "width"), SCALAR_FIELDS, ids=SCALAR_IDS)
def test_scalar_field_rejects_values_just_outside_its_width(
    cls: type[Any], base: dict[str, Any], field: str, width: tuple[int, int]
) -> None:
    lo, hi = width
    for value in (lo - 1, hi + 1):
        with pytest.raises(ValueError):
            _make(cls, base, field, value)
    with pytest.raises(ValueError):
        _make(cls, base, field, hi + 2**70)
    with pytest.raises(ValueError):
        _make(cls, base, field, lo - 2**70)


@pytest.mark.parametrize(("cls", "base", "field", "width"), SCALAR_FIELDS, ids=SCALAR_IDS)
def test_scalar_field_rejects_wrong_python_types(
    cls: type[Any], base: dict[str, Any], field: str, width: tuple[int, int]
) -> None:
    for bad in (True, False, np.bool_(True), 1.0, np.float64(1.0), "1", b"1", None, [1], (1,), 1j):
        with pytest.raises(TypeError):
            _make(cls, base, field, bad)


@pytest.mark.parametrize(("cls", "base", "field", "width"), SCALAR_FIELDS, ids=SCALAR_IDS)
def test_scalar_field_accepts_numpy_integers_and_stores_python_ints(
    cls: type[Any], base: dict[str, Any], field: str, width: tuple[int, int]
) -> None:
    lo, hi = width
    for value, expected in ((_np_int(lo), lo), (_np_int(hi), hi), (np.uint8(1), 1), (np.int32(0), 0)):
        obj = _make(cls, base, field, value)
        got = getattr(obj, field)
        assert got == expected
        assert isinstance(got, int) and not isinstance(got, np.integer)
    # numpy integers outside the width are ValueError too
    if lo == 0:
        with pytest.raises(ValueError):
            _make(cls, base, field, np.int64(-1))
    if hi < INT64[1]:
        with pytest.raises(ValueError):
            _make(cls, base, field, np.int64(hi + 1))


class _Index:
    """An integer-like object (``__index__``), as operator.index accepts."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_integer_fields_accept_index_objects() -> None:
    idx = CacheIndex(cluster_id=_Index(7), cache_id=_Index(-3), batch_index=_Index(2))
    assert (idx.cluster_id, idx.cache_id, idx.batch_index) == (7, -3, 2)
    assert CacheDesc(shape=[_Index(4), _Index(16)]).shape == (4, 16)


# ---------------------------------------------------------------------------------------------
# integer sequence fields: (class, kwargs, field, width, min length)

SEQ_FIELDS: list[tuple[type[Any], str, tuple[int, int]]] = [
    (CacheDesc, "shape", INT64),
    (Cache, "tensor_addrs", UINT64),
]


@pytest.mark.parametrize(("cls", "field", "width"), SEQ_FIELDS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_sequence_field_stores_tuples_of_ints(cls: type[Any], field: str, width: tuple[int, int]) -> None:
    lo, hi = width
    items = [lo, 1, hi]
    dtype = np.int64 if lo < 0 else np.uint64
    for given in (items, tuple(items), np.array(items, dtype=dtype), range(1, 4)):
        obj = _mk(cls, **{field: given})
        got = getattr(obj, field)
        assert type(got) is tuple
        assert got == tuple(int(v) for v in given)
        assert all(type(v) is int for v in got)
    assert getattr(_mk(cls, **{field: []}), field) == ()
    # numpy array views and other integer dtypes
    arr = np.arange(10, dtype=np.int32)[2:8:2]
    assert getattr(_mk(cls, **{field: arr}), field) == (2, 4, 6)
    assert getattr(_mk(cls, **{field: np.array([3, 4], dtype=np.uint8)}), field) == (3, 4)
    # a list holding numpy scalars
    assert getattr(_mk(cls, **{field: [np.int16(5), np.uint64(6)]}), field) == (5, 6)


@pytest.mark.parametrize(("cls", "field", "width"), SEQ_FIELDS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_sequence_field_rejects_out_of_width_items(cls: type[Any], field: str, width: tuple[int, int]) -> None:
    lo, hi = width
    with pytest.raises(ValueError):
        _mk(cls, **{field: [1, lo - 1]})
    with pytest.raises(ValueError):
        _mk(cls, **{field: (hi + 1,)})


@pytest.mark.parametrize(("cls", "field", "width"), SEQ_FIELDS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_sequence_field_rejects_wrong_types(cls: type[Any], field: str, width: tuple[int, int]) -> None:
    bad_values: list[object] = [
        5,                                  # not a sequence
        None,
        "12",                               # str is not a sequence of integers
        b"\x01\x02",
        {1, 2},                             # not a sequence
        (x for x in (1, 2)),                # iterator, not a sequence
        [1, True],                          # bool item
        [1, 2.0],                           # float item
        ["1"],
        [None],
        np.array([1.0, 2.0]),               # float array
        np.array([True, False]),            # bool array
    ]
    for bad in bad_values:
        with pytest.raises(TypeError):
            _mk(cls, **{field: bad})


def test_layer_ranges_are_int32_pairs() -> None:
    for field in ("src_layer_range", "dst_layer_range"):
        for lo_hi in (INT32, (-1, -1), (0, 0), (5, 2)):
            for given in (list(lo_hi), tuple(lo_hi), np.array(lo_hi, dtype=np.int64)):
                p = _mk(KvCacheExtParam, **{field: given})
                got = getattr(p, field)
                assert type(got) is tuple and got == lo_hi
                assert all(type(v) is int for v in got)
        for bad_width in ((INT32[0] - 1, 0), (0, INT32[1] + 1)):
            with pytest.raises(ValueError):
                _mk(KvCacheExtParam, **{field: bad_width})
        for bad_type in (1, None, "01", (True, 1), (1.0, 2), np.array([1.0, 2.0]), {0, 1}):
            with pytest.raises(TypeError):
                _mk(KvCacheExtParam, **{field: bad_type})
        for bad_len in ((), (1,), (1, 2, 3)):
            with pytest.raises((TypeError, ValueError)):
                _mk(KvCacheExtParam, **{field: bad_len})


# ---------------------------------------------------------------------------------------------
# other fields


def test_ipinfo_ip_must_be_str() -> None:
    for bad in (b"127.0.0.1", None, 1, ["127.0.0.1"]):
        with pytest.raises(TypeError):
            IpInfo(ip=bad)  # type: ignore[arg-type]
    # any string is a valid object; the call that uses it decides (IPv6/"" -> PARAM_INVALID).
    for ok in ("", "::1", "not an ip", "127.0.0.1"):
        assert IpInfo(ok).ip == ok
    assert IpInfo("1.2.3.4").port == 0


def test_cluster_info_ip_info_sequences() -> None:
    a, b = IpInfo("10.0.0.1", 1), IpInfo("10.0.0.2", 2)
    for field in ("local_ip_infos", "remote_ip_infos"):
        for given in ([a, b], (a, b)):
            got = getattr(_mk(ClusterInfo, **{field: given}), field)
            assert type(got) is tuple and got == (a, b)
        bad: object
        for bad in (a, "10.0.0.1:1", None, 3, [a, "10.0.0.2"], [("10.0.0.1", 1)], {a}):
            with pytest.raises(TypeError):
                _mk(ClusterInfo, **{field: bad})


def test_cache_desc_of_cache_must_be_cache_desc() -> None:
    bad: object
    for bad in (None, {}, (1, 3, (4,), 1), 0):
        with pytest.raises(TypeError):
            _mk(Cache, cache_desc=bad)


def test_cache_index_requires_cluster_and_cache_id() -> None:
    with pytest.raises(TypeError):
        CacheIndex()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        CacheIndex(1)  # type: ignore[call-arg]
    assert CacheIndex(1, 2) == CacheIndex(cluster_id=1, cache_id=2, batch_index=0)


def test_defaults_are_those_of_the_cpp_structs() -> None:
    d = CacheDesc()
    assert (d.num_tensors, d.data_type, d.shape, d.placement) == (0, 28, (), 1)
    c = Cache()
    assert (c.cache_id, c.tensor_addrs, c.cache_desc) == (-1, (), CacheDesc())
    e = KvCacheExtParam()
    assert (e.src_layer_range, e.dst_layer_range, e.tensor_num_per_layer) == ((-1, -1), (-1, -1), 2)
    ci = ClusterInfo()
    assert (ci.remote_cluster_id, ci.remote_role_type, ci.local_ip_infos, ci.remote_ip_infos) == (0, 0, (), ())
    assert CacheIndex(3, 4).batch_index == 0
    assert dataclasses.fields(RegisterCfg) == ()
    assert RegisterCfg() == RegisterCfg()


def test_enums() -> None:
    assert [(m.name, int(m)) for m in LlmRole] == [("PROMPT", 1), ("DECODER", 2), ("MIX", 3)]
    assert [(m.name, int(m)) for m in CachePlacement] == [("HOST", 0), ("DEVICE", 1)]


def test_semantic_oddities_are_valid_objects() -> None:
    # API.md: value types check type and width only, never LLM semantics.
    assert ClusterInfo(remote_role_type=4).remote_role_type == 4
    assert ClusterInfo(remote_role_type=0).remote_role_type == 0
    assert CacheDesc(data_type=5).data_type == 5
    assert CacheDesc(data_type=-1).data_type == -1
    assert CacheDesc(data_type=43).data_type == 43
    assert CacheDesc(shape=[1] * 32).shape == (1,) * 32
    assert CacheDesc(num_tensors=0, data_type=DataType.DT_INT32, shape=(4, 16)).num_tensors == 0
    assert CacheDesc(shape=(4, 0)).shape == (4, 0)
    assert CacheDesc(shape=(-1, 16)).shape == (-1, 16)
    assert CacheDesc(placement=7).placement == 7
    assert KvCacheExtParam(tensor_num_per_layer=0).tensor_num_per_layer == 0
    assert KvCacheExtParam(src_layer_range=(3, 1)).src_layer_range == (3, 1)
    assert Cache(tensor_addrs=[0]).tensor_addrs == (0,)
    assert CacheIndex(0, -5, 4294967295).cache_id == -5


def test_value_types_are_immutable_and_hashable() -> None:
    shape = [4, 16]
    d = CacheDesc(10, DataType.DT_INT32, shape)
    shape.append(7)  # the object does not alias the caller's list
    assert d.shape == (4, 16)
    objs: list[Any] = [
        IpInfo("1.2.3.4", 5),
        ClusterInfo(1, 2, [IpInfo("1.1.1.1")], [IpInfo("2.2.2.2", 3)]),
        d,
        Cache(1, [16, 32], d),
        CacheIndex(1, 2, 3),
        KvCacheExtParam((0, 1), (2, 3), 2),
        RegisterCfg(),
    ]
    for obj in objs:
        for f in dataclasses.fields(obj):
            with pytest.raises(AttributeError):
                setattr(obj, f.name, getattr(obj, f.name))
        with pytest.raises(AttributeError):
            obj.new_attribute = 1
        assert hash(obj) == hash(dataclasses.replace(obj))
        assert obj == dataclasses.replace(obj)
    # replace() re-validates
    with pytest.raises(ValueError):
        dataclasses.replace(objs[0], port=70000)


def test_value_types_are_exported() -> None:
    for name in ("LlmRole", "CachePlacement", "DataType", "IpInfo", "ClusterInfo", "CacheDesc",
                 "Cache", "CacheIndex", "KvCacheExtParam", "RegisterCfg"):
        assert name in kvdd.__all__
        assert getattr(kvdd, name) is getattr(kvdd.types, name)


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


def test_constructors_are_typed_for_lists_and_numpy() -> None:
    # Written without casts: mypy --strict on this file checks that the constructors' signatures
    # take what API.md says they accept (any sequence, numpy arrays, numpy integers).
    d = CacheDesc(np.uint32(10), DataType.DT_INT32, np.array([4, 16]), np.int64(1))
    assert (d.num_tensors, d.shape, d.placement) == (10, (4, 16), 1)
    c = Cache(np.int64(3), np.array([16, 32], dtype=np.uint64), d)
    assert c.tensor_addrs == (16, 32)
    e = KvCacheExtParam([0, 1], np.array([2, 3], dtype=np.int32), np.uint8(4))
    assert (e.src_layer_range, e.dst_layer_range, e.tensor_num_per_layer) == ((0, 1), (2, 3), 4)
    ci = ClusterInfo(np.uint64(2), LlmRole.PROMPT, [IpInfo("1.1.1.1", np.uint16(80))])
    assert ci.local_ip_infos == (IpInfo("1.1.1.1", 80),)
    assert CacheIndex(np.uint64(1), np.int64(2), np.uint32(3)) == CacheIndex(1, 2, 3)
