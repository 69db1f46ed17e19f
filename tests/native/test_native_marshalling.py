"""Every field NativeBackend passes reaches the engine unchanged, and every output comes back.

Runs against kvdd's CI test double: the double rebuilds kvdd value types from the C++ structs the
binding filled and hands them to the (recording) simulator engine, so comparing what the engine
received with what the test passed checks the Python -> C++ -> Python round trip of every field,
including the values API.md lets through unchecked (role 4, placement 7, ...).  A data_type that is
no ge::DataType enumerator (dtype 99) reaches the library as DT_UNDEFINED (VENDOR.md: the cast would
be undefined).  Expected values are the literals of each test, never recomputed by the code under
test.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvdd import (
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    IpInfo,
    KvCacheExtParam,
    RegisterCfg,
    Status,
)
from .native_support import skip_unless_test_double

skip_unless_test_double()

from kvdd._native._datadist import NativeBackend  # noqa: E402

U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
U32_MAX = 2**32 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
PARAM_INVALID = 0x5010B005
FEATURE_NOT_ENABLED = 0x5010B019
NOT_INITIALIZED = 0xFFFFFFFF  # LLM_FAILED

ODD_DESC = CacheDesc(num_tensors=U32_MAX, data_type=99, shape=(I64_MAX, -1, 0, I64_MIN),
                     placement=7)
ODD_CACHE = Cache(cache_id=I64_MIN, tensor_addrs=(1, U64_MAX, 0x7F00_0000_1000),
                  cache_desc=CacheDesc(num_tensors=3, data_type=-(2**31), shape=(4, 16),
                                       placement=U32_MAX))
# ... as the engine receives them: data_type 99 and -(2**31) are no enumerators -> DT_UNDEFINED (28)
ODD_DESC_SEEN = CacheDesc(num_tensors=U32_MAX, data_type=28, shape=(I64_MAX, -1, 0, I64_MIN),
                          placement=7)
ODD_CACHE_SEEN = Cache(cache_id=I64_MIN, tensor_addrs=(1, U64_MAX, 0x7F00_0000_1000),
                       cache_desc=CacheDesc(num_tensors=3, data_type=28, shape=(4, 16),
                                            placement=U32_MAX))
ODD_INDEX = CacheIndex(cluster_id=U64_MAX, cache_id=I64_MAX, batch_index=U32_MAX)
ODD_EXT = KvCacheExtParam(src_layer_range=(0, 3), dst_layer_range=(-1, 5),
                          tensor_num_per_layer=255)
EXTREME_EXT = KvCacheExtParam(src_layer_range=(I32_MAX, I32_MIN), dst_layer_range=(I32_MIN, 0),
                              tensor_num_per_layer=0)


def make(recorders: list[Any], cluster_id: int = 7, role: int = 3) -> tuple[NativeBackend, Any]:
    nb = NativeBackend(cluster_id, role)
    return nb, recorders[-1]


@pytest.mark.parametrize(("cluster_id", "role"),
                         [(0, 1), (U64_MAX, 4), (12345, I32_MIN), (1, I32_MAX), (2, 0)])
def test_constructor_arguments_reach_the_engine(recorders: list[Any], cluster_id: int,
                                                role: int) -> None:
    nb, rec = make(recorders, cluster_id, role)
    assert rec.ctor_args == (cluster_id, role)
    status = nb.initialize({"llm.DeviceId": "0"})
    assert status == (0 if role in (1, 2, 3) else PARAM_INVALID)
    assert status == rec.last("initialize").result


def test_options_reach_the_engine_exactly(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    options = {"llm.DeviceId": "0", "llm.SyncKvCacheWaitTime": "250", "x.empty": "",
               "x.unicode": "缓存 ✓", "x.punct": "a=b;c:d,[e]"}
    assert nb.initialize(options) == 0
    assert rec.last("initialize").args == (options,)
    role_options = {"llm.EnableSwitchRole": "1", "x.other": "ü"}
    status = nb.set_role(-7, role_options)
    assert rec.last("set_role").args == (-7, role_options)
    assert status == rec.last("set_role").result == PARAM_INVALID
    assert nb.set_role(2, {}) == 0
    assert rec.last("set_role").args == (2, {})


def test_uninitialized_calls_return_the_raw_status(recorders: list[Any]) -> None:
    nb, _ = make(recorders)
    assert nb.unregister_kv_cache(1) == NOT_INITIALIZED
    assert nb.register_kv_cache(CacheDesc(1, 3, (4,)), [64], RegisterCfg()) == (NOT_INITIALIZED, -1)
    assert nb.link_llm_clusters([ClusterInfo(1)], 1000) == (NOT_INITIALIZED, [])


CLUSTERS = [
    ClusterInfo(remote_cluster_id=U64_MAX, remote_role_type=-5,
                local_ip_infos=(IpInfo("127.0.0.1", 0), IpInfo("10.1.2.3", 65535)),
                remote_ip_infos=(IpInfo("127.0.0.1", 1),)),
    ClusterInfo(remote_cluster_id=0, remote_role_type=I32_MAX),
    ClusterInfo(remote_cluster_id=2, remote_role_type=I32_MIN,
                remote_ip_infos=(IpInfo("", 7), IpInfo("not-an-ip", 8), IpInfo("::1", 9))),
]


@pytest.mark.parametrize("timeout_ms", [1, 1000, I32_MAX, 0, I32_MIN])
def test_link_and_unlink_arguments_reach_the_engine(recorders: list[Any], timeout_ms: int) -> None:
    nb, rec = make(recorders)
    assert nb.initialize({"llm.DeviceId": "0"}) == 0
    result = nb.link_llm_clusters(CLUSTERS, timeout_ms)
    call = rec.last("link_llm_clusters")
    assert list(call.args[0]) == CLUSTERS
    assert call.args[1] == timeout_ms
    assert result == (call.result[0], list(call.result[1]))
    for force in (False, True):
        result = nb.unlink_llm_clusters(CLUSTERS[1:], timeout_ms, force)
        call = rec.last("unlink_llm_clusters")
        assert (list(call.args[0]), call.args[1], call.args[2]) == (CLUSTERS[1:], timeout_ms, force)
        assert result == (call.result[0], list(call.result[1]))


def test_per_cluster_statuses_come_back_raw_and_in_order(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    rets = [0, 0x5010B009, 507053, 0xFFFFFFFF]
    rec.overrides["link_llm_clusters"] = lambda clusters, timeout: (0x5010B009, rets)
    rec.overrides["unlink_llm_clusters"] = lambda clusters, timeout, force: (0, [])
    assert nb.link_llm_clusters(CLUSTERS, 1000) == (0x5010B009, rets)
    assert nb.unlink_llm_clusters(CLUSTERS, 1000, True) == (0, [])


def test_register_arguments_reach_the_engine(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    assert nb.initialize({"llm.DeviceId": "0"}) == 0
    addrs = [1, U64_MAX, 0]
    status, cache_id = nb.register_kv_cache(ODD_DESC, addrs, RegisterCfg())
    call = rec.last("register_kv_cache")
    assert call.args[0] == ODD_DESC_SEEN
    assert list(call.args[1]) == addrs
    assert call.args[2] == RegisterCfg()
    assert (status, cache_id) == (PARAM_INVALID, -1) == call.result


def test_register_numpy_addresses(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    assert nb.initialize({"llm.DeviceId": "0"}) == 0
    mem = np.zeros((2, 4, 16), np.int32)
    addrs: Any = np.array([mem[0].ctypes.data, mem[1].ctypes.data], dtype=np.uint64)
    status, cache_id = nb.register_kv_cache(CacheDesc(2, 3, (4, 16)), addrs, RegisterCfg())
    assert (status, cache_id) == (0, 1)
    assert list(rec.last("register_kv_cache").args[1]) == [mem[0].ctypes.data, mem[1].ctypes.data]
    assert nb.unregister_kv_cache(1) == 0
    assert rec.last("unregister_kv_cache").args == (1,)


def test_cache_id_is_output_only_on_success(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    rec.overrides["register_kv_cache"] = lambda desc, addrs, cfg: (PARAM_INVALID, 99)
    assert nb.register_kv_cache(CacheDesc(1, 3, (4,)), [64], RegisterCfg()) == (PARAM_INVALID, -1)
    rec.overrides["register_kv_cache"] = lambda desc, addrs, cfg: (0, I64_MAX)
    assert nb.register_kv_cache(CacheDesc(1, 3, (4,)), [64], RegisterCfg()) == (0, I64_MAX)
    rec.overrides["register_kv_cache"] = lambda desc, addrs, cfg: (0, I64_MIN)
    assert nb.register_kv_cache(CacheDesc(1, 3, (4,)), [64], RegisterCfg()) == (0, I64_MIN)


def test_unregister_and_deallocate_ids(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    assert nb.initialize({"llm.DeviceId": "0"}) == 0
    for cache_id in (I64_MIN, -1, 0, I64_MAX):
        assert nb.unregister_kv_cache(cache_id) == 0
        assert rec.last("unregister_kv_cache").args == (cache_id,)
        assert nb.deallocate_cache(cache_id) == FEATURE_NOT_ENABLED
        assert rec.last("deallocate_cache").args == (cache_id,)


def test_allocate_cache_output(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    assert nb.allocate_cache(ODD_DESC) == (FEATURE_NOT_ENABLED, None)
    assert rec.last("allocate_cache").args == (ODD_DESC_SEEN,)
    # A library that supported it would fill the Cache: every field must come back.
    rec.overrides["allocate_cache"] = lambda desc: (0, ODD_CACHE)
    assert nb.allocate_cache(ODD_DESC) == (0, ODD_CACHE)
    rec.overrides["allocate_cache"] = lambda desc: (PARAM_INVALID, ODD_CACHE)
    assert nb.allocate_cache(ODD_DESC) == (PARAM_INVALID, None)


@pytest.mark.parametrize("ext", [None, ODD_EXT, EXTREME_EXT, KvCacheExtParam()])
def test_transfer_arguments_reach_the_engine(recorders: list[Any],
                                             ext: KvCacheExtParam | None) -> None:
    nb, rec = make(recorders)
    expected_ext = KvCacheExtParam() if ext is None else ext
    src_blocks = [0, 1, U64_MAX]
    dst_blocks = np.array([5, 2**63, 7], dtype=np.uint64)
    cases: list[tuple[str, tuple[Any, ...], tuple[Any, ...]]] = [
        ("pull_kv_cache", (ODD_INDEX, ODD_CACHE, U32_MAX, -1, ext),
         (ODD_INDEX, ODD_CACHE_SEEN, U32_MAX, -1, expected_ext)),
        ("pull_kv_cache", (CacheIndex(0, I64_MIN, 0), Cache(), 0, I64_MAX, ext),
         (CacheIndex(0, I64_MIN, 0), Cache(), 0, I64_MAX, expected_ext)),
        ("pull_kv_blocks", (ODD_INDEX, ODD_CACHE, src_blocks, dst_blocks, ext),
         (ODD_INDEX, ODD_CACHE_SEEN, src_blocks, [5, 2**63, 7], expected_ext)),
        ("push_kv_cache", (ODD_CACHE, ODD_INDEX, U32_MAX, I64_MIN, ext),
         (ODD_CACHE_SEEN, ODD_INDEX, U32_MAX, I64_MIN, expected_ext)),
        ("push_kv_blocks", (ODD_CACHE, ODD_INDEX, [], [U64_MAX], ext),
         (ODD_CACHE_SEEN, ODD_INDEX, [], [U64_MAX], expected_ext)),
    ]
    for name, args, expected in cases:
        status = getattr(nb, name)(*args)
        call = rec.last(name)
        assert call.args == expected, name
        assert isinstance(call.args[-1], KvCacheExtParam)
        assert status == call.result == NOT_INITIALIZED, name


def test_copy_arguments_reach_the_engine(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    status = nb.copy_kv_cache(ODD_CACHE, Cache(), U32_MAX, 0, U64_MAX, I64_MIN)
    assert rec.last("copy_kv_cache").args == (ODD_CACHE_SEEN, Cache(), U32_MAX, 0, U64_MAX,
                                              I64_MIN)
    assert status == FEATURE_NOT_ENABLED
    dst_list = [[1, 2], [], [U64_MAX]]
    status = nb.copy_kv_blocks(Cache(), ODD_CACHE, [0, U64_MAX], dst_list)
    call = rec.last("copy_kv_blocks")
    assert call.args[0] == Cache() and call.args[1] == ODD_CACHE_SEEN
    assert list(call.args[2]) == [0, U64_MAX]
    assert [list(b) for b in call.args[3]] == dst_list
    assert status == FEATURE_NOT_ENABLED


def test_statuses_come_back_raw(recorders: list[Any]) -> None:
    nb, rec = make(recorders)
    for raw in (507053, 0xFFFFFFFF, 1, 0x5010B01C):
        rec.overrides["unregister_kv_cache"] = lambda cache_id, raw=raw: raw
        rec.overrides["pull_kv_cache"] = lambda *args, raw=raw: raw
        assert nb.unregister_kv_cache(1) == raw
        assert nb.pull_kv_cache(ODD_INDEX, ODD_CACHE, 0, -1, None) == raw
    assert isinstance(nb.unregister_kv_cache(1), int)


@pytest.mark.parametrize(("call", "error"), [
    (lambda nb: nb.set_role(True, {}), TypeError),
    (lambda nb: nb.set_role(2**31, {}), ValueError),
    (lambda nb: nb.initialize({"k": 1}), TypeError),
    (lambda nb: nb.initialize({1: "v"}), TypeError),
    (lambda nb: nb.initialize(["llm.DeviceId"]), TypeError),
    (lambda nb: nb.link_llm_clusters([ClusterInfo(1)], 2**31), ValueError),
    (lambda nb: nb.link_llm_clusters([ClusterInfo(1)], 1.5), TypeError),
    (lambda nb: nb.unregister_kv_cache(2**63), ValueError),
    (lambda nb: nb.deallocate_cache("1"), TypeError),
    (lambda nb: nb.register_kv_cache(CacheDesc(1, 3, (4,)), [-1], RegisterCfg()), ValueError),
    (lambda nb: nb.register_kv_cache(CacheDesc(1, 3, (4,)), [2**64], RegisterCfg()), ValueError),
    (lambda nb: nb.register_kv_cache(CacheDesc(1, 3, (4,)), [False], RegisterCfg()), TypeError),
    (lambda nb: nb.pull_kv_cache(ODD_INDEX, ODD_CACHE, 2**32, -1, None), ValueError),
    (lambda nb: nb.pull_kv_cache(ODD_INDEX, ODD_CACHE, -1, -1, None), ValueError),
    (lambda nb: nb.pull_kv_cache(ODD_INDEX, ODD_CACHE, 0, 2**63, None), ValueError),
    (lambda nb: nb.pull_kv_blocks(ODD_INDEX, ODD_CACHE, [-1], [0], None), ValueError),
    (lambda nb: nb.push_kv_blocks(ODD_CACHE, ODD_INDEX, [0], [2**64], None), ValueError),
    (lambda nb: nb.copy_kv_cache(ODD_CACHE, ODD_CACHE, 0, 0, -1, -1), ValueError),
    (lambda nb: nb.copy_kv_blocks(ODD_CACHE, ODD_CACHE, [0], [[-1]]), ValueError),
])
def test_width_and_type_errors_raise_before_any_call(recorders: list[Any], call: Any,
                                                     error: type[Exception]) -> None:
    nb, rec = make(recorders)
    with pytest.raises(error):
        call(nb)
    assert rec.calls == []


def test_constructor_width_errors() -> None:
    with pytest.raises(ValueError):
        NativeBackend(-1, 1)
    with pytest.raises(ValueError):
        NativeBackend(2**64, 1)
    with pytest.raises(ValueError):
        NativeBackend(1, 2**31)
    with pytest.raises(TypeError):
        NativeBackend(1, True)
    with pytest.raises(TypeError):
        NativeBackend("1", 1)  # type: ignore[arg-type]


def test_numpy_integers_are_accepted(recorders: list[Any]) -> None:
    nb = NativeBackend(np.uint64(U64_MAX), np.int32(2))
    assert recorders[-1].ctor_args == (U64_MAX, 2)
    assert nb.unregister_kv_cache(np.int64(-5)) == NOT_INITIALIZED
    assert recorders[-1].last("unregister_kv_cache").args == (-5,)
