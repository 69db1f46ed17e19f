"""Rank-table links between engines in separate processes (PYPKG.md §3.3, §7.5 item 10, §9.2-9.3):
PREPARING until every member linked, then OK (sticky); FAILED on a mismatch or after the link total
time; the rendezvous (per-user directory, or the address map across hosts) and its trust rules."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from links_support import (EXIST_LINK, FAILED_STATE, LINK_FAILED, NOT_YET_LINK, OK, PREPARING, S_OK,
                           free_port, options, rank_table)
from peer import Peer

L = "kvdd.sim.pypkg.lifecycle."
K = "kvdd.sim.pypkg.links."
S = "links_support."
PD = [(1, 0), (2, 1)]


@pytest.fixture(scope="module")
def rv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rendezvous") / "rv"
    os.mkdir(path, 0o700)
    return path


@pytest.fixture(scope="module")
def trio(rv_dir: Path) -> Iterator[tuple[Peer, Peer, Peer]]:
    env = {"KVDD_SIM_RENDEZVOUS_DIR": str(rv_dir)}
    with Peer(env) as a, Peer(env) as b, Peer(env) as c:
        yield a, b, c


@pytest.fixture
def fresh(trio: tuple[Peer, Peer, Peer], rv_dir: Path) -> Iterator[tuple[Peer, Peer, Peer]]:
    os.chmod(rv_dir, 0o700)
    yield trio
    for peer in trio:
        peer.call(S + "fin")
    os.chmod(rv_dir, 0o700)
    assert not [f for f in os.listdir(rv_dir) if not f.startswith(".")]  # entries withdrawn


def test_preparing_then_ok_on_both_sides_and_usable_both_ways(fresh: tuple[Peer, Peer, Peer]) -> None:
    p, d, _ = fresh
    table = rank_table()
    assert p.call(S + "init", 1, options("Prompt")) == S_OK  # no listen address on either side
    assert d.call(S + "init", 2, options("Decoder")) == S_OK
    assert p.call(K + "link", "pd_comm", PD, table) == (S_OK, 1)
    time.sleep(0.2)
    assert p.call(K + "query_register_mem_status", 1) == (S_OK, PREPARING)  # D has not called link
    assert p.call(S + "pending", 2) is True  # transfers to D: NOT_YET_LINK until OK
    assert d.call(K + "link", "pd_comm", PD, table) == (S_OK, 1)
    assert d.call(S + "wait_status", 1) == (S_OK, OK)
    assert p.call(S + "wait_status", 1) == (S_OK, OK)
    assert p.call(S + "pending", 2) is False and d.call(S + "pending", 1) is False
    # one comm link, an entity on each side keyed by the peer's real id (usable both ways)
    assert p.call(S + "entities") == [2] and d.call(S + "entities") == [1]
    assert p.call(L + "switch_role_v2", "Decoder", {}) == EXIST_LINK
    # a second domain: the next comm id; the link it makes replaces the first (last one wins)
    assert d.call(K + "link", "pd_comm_2", PD, table) == (S_OK, 2)
    assert p.call(K + "link", "pd_comm_2", PD, table) == (S_OK, 2)
    assert p.call(S + "wait_status", 2) == (S_OK, OK) and d.call(S + "wait_status", 2) == (S_OK, OK)
    assert p.call(K + "query_register_mem_status", 1) == (S_OK, OK)  # sticky
    # unlink: local only; the replaced domain's unlink leaves the live link alone
    assert p.call(K + "unlink", 1) == S_OK
    assert p.call(S + "entities") == [2]
    assert p.call(K + "unlink", 2) == S_OK
    assert p.call(S + "entities") == [] and d.call(S + "entities") == [1]
    assert p.call(K + "unlink", 2) == NOT_YET_LINK
    assert p.call(L + "switch_role_v2", "Decoder", {}) == S_OK
    assert d.call(K + "unlink", 1) == S_OK and d.call(K + "unlink", 2) == S_OK
    assert d.call(S + "entities") == []


def test_three_members(fresh: tuple[Peer, Peer, Peer]) -> None:
    a, b, c = fresh
    members = [(10, 0), (20, 1), (30, 2)]
    table = rank_table(3)
    for cid, peer in zip((10, 20, 30), (a, b, c)):
        assert peer.call(S + "init", cid, options("Mix")) == S_OK
    calls = [peer.call_async(K + "link", "trio", members, table) for peer in (c, a)]
    assert [x.wait() for x in calls] == [(S_OK, 1), (S_OK, 1)]
    time.sleep(0.2)
    assert a.call(K + "query_register_mem_status", 1) == (S_OK, PREPARING)
    assert b.call(K + "link", "trio", members, table) == (S_OK, 1)
    for peer in (a, b, c):
        assert peer.call(S + "wait_status", 1) == (S_OK, OK)
    assert a.call(S + "entities") == [20, 30]
    assert b.call(S + "entities") == [10, 30]
    assert c.call(S + "entities") == [10, 20]


@pytest.mark.parametrize("mismatch", ["flags", "members"])
def test_a_mismatch_fails_both_sides_at_once(fresh: tuple[Peer, Peer, Peer], mismatch: str) -> None:
    p, d, _ = fresh
    table = rank_table()
    assert p.call(S + "init", 1, options("Prompt", llm_LinkTotalTime="60")) == S_OK
    d_ra = "0" if mismatch == "flags" else "1"
    assert d.call(S + "init", 2, options("Decoder", ra=d_ra, llm_LinkTotalTime="60")) == S_OK
    d_members = PD if mismatch == "flags" else [(1, 0), (2, 1), (3, 2)]
    t0 = time.monotonic()
    assert d.call(K + "link", "pd", d_members, rank_table(3)) == (S_OK, 1)
    assert p.call(K + "link", "pd", PD, table) == (S_OK, 1)
    assert p.call(S + "wait_status", 1) == (S_OK, FAILED_STATE)
    assert d.call(S + "wait_status", 1) == (S_OK, FAILED_STATE)
    assert time.monotonic() - t0 < 30.0  # not the 60 s link total time
    assert p.call(S + "entities") == [] and d.call(S + "entities") == []
    assert p.call(S + "pending", 2) is False


def test_the_rendezvous_directory_must_be_private(fresh: tuple[Peer, Peer, Peer], rv_dir: Path) -> None:
    p, _, _ = fresh
    assert p.call(S + "init", 1, options("Prompt")) == S_OK
    os.chmod(rv_dir, 0o777)
    assert p.call(K + "link", "pd", PD, rank_table()) == (LINK_FAILED, 0)
    assert "rendezvous directory" in (p.call(L + "last_error_detail") or "")
    os.chmod(rv_dir, 0o700)
    if os.geteuid() == 0:  # a directory of another user (only root can make one here)
        os.chown(rv_dir, 12345, -1)
        try:
            assert p.call(K + "link", "pd", PD, rank_table()) == (LINK_FAILED, 0)
            assert "belongs to uid 12345" in (p.call(L + "last_error_detail") or "")
        finally:
            os.chown(rv_dir, 0, -1)
    assert p.call(K + "link", "pd", PD, rank_table()) == (S_OK, 1)


def test_an_entry_that_is_not_private_is_ignored(fresh: tuple[Peer, Peer, Peer], rv_dir: Path) -> None:
    # another member's entry readable by others is not trusted: P keeps waiting for D
    p, d, _ = fresh
    assert p.call(S + "init", 1, options("Prompt", llm_LinkTotalTime="1")) == S_OK
    assert d.call(S + "init", 2, options("Decoder", llm_LinkTotalTime="1")) == S_OK
    entries = set(os.listdir(rv_dir))
    assert d.call(K + "link", "pd", PD, rank_table()) == (S_OK, 1)
    (entry,) = set(os.listdir(rv_dir)) - entries
    os.chmod(rv_dir / entry, 0o644)
    assert p.call(K + "link", "pd", PD, rank_table()) == (S_OK, 1)
    assert p.call(S + "wait_status", 1) == (S_OK, FAILED_STATE)
    assert d.call(S + "wait_status", 1) == (S_OK, FAILED_STATE)


def test_across_hosts_the_address_map_replaces_the_directory(tmp_path: Path) -> None:
    # KVDD_SIM_RANK_TABLE_ADDRS maps device_ip -> fabric address; no directory is needed
    # (a world-writable one would be refused)
    bad = tmp_path / "open"
    os.mkdir(bad)
    os.chmod(bad, 0o777)
    pp, dp = free_port(), free_port()
    env = {"KVDD_SIM_RENDEZVOUS_DIR": str(bad),
           "KVDD_SIM_RANK_TABLE_ADDRS": f"10.0.0.1=127.0.0.1:{pp},10.0.0.2=127.0.0.1:{dp}"}
    with Peer(env) as p, Peer(env) as d:
        # P's own listen address is its mapped one: the rank-table link uses that listener
        assert p.call(S + "init", 1, options("Prompt", pp)) == S_OK
        assert d.call(S + "init", 2, options("Decoder")) == S_OK
        assert d.call(K + "link", "x", PD, rank_table()) == (S_OK, 1)
        assert p.call(K + "link", "x", PD, rank_table()) == (S_OK, 1)
        assert p.call(S + "wait_status", 1) == (S_OK, OK)
        assert d.call(S + "wait_status", 1) == (S_OK, OK)
        assert d.call(S + "listening", dp) is True  # D listens at its mapped address
        assert os.listdir(bad) == []
    env["KVDD_SIM_RANK_TABLE_ADDRS"] = "10.0.0.1=nowhere"
    with Peer(env) as p:
        assert p.call(S + "init", 1, options("Prompt")) == S_OK
        assert p.call(K + "link", "x", PD, rank_table()) == (LINK_FAILED, 0)
        assert "KVDD_SIM_RANK_TABLE_ADDRS" in (p.call(L + "last_error_detail") or "")


def test_a_member_that_vanishes_after_link_fails_the_domain_in_time(fresh: tuple[Peer, Peer, Peer],
                                                                     rv_dir: Path) -> None:
    # D calls link and dies before P links: its entry names a process that is gone, so P never
    # dials it and the domain fails after the link total time (PREPARING always ends, §9.3)
    p, _, _ = fresh
    with Peer({"KVDD_SIM_RENDEZVOUS_DIR": str(rv_dir)}) as d:
        assert d.call(S + "init", 2, options("Decoder")) == S_OK
        assert d.call(K + "link", "pd", PD, rank_table()) == (S_OK, 1)
        d.process.kill()
        d.process.join(5)
    stale = [f for f in os.listdir(rv_dir) if not f.startswith(".")]
    assert len(stale) == 1  # the dead member's entry stays behind until someone looks it up
    assert p.call(S + "init", 1, options("Prompt", llm_LinkTotalTime="1")) == S_OK
    t0 = time.monotonic()
    assert p.call(K + "link", "pd", PD, rank_table()) == (S_OK, 1)
    assert p.call(S + "wait_status", 1) == (S_OK, FAILED_STATE)
    assert 0.9 < time.monotonic() - t0 < 10.0
    assert not os.path.exists(rv_dir / stale[0])  # ignored, then removed
