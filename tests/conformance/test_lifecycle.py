"""Initialize / Finalize / SetRole: SEMANTICS.md §3.2-§3.4, §6 scenarios 1-16 and 39-42, §7.12-15,
§7.21, §10.6 (real listening), §10.14."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

import kvdd
import kvdd.testing as kt
from kvdd import (
    OPTION_BUF_POOL_CFG,
    OPTION_DEVICE_ID,
    OPTION_ENABLE_SET_ROLE,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LISTEN_IP_INFO,
    OPTION_LOCAL_COMM_RES,
    OPTION_SYNC_CACHE_WAIT_TIME,
    OPTION_TRANSFER_BACKEND,
    CacheIndex,
    LlmRole,
    Status,
)

from .harness import (
    EXIST_LINK,
    FAILED,
    FEATURE_NOT_ENABLED,
    KV_CACHE_NOT_EXIST,
    LINK_FAILED,
    LOCALHOST,
    NOT_YET_LINK,
    PARAM_INVALID,
    Node,
    World,
    cluster,
    free_port,
    link,
    listen_address,
    pair,
    pull_cache_checked,
    raises,
)

DEV = {OPTION_DEVICE_ID: str(kt.device_ids()[0])}
LISTEN0 = {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0"}
HIXL = {OPTION_TRANSFER_BACKEND: "hixl"}
#: For tests that check the port bound for port 0, which the real library cannot report.
NEEDS_PORT0 = pytest.mark.needs_bound_port


def _listen(world: World) -> dict[str, str]:
    """``llm.ListenIpInfo`` on some free port: port 0 on sim, a pre-chosen one on native."""
    return {OPTION_LISTEN_IP_INFO: listen_address(world.backend)}


def _free_port_v6() -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        port: int = s.getsockname()[1]
    return port


def _is_listening(port: int, host: str = LOCALHOST) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def _assert_initialized(d: Node) -> None:
    # An initialized instance registers (id 1 on a fresh one); an uninitialized one returns FAILED.
    assert d.register().cache_id >= 1


def _assert_uninitialized(d: Node) -> None:
    with raises(FAILED):
        d.register()


# -- Initialize (§3.2) --------------------------------------------------------------------------


def test_s01_device_id_and_unvalidated_local_comm_res(world: World) -> None:
    d = world.dut()
    d.initialize_raw({OPTION_DEVICE_ID: "1", OPTION_LOCAL_COMM_RES: "mock"})
    assert d.register().cache_id == 1


def test_s02_missing_device_id_then_retry(world: World) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({})
    _assert_uninitialized(d)  # §3.2 step 10: stays uninitialized, may be retried
    d.initialize_raw(DEV)
    assert d.register().cache_id == 1


@pytest.mark.parametrize("value", ["", "-1", "abc", "0;", ";0", "0;;1", "0 ", "1x", "0.5",
                                   "2147483648", " "])
def test_s03_bad_device_id(world: World, value: str) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({OPTION_DEVICE_ID: value})
    _assert_uninitialized(d)


@pytest.mark.parametrize("value", ["+0", " 0", "\t3", "00"])
def test_device_id_stream_parse_tolerates_leading_space_and_plus(world: World, value: str) -> None:
    d = world.dut()
    d.initialize_raw({OPTION_DEVICE_ID: value})
    _assert_initialized(d)


def test_s04_multi_device_rejected(world: World) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({OPTION_DEVICE_ID: "0;1"})


def test_user_ge_exec_device_id_is_overwritten(world: World) -> None:
    d = world.dut()
    d.initialize_raw({OPTION_DEVICE_ID: "0", "ge.exec.deviceId": "not a number"})
    _assert_initialized(d)


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
    _assert_initialized(d)


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
    _assert_uninitialized(d)


def test_s07_bracketed_ipv6_listen_accepted(world: World) -> None:
    if not _ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    d = world.dut()
    asked = 0 if world.backend == "sim" else _free_port_v6()
    d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"[::1]:{asked}"})
    port = d.listen_port
    assert port is not None and port > 0 and (asked == 0 or port == asked)
    assert _is_listening(port, "::1")


def test_s07_port_above_65535_truncated_to_16_bits(world: World) -> None:
    # §3.2 step 4 and §7.15: accepted up to 4294967295; 65536 keeps its low 16 bits = 0 -> free
    # port (sim); on native 65536 + p keeps p (a pre-chosen port: the bound one is not reported).
    d = world.dut()
    low = 0 if world.backend == "sim" else free_port()
    d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{65536 + low}"})
    port = d.listen_port
    assert port is not None and 0 < port <= 65535 and (low == 0 or port == low)
    assert _is_listening(port)


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
    _assert_uninitialized(d)


def test_s10_hixl_global_resource_config_invalid_json(world: World) -> None:
    d = world.dut()
    with pytest.raises(kvdd.LLMError) as info:
        d.initialize_raw({**DEV, **LISTEN0, **HIXL, OPTION_GLOBAL_RESOURCE_CONFIG: "not_json"})
    assert info.value.status != Status.LLM_SUCCESS
    if world.backend == "sim":
        # kvdd rule 14 (§10.14): a malformed option value is LLM_PARAM_INVALID.
        assert type(info.value) is kvdd.LLMParamInvalidError
    _assert_uninitialized(d)


def test_s10_hixl_global_resource_config_valid_json(world: World) -> None:
    d = world.dut()
    d.initialize_raw({**DEV, **LISTEN0, **HIXL, OPTION_GLOBAL_RESOURCE_CONFIG: "{}"})
    _assert_initialized(d)


@pytest.mark.parametrize("value", ["abc", "-5", "", "+5", " 5", "5 ", "1.5"])
def test_s11_bad_sync_wait_time(world: World, value: str) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, OPTION_SYNC_CACHE_WAIT_TIME: value})
    _assert_uninitialized(d)


@pytest.mark.parametrize("value", ["0", "1", "1000", "007"])
def test_s11_sync_wait_time_accepted(world: World, value: str) -> None:
    d = world.dut()
    d.initialize_raw({**DEV, OPTION_SYNC_CACHE_WAIT_TIME: value})
    _assert_initialized(d)


@pytest.mark.parametrize("key,value", [
    ("llm.LinkRetryCount", "0"), ("llm.LinkRetryCount", "101"), ("llm.LinkRetryCount", "x"),
    ("llm.LinkTotalTime", "x"), ("llm.RdmaTrafficClass", "abc"), ("llm.RdmaServiceLevel", "abc"),
])
def test_s12_bad_comm_link_options(world: World, key: str, value: str) -> None:
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, key: value})
    _assert_uninitialized(d)


@pytest.mark.parametrize("value", ["1", "100"])
def test_s12_link_retry_count_bounds_accepted(world: World, value: str) -> None:
    d = world.dut()
    d.initialize_raw({**DEV, "llm.LinkRetryCount": value})
    _assert_initialized(d)


def test_s14_auto_local_comm_res_unknown_device(world: World) -> None:
    d = world.dut()
    d.initialize_raw({OPTION_DEVICE_ID: "9", **_listen(world)})
    assert d.listen_port
    _assert_initialized(d)


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
    _assert_uninitialized(d)


@pytest.mark.parametrize("value", ['{"memory_size": 1048576}',
                                   '{"memory_size": 1048576, "page_shift": 10}',
                                   '{"memory_size": 1048576, "page_shift": 30}'])
def test_mem_pool_config_accepted(world: World, value: str) -> None:
    d = world.dut()
    d.initialize_raw({**DEV, "llm.MemPoolConfig": value})
    _assert_initialized(d)


def test_backend_name(world: World) -> None:
    d = world.dut()
    assert d.backend_name == world.backend


def test_ignored_options_on_comm(world: World) -> None:
    # §3.2: EnableSwitchRole and BufPoolCfg ignored; GlobalResourceConfig ignored on comm.
    d = world.dut()
    d.initialize_raw({**DEV, OPTION_ENABLE_SET_ROLE: "garbage", OPTION_BUF_POOL_CFG: "garbage",
                      OPTION_GLOBAL_RESOURCE_CONFIG: "not_json"})
    _assert_initialized(d)


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
        _assert_uninitialized(d)
    d.initialize_raw({**DEV, **_listen(world)})
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
    assert _is_listening(port)
    d.finalize()
    assert d.listen_port is None
    assert not _is_listening(port)


def test_no_listen_port_without_listen_ip(world: World) -> None:
    d = world.dut()
    d.initialize()
    assert d.listen_port is None


# -- uninitialized / finalized (§3.3, scenarios 15-16, §7.12) -------------------------------------

# Each call gets the node and the address of 256 bytes of its memory (allocated beforehand).
UninitCall = Callable[[Node, int], object]
_DESC = kvdd.CacheDesc(1, kvdd.DataType.DT_INT32, (4, 16))

_UNINIT_CALLS: dict[str, UninitCall] = {
    "register": lambda d, a: d.register_addrs(_DESC, [a]),
    "register_bad_addrs": lambda d, a: d.register_addrs(_DESC, []),
    "unregister": lambda d, a: d.unregister(1),  # unknown ids succeed only when initialized
    "unregister_unknown": lambda d, a: d.unregister(-5),
    "link": lambda d, a: d.link(free_port(), 1),
    "unlink": lambda d, a: d.unlink(free_port(), 1),
    "unlink_force": lambda d, a: d.unlink_clusters([cluster(free_port(), 1)], force=True),
    "set_role": lambda d, a: d.set_role(LlmRole.PROMPT),
    "set_role_bad_role": lambda d, a: d.set_role(9),
    "link_bad_timeout": lambda d, a: d.link_clusters([], timeout_ms=0),
    "pull_kv_cache": lambda d, a: d.pull_kv_cache(CacheIndex(1, 1), kvdd.Cache(cache_id=1)),
    "pull_kv_cache_bad_size": lambda d, a: d.pull_kv_cache(CacheIndex(1, 1), kvdd.Cache(1), size=0),
    "pull_kv_blocks": lambda d, a: d.pull_kv_blocks(CacheIndex(1, 1), kvdd.Cache(1), [0], [0]),
    "push_kv_cache": lambda d, a: d.push_kv_cache(kvdd.Cache(1), CacheIndex(1, 1)),
    "push_kv_blocks": lambda d, a: d.push_kv_blocks(kvdd.Cache(1), CacheIndex(1, 1), [0], [0]),
    "push_kv_blocks_empty": lambda d, a: d.push_kv_blocks(kvdd.Cache(1), CacheIndex(1, 1), [], []),
}


@pytest.mark.parametrize("call", sorted(_UNINIT_CALLS))
def test_s15_calls_before_initialize_fail(world: World, call: str) -> None:
    d = world.dut()
    addr = d.alloc(256, 1)[1][0]
    with world.rejects(FAILED):
        _UNINIT_CALLS[call](d, addr)


@pytest.mark.parametrize("call", sorted(_UNINIT_CALLS))
def test_s16_calls_after_finalize_fail(world: World, call: str) -> None:
    d, p = pair(world)
    p.register()
    d.register()
    link(d, p)
    d.finalize()
    addr = d.alloc(256, 1)[1][0]
    with world.rejects(FAILED):
        _UNINIT_CALLS[call](d, addr)


def test_s16_finalize_twice_and_before_initialize(world: World) -> None:
    d = world.dut()
    d.finalize()  # not initialized: no-op
    d.initialize()
    d.finalize()
    d.finalize()
    _assert_uninitialized(d)


def test_s16_reinitialize_starts_fresh(world: World, transfer: str) -> None:
    d, p = pair(world, transfer)
    ph = p.register()
    assert d.register().cache_id == 1
    assert d.register().cache_id == 2
    link(d, p)
    d.finalize()
    d.initialize(transfer=transfer)
    dh = d.register()
    assert dh.cache_id == 1  # ids restart at 1 (§2.2)
    with world.rejects(NOT_YET_LINK):  # no links survive
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):  # no caches survive (id 2 is gone)
        d.pull_kv_cache(ph.index(), kvdd.Cache(cache_id=2))
    # relinking works although P may still hold a stale entity for D (§3.3, §3.5 d/e)
    assert link(d, p) == [Status.LLM_SUCCESS]
    pull_cache_checked(world, d, ph, dh)


def test_finalize_leaves_stale_entity_on_peer(world: World) -> None:
    # §3.3: the peer is not notified and keeps its entity -> its SetRole still sees a link (§3.4).
    d, p = pair(world, "comm")
    p.register()
    link(d, p)
    d.finalize()
    with raises(EXIST_LINK):
        p.set_role(LlmRole.PROMPT)


def test_finalized_owner_cache_not_found(world: World) -> None:
    # kvdd rule 2 (§10.2): P pulls over its (stale, bidirectional) entity from D, which finalized.
    d, p = pair(world, "comm")
    dh = d.register()
    ph = p.register()
    link(d, p)
    d.finalize()
    with world.rejects(KV_CACHE_NOT_EXIST):
        p.pull_kv_cache(dh.index(), ph.cache())


# -- SetRole (§3.4, scenarios 39-42, §7.21) -------------------------------------------------------


def test_s39_set_role_sequence_without_links(world: World) -> None:
    p = world.peer(1)
    p.initialize()
    d = world.dut()
    d.initialize()
    listen = _listen(world)
    assert d.listen_port is None
    d.set_role(LlmRole.DECODER, {})
    assert d.listen_port is None
    d.set_role(LlmRole.PROMPT, listen)
    port1 = d.listen_port
    assert port1 and _is_listening(port1)
    d.set_role(LlmRole.DECODER, listen)  # same port string: no-op
    assert d.listen_port == port1
    d.set_role(LlmRole.MIX, {})  # stops listening
    assert d.listen_port is None
    assert not _is_listening(port1)
    d.set_role(LlmRole.PROMPT, listen)
    port2 = d.listen_port
    assert port2 and _is_listening(port2)
    d.set_role(LlmRole.PROMPT, {})
    assert d.listen_port is None
    d.set_role(LlmRole.DECODER, listen)
    port3 = d.listen_port
    assert port3 and _is_listening(port3)
    # it really accepts links now (peer = caller), and a peer linking in makes SetRole fail
    assert p.link(port3, 2) == [Status.LLM_SUCCESS]
    with raises(EXIST_LINK):
        d.set_role(LlmRole.DECODER, {})
    assert p.unlink(port3, 2) == [Status.LLM_SUCCESS]
    d.set_role(LlmRole.DECODER, {})
    assert d.listen_port is None
    with raises(LINK_FAILED, rets=[Status.LLM_LINK_FAILED]):
        p.link(port3, 2)


def test_set_role_same_port_string_is_noop_even_if_ip_changes(world: World) -> None:
    # §3.4 step 4 and §7.21: only the port string is compared.
    d = world.dut()
    asked = listen_address(world.backend)
    d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: asked})
    port = d.listen_port
    d.set_role(LlmRole.MIX, {OPTION_LISTEN_IP_INFO: "127.0.0.2:" + asked.rsplit(":", 1)[1]})
    assert d.listen_port == port
    assert port and _is_listening(port)


def test_set_role_moves_listener_to_new_port(world: World) -> None:
    d = world.dut()
    d.initialize(listen=True)
    old = d.listen_port
    new = free_port()
    d.set_role(LlmRole.MIX, {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{new}"})
    assert d.listen_port == new
    assert _is_listening(new)
    assert old and not _is_listening(old)


def test_set_role_bind_failure(world: World) -> None:
    d = world.dut()
    d.initialize()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((LOCALHOST, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with raises(FAILED):  # §3.4 step 4: bind failure -> FAILED
            d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}"})


@pytest.mark.parametrize("as_acceptor", [False, True])
def test_s40_set_role_with_link_comm(world: World, as_acceptor: bool) -> None:
    d, p = pair(world, "comm", d_listen=True)
    if as_acceptor:
        port = d.listen_port
        assert port
        p.link(port, 2)
    else:
        link(d, p)
    with raises(EXIST_LINK):
        d.set_role(LlmRole.DECODER)  # checked even with empty options
    with raises(EXIST_LINK):
        d.set_role(LlmRole.DECODER, LISTEN0)
    with raises(EXIST_LINK):
        p.set_role(LlmRole.PROMPT)


@pytest.mark.parametrize("role", [0, 4, -1])
def test_s41_set_role_invalid_role(world: World, role: int, transfer: str) -> None:
    d = world.dut()
    d.initialize(transfer=transfer)
    with raises(PARAM_INVALID):
        d.set_role(role)


@pytest.mark.parametrize("value", ["127.0.0.1", "localhost:0", "::1:0", "1.1.1.1:-1", ""])
def test_s41_set_role_malformed_listen(world: World, value: str, transfer: str) -> None:
    d = world.dut()
    d.initialize(transfer=transfer)
    with raises(PARAM_INVALID):
        d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: value})


def test_set_role_order_role_and_listen_before_link_check(world: World) -> None:
    # §3.4: steps 2 (role) and 3 (listen parse) precede step 4 (LLM_EXIST_LINK).
    d, p = pair(world, "comm")
    link(d, p)
    with raises(PARAM_INVALID):
        d.set_role(7)
    with raises(PARAM_INVALID):
        d.set_role(LlmRole.DECODER, {OPTION_LISTEN_IP_INFO: "nonsense"})
    with raises(EXIST_LINK):
        d.set_role(LlmRole.DECODER)


@NEEDS_PORT0
def test_s42_hixl_set_role_listen_change_not_enabled(world: World) -> None:
    d, p = pair(world, "hixl")
    port = d.listen_port
    assert port
    # §3.4 step 5: compared as the parsed ip:port of Initialize ("127.0.0.1:0"), so even the real
    # port spelled out is a change.
    with raises(FEATURE_NOT_ENABLED):
        d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}"})
    with raises(FEATURE_NOT_ENABLED):
        d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{free_port()}"})
    d.set_role(LlmRole.PROMPT, LISTEN0)
    assert d.listen_port == port
    d.set_role(LlmRole.MIX, {})  # never stops listening on hixl
    assert d.listen_port == port and _is_listening(port)


def test_hixl_set_role_ignores_links(world: World) -> None:
    # §3.4 step 5 and §7.21: no LLM_EXIST_LINK on hixl.
    d, p = pair(world, "hixl")
    p.register()
    link(d, p)
    d.set_role(LlmRole.MIX)
    assert d.listen_ip_info is not None
    d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: d.listen_ip_info})  # unchanged: no-op
