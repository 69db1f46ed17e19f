"""Transfers over rank-table links, through CANN's Python API in separate processes (PYPKG.md §3.3,
§4.9 items 1-3, §7.5 items 10-11, §9.3-9.4): NOT_YET_LINK until OK, the link usable both ways, the
after-link registration rule, and caches registered after ``link`` invisible over that link."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from links_support import free_port, rank_table
from peer import Peer

E = "links_e2e."


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Peer, Peer, Peer]]:
    path = tmp_path_factory.mktemp("rendezvous") / "rv"
    os.mkdir(path, 0o700)
    env = {"KVDD_SIM_RENDEZVOUS_DIR": str(path)}
    with Peer(env) as a, Peer(env) as b, Peer(env) as c:
        yield a, b, c


@pytest.fixture
def fresh(trio: tuple[Peer, Peer, Peer]) -> Iterator[tuple[Peer, Peer, Peer]]:
    yield trio
    for peer in trio:
        peer.call(E + "stop")


def _wait(peer: Peer, comm_id: int, timeout_s: float = 30.0) -> str:
    end = time.monotonic() + timeout_s
    while (state := peer.call(E + "query", comm_id)) == "PREPARING" and time.monotonic() < end:
        time.sleep(0.02)
    return str(state)


def test_pulls_wait_for_ok_and_then_work_both_ways(fresh: tuple[Peer, Peer, Peer]) -> None:
    a, b, c = fresh
    members = {1: 0, 2: 1, 3: 2}
    for cid, peer in ((1, a), (2, b), (3, c)):
        peer.call(E + "start", "MIX", cid)
        assert peer.call(E + "register", "kv", 0, 16 * cid) == 1
        assert peer.call(E + "register", "dst", 9, 200) == 2
    table = rank_table(3)
    assert a.call(E + "link", "abc", members, table) == 1
    assert b.call(E + "link", "abc", members, table) == 1
    deadline = time.monotonic() + 5
    while a.call("links_support.entities") != [2]:  # A linked B; C has not called link
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert a.call(E + "query", 1) == "PREPARING"
    # the entity to B exists, but the domain is not ready: NOT_YET_LINK, nothing moved
    assert a.call(E + "pull", 2, 0, "dst", [0], [0]) == "LLM_NOT_YET_LINK"
    assert b.call(E + "pull", 1, 0, "dst", [0], [0]) == "LLM_NOT_YET_LINK"
    assert a.call(E + "block", "dst", 0) == [200]
    assert c.call(E + "link", "abc", members, table) == 1
    assert [_wait(p, 1) for p in (a, b, c)] == ["OK", "OK", "OK"]
    # every pair, both directions, exact bytes
    assert a.call(E + "pull", 2, 0, "dst", [3, 1], [0, 5]) == "OK"
    assert a.call(E + "block", "dst", 0) == [32 + 3] and a.call(E + "block", "dst", 5) == [32 + 1]
    assert a.call(E + "block", "dst", 1) == [201]  # untouched
    assert b.call(E + "pull", 1, 0, "dst", [2], [2]) == "OK"
    assert b.call(E + "block", "dst", 2) == [16 + 2]
    assert c.call(E + "pull", 1, 0, "dst", [7], [7]) == "OK"
    assert c.call(E + "block", "dst", 7) == [16 + 7]
    assert a.call(E + "pull", 3, 0, "dst", [4], [4]) == "OK"
    assert a.call(E + "block", "dst", 4) == [48 + 4]


def test_after_link_registrations(fresh: tuple[Peer, Peer, Peer]) -> None:
    p, d, _ = fresh
    p.call(E + "start", "PROMPT", 1)
    d.call(E + "start", "DECODER", 2)
    assert p.call(E + "register", "kv", 0, 10) == 1
    assert d.call(E + "register", "early", 0, 100) == 1
    table = rank_table()
    assert p.call(E + "link", "pd", {1: 0, 2: 1}, table) == 1
    time.sleep(0.1)
    # §9.4: remote-accessible caches registered after link() (through the engine directly) are
    # not visible over that link: P's while it waits for D, D's right after its own link()
    p.call(E + "wrapper_register_after_link", 7, 77)
    assert d.call(E + "link", "pd", {1: 0, 2: 1}, table) == 1
    d.call(E + "wrapper_register_after_link", 8, 88)
    assert _wait(p, 1) == "OK" and _wait(d, 1) == "OK"
    assert d.call(E + "pull", 1, 7, "early", [0], [0]) == "LLM_KV_CACHE_NOT_EXIST"
    assert d.call(E + "block", "early", 0) == [100]
    assert p.call(E + "pull", 2, 8, "kv", [0], [0]) == "LLM_KV_CACHE_NOT_EXIST"
    assert p.call(E + "block", "kv", 0) == [10]
    # §7.5 item 11: remote_accessible=True after link() is refused; without it the cache is
    # registered, not remote-accessible, and a remote-accessible engine cannot pull into it
    assert d.call(E + "register_status", "late", 5, 0, True) == "LLM_PARAM_INVALID"
    assert d.call(E + "register_status", "late", 5, 0) == "OK"
    assert d.call(E + "pull", 1, 0, "late", [0], [0]) == "LLM_PARAM_INVALID"
    assert d.call(E + "pull", 1, 0, "early", [6], [1]) == "OK"
    assert d.call(E + "block", "early", 1) == [16]
    assert p.call(E + "pull", 2, 0, "kv", [3], [2]) == "OK"  # and the other way
    assert p.call(E + "block", "kv", 2) == [103]


def test_a_rank_table_link_replaces_a_link_clusters_link(fresh: tuple[Peer, Peer, Peer]) -> None:
    p, d, _ = fresh
    port = free_port()
    p.call(E + "start", "PROMPT", 1, listen_port=port)
    d.call(E + "start", "DECODER", 2)
    assert p.call(E + "register", "kv", 0, 10) == 1
    assert d.call(E + "register", "dst", 0, 100) == 1
    assert d.call(E + "link_clusters", 1, port) == ("LLM_SUCCESS", ["LLM_SUCCESS"])
    assert d.call(E + "pull", 1, 0, "dst", [1], [1]) == "OK"
    # D prepares a domain with P: its transfers to P wait for OK even over the existing link
    assert d.call(E + "link", "pd", {1: 0, 2: 1}, rank_table()) == 1
    assert d.call(E + "pull", 1, 0, "dst", [2], [2]) == "LLM_NOT_YET_LINK"
    assert p.call(E + "link", "pd", {1: 0, 2: 1}, rank_table()) == 1
    assert _wait(d, 1) == "OK" and _wait(p, 1) == "OK"
    assert d.call(E + "pull", 1, 0, "dst", [2], [2]) == "OK"
    assert d.call(E + "block", "dst", 2) == [12]


def test_an_unreachable_rendezvous_is_link_failed(tmp_path: Path) -> None:
    env = {"KVDD_SIM_RENDEZVOUS_DIR": str(tmp_path / "missing" / "rv")}
    with Peer(env) as p:
        p.call(E + "start", "PROMPT", 1)
        with pytest.raises(Exception) as info:
            p.call(E + "link", "pd", {1: 0, 2: 1}, rank_table())
        assert getattr(info.value, "status_code", None) is not None
        assert info.value.status_code.name == "LLM_LINK_FAILED"  # type: ignore[attr-defined]
        p.call(E + "stop")
