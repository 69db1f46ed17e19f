"""Initialize and SetRole options as upstream's components read them, in their order (SEMANTICS.md
§3.2 steps 3-9, §3.4 steps 3-7, §3.5 e), driven by the table of :mod:`kvdd.options`.

Upstream's ``LlmDataDist`` copies every user option into the map it passes on and only *adds* the
internal keys ``llm.ListenIp`` / ``llm.ListenPort`` (derived from ``llm.ListenIpInfo``); the
transfer engines read the internal keys.  The functions here build that map and read it the same
way, so a user passing the internal keys directly gets what upstream gives.  Every failure raises
:class:`kvdd.options.OptionError`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..option_json import (
    GlobalResourceConfig,
    read_local_comm_res_file,
    selects_hixl_cs,
)
from ..options import (
    OPTION_DEVICE_ID,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_HOST_MEM_POOL_CONFIG,
    OPTION_LINK_RETRY_COUNT,
    OPTION_LINK_TOTAL_TIME,
    OPTION_LISTEN_IP,
    OPTION_LISTEN_IP_INFO,
    OPTION_LISTEN_PORT,
    OPTION_LOCAL_COMM_RES,
    OPTION_MEM_POOL_CONFIG,
    OPTION_RDMA_SERVICE_LEVEL,
    OPTION_RDMA_TRAFFIC_CLASS,
    OPTION_SYNC_CACHE_WAIT_TIME,
    OPTION_TRANSFER_BACKEND,
    OptionError,
    is_ipv4_literal,
    is_ipv6_literal,
    parse_option,
    rule,
    to_number,
)

__all__ = ["InitPlan", "plan_initialize", "cache_engine_options", "switch_options",
           "comm_switch_listen", "hixl_switch_engine", "check_link_comm_res"]

_EXEC_DEVICE_ID = "ge.exec.deviceId"


@dataclass(frozen=True)
class InitPlan:
    """What Initialize decided before it starts listening (§3.2 steps 3-8)."""

    backend: str  # "comm" or "hixl"
    device_id: int
    listen: tuple[str, int] | None  # where to listen (ip, port before 16-bit truncation)
    listen_port_text: str | None  # comm: the llm.ListenPort text SetRole compares (§3.4 step 4)
    local_engine: str | None  # hixl: "ip:port" SetRole compares (§3.4 step 5)
    comm_res_text: str | None  # comm: a non-empty llm.LocalCommRes, checked at link time (§3.5 e)
    has_comm_res: bool  # comm: a local comm resource exists (given, or generated from llm.ListenIp)


def _internal_map(options: Mapping[str, str], listen: tuple[str, int] | None) -> dict[str, str]:
    """The map upstream passes on: the user's options plus the derived internal keys."""
    out = dict(options)
    if listen is not None:
        out[OPTION_LISTEN_IP], out[OPTION_LISTEN_PORT] = listen[0], str(listen[1])
    return out


def plan_initialize(options: Mapping[str, str], environ: Mapping[str, str] | None = None,
                    engine_replaced: Callable[[], None] | None = None) -> InitPlan:
    """§3.2 steps 3-8 up to listening: llm_datadist_impl.cc ``Initialize``, the engine factory,
    then the comm (llm_link_manager.cc) or hixl (hixl_transfer_engine.cc) engine's option reads.

    ``engine_replaced`` is called once steps 3-4 passed, where llm_datadist_v2.cc ``DoInitialize``
    replaces the transfer engine (step 6): a port a failed Initialize left bound is freed there
    (§3.2 step 10), whatever the later steps decide."""
    env = os.environ if environ is None else environ
    parse_option("initialize", OPTION_DEVICE_ID, options)  # step 3 (absent: checked below)
    if OPTION_DEVICE_ID not in options:
        raise OptionError(f"option {OPTION_DEVICE_ID} can not be empty")
    listen_ip_info = parse_option("initialize", OPTION_LISTEN_IP_INFO, options)  # step 4
    listen = listen_ip_info if isinstance(listen_ip_info, tuple) else None
    m = _internal_map(options, listen)
    m[_EXEC_DEVICE_ID] = options[OPTION_DEVICE_ID]
    if engine_replaced is not None:
        engine_replaced()
    backend = "hixl" if parse_option("factory", OPTION_TRANSFER_BACKEND, m) else "comm"  # step 6
    device_id = parse_option("factory", _EXEC_DEVICE_ID, m)  # the single-int32 re-parse
    assert isinstance(device_id, int)
    if backend == "comm":
        return _plan_comm(m, device_id)
    return _plan_hixl(m, device_id, env)


def _plan_comm(m: Mapping[str, str], device_id: int) -> InitPlan:
    for key in (OPTION_RDMA_TRAFFIC_CLASS, OPTION_RDMA_SERVICE_LEVEL, OPTION_LINK_TOTAL_TIME,
                OPTION_LINK_RETRY_COUNT):  # comm_link_manager.cc CommLinkManager::Initialize
        parse_option("comm", key, m)
    comm_res = m.get(OPTION_LOCAL_COMM_RES) or None  # link_msg_handler.cc: empty = absent
    listen = None
    port_text = m.get(OPTION_LISTEN_PORT)
    if port_text is not None:  # llm_link_manager.cc LLMLinkManager::Initialize
        if OPTION_LISTEN_IP not in m:
            raise OptionError(f"{OPTION_LISTEN_IP} is not assigned")
        port = parse_option("comm", OPTION_LISTEN_PORT, m)
        assert isinstance(port, int)
        listen = (m[OPTION_LISTEN_IP], port)
    # a local comm resource is generated from llm.ListenIp alone (link_msg_handler.cc Initialize)
    has_comm_res = comm_res is not None or bool(m.get(OPTION_LISTEN_IP))
    return InitPlan("comm", device_id, listen, port_text, None, comm_res, has_comm_res)


def _plan_hixl(m: Mapping[str, str], device_id: int, env: Mapping[str, str]) -> InitPlan:
    if OPTION_LISTEN_PORT not in m or OPTION_LISTEN_IP not in m:  # mandatory listen address
        raise OptionError(f"the hixl transfer backend needs {OPTION_LISTEN_IP_INFO}")
    port = parse_option("hixl", OPTION_LISTEN_PORT, m)
    assert isinstance(port, int)
    ip = m[OPTION_LISTEN_IP]
    # hixl_options.cc HixlOptions::Parse on the forwarded options, then engine_factory.cc
    for key in (OPTION_RDMA_TRAFFIC_CLASS, OPTION_RDMA_SERVICE_LEVEL):
        parse_option("hixl", key, m, env)
    grc = parse_option("hixl", OPTION_GLOBAL_RESOURCE_CONFIG, m)
    comm_res = m.get(OPTION_LOCAL_COMM_RES) or None
    if isinstance(grc, GlobalResourceConfig) and grc.local_comm_res_path is not None and comm_res is None:
        try:
            comm_res = read_local_comm_res_file(grc.local_comm_res_path)
        except ValueError as exc:
            raise OptionError(f"option {OPTION_GLOBAL_RESOURCE_CONFIG}: {exc}") from None
    if comm_res is not None:
        parse_option("hixl", OPTION_LOCAL_COMM_RES, {OPTION_LOCAL_COMM_RES: comm_res})
    local_engine = f"{ip}:{port}"
    if not selects_hixl_cs(comm_res, grc if isinstance(grc, GlobalResourceConfig) else None):
        parse_option("hixl_comm_engine", OPTION_GLOBAL_RESOURCE_CONFIG, m)  # its own read
    listen_ip, listen_port = _hixl_listen_info(local_engine)
    return InitPlan("hixl", device_id, (listen_ip, listen_port), None, local_engine, None, False)


def _hixl_listen_info(local_engine: str) -> tuple[str, int]:
    """hixl_utils.cc ``ParseListenInfo`` of the engine name (both engines' Initialize): brackets or
    ``Split(':')``, the first item an IP literal, the second (if any) a whole int32."""
    lb, rb = local_engine.find("["), local_engine.find("]")
    if lb != -1 and rb != -1 and lb < rb:
        colon = local_engine.find(":", rb)
        items = [local_engine[lb + 1: rb]] + ([] if colon == -1 else [local_engine[colon + 1:]])
    else:
        items = local_engine.split(":")
    if not (is_ipv4_literal(items[0]) or is_ipv6_literal(items[0])):
        raise OptionError(f"listen address {local_engine!r}: {items[0]!r} is not an IP literal "
                          "(an IPv6 llm.ListenIp needs brackets on hixl)")
    port = to_number(items[1], "int32") if len(items) > 1 else 0
    if port is None:
        raise OptionError(f"listen address {local_engine!r}: the port is not an int32")
    return items[0], port


def cache_engine_options(options: Mapping[str, str]) -> int:
    """§3.2 step 9 (data_cache_engine.cc ``Initialize``): the transfer time limit in ms, after
    checking the memory-pool options."""
    wait = parse_option("cache", OPTION_SYNC_CACHE_WAIT_TIME, options)
    for key in (OPTION_MEM_POOL_CONFIG, OPTION_HOST_MEM_POOL_CONFIG):
        parse_option("cache", key, options)
    assert wait is None or isinstance(wait, int)
    return 1000 if wait is None else wait


def switch_options(options: Mapping[str, str]) -> dict[str, str]:
    """§3.4 step 3 (llm_datadist_impl.cc ``SetRole``): the map passed to SwitchRole."""
    listen = parse_option("set_role", OPTION_LISTEN_IP_INFO, options)
    return _internal_map(options, listen if isinstance(listen, tuple) else None)


def comm_switch_listen(m: Mapping[str, str]) -> tuple[str, int, str] | None:
    """§3.4 step 4 (llm_link_manager.cc ``SwitchRole``, after the link check): where to listen
    ``(ip, port, port text compared with the stored one)``, or None to stop listening."""
    text = m.get(OPTION_LISTEN_PORT)
    if text is None:
        return None
    port = rule("set_role_comm", OPTION_LISTEN_PORT).parse(OPTION_LISTEN_PORT, text)
    assert isinstance(port, int)
    if OPTION_LISTEN_IP not in m:
        raise OptionError(f"{OPTION_LISTEN_IP} is not assigned")
    return m[OPTION_LISTEN_IP], port, text


def hixl_switch_engine(m: Mapping[str, str]) -> str | None:
    """§3.4 step 5 (hixl_transfer_engine.cc ``SwitchRole``): the ``ip:port`` compared with the one
    of Initialize, or None when the map lacks either internal key (nothing compared)."""
    text, ip = m.get(OPTION_LISTEN_PORT), m.get(OPTION_LISTEN_IP)
    if text is None or ip is None:
        return None
    port = rule("set_role_hixl", OPTION_LISTEN_PORT).parse(OPTION_LISTEN_PORT, text)
    return f"{ip}:{port}"


def check_link_comm_res(text: str | None) -> None:
    """§3.5 e on comm: a given ``llm.LocalCommRes`` must be a comm resource of version 1.0/1.2."""
    if text is not None:
        parse_option("link_comm", OPTION_LOCAL_COMM_RES, {OPTION_LOCAL_COMM_RES: text})
