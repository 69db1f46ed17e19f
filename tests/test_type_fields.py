"""The value types' fields (API.md "Value types"): every integer field takes exactly the values of
its C++ width (ints, numpy integers, ``__index__`` objects; never bool, float or str), integer
sequences become tuples of ints, layer ranges are int32 pairs, and the other fields check their types.

Every width here is written out from API.md, never taken from kvdd.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, IpInfo, KvCacheExtParam

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
