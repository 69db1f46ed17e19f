"""Behaviours that upstream's own hardware-free Python tests assert, checked on kvdd's façade over
the simulator (PYPKG.md §1.1, §2.1, §3, §4, §5; every case here is also specified there).

Upstream's tests run the package against a stubbed native module; here the same calls reach the
simulator engine, so where the stub answered "success" for something real hardware refuses (an
HCCL rank table with no ranks, a transfer over no link), the expectation is the status PYPKG.md
specifies for the real engine.  The package is reached as ``llm_datadist`` (the name clients
import) through :mod:`kvdd.llm_datadist.toplevel`.
"""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvdd.llm_datadist import toplevel
from kvdd.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    LlmConfig,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
)
from kvdd.llm_datadist.utils import utils as checks

PI = LLMStatusCode.LLM_PARAM_INVALID
ME = 3


def _finalize_leftover() -> None:
    if LLMDataDist.llm_engine_instance is not None:  # one engine per process
        LLMDataDist.llm_engine_instance.finalize()


def cm_config(remote_accessible: bool | None = None) -> LlmConfig:
    """The configuration upstream's cache-manager tests start from (a device pool is configured;
    nothing below allocates from it)."""
    cfg = LlmConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = '{"memory_size": 102428800}'
    cfg.sync_kv_timeout = "3000"
    cfg.rdma_service_level = 100
    cfg.rdma_traffic_class = 100
    if remote_accessible is not None:
        cfg.enable_remote_cache_accessible = remote_accessible
    return cfg


def engine(remote_accessible: bool | None = None, role: LLMRole = LLMRole.PROMPT) -> LLMDataDist:
    _finalize_leftover()
    dd = LLMDataDist(role, ME)
    dd.init(cm_config(remote_accessible).generate_options())
    return dd


@pytest.fixture
def dd() -> Iterator[LLMDataDist]:
    yield engine()
    _finalize_leftover()


@pytest.fixture
def dd_ra() -> Iterator[LLMDataDist]:
    yield engine(remote_accessible=True, role=LLMRole.DECODER)
    _finalize_leftover()


@pytest.fixture
def memory() -> list[np.ndarray]:
    return [np.arange(i * 8, i * 8 + 8, dtype=np.int8) for i in range(12)]


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def code(exc: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc.value.status_code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---------------------------------------------------------------- module surface (§1.1)

def test_top_level_name_module_getattr_and_legacy_names() -> None:
    with toplevel.installed():
        ld: Any = importlib.import_module("llm_datadist")
        assert ld.LLMDataDist is LLMDataDist
        for name in ld.v2_list:  # upstream's tests pull every v2 name into their globals
            assert getattr(ld, name) is getattr(ld, name)
        assert len(ld.v2_list) == 23
        with pytest.raises(AttributeError, match="has no attribute"):
            getattr(ld, "NonExistentAttr")
        for legacy in ("KvCacheManager", "Tensor", "TensorDesc"):
            with pytest.raises(ImportError):
                getattr(ld, legacy)
        with pytest.raises(ImportError):
            exec("from llm_datadist import Tensor", {})


def test_numpy_dtype_maps_are_reachable() -> None:
    from kvdd.llm_datadist.data_type import dtype_to_np_dtype, np_dtype_to_dtype, valid_np_dtypes

    assert dtype_to_np_dtype[DataType.DT_BF16] == np.float16  # BF16 has no numpy type
    assert np_dtype_to_dtype[np.dtype(np.float16)] is DataType.DT_FLOAT16  # BF16 is not the inverse
    assert valid_np_dtypes == list(dtype_to_np_dtype.values())  # float16 twice (FLOAT16, BF16)
    assert DataType.DT_BF16 not in np_dtype_to_dtype.values()


# ---------------------------------------------------------------- check_* helpers

@pytest.mark.parametrize("check, value", [
    (checks.check_uint64, -1), (checks.check_uint64, 2**64),
    (checks.check_int64, 2**64 - 1), (checks.check_int64, 2**63),
    (checks.check_int32, 2**64 - 1), (checks.check_int32, 2**31),
    (checks.check_uint32, -1), (checks.check_uint32, 2**32),
    (checks.check_uint16, -1), (checks.check_uint16, 2**16),
    (checks.check_uint8, -1), (checks.check_uint8, 256),
])
def test_integer_checks_one_past_each_bound(check: Any, value: int) -> None:
    with pytest.raises(ValueError):
        check("cluster", value)


@pytest.mark.parametrize("check, value", [
    (checks.check_uint64, 2**64 - 1), (checks.check_int64, -(2**63)), (checks.check_int32, 2**31 - 1),
    (checks.check_uint32, 2**32 - 1), (checks.check_uint16, 2**16 - 1), (checks.check_uint8, 255),
    (checks.check_uint8, 0),
])
def test_integer_checks_accept_each_bound(check: Any, value: int) -> None:
    check("cluster", value)


def test_list_int32_check_names_the_bad_item() -> None:
    checks.check_list_int32("cluster_ids", [0, 1, 2**31 - 1])
    with pytest.raises(ValueError, match=r"cluster_ids\[2\]"):
        checks.check_list_int32("cluster_ids", [0, 1, 2**64 - 1])


# ---------------------------------------------------------------- LlmConfig (§2.1)

def test_device_id_list_and_tuple() -> None:
    cfg = LlmConfig()
    cfg.device_id = [0, 1]
    options = cfg.gen_options()
    assert options["ge.exec.deviceId"] == "0;1"
    assert options["ge.session_device_id"] == "0"
    cfg.device_id = [0, 1, 2]
    assert cfg.device_id == [0, 1, 2]
    cfg.device_id = (3, 4)
    assert cfg.device_id == (3, 4)


def test_mem_utilization_closed_unit_interval() -> None:
    cfg = LlmConfig()
    for ok in (0.5, 0.0, 1.0):
        cfg.mem_utilization = ok
        assert cfg.mem_utilization == ok
    for bad in (1.5, -0.1, 1.0000001):
        with pytest.raises(LLMException) as exc:
            cfg.mem_utilization = bad
        assert code(exc) == PI
    assert cfg.mem_utilization == 1.0  # a refused value leaves the last good one


def test_global_resource_config() -> None:
    cfg = LlmConfig()
    cfg.device_id = 0
    assert "llm.GlobalResourceConfig" not in cfg.gen_options()
    for bad in (123, {"key": "value"}, [1, 2]):
        with pytest.raises(TypeError):
            cfg.global_resource_config = bad  # type: ignore[assignment]
    cfg.global_resource_config = ""
    assert cfg.gen_options()["llm.GlobalResourceConfig"] == ""
    text = '{"comm_resource_config.listen_port": 26666, "comm_resource_config.max_active_channels": 128}'
    cfg.global_resource_config = text
    assert cfg.global_resource_config == text
    assert cfg.gen_options()["llm.GlobalResourceConfig"] == text


def test_remote_cache_accessible_option() -> None:
    cfg = LlmConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    assert cfg.enable_cache_manager is True
    assert "llm.EnableRemoteCacheAccessible" not in cfg.gen_options()
    cfg.enable_remote_cache_accessible = False
    assert cfg.enable_remote_cache_accessible is False
    assert cfg.gen_options()["llm.EnableRemoteCacheAccessible"] == "0"
    cfg.enable_remote_cache_accessible = True
    assert cfg.gen_options()["llm.EnableRemoteCacheAccessible"] == "1"


# ---------------------------------------------------------------- init (§3.1, §2.2)

def _init_fails(options: dict[str, Any], exc_type: type[BaseException] = LLMException) -> BaseException:
    _finalize_leftover()
    dd = LLMDataDist(LLMRole.PROMPT, 13)
    with pytest.raises(exc_type) as exc:
        dd.init(options)
    assert LLMDataDist.llm_engine_instance is None
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = dd.cache_manager
    return exc.value


@pytest.mark.parametrize("value", ["1.23", "-1", "1024,2048", "", "12a"])
def test_flow_graph_mem_max_size_must_be_one_number(value: str) -> None:
    cfg = LlmConfig()
    cfg.device_id = 0
    cfg.listen_ip_info = "127.0.0.1:26000"
    cfg.ge_options = {"ge.flowGraphMemMaxSize": value}
    exc = _init_fails(cfg.generate_options())
    assert isinstance(exc, LLMException) and exc.status_code == PI


def test_flow_graph_mem_max_size_must_be_str() -> None:
    options = cm_config().generate_options()
    options["ge.flowGraphMemMaxSize"] = 123  # type: ignore[assignment]
    _init_fails(options, TypeError)


def test_flow_graph_mem_max_size_digits_pass() -> None:
    cfg = cm_config()
    cfg.ge_options = {"ge.flowGraphMemMaxSize": "1024"}
    dd = LLMDataDist(LLMRole.PROMPT, 13)
    _finalize_leftover()
    dd.init(cfg.generate_options())
    try:
        assert LLMDataDist.llm_engine_instance is dd
    finally:
        dd.finalize()


def test_hixl_backend_preconditions_name_the_missing_option() -> None:
    cfg = LlmConfig()
    cfg.device_id = 0
    cfg.transfer_backend = "hixl"
    cfg.listen_ip_info = "127.0.0.1:26000"
    exc = _init_fails(cfg.generate_options())
    assert "EnableCacheManager" in str(exc)

    cfg = cm_config(remote_accessible=True)
    cfg.transfer_backend = "hixl"
    exc = _init_fails(cfg.generate_options())
    assert "listenIpInfo" in str(exc)

    cfg = cm_config(remote_accessible=False)
    cfg.transfer_backend = "hixl"
    cfg.listen_ip_info = "127.0.0.1:26000"
    exc = _init_fails(cfg.generate_options())
    assert "EnableRemoteCacheAccessible" in str(exc)
    assert isinstance(exc, LLMException) and exc.status_code == PI


def test_init_twice_and_a_second_instance(dd: LLMDataDist) -> None:
    dd.init({"not": "even checked"})  # the same object again: silently nothing
    assert LLMDataDist.llm_engine_instance is dd
    other = LLMDataDist(LLMRole.DECODER, 12)
    with pytest.raises(LLMException) as exc:
        other.init(cm_config().generate_options())
    assert code(exc) == LLMStatusCode.LLM_FAILED
    assert LLMDataDist.llm_engine_instance is dd


def test_finalize_before_init_is_a_no_op() -> None:
    _finalize_leftover()
    LLMDataDist(LLMRole.PROMPT, 18).finalize()
    assert LLMDataDist.llm_engine_instance is None


def test_methods_before_init_raise_plain_runtime_error() -> None:
    _finalize_leftover()
    dd = LLMDataDist(LLMRole.PROMPT, 99)
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    calls: list[Callable[[], Any]] = [lambda: dd.link("link", {3: 0, 2: 1}, "{}"), lambda: dd.unlink(1),
             lambda: dd.cache_manager, lambda: dd.link_clusters([cluster], 5000),
             lambda: dd.query_register_mem_status(1), lambda: dd.switch_role(LLMRole.DECODER)]
    for call in calls:
        with pytest.raises(RuntimeError) as exc:
            call()
        assert not isinstance(exc.value, LLMException)
    assert dd.cluster_id == 99


# ---------------------------------------------------------------- LLMDataDist methods (§3.3-3.6)

def test_cluster_id_and_legacy_only_members(dd: LLMDataDist) -> None:
    assert dd.cluster_id == ME
    with pytest.raises(LLMException) as exc:
        _ = dd.kv_cache_manager
    assert code(exc) == PI
    with pytest.raises(LLMException) as exc:
        dd.check_link_status(1)
    assert code(exc) == PI


@pytest.mark.parametrize("comm_name, rank_info, rank_table, expected", [
    ("", {3: 0, 2: 1}, "{}", PI),
    ("a" * 128, {3: 0, 2: 1}, "{}", PI),
    ("link", [3, 2], "{}", TypeError),
    ("link", {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}, "{}", PI),
    ("link", {3: 0}, "{}", PI),
    ("link", {3: 1, 2: 0}, "{}", PI),
    ("link", {3: 0, 2: 1}, 123, TypeError),
    (None, {3: 0, 2: 1}, "{}", TypeError),
    ("link", {3: "0", 2: 1}, "{}", TypeError),
    ("link", {3: 0, 2: 2**32}, "{}", ValueError),
])
def test_link_python_checks(dd: LLMDataDist, comm_name: Any, rank_info: Any, rank_table: Any,
                            expected: Any) -> None:
    if isinstance(expected, LLMStatusCode):
        with pytest.raises(LLMException) as exc:
            dd.link(comm_name, rank_info, rank_table)
        assert code(exc) == expected
    else:
        with pytest.raises(expected):
            dd.link(comm_name, rank_info, rank_table)


def test_link_name_of_127_characters_passes_the_length_check(dd: LLMDataDist) -> None:
    # past the Python checks the engine refuses a table without this rank (no communicator)
    with pytest.raises(LLMException) as exc:
        dd.link("a" * 127, {3: 0, 2: 1}, '{"server_list":[{"device":[{}]}]}')
    assert code(exc) == LLMStatusCode.LLM_LINK_FAILED


def test_rank_table_link_ids_states_and_unlink(dd: LLMDataDist) -> None:
    table = ('{"server_count": "2", "status": "completed", "version": "1.2", "server_list": ['
             '{"server_id": "1", "device": [{"device_id": "0", "device_ip": "192.168.1.1", "rank_id": "0"}]},'
             '{"server_id": "2", "device": [{"device_id": "0", "device_ip": "192.168.2.1", "rank_id": "1"}]}]}')
    first = dd.link("upstream-cases-a", {ME: 0, 2: 1}, table)
    second = dd.link("upstream-cases-b", {ME: 0, 2: 1}, table)
    assert (first, second) == (1, 2)
    # nobody else joins: the domain stays PREPARING (the peer has not linked)
    assert dd.query_register_mem_status(first) == RegisterMemStatus.PREPARING
    dd.unlink(first)
    with pytest.raises(LLMException) as exc:
        dd.query_register_mem_status(first)
    assert code(exc) == LLMStatusCode.LLM_NOT_YET_LINK
    with pytest.raises(LLMException) as exc:
        dd.unlink(first)
    assert code(exc) == LLMStatusCode.LLM_NOT_YET_LINK
    with pytest.raises(TypeError):
        dd.unlink("not_int")  # type: ignore[arg-type]
    dd.unlink(second)


def _cluster(port: int = 26008) -> LLMClusterInfo:
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_local_ip_info("127.0.0.1", port)
    cluster.append_remote_ip_info("127.0.0.1", port)
    return cluster


def test_link_clusters_python_checks(dd: LLMDataDist) -> None:
    for timeout in (0, -1):
        with pytest.raises(LLMException) as exc:
            dd.link_clusters([_cluster()], timeout)
        assert code(exc) == PI
        with pytest.raises(LLMException) as exc:
            dd.unlink_clusters([_cluster()], timeout)
        assert code(exc) == PI
    with pytest.raises(TypeError):
        dd.link_clusters("not_list", 5000)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dd.unlink_clusters([_cluster()], 5000, force="not_bool")  # type: ignore[arg-type]
    bare = LLMClusterInfo()
    bare.remote_cluster_id = 1
    with pytest.raises(LLMException, match="local_ip_info_list is empty") as exc:
        dd.link_clusters([bare], 5000)
    assert code(exc) == PI


def test_switch_role(dd: LLMDataDist) -> None:
    dd.switch_role(LLMRole.DECODER)
    dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{free_port()}"})
    dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{free_port()}"})
    dd.switch_role(LLMRole.DECODER)  # no same-role check, and without a port: stop listening
    with pytest.raises(TypeError, match="role only support"):  # the package's wording for a wrong type
        dd.switch_role("not_a_role")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dd.switch_role(LLMRole.DECODER, "not_dict")  # type: ignore[arg-type]


# ---------------------------------------------------------------- types (§5)

def test_cache_key_construction() -> None:
    with pytest.raises(LLMException, match="cluster_id is required"):
        CacheKey(req_id=1, model_id=1, prefix_id=1)
    with pytest.raises(LLMException, match="req_id is required"):
        CacheKey(cluster_id=1, model_id=1, prefix_id=1)
    with pytest.raises(LLMException, match="Unsupported") as exc:
        CacheKey(cluster_id=1, req_id=1, prefix_id1=1)
    assert code(exc) == PI
    for key in (CacheKey(1, 2, 3, 4), CacheKey(cluster_id=1, req_id=2, model_id=3, prefix_id=4),
                CacheKey(prompt_cluster_id=1, req_id=2, model_id=3, prefix_id=4)):
        assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == (1, 2, 3, 4)
    with pytest.raises(ValueError):
        CacheKey(cluster_id=-1, req_id=1, model_id=1, prefix_id=1)
    defaults = CacheKey(1, 2)
    assert (defaults.model_id, defaults.prefix_id) == (0, 2**64 - 1)


def test_blocks_cache_key_construction() -> None:
    with pytest.raises(TypeError, match="only support"):
        BlocksCacheKey("aa")
    with pytest.raises(LLMException, match="cluster_id is required") as exc:
        BlocksCacheKey(model_id=1)
    assert code(exc) == PI
    with pytest.raises(LLMException, match="Unsupported"):
        BlocksCacheKey(cluster_id=1, req_id=1)
    for key in (BlocksCacheKey(1, 7), BlocksCacheKey(prompt_cluster_id=1, model_id=7)):
        assert (key.cluster_id, key.model_id) == (1, 7)
    assert BlocksCacheKey(cluster_id=2).model_id == 0


def test_cache_desc_range_checks() -> None:
    with pytest.raises(ValueError):
        CacheDesc(-1, [2, 4], DataType.DT_INT8, Placement.DEVICE)
    with pytest.raises(ValueError):
        CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE, seq_len_dim_index=2**64 - 1)
    assert CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE).size == 8


def test_enum_names_in_text() -> None:
    # what the samples' log lines and error messages show
    assert str(Placement.DEVICE) == f"{Placement.HOST}".replace("HOST", "DEVICE") == "Placement.DEVICE"
    assert int(Placement.DEVICE) == 1
    assert "placement=Placement.HOST" in repr(CacheDesc(1, [2], DataType.DT_INT8, Placement.HOST))
    assert str(LLMRole.PROMPT) == "LLMRole.PROMPT"
    assert str(LLMStatusCode.LLM_SUCCESS) == "LLMStatusCode.LLM_SUCCESS"


# ---------------------------------------------------------------- CacheManager (§4)

def test_registration_ids_count_from_one(dd: LLMDataDist, memory: list[np.ndarray]) -> None:
    mgr = dd.cache_manager
    cache = mgr.register_cache(CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE), [addr(memory[0])])
    assert cache.cache_id == 1 and cache.tensor_addrs == [addr(memory[0])]
    blocks = mgr.register_blocks_cache(CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE),
                                       [addr(memory[1])], BlocksCacheKey(1, 100))
    assert blocks.cache_id == 2 and blocks.is_blocks_cache
    mgr.unregister_cache(1)
    mgr.unregister_cache(1)  # an unknown id is success
    assert memory[0].tolist() == list(range(8))  # registration never writes


def test_host_cache_may_be_remote_accessible(dd_ra: LLMDataDist, memory: list[np.ndarray]) -> None:
    cache = dd_ra.cache_manager.register_cache(CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.HOST),
                                               [addr(memory[0])], remote_accessible=True)
    assert cache.cache_id == 1


def test_remap_registered_memory_checks(dd: LLMDataDist) -> None:
    mgr = dd.cache_manager
    for bad in ("some val", MemInfo(Memtype.MEM_TYPE_HOST, 1234, 1), MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 1),
                MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, -1), MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, 0),
                [MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, 1), "x"]):
        with pytest.raises(LLMException) as exc:
            mgr.remap_registered_memory(bad)  # type: ignore[arg-type]
        assert code(exc) == PI
    for good in (MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, 1), [MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, 1)]):
        with pytest.raises(LLMException) as exc:  # valid, but there is no link to remap for
            mgr.remap_registered_memory(good)
        assert code(exc) == LLMStatusCode.LLM_NOT_YET_LINK


def _ten_tensor_caches(dd: LLMDataDist, memory: list[np.ndarray]) -> tuple[Cache, Cache]:
    mgr = dd.cache_manager
    addrs = [addr(m) for m in memory[:10]]
    cache = mgr.register_cache(CacheDesc(10, [2, 4], DataType.DT_INT8, Placement.DEVICE), addrs,
                               [CacheKey(2, 0, 0), CacheKey(2, 1, 0)])
    blocks = mgr.register_blocks_cache(CacheDesc(10, [2, 4], DataType.DT_INT8, Placement.DEVICE), addrs)
    return cache, blocks


def test_pull_tensor_num_per_layer_checks(dd: LLMDataDist, memory: list[np.ndarray]) -> None:
    mgr = dd.cache_manager
    cache, blocks = _ten_tensor_caches(dd, memory)
    ranges = {"src_layer_range": range(0, 1), "dst_layer_range": range(0, 1)}
    pulls: list[Callable[[Any], Any]] = [lambda t: mgr.pull_cache(CacheKey(2, 0, 0), cache, 0, 4, **ranges, tensor_num_per_layer=t),
             lambda t: mgr.pull_blocks(CacheKey(2, 0, 0), blocks, [], [0], **ranges, tensor_num_per_layer=t)]
    for pull in pulls:
        with pytest.raises(ValueError):
            pull(-1)
        for bad_type in (1.0, "x"):
            with pytest.raises(TypeError):
                pull(bad_type)
        with pytest.raises(LLMException) as exc:
            pull(0)
        assert code(exc) == PI
        with pytest.raises(LLMException) as exc:  # 10 tensors are no whole number of 3-tensor layers
            pull(3)
        assert code(exc) == PI
        with pytest.raises(LLMException) as exc:  # well-formed: only the missing link is left
            pull(2)
        assert code(exc) == LLMStatusCode.LLM_NOT_YET_LINK
    assert [m.tolist() for m in memory[:10]] == [list(range(i * 8, i * 8 + 8)) for i in range(10)]


def test_pull_layer_range_on_a_one_tensor_cache(dd: LLMDataDist, memory: list[np.ndarray]) -> None:
    mgr = dd.cache_manager
    one = mgr.register_cache(CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE), [addr(memory[0])])
    with pytest.raises(LLMException) as exc:  # with ranges, 1 tensor is no whole 2-tensor layer
        mgr.pull_cache(CacheKey(2, 0, 0), one, 0, 4, src_layer_range=range(1), dst_layer_range=range(1))
    assert code(exc) == PI
    with pytest.raises(LLMException) as exc:  # without ranges the default of 2 is not checked
        mgr.pull_cache(CacheKey(2, 0, 0), one, 0, 4)
    assert code(exc) == LLMStatusCode.LLM_NOT_YET_LINK


def test_push_tensor_num_per_layer_checks(dd_ra: LLMDataDist, memory: list[np.ndarray]) -> None:
    mgr = dd_ra.cache_manager
    cache, blocks = _ten_tensor_caches(dd_ra, memory)
    ranges = {"src_layer_range": range(0, 1), "dst_layer_range": range(0, 1)}
    pushes: list[Callable[[Any], Any]] = [lambda t: mgr.push_cache(CacheKeyByIdAndIndex(2, 0, 0), cache, src_batch_index=0, size=-1,
                                       **ranges, tensor_num_per_layer=t),
              lambda t: mgr.push_blocks(BlocksCacheKey(2, 0), blocks, [0], [0], **ranges, tensor_num_per_layer=t)]
    for push in pushes:
        with pytest.raises(ValueError):
            push(-1)
        for bad_type in (2.0, "x"):
            with pytest.raises(TypeError):
                push(bad_type)
        with pytest.raises(LLMException) as exc:
            push(0)
        assert code(exc) == PI
        for t in (2, 3):  # the engine's link check comes before its tensor-count rule for pushes
            with pytest.raises(LLMException) as exc:
                push(t)
            assert code(exc) == LLMStatusCode.LLM_NOT_YET_LINK


def test_push_needs_remote_accessible_mode(dd: LLMDataDist, memory: list[np.ndarray]) -> None:
    cache, blocks = _ten_tensor_caches(dd, memory)
    with pytest.raises(LLMException) as exc:
        dd.cache_manager.push_cache(CacheKeyByIdAndIndex(2, 1, 0), cache, tensor_num_per_layer=-1)
    assert code(exc) == PI  # the mode check is first, before the argument checks
    with pytest.raises(LLMException) as exc:
        dd.cache_manager.push_blocks(BlocksCacheKey(2, 0), blocks, [0], [0])
    assert code(exc) == PI


def test_transfer_cache_async_argument_types(dd: LLMDataDist, memory: list[np.ndarray]) -> None:
    from kvdd.llm_datadist import TransferConfig

    cache, _ = _ten_tensor_caches(dd, memory)
    configs = [TransferConfig(1, [10000000 * i for i in range(1, 7)], range(0, 3)),
               TransferConfig(2, [10000000 * i for i in range(1, 5)], range(2, 4))]
    for src, sync in ((None, None), ("cache", None), (cache, None)):
        with pytest.raises(TypeError):
            dd.cache_manager.transfer_cache_async(src, sync, configs)  # type: ignore[arg-type]


def test_swap_blocks_between_device_and_host_views(dd: LLMDataDist) -> None:
    # the pull_blocks sample's swap: a registered blocks cache and a host view of other memory
    mgr = dd.cache_manager
    device = np.arange(2 * 16, dtype=np.float32).reshape(2, 16)
    host = np.full((2, 16), -1.0, dtype=np.float32)
    cache = mgr.register_blocks_cache(CacheDesc(1, [2, 16], DataType.DT_FLOAT, Placement.DEVICE), [addr(device)])
    cpu = Cache.create_cpu_cache(CacheDesc(1, [2, 16], DataType.DT_FLOAT, Placement.HOST), [addr(host)])
    mgr.swap_blocks(cache, cpu, {1: 0})
    assert host[0].tolist() == device[1].tolist() and host[1].tolist() == [-1.0] * 16
    device[:] = 0
    mgr.swap_blocks(cpu, cache, {0: 0, 1: 1})
    assert device[0].tolist() == list(range(16, 32)) and device[1].tolist() == [-1.0] * 16
    with pytest.raises(LLMException) as exc:  # both on one side
        mgr.swap_blocks(cache, cache, {0: 1})
    assert code(exc) == PI


def test_copy_blocks_and_copy_cache_on_registered_memory(dd: LLMDataDist) -> None:
    # upstream's copy cases allocate from a pool; the copies themselves need none (§4.11)
    mgr = dd.cache_manager
    blk = np.arange(8, dtype=np.int8)  # 2 blocks of 4 bytes
    blocks = mgr.register_blocks_cache(CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE), [addr(blk)])
    mgr.copy_blocks(blocks, {0: [1]})
    assert blk.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(LLMException) as exc:
        mgr.copy_blocks(blocks, {0: [2]})  # one past the last block
    assert code(exc) == PI
    assert blk.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]

    src = np.arange(8, dtype=np.int8)
    dst = np.full(8, -1, dtype=np.int8)
    desc = CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE)
    src_cache = mgr.register_cache(desc, [addr(src)])
    dst_cache = mgr.register_cache(desc, [addr(dst)])
    mgr.copy_cache(dst_cache, src_cache, dst_batch_index=1, src_batch_index=0)
    assert dst.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    mgr.copy_cache(dst_cache, src_cache)
    assert dst.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_local_comm_res_engine_links_to_its_own_listener() -> None:
    _finalize_leftover()
    port = free_port()
    cfg = LlmConfig()
    cfg.device_id = 0
    cfg.rdma_service_level = 100
    cfg.rdma_traffic_class = 100
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.local_comm_res = ('{"server_count": "1", "server_list": [{"device": [{"device_id": "0", '
                          '"device_ip": "1.1.1.1"}], "server_id": "127.0.0.1"}], "status": "completed", '
                          '"version": "1.0"}')
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(cfg.generate_options())
    try:
        cluster = _cluster(port)
        ok = LLMStatusCode.LLM_SUCCESS
        assert dd.unlink_clusters([cluster], 5000) == (ok, [ok])  # never linked: success
        assert dd.link_clusters([cluster], 5000) == (ok, [ok])
        # linked now, so the (documented as reserved) remap has a link to act on
        dd.cache_manager.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, 1))
        dd.cache_manager.remap_registered_memory([MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, 1)])
        assert dd.unlink_clusters([cluster], 5000) == (ok, [ok])
        mem = np.zeros(8, dtype=np.int8)
        cache = dd.cache_manager.register_cache(CacheDesc(1, [2, 4], DataType.DT_INT8, Placement.DEVICE),
                                                [addr(mem)])
        assert cache.cache_id == 1
        dd.cache_manager.unregister_cache(1)
        dd.switch_role(LLMRole.DECODER)
        dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{port}"})
        dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"127.0.0.1:{free_port()}"})
    finally:
        dd.finalize()
    with pytest.raises(RuntimeError):
        LLMDataDist(LLMRole.PROMPT, 2).link_clusters([_cluster(port)], 5000)
