"""Value types as objects (API.md "Value types"): the C++ structs' defaults, the enums, valid objects
for semantically odd values (the call decides), immutability and hashing, the exports, and
constructors typed for lists and numpy (checked by mypy --strict on this file).

Field types and widths: test_type_fields.py; DataType and CacheDesc sizes: test_datatype.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
