"""Initialize: SEMANTICS.md §3.2, §6 scenarios 1-14, §7.13-15, §7.21, §10.6 (real listening), §10.14."""

from __future__ import annotations

import socket

import pytest

import kvdd
from kvdd import (
    OPTION_BUF_POOL_CFG,
    OPTION_DEVICE_ID,
    OPTION_ENABLE_SET_ROLE,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LISTEN_IP_INFO,
    OPTION_LOCAL_COMM_RES,
    OPTION_SYNC_CACHE_WAIT_TIME,
    OPTION_TRANSFER_BACKEND,
    LlmRole,
    Status,
)

from .harness import (
    FAILED,
    LOCALHOST,
    NOT_YET_LINK,
    PARAM_INVALID,
    World,
    cluster,
    free_port,
    link,
    raises,
)
from .init_helpers import (
    DEV,
    LISTEN0,
    HIXL,
    listen_any,
    is_listening,
    assert_uninitialized,
    assert_initialized,
    free_port_v6,
    ipv6_loopback,
)


# -- Initialize (§3.2) --------------------------------------------------------------------------


def test_s01_device_id_and_unvalidated_local_comm_res(world: World) -> None:
    d = world.dut()
    d.initialize_raw({OPTION_DEVICE_ID: "1", OPTION_LOCAL_COMM_RES: "mock"})
    assert d.register().cache_id == 1


def test_s02_missing_device_id_then_retry(world: World) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({})
    assert_uninitialized(d)  # §3.2 step 10: stays uninitialized, may be retried
    d.initialize_raw(DEV)
    assert d.register().cache_id == 1


@pytest.mark.parametrize("value", ["", "-1", "abc", "0;", ";0", "0;;1", "0 ", "1x", "0.5",
                                   "2147483648", " "])
def test_s03_bad_device_id(world: World, value: str) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({OPTION_DEVICE_ID: value})
    assert_uninitialized(d)


@pytest.mark.parametrize("value", ["+0", " 0", "\t3", "00"])
def test_device_id_stream_parse_tolerates_leading_space_and_plus(world: World, value: str) -> None:
    d = world.dut()
    d.initialize_raw({OPTION_DEVICE_ID: value})
    assert_initialized(d)


def test_s04_multi_device_rejected(world: World) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({OPTION_DEVICE_ID: "0;1"})


def test_user_ge_exec_device_id_is_overwritten(world: World) -> None:
    d = world.dut()
    d.initialize_raw({OPTION_DEVICE_ID: "0", "ge.exec.deviceId": "not a number"})
    assert_initialized(d)


def test_s05_second_initialize_ignores_options(world: World) -> None:
    d = world.dut()
    d.initialize_raw(DEV)
    assert d.register().cache_id == 1
    d.initialize_raw({OPTION_DEVICE_ID: "abc", OPTION_TRANSFER_BACKEND: "foo"})
    d.initialize_raw({})
    assert d.register().cache_id == 2  # state kept, nothing re-initialized
    assert d.listen_port is None  # the options were ignored


@pytest.mark.parametrize("role", [0, 4, -1, 2**31 - 1])
def test_s06_constructor_role_checked_at_initialize(world: World, role: int) -> None:
    d = world.dut(role=role)  # the constructor validates nothing (§3.1)
    with raises(PARAM_INVALID):
        d.initialize_raw(DEV)


@pytest.mark.parametrize("role", list(LlmRole))
def test_valid_roles(world: World, role: LlmRole) -> None:
    d = world.dut(role=role)
    d.initialize_raw(DEV)
    assert_initialized(d)


@pytest.mark.parametrize("value", [
    "127.0.0.1", "localhost:0", "::1:0", "1.1.1.1:-1", "127.0.0.1:", ":0", "127.0.0.1:0:0",
    "127.0.0.1:abc", "127.0.0.1:0x10", "127.0.0.1:1 ", "256.0.0.1:0", "[::1]", "[::1]0",
    "127.0.0.1:4294967296", "", "[localhost]:0",
])
def test_s07_bad_listen_ip_info(world: World, value: str) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: value})
    assert d.listen_port is None
    assert_uninitialized(d)


def test_s07_bracketed_ipv6_listen_accepted(world: World) -> None:
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    d = world.dut()
    asked = 0 if world.backend == "sim" else free_port_v6()
    d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"[::1]:{asked}"})
    port = d.listen_port
    assert port is not None and port > 0 and (asked == 0 or port == asked)
    assert is_listening(port, "::1")


def test_s07_port_above_65535_truncated_to_16_bits(world: World) -> None:
    # §3.2 step 4 and §7.15: accepted up to 4294967295; 65536 keeps its low 16 bits = 0 -> free
    # port (sim); on native 65536 + p keeps p (a pre-chosen port: the bound one is not reported).
    d = world.dut()
    low = 0 if world.backend == "sim" else free_port()
    d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{65536 + low}"})
    port = d.listen_port
    assert port is not None and 0 < port <= 65535 and (low == 0 or port == low)
    assert is_listening(port)


@pytest.mark.parametrize("value", ["foo", "", "HIXL", "hixl ", "comm"])
def test_s08_bad_transfer_backend(world: World, value: str) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, **LISTEN0, OPTION_TRANSFER_BACKEND: value})
    assert d.listen_port is None


def test_s09_hixl_requires_listen_ip(world: World) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, **HIXL})
    assert_uninitialized(d)


def test_s10_hixl_global_resource_config_invalid_json(world: World) -> None:
    d = world.dut()
    with pytest.raises(kvdd.LLMError) as info:
        d.initialize_raw({**DEV, **LISTEN0, **HIXL, OPTION_GLOBAL_RESOURCE_CONFIG: "not_json"})
    assert info.value.status != Status.LLM_SUCCESS
    if world.backend == "sim":
        # kvdd rule 14 (§10.14): a malformed option value is LLM_PARAM_INVALID.
        assert type(info.value) is kvdd.LLMParamInvalidError
    assert_uninitialized(d)


def test_s10_hixl_global_resource_config_valid_json(world: World) -> None:
    d = world.dut()
    d.initialize_raw({**DEV, **LISTEN0, **HIXL, OPTION_GLOBAL_RESOURCE_CONFIG: "{}"})
    assert_initialized(d)


@pytest.mark.parametrize("value", ["abc", "-5", "", "+5", " 5", "5 ", "1.5"])
def test_s11_bad_sync_wait_time(world: World, value: str) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, OPTION_SYNC_CACHE_WAIT_TIME: value})
    assert_uninitialized(d)


@pytest.mark.parametrize("value", ["0", "1", "1000", "007"])
def test_s11_sync_wait_time_accepted(world: World, value: str) -> None:
    d = world.dut()
    d.initialize_raw({**DEV, OPTION_SYNC_CACHE_WAIT_TIME: value})
    assert_initialized(d)


@pytest.mark.parametrize("key,value", [
    ("llm.LinkRetryCount", "0"), ("llm.LinkRetryCount", "101"), ("llm.LinkRetryCount", "x"),
    ("llm.LinkTotalTime", "x"), ("llm.RdmaTrafficClass", "abc"), ("llm.RdmaServiceLevel", "abc"),
])
def test_s12_bad_comm_link_options(world: World, key: str, value: str) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, key: value})
    assert_uninitialized(d)


@pytest.mark.parametrize("value", ["1", "100"])
def test_s12_link_retry_count_bounds_accepted(world: World, value: str) -> None:
    d = world.dut()
    d.initialize_raw({**DEV, "llm.LinkRetryCount": value})
    assert_initialized(d)


def test_s14_auto_local_comm_res_unknown_device(world: World) -> None:
    d = world.dut()
    d.initialize_raw({OPTION_DEVICE_ID: "9", **listen_any(world)})
    assert d.listen_port
    assert_initialized(d)


@pytest.mark.parametrize("key", ["llm.MemPoolConfig", "llm.HostMemPoolConfig"])
@pytest.mark.parametrize("value", [
    "not json", "{}", '{"memory_size": -1}',
    '{"memory_size": 1048576, "page_shift": 9}', '{"memory_size": 1048576, "page_shift": 31}',
    '{"memory_size": 4398046511104, "page_shift": 10}',  # (size >> 10) = 2**32 >= UINT32_MAX
])
def test_bad_mem_pool_config(world: World, key: str, value: str) -> None:
    # §3.2 step 9: parsed if present; malformed -> PARAM_INVALID.
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, key: value})
    assert_uninitialized(d)


@pytest.mark.parametrize("value", ['{"memory_size": 1048576}',
                                   '{"memory_size": 1048576, "page_shift": 10}',
                                   '{"memory_size": 1048576, "page_shift": 30}'])
def test_mem_pool_config_accepted(world: World, value: str) -> None:
    d = world.dut()
    d.initialize_raw({**DEV, "llm.MemPoolConfig": value})
    assert_initialized(d)


def test_backend_name(world: World) -> None:
    d = world.dut()
    assert d.backend_name == world.backend


def test_ignored_options_on_comm(world: World) -> None:
    # §3.2: EnableSwitchRole and BufPoolCfg ignored; GlobalResourceConfig ignored on comm.
    d = world.dut()
    d.initialize_raw({**DEV, OPTION_ENABLE_SET_ROLE: "garbage", OPTION_BUF_POOL_CFG: "garbage",
                      OPTION_GLOBAL_RESOURCE_CONFIG: "not_json"})
    assert_initialized(d)


@pytest.mark.parametrize("local_comm_res", ["not json{", '{"version": "1.9"}', '{"version": "1.3"}'])
def test_s13_local_comm_res_checked_only_at_link(world: World, local_comm_res: str) -> None:
    # §3.2 step 8 (not validated at Initialize), §3.5 e (PARAM_INVALID at link), §7.27 (1.3 on comm).
    p = world.peer()
    p.initialize(listen=True)
    h = p.register()
    d = world.dut()
    d.initialize_raw({**DEV, OPTION_LOCAL_COMM_RES: local_comm_res})
    port = p.listen_port
    assert port is not None
    with raises(PARAM_INVALID, rets=[Status.LLM_PARAM_INVALID]):
        d.link_clusters([cluster(port, 1)])
    dh = d.register()
    with raises(NOT_YET_LINK):  # nothing was linked
        d.pull_kv_cache(h.index(), dh.cache())


def test_initialize_bind_failure_is_llm_failed_then_retry(world: World) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((LOCALHOST, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        d = world.dut()
        with raises(FAILED):  # §3.2 step 8: bind failure -> FAILED (TransRetToLlmCodes)
            d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}"})
        assert d.listen_port is None
        assert_uninitialized(d)
    d.initialize_raw({**DEV, **listen_any(world)})
    assert d.listen_port


def test_initialize_order_bind_failure_before_sync_wait_time(world: World) -> None:
    # §3.2: step 8 (listen daemon, FAILED) precedes step 9 (SyncKvCacheWaitTime, PARAM_INVALID).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((LOCALHOST, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        d = world.dut()
        with raises(FAILED):
            d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}",
                              OPTION_SYNC_CACHE_WAIT_TIME: "abc"})


def test_initialize_order_link_options_before_bind(world: World) -> None:
    # §3.2 step 8: link options are parsed before the listen daemon starts.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((LOCALHOST, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        d = world.dut()
        with raises(PARAM_INVALID):
            d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}",
                              "llm.LinkRetryCount": "0"})


def test_initialize_order_role_before_listen(world: World) -> None:
    # §3.2: step 2 (role) precedes step 4/8 (listen): nothing gets bound when the role is invalid.
    d = world.dut(role=0)
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, **LISTEN0})
    assert d.listen_port is None


# -- listening (§10.6) ----------------------------------------------------------------------------


def test_listen_port_is_real(world: World, transfer: str) -> None:
    d = world.dut()
    assert d.listen_port is None
    d.initialize(listen=True, transfer=transfer)
    port = d.listen_port
    assert port is not None and port > 0
    assert is_listening(port)
    d.finalize()
    assert d.listen_port is None
    assert not is_listening(port)


def test_no_listen_port_without_listen_ip(world: World) -> None:
    d = world.dut()
    d.initialize()
    assert d.listen_port is None
