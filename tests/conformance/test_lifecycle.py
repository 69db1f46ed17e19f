"""Finalize / SetRole and calls on an uninitialized or finalized instance: SEMANTICS.md §3.3-§3.4,
§6 scenarios 15-16 and 39-42, §7.12."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

import kvdd
from kvdd import (
    OPTION_LISTEN_IP_INFO,
    CacheIndex,
    LlmRole,
    Status,
)

from .checked import (
    pull_cache_checked,
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
    raises,
)
from .init_helpers import (
    DEV,
    LISTEN0,
    NEEDS_PORT0,
    listen_any,
    is_listening,
    assert_uninitialized,
)


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
    assert_uninitialized(d)


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
    listen = listen_any(world)
    assert d.listen_port is None
    d.set_role(LlmRole.DECODER, {})
    assert d.listen_port is None
    d.set_role(LlmRole.PROMPT, listen)
    port1 = d.listen_port
    assert port1 and is_listening(port1)
    d.set_role(LlmRole.DECODER, listen)  # same port string: no-op
    assert d.listen_port == port1
    d.set_role(LlmRole.MIX, {})  # stops listening
    assert d.listen_port is None
    assert not is_listening(port1)
    d.set_role(LlmRole.PROMPT, listen)
    port2 = d.listen_port
    assert port2 and is_listening(port2)
    d.set_role(LlmRole.PROMPT, {})
    assert d.listen_port is None
    d.set_role(LlmRole.DECODER, listen)
    port3 = d.listen_port
    assert port3 and is_listening(port3)
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
    assert port and is_listening(port)


def test_set_role_moves_listener_to_new_port(world: World) -> None:
    d = world.dut()
    d.initialize(listen=True)
    old = d.listen_port
    new = free_port()
    d.set_role(LlmRole.MIX, {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{new}"})
    assert d.listen_port == new
    assert is_listening(new)
    assert old and not is_listening(old)


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
    assert d.listen_port == port and is_listening(port)


def test_hixl_set_role_ignores_links(world: World) -> None:
    # §3.4 step 5 and §7.21: no LLM_EXIST_LINK on hixl.
    d, p = pair(world, "hixl")
    p.register()
    link(d, p)
    d.set_role(LlmRole.MIX)
    assert d.listen_ip_info is not None
    d.set_role(LlmRole.PROMPT, {OPTION_LISTEN_IP_INFO: d.listen_ip_info})  # unchanged: no-op
