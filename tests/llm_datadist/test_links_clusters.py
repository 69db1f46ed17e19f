"""``link_clusters_v2`` / ``unlink_clusters_v2`` between engines in two processes (PYPKG.md §3.4,
§7.5 item 12, SEMANTICS.md §3.5-3.6) and ``switch_role_v2``'s EXIST_LINK (§3.5)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from links_support import (ALREADY_LINK, EXIST_LINK, LINK_FAILED, PARAM_INVALID, S_OK,
                           UNLINK_FAILED, cluster, free_port, options)
from peer import Peer

L = "kvdd.sim.pypkg.lifecycle."
K = "kvdd.sim.pypkg.links."
S = "links_support."


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Peer, Peer]]:
    with Peer() as p, Peer() as d:
        yield p, d


@pytest.fixture
def fresh(pair: tuple[Peer, Peer]) -> Iterator[tuple[Peer, Peer]]:
    p, d = pair
    yield p, d
    p.call(S + "fin")
    d.call(S + "fin")


def test_link_relink_unlink_and_the_per_cluster_statuses(fresh: tuple[Peer, Peer]) -> None:
    p, d = fresh
    port, dead = free_port(), free_port()
    assert p.call(S + "init", 1, options("Prompt", port)) == S_OK
    assert d.call(S + "init", 2, options("Decoder")) == S_OK
    # §7.5 item 12: nobody listening -> returned, not raised
    assert d.call(K + "link_clusters_v2", [cluster(1, dead)], 1000) == (LINK_FAILED, [LINK_FAILED])
    assert d.call(K + "link_clusters_v2", [], 1000) == (PARAM_INVALID, [])
    assert d.call(K + "link_clusters_v2", [cluster(1, port)], 0) == (PARAM_INVALID, [])
    # one remote address per cluster; the statuses in input order, the last failure overall
    no_remote: tuple[int, int, list[tuple[int, int]], list[tuple[int, int]]] = (1, 0, [(0x0100007F, 0)], [])
    assert d.call(K + "link_clusters_v2", [cluster(1, port), no_remote, cluster(3, dead)], 2000) \
        == (LINK_FAILED, [S_OK, PARAM_INVALID, LINK_FAILED])
    assert d.call(S + "entities") == [1] and p.call(S + "entities") == [2]
    assert d.call(K + "link_clusters_v2", [cluster(1, port)], 2000) == (ALREADY_LINK, [ALREADY_LINK])
    # both ends have a live entity: switch_role refuses on both (§3.5)
    assert p.call(L + "switch_role_v2", "Decoder", {}) == EXIST_LINK
    assert d.call(L + "switch_role_v2", "Prompt", {}) == EXIST_LINK
    # a non-force unlink tells the peer; unlinking what is not linked is fine
    assert d.call(K + "unlink_clusters_v2", [cluster(1, port, local=False)], 2000, False) == (S_OK, [S_OK])
    assert d.call(S + "entities") == [] and p.call(S + "entities") == []
    assert d.call(K + "unlink_clusters_v2", [cluster(1, port, local=False)], 2000, False) == (S_OK, [S_OK])
    assert d.call(K + "unlink_clusters_v2", [cluster(1, dead, local=False)], 1000, False) \
        == (UNLINK_FAILED, [UNLINK_FAILED])
    assert p.call(L + "switch_role_v2", "Decoder", {}) == S_OK  # and P stops listening
    assert d.call(K + "link_clusters_v2", [cluster(1, port)], 1000) == (LINK_FAILED, [LINK_FAILED])


def test_comm_links_are_keyed_by_the_real_id_and_force_unlink_is_local(fresh: tuple[Peer, Peer]) -> None:
    p, d = fresh
    port = free_port()
    assert p.call(S + "init", 1, options("Prompt", port)) == S_OK
    assert d.call(S + "init", 2, options("Decoder")) == S_OK
    # the id D names does not matter on comm: both sides key by the other's real id
    assert d.call(K + "link_clusters_v2", [cluster(99, port)], 2000) == (S_OK, [S_OK])
    assert d.call(S + "entities") == [1] and p.call(S + "entities") == [2]
    # force: no traffic, no remote address needed, only this side's entity goes
    assert d.call(K + "unlink_clusters_v2", [(1, 0, [], [])], 2000, True) == (S_OK, [S_OK])
    assert d.call(S + "entities") == [] and p.call(S + "entities") == [2]
    # P's stale entity is replaced by the next link (force_link: D has none for P)
    assert d.call(K + "link_clusters_v2", [cluster(1, port)], 2000) == (S_OK, [S_OK])
    assert d.call(S + "entities") == [1] and p.call(S + "entities") == [2]


def test_missing_local_ip_without_comm_res(fresh: tuple[Peer, Peer]) -> None:
    p, d = fresh
    port = free_port()
    assert p.call(S + "init", 1, options("Prompt", port)) == S_OK
    assert d.call(S + "init", 2, options("Decoder")) == S_OK
    assert d.call(K + "link_clusters_v2", [cluster(1, port, local=False)], 2000) \
        == (PARAM_INVALID, [PARAM_INVALID])
    assert d.call(S + "entities") == []


@pytest.mark.parametrize("p_ra, d_ra", [("1", "0"), ("0", "1"), ("1", None)])
def test_remote_accessible_flags_must_match(fresh: tuple[Peer, Peer], p_ra: str,
                                            d_ra: str | None) -> None:
    # PYPKG.md §4.9 item 4: a mismatch fails the link with PARAM_INVALID, no entity on either side
    p, d = fresh
    port = free_port()
    assert p.call(S + "init", 1, options("Prompt", port, ra=p_ra)) == S_OK
    assert d.call(S + "init", 2, options("Decoder", ra=d_ra)) == S_OK
    assert d.call(K + "link_clusters_v2", [cluster(1, port)], 2000) == (PARAM_INVALID, [PARAM_INVALID])
    assert d.call(S + "entities") == [] and p.call(S + "entities") == []


def test_equal_flags_off_link(fresh: tuple[Peer, Peer]) -> None:
    p, d = fresh
    port = free_port()
    assert p.call(S + "init", 1, options("Prompt", port, ra="0")) == S_OK
    assert d.call(S + "init", 2, options("Decoder", ra=None)) == S_OK
    assert d.call(K + "link_clusters_v2", [cluster(1, port)], 2000) == (S_OK, [S_OK])


def test_hixl_links_are_one_directional_under_the_given_id(fresh: tuple[Peer, Peer]) -> None:
    p, d = fresh
    pp, dp = free_port(), free_port()
    hixl = {"llm_TransferBackend": "hixl"}
    assert p.call(S + "init", 1, options("Prompt", pp, **hixl)) == S_OK
    assert d.call(S + "init", 2, options("Decoder", dp, **hixl)) == S_OK
    assert d.call(K + "link_clusters_v2", [cluster(77, pp, local=False)], 2000) == (S_OK, [S_OK])
    assert d.call(S + "entities") == [77] and p.call(S + "entities") == []
    # the same engine again (under any id): already connected
    assert d.call(K + "link_clusters_v2", [cluster(1, pp)], 2000) == (ALREADY_LINK, [ALREADY_LINK])
    # hixl: no link check in switch_role; the unlink ignores force and remote addresses
    assert d.call(L + "switch_role_v2", "Prompt", {}) == S_OK
    assert d.call(K + "unlink_clusters_v2", [(77, 0, [], [])], 2000, False) == (S_OK, [S_OK])
    assert d.call(S + "entities") == []
    assert d.call(K + "link_clusters_v2", [cluster(1, pp)], 2000) == (S_OK, [S_OK])
    assert d.call(S + "entities") == [1]


def test_local_comm_res_is_checked_at_link_time(fresh: tuple[Peer, Peer]) -> None:
    # PYPKG.md §2.3: llm.LocalCommRes is not validated by initialize; a link checks both sides'
    p, d = fresh
    port = free_port()
    assert p.call(S + "init", 1, options("Prompt", port)) == S_OK
    assert d.call(S + "init", 2, options("Decoder", llm_LocalCommRes="{not json")) == S_OK
    # a non-empty resource: no local IP needed, but it must be a valid one
    assert d.call(K + "link_clusters_v2", [cluster(1, port, local=False)], 2000) \
        == (PARAM_INVALID, [PARAM_INVALID])
    assert d.call(S + "entities") == [] and p.call(S + "entities") == []


@pytest.mark.parametrize("garbage", [b"", b"{", b"[]", b'{"ra": 1, "comm": null, "members": []}',
                                     b'{"ra": true, "comm": null, "members": [[1]]}',
                                     b'{"ra": true, "comm": null, "members": []}' + b" " * 3000,
                                     b"[" * 2000 + b"]" * 2000])
def test_a_malformed_claim_is_refused(fresh: tuple[Peer, Peer], garbage: bytes) -> None:
    # a peer (holding the fabric secret) whose handshake entry is not a valid claim: refused
    # before any entity is made, and the acceptor keeps serving
    p, d = fresh
    port = free_port()
    assert p.call(S + "init", 1, options("Prompt", port)) == S_OK
    assert d.call(S + "init", 2, options("Decoder")) == S_OK
    d.call(S + "state_garbage", garbage)
    try:
        assert d.call(K + "link_clusters_v2", [cluster(1, port)], 2000) == (LINK_FAILED, [LINK_FAILED])
        assert p.call(S + "entities") == [] and d.call(S + "entities") == []
    finally:
        d.call(S + "state_normally")
    assert d.call(K + "link_clusters_v2", [cluster(1, port)], 2000) == (S_OK, [S_OK])
