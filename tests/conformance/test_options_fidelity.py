"""Option parsing as upstream's parse functions define it: SEMANTICS.md §3.2 steps 8-9 (ToNumber
full parse, the hixl engine factory's checks, environment fallbacks, memory-pool JSON), §3.4 steps
4-5 and 7 (SetRole compares, the internal keys ``llm.ListenIp``/``llm.ListenPort``) and §3.5 e
(the comm resource at link time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdd import (
    OPTION_DEVICE_ID,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LISTEN_IP_INFO,
    OPTION_LOCAL_COMM_RES,
    OPTION_TRANSFER_BACKEND,
    LlmRole,
    Status,
)

from .harness import (
    FAILED,
    FEATURE_NOT_ENABLED,
    LOCALHOST,
    PARAM_INVALID,
    Err,
    Node,
    World,
    pair,
    raises,
)

DEV = {OPTION_DEVICE_ID: "0"}
LISTEN0 = {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0"}
HIXL = {OPTION_TRANSFER_BACKEND: "hixl"}
IP, PORT = "llm.ListenIp", "llm.ListenPort"
S = Status.LLM_SUCCESS


def _init_ok(d: Node, options: dict[str, str]) -> None:
    d.initialize_raw(options)
    assert d.register().cache_id >= 1  # initialized


def _init_fails(d: Node, options: dict[str, str], err: Err = PARAM_INVALID) -> None:
    with raises(err):
        d.initialize_raw(options)
    with raises(FAILED):  # stays uninitialized (§3.2 step 10)
        d.register()


# -- §3.2 step 8, comm: LLMUtils::ToNumber (full parse) ------------------------------------------

COMM_NUMBERS = ["llm.RdmaTrafficClass", "llm.RdmaServiceLevel", "llm.LinkTotalTime",
                "llm.LinkRetryCount"]


@pytest.mark.parametrize("key", COMM_NUMBERS)
@pytest.mark.parametrize("value", ["5 ", "5\n", "5x", "0x5", "", " ", "+", "5.0"])
def test_comm_numbers_reject_trailing_characters(world: World, key: str, value: str) -> None:
    _init_fails(world.dut(), {**DEV, key: value})


@pytest.mark.parametrize("key", COMM_NUMBERS)
@pytest.mark.parametrize("value", [" 5", "+5", "\t05"])
def test_comm_numbers_tolerate_leading_space_and_plus(world: World, key: str, value: str) -> None:
    _init_ok(world.dut(), {**DEV, key: value})


@pytest.mark.parametrize("key,value,ok", [
    ("llm.RdmaTrafficClass", "4294967295", True), ("llm.RdmaTrafficClass", "4294967296", False),
    ("llm.RdmaServiceLevel", "4294967295", True), ("llm.RdmaServiceLevel", "4294967296", False),
    # uint32 through libstdc++'s stream: a '-' sign is accepted and negates modulo 2**32
    ("llm.RdmaTrafficClass", "-1", True), ("llm.RdmaServiceLevel", "-4294967295", True),
    ("llm.RdmaServiceLevel", "-4294967296", False),
    ("llm.LinkTotalTime", "-2147483648", True), ("llm.LinkTotalTime", "2147483648", False),
    ("llm.LinkRetryCount", "+100", True), ("llm.LinkRetryCount", " 0", False),
])
def test_comm_number_types(world: World, key: str, value: str, ok: bool) -> None:
    d = world.dut()
    if ok:
        _init_ok(d, {**DEV, key: value})
    else:
        _init_fails(d, {**DEV, key: value})


# -- §3.2 step 8, hixl: the engine factory validates the forwarded options -----------------------


@pytest.mark.parametrize("key,value,ok", [
    ("llm.RdmaTrafficClass", "0", True), ("llm.RdmaTrafficClass", "252", True),
    ("llm.RdmaTrafficClass", " +4", True), ("llm.RdmaTrafficClass", "2", False),
    ("llm.RdmaTrafficClass", "256", False), ("llm.RdmaTrafficClass", "-4", False),
    ("llm.RdmaTrafficClass", "4 ", False), ("llm.RdmaTrafficClass", "abc", False),
    ("llm.RdmaServiceLevel", "0", True), ("llm.RdmaServiceLevel", "7", True),
    ("llm.RdmaServiceLevel", "8", False), ("llm.RdmaServiceLevel", "-1", False),
    ("llm.RdmaServiceLevel", "7\n", False),
    ("llm.RdmaTrafficClass", "", True), ("llm.RdmaServiceLevel", "", True),  # empty = absent
])
def test_hixl_rdma_options(world: World, monkeypatch: pytest.MonkeyPatch, key: str, value: str,
                           ok: bool) -> None:
    monkeypatch.delenv("HCCL_RDMA_TC", raising=False)
    monkeypatch.delenv("HCCL_RDMA_SL", raising=False)
    d = world.dut()
    if ok:
        _init_ok(d, {**DEV, **LISTEN0, **HIXL, key: value})
    else:
        _init_fails(d, {**DEV, **LISTEN0, **HIXL, key: value})


@pytest.mark.parametrize("env,key", [("HCCL_RDMA_TC", "llm.RdmaTrafficClass"),
                                     ("HCCL_RDMA_SL", "llm.RdmaServiceLevel")])
def test_hixl_rdma_environment_fallback(world: World, monkeypatch: pytest.MonkeyPatch, env: str,
                                        key: str) -> None:
    # §3.2 step 8: an absent or empty option reads the environment variable, with the same checks.
    monkeypatch.setenv(env, "9")  # invalid for both (not a multiple of 4; above 7)
    d = world.dut()
    _init_fails(d, {**DEV, **LISTEN0, **HIXL})
    _init_fails(d, {**DEV, **LISTEN0, **HIXL, key: ""})
    _init_ok(d, {**DEV, **LISTEN0, **HIXL, key: "4"})  # a given value wins: the variable is unread


def test_hixl_rdma_environment_fallback_valid(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HCCL_RDMA_TC", "8")
    monkeypatch.setenv("HCCL_RDMA_SL", "3")
    _init_ok(world.dut(), {**DEV, **LISTEN0, **HIXL})


def test_comm_ignores_the_hixl_environment(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HCCL_RDMA_TC", "9")
    _init_ok(world.dut(), {**DEV})


@pytest.mark.parametrize("grc,ok", [
    ("{}", True), ('{"unknown": [1, {}]}', True),
    ("[]", False), ("1", False), ('"x"', False), ("null", False), ("{", False),
    ('{"connect_pool.thread_num": 64}', True), ('{"connect_pool.thread_num": "8"}', True),
    ('{"connect_pool.thread_num": 0}', False), ('{"connect_pool.thread_num": 65}', False),
    ('{"connect_pool.thread_num": "8 "}', False), ('{"connect_pool.thread_num": 8.0}', False),
    ('{"connect_pool.thread_num": true}', False),
    ('{"connect_pool.task_queue_capacity": 65535}', True),
    ('{"connect_pool.task_queue_capacity": 65536}', False),
    ('{"comm_resource_config.listen_port": 65535}', True),
    ('{"comm_resource_config.listen_port": 0}', False),
    ('{"comm_resource_config.qos": 7}', True), ('{"comm_resource_config.qos": 8}', False),
    ('{"comm_resource_config.max_active_channels": 4294967295}', True),
    ('{"comm_resource_config.max_active_channels": 0}', False),
    ('{"comm_resource_config.max_active_channels": 18446744073709551615}', False),
    ('{"comm_resource_config.protocol_desc": ["a", "b"]}', True),
    ('{"comm_resource_config.protocol_desc": [1]}', False),
    ('{"fabric_memory": {"task_stream_num": 1, "max_capacity": 1024}}', True),
    ('{"fabric_memory": {"task_stream_num": 2}}', False),  # aicpu unfold (default on) needs 1
    ('{"fabric_memory": {"task_stream_num": 2, "enable_aicpu_unfold": false}}', True),
    ('{"fabric_memory.task_stream_num": 9, "fabric_memory.enable_aicpu_unfold": false}', False),
    ('{"fabric_memory": {"enable_aicpu_unfold": "no"}}', False),
    ('{"fabric_memory.start_address": 1025}', False),
    ('{"local_comm_res_path": ""}', False), ('{"local_comm_res_path": 5}', False),
    ('{"local_comm_res_path": "/nonexistent/kvdd/comm_res.json"}', False),
])
def test_hixl_global_resource_config(world: World, grc: str, ok: bool) -> None:
    d = world.dut()
    opts = {**DEV, **LISTEN0, **HIXL, OPTION_GLOBAL_RESOURCE_CONFIG: grc}
    if ok:
        _init_ok(d, opts)
    else:
        _init_fails(d, opts)


V13 = {OPTION_LOCAL_COMM_RES: '{"version": "1.3"}'}  # selects the HixlCS engine (engine_factory.cc)


@pytest.mark.parametrize("grc,engine,ok", [
    # HixlOptions skips an empty value, but the comm (adxl) engine parses it again and fails
    ("", {}, False), ("", V13, True),
    ('{"channel_pool.max_channel": 8, "channel_pool.high_waterline": 0.75, '
     '"channel_pool.low_waterline": 0.25}', {}, True),
    ('{"channel_pool.max_channel": 8}', {}, False),  # only together with both waterlines
    ('{"channel_pool.max_channel": 8}', V13, True),  # the HixlCS engine does not read it
    ('{"channel_pool.max_channel": 513, "channel_pool.high_waterline": 0.9, '
     '"channel_pool.low_waterline": 0.1}', {}, False),
    ('{"channel_pool.high_waterline": 1.0, "channel_pool.low_waterline": 0.1}', {}, False),
    ('{"channel_pool.high_waterline": "0.5 ", "channel_pool.low_waterline": 0.1}', {}, False),
    ('{"channel_pool.high_waterline": 0.5, "channel_pool.low_waterline": 0.5}', {}, False),
    ('{"channel_pool.high_waterline": 0.5}', {}, True),
])
def test_hixl_comm_engine_reads_the_config_again(world: World, grc: str, engine: dict[str, str],
                                                 ok: bool) -> None:
    # §3.2.1: on the comm engine (the default on A2/A3 without a version 1.3 LocalCommRes or a
    # protocol_desc), adxl_inner_engine.cc LoadGlobalResourceConfig parses the value again.
    d = world.dut()
    opts = {**DEV, **LISTEN0, **HIXL, **engine, OPTION_GLOBAL_RESOURCE_CONFIG: grc}
    if ok:
        _init_ok(d, opts)
    else:
        _init_fails(d, opts)


@pytest.mark.parametrize("listen", ["127.0.0.1:4294967295", "127.0.0.1:2147483648", "[::1]:0"])
def test_hixl_engine_name_must_parse(world: World, listen: str) -> None:
    # §3.2.1: the engine name ip:to_string(port) is re-parsed by hixl_utils.cc ParseListenInfo:
    # a port above INT32_MAX, or an IPv6 address (no brackets in the name), is PARAM_INVALID.
    _init_fails(world.dut(), {**DEV, **HIXL, OPTION_LISTEN_IP_INFO: listen})


@pytest.mark.parametrize("content,ok", [('{"version": "1.3"}', True), ("not json", False), ("", False)])
def test_hixl_local_comm_res_path(world: World, tmp_path: Path, content: str, ok: bool) -> None:
    # hixl_options.cc ResolveLocalCommResFromFile: a regular file of 1 B..1 MiB, then valid JSON.
    path = tmp_path / "comm_res.json"
    path.write_text(content)
    d = world.dut()
    opts = {**DEV, **LISTEN0, **HIXL,
            OPTION_GLOBAL_RESOURCE_CONFIG: json.dumps({"local_comm_res_path": str(path)})}
    if ok:
        _init_ok(d, opts)
    else:
        _init_fails(d, opts)


def test_hixl_local_comm_res_path_is_ignored_when_local_comm_res_is_given(world: World) -> None:
    opts = {**DEV, **LISTEN0, **HIXL, OPTION_LOCAL_COMM_RES: "{}",
            OPTION_GLOBAL_RESOURCE_CONFIG: '{"local_comm_res_path": "/nonexistent/kvdd"}'}
    _init_ok(world.dut(), opts)


@pytest.mark.parametrize("value,ok", [("not json", False), ("[1, 2", False), ('{"version": "1.9"}', True),
                                      ("[]", True), ("", True), ('{"version": "1.3"}', True)])
def test_hixl_local_comm_res_must_be_json(world: World, value: str, ok: bool) -> None:
    d = world.dut()
    opts = {**DEV, **LISTEN0, **HIXL, OPTION_LOCAL_COMM_RES: value}
    if ok:
        _init_ok(d, opts)
    else:
        _init_fails(d, opts)


# -- §3.2 step 9: memory-pool JSON as nlohmann::json classifies it -------------------------------


@pytest.mark.parametrize("key", ["llm.MemPoolConfig", "llm.HostMemPoolConfig"])
@pytest.mark.parametrize("value", [
    f'{{"memory_size": {(2**32 - 1) << 16}}}',  # (size >> 16) == UINT32_MAX
    f'{{"memory_size": {(2**32 - 1) << 10}, "page_shift": 10}}',
    '{"memory_size": -0}', '{"memory_size": 1048576.0}', '{"memory_size": 1e6}',
    '{"memory_size": "1048576"}', '{"memory_size": 18446744073709551616}', "[1048576]", "",
    '{"memory_size": 1048576, "page_shift": 16.0}', '{"memory_size": 1048576, "page_shift": -16}',
    '{"memory_size": NaN}',
])
def test_mem_pool_config_rejected(world: World, key: str, value: str) -> None:
    _init_fails(world.dut(), {**DEV, key: value})


# -- §3.4 step 7: the internal keys at Initialize -------------------------------------------------


@pytest.mark.needs_bound_port
def test_comm_internal_listen_keys_listen(world: World) -> None:
    d = world.dut()
    _init_ok(d, {**DEV, IP: LOCALHOST, PORT: "0"})
    p = world.peer()
    p.initialize()
    port = d.listen_port
    assert port
    assert p.link(port, d.cluster_id) == [S]


@pytest.mark.parametrize("opts", [{PORT: "0"}, {IP: LOCALHOST, PORT: "x"}, {IP: LOCALHOST, PORT: "0 "},
                                  {IP: LOCALHOST, PORT: "4294967296"}])
def test_comm_internal_listen_keys_rejected(world: World, opts: dict[str, str]) -> None:
    _init_fails(world.dut(), {**DEV, **opts})


@pytest.mark.needs_bound_port
def test_listen_ip_info_overrides_the_internal_keys(world: World, transfer: str) -> None:
    d = world.dut()
    _init_ok(d, {**DEV, **LISTEN0, **({} if transfer == "comm" else HIXL), IP: "bogus", PORT: "x"})
    assert d.listen_port


def test_comm_lone_listen_ip_generates_the_comm_resource(world: World) -> None:
    # §3.4 step 7 / §3.5 b: llm.ListenIp alone makes no listener but a local comm resource.
    d, p = pair(world)
    d.finalize()
    _init_ok(d, {**DEV, IP: LOCALHOST})
    assert d.listen_port is None
    port = p.listen_port
    assert port
    assert d.link(port, 1, local_ip=False) == [S]


@pytest.mark.needs_bound_port
def test_comm_listener_started_by_set_role_generates_no_comm_resource(world: World) -> None:
    # §3.5 b: only Initialize's listen IP (or llm.LocalCommRes) provides the comm resource.
    d, p = pair(world)
    d.set_role(LlmRole.PROMPT, LISTEN0)
    assert d.listen_port
    port = p.listen_port
    assert port
    with raises(PARAM_INVALID, rets=[Status.LLM_PARAM_INVALID]):
        d.link(port, 1, local_ip=False)
    assert d.link(port, 1) == [S]


@pytest.mark.parametrize("opts", [{IP: LOCALHOST}, {PORT: "0"}, {IP: LOCALHOST, PORT: "x"},
                                  {IP: LOCALHOST, PORT: "-1 "}])
def test_hixl_listen_address_needs_both_internal_keys(world: World, opts: dict[str, str]) -> None:
    _init_fails(world.dut(), {**DEV, **HIXL, **opts})


@pytest.mark.needs_bound_port
def test_hixl_internal_listen_keys_satisfy_the_mandatory_address(world: World) -> None:
    d = world.dut()
    _init_ok(d, {**DEV, **HIXL, IP: LOCALHOST, PORT: "0"})
    assert d.listen_port


@pytest.mark.parametrize("transfer_opts", [{}, HIXL])
def test_listen_ip_must_be_a_literal(world: World, transfer_opts: dict[str, str]) -> None:
    # §3.2.1: a name is never resolved (comm: msg_handler_plugin.cc GetAiFamily; hixl:
    # ParseListenInfo's CheckIp) -> PARAM_INVALID.
    _init_fails(world.dut(), {**DEV, **transfer_opts, IP: "localhost", PORT: "0"})


# -- §3.2 step 8 / §3.5 e: llm.LocalCommRes on comm -----------------------------------------------


def test_comm_empty_local_comm_res_counts_as_absent(world: World) -> None:
    d, p = pair(world)
    d.finalize()
    _init_ok(d, {**DEV, OPTION_LOCAL_COMM_RES: ""})
    port = p.listen_port
    assert port
    with raises(PARAM_INVALID, rets=[Status.LLM_PARAM_INVALID]):  # none yet: local_ip_infos needed
        d.link(port, 1, local_ip=False)
    assert d.link(port, 1) == [S]


def _padded(version: object, size: int) -> str:
    head = json.dumps({"version": version, "pad": ""})
    return json.dumps({"version": version, "pad": "x" * (size - len(head))})


@pytest.mark.parametrize("text,ok", [
    (_padded("1.0", 64 * 1024), True), (_padded("1.2", 64 * 1024 + 1), False),
    (json.dumps({"version": 1.0}), False), (json.dumps({"version": "1.0", "x": float("nan")}), False),
    ('["1.0"]', False),
])
def test_comm_local_comm_res_at_link(world: World, text: str, ok: bool) -> None:
    # §3.5 e (rank_table_generator.cc): <= 64 KiB, JSON object, string version 1.0 or 1.2.
    d, p = pair(world)
    d.finalize()
    _init_ok(d, {**DEV, OPTION_LOCAL_COMM_RES: text})
    port = p.listen_port
    assert port
    if ok:
        assert d.link(port, 1) == [S]
    else:
        with raises(PARAM_INVALID, rets=[Status.LLM_PARAM_INVALID]):
            d.link(port, 1)


# -- §3.4 steps 4-5: SetRole compares -------------------------------------------------------------


@pytest.mark.needs_bound_port
@pytest.mark.parametrize("same", [f"{LOCALHOST}:00", f"{LOCALHOST}:+0", f"{LOCALHOST}: 0",
                                  f"[{LOCALHOST}]:0", "127.0.0.2:0"])
def test_comm_set_role_compares_the_normalized_port(world: World, same: str) -> None:
    d = world.dut()
    d.initialize(listen=True)
    port = d.listen_port
    assert port
    d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: same})  # same port: nothing happens
    assert d.listen_port == port


@pytest.mark.needs_bound_port
def test_comm_set_role_compares_raw_internal_port_text(world: World) -> None:
    # §3.4 step 7: a user's llm.ListenPort is stored and compared as given (not normalized).
    d = world.dut()
    _init_ok(d, {**DEV, IP: LOCALHOST, PORT: "0"})
    first = d.listen_port
    d.set_role(LlmRole.PROMPT, {IP: LOCALHOST, PORT: "0"})
    assert d.listen_port == first  # same text
    d.set_role(LlmRole.PROMPT, {IP: LOCALHOST, PORT: "00"})  # other text: a new listener
    second = d.listen_port
    assert second and second != first
    d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:000"})  # derived "0" != "00"
    third = d.listen_port
    assert third and third != second
    d.set_role(LlmRole.PROMPT, LISTEN0)  # "0" == "0"
    assert d.listen_port == third


@pytest.mark.needs_bound_port
def test_comm_set_role_internal_keys(world: World) -> None:
    d = world.dut()
    d.initialize()
    with raises(PARAM_INVALID):  # llm.ListenIp is not assigned
        d.set_role(LlmRole.PROMPT, {PORT: "0"})
    with raises(PARAM_INVALID):
        d.set_role(LlmRole.PROMPT, {IP: LOCALHOST, PORT: "0x"})
    assert d.listen_port is None
    d.set_role(LlmRole.PROMPT, {IP: LOCALHOST, PORT: "0"})
    assert d.listen_port
    d.set_role(LlmRole.PROMPT, {IP: LOCALHOST})  # no port: stop listening
    assert d.listen_port is None


@pytest.mark.needs_bound_port
@pytest.mark.parametrize("same", [f"[{LOCALHOST}]:0", f"{LOCALHOST}:+0", f"{LOCALHOST}:00",
                                  f"{LOCALHOST}: 0"])
def test_hixl_set_role_compares_the_parsed_address(world: World, same: str) -> None:
    d = world.dut()
    d.initialize(transfer="hixl")
    port = d.listen_port
    d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: same})
    assert d.listen_port == port


@pytest.mark.needs_bound_port
def test_hixl_set_role_internal_keys(world: World) -> None:
    d = world.dut()
    d.initialize(transfer="hixl")
    with raises(FEATURE_NOT_ENABLED):
        d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: "127.0.0.2:0"})
    with raises(FEATURE_NOT_ENABLED):
        d.set_role(LlmRole.PROMPT, {IP: LOCALHOST, PORT: "1"})
    d.set_role(LlmRole.PROMPT, {IP: LOCALHOST, PORT: "+00"})  # parsed: 127.0.0.1:0
    d.set_role(LlmRole.PROMPT, {PORT: "1"})  # only one internal key: nothing compared
    d.set_role(LlmRole.PROMPT, {IP: "10.0.0.1"})
    with raises(PARAM_INVALID):
        d.set_role(LlmRole.PROMPT, {IP: LOCALHOST, PORT: "x"})
