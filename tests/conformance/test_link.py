"""LinkLlmClusters / UnlinkLlmClusters: SEMANTICS.md §2.3, §3.5, §3.6, §4, §6 scenarios 27-38,
§7.1, §7.16-20, kvdd rule §10.6."""

from __future__ import annotations

import time

import pytest

from kvdd import ClusterInfo, IpInfo, LlmRole, Status

from .checked import (
    pull_cache_checked,
    push_cache_checked,
)
from .harness import (
    ALREADY_LINK,
    EXIST_LINK,
    LINK_FAILED,
    LOCALHOST,
    NOT_YET_LINK,
    PARAM_INVALID,
    UNLINK_FAILED,
    CacheHandle,
    Node,
    World,
    cluster,
    free_port,
    link,
    pair,
    raises,
    unlink,
)

S = Status.LLM_SUCCESS
PI = Status.LLM_PARAM_INVALID
LF = Status.LLM_LINK_FAILED


def _port(n: Node) -> int:
    port = n.listen_port
    assert port
    return port


def _linked(world: World, d: Node, ph: CacheHandle, dh: CacheHandle, *,
            cluster_id: int | None = None) -> None:
    """D can pull from P over the link (bytes checked)."""
    pull_cache_checked(world, d, ph, dh, index=ph.index(cluster_id=cluster_id))


def _not_linked(world: World, d: Node, ph: CacheHandle, dh: CacheHandle, *,
                cluster_id: int | None = None) -> None:
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(cluster_id=cluster_id), dh.cache())


def test_s27_link_and_unlink(world: World, transfer: str) -> None:
    d, p = pair(world, transfer)
    ph, dh = p.register(), d.register()
    _not_linked(world, d, ph, dh)
    assert link(d, p) == [S]
    _linked(world, d, ph, dh)
    assert unlink(d, p) == [S]
    _not_linked(world, d, ph, dh)
    assert link(d, p) == [S]  # and it can be linked again
    _linked(world, d, ph, dh)


def test_s28_link_refused_is_link_failed_at_once(world: World, transfer: str) -> None:
    d = world.dut()
    d.initialize(transfer=transfer)
    start = time.monotonic()
    with raises(LINK_FAILED, rets=[LF]):
        d.link(free_port(), 1, timeout_ms=60_000)
    # kvdd rule 6: at once, without retrying (generous bound: the timeout is 60 s).
    assert time.monotonic() - start < 30


def test_link_to_port_0_is_link_failed(world: World, transfer: str) -> None:
    d = world.dut()
    d.initialize(transfer=transfer)
    with raises(LINK_FAILED, rets=[LF]):
        d.link(0, 1)


def test_s29_link_twice_already_link(world: World, transfer: str) -> None:
    d, p = pair(world, transfer)
    ph, dh = p.register(), d.register()
    link(d, p)
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p)
    _linked(world, d, ph, dh)  # the existing link is intact


@pytest.mark.parametrize("timeout_ms", [0, -1, -(2**31)])
def test_s31_bad_timeout(world: World, transfer: str, timeout_ms: int) -> None:
    d, p = pair(world, transfer)
    ph, dh = p.register(), d.register()
    with raises(PARAM_INVALID, rets=[]):
        d.link_clusters([cluster(_port(p), 1)], timeout_ms)
    _not_linked(world, d, ph, dh)
    link(d, p)
    with raises(PARAM_INVALID, rets=[]):
        d.unlink_clusters([cluster(_port(p), 1)], timeout_ms)
    with raises(PARAM_INVALID, rets=[]):
        d.unlink_clusters([cluster(_port(p), 1)], timeout_ms, force=True)
    _linked(world, d, ph, dh)


def test_s32_empty_clusters(world: World, transfer: str) -> None:
    d = world.dut()
    d.initialize(transfer=transfer)
    with raises(PARAM_INVALID, rets=[]):
        d.link_clusters([])
    with raises(PARAM_INVALID, rets=[]):
        d.unlink_clusters([])
    with raises(PARAM_INVALID, rets=[]):
        d.unlink_clusters([], force=True)


@pytest.mark.parametrize("where,ip", [
    ("remote", ""), ("remote", "::1"), ("remote", "localhost"), ("remote", "[::1]"),
    ("remote", "1.2.3"), ("local", ""), ("local", "::1"), ("local", "fe80::1"),
])
def test_s33_bad_ip_aborts_whole_call(world: World, transfer: str, where: str, ip: str) -> None:
    d, p = pair(world, transfer)
    ph, dh = p.register(), d.register()
    good = cluster(_port(p), 1)
    if where == "remote":
        bad = ClusterInfo(remote_cluster_id=7, remote_ip_infos=(IpInfo(ip, 1),))
    else:
        bad = ClusterInfo(remote_cluster_id=7, remote_ip_infos=(IpInfo(LOCALHOST, 1),),
                          local_ip_infos=(IpInfo(ip, 0),))
    with raises(PARAM_INVALID, rets=[]):  # §3.5 step 3: before any cluster is processed
        d.link_clusters([good, bad])
    _not_linked(world, d, ph, dh)
    link(d, p)
    with raises(PARAM_INVALID, rets=[]):  # §3.6: same conversion for unlink
        d.unlink_clusters([good, bad])
    _linked(world, d, ph, dh)


def test_s33_ip_checked_before_empty_list_and_timeout_first(world: World) -> None:
    # §3.5 order: timeout (step 2) and IP conversion (step 3) are both PARAM_INVALID with rets
    # untouched; a refused port never gets contacted when a later cluster has a bad IP.
    d = world.dut()
    d.initialize()
    bad = ClusterInfo(remote_cluster_id=7, remote_ip_infos=(IpInfo("::1", 1),))
    with raises(PARAM_INVALID, rets=[]):
        d.link_clusters([cluster(free_port(), 1), bad], timeout_ms=0)
    with raises(PARAM_INVALID, rets=[]):
        d.link_clusters([cluster(free_port(), 1), bad])


@pytest.mark.parametrize("n_remote", [0, 2])
def test_s34_remote_ip_count_per_cluster(world: World, transfer: str, n_remote: int) -> None:
    d, p = pair(world, transfer)
    ph, dh = p.register(), d.register()
    infos = tuple(IpInfo(LOCALHOST, _port(p)) for _ in range(n_remote))
    bad = ClusterInfo(remote_cluster_id=1, remote_ip_infos=infos,
                      local_ip_infos=(IpInfo(LOCALHOST, 0),))
    with raises(PARAM_INVALID, rets=[PI]):
        d.link_clusters([bad])
    _not_linked(world, d, ph, dh)


def test_s34_rets_in_order_and_good_clusters_linked(world: World, transfer: str) -> None:
    d, p = pair(world, transfer)
    p2 = world.peer(3)
    p2.initialize(listen=True, transfer=transfer)
    ph, p2h, dh = p.register(), p2.register(), d.register()
    two_ips = ClusterInfo(remote_cluster_id=9, remote_ip_infos=(IpInfo(LOCALHOST, 1),) * 2,
                          local_ip_infos=(IpInfo(LOCALHOST, 0),))
    with raises(PARAM_INVALID, rets=[S, PI, S]):
        d.link_clusters([cluster(_port(p), 1), two_ips, cluster(_port(p2), 3)])
    _linked(world, d, ph, dh)
    _linked(world, d, p2h, dh)


@pytest.mark.parametrize("refused_last", [True, False])
def test_last_failing_cluster_wins(world: World, transfer: str, refused_last: bool) -> None:
    # §3.5 step 5 / §7.17: overall status = the last failing cluster's.
    d = world.dut()
    d.initialize(transfer=transfer)
    two_ips = ClusterInfo(remote_cluster_id=9, remote_ip_infos=(IpInfo(LOCALHOST, 1),) * 2,
                          local_ip_infos=(IpInfo(LOCALHOST, 0),))
    refused = cluster(free_port(), 8)
    if refused_last:
        with raises(LINK_FAILED, rets=[PI, LF]):
            d.link_clusters([two_ips, refused])
    else:
        with raises(PARAM_INVALID, rets=[LF, PI]):
            d.link_clusters([refused, two_ips])


@pytest.mark.parametrize("n_local", [0, 2])
def test_s35_comm_local_ip_required_without_listen(world: World, n_local: int) -> None:
    d, p = pair(world, "comm")
    ph, dh = p.register(), d.register()
    c = ClusterInfo(remote_cluster_id=1, remote_ip_infos=(IpInfo(LOCALHOST, _port(p)),),
                    local_ip_infos=(IpInfo(LOCALHOST, 0),) * n_local)
    with raises(PARAM_INVALID, rets=[PI]):
        d.link_clusters([c])
    _not_linked(world, d, ph, dh)


def test_s35_local_ip_not_needed_when_listening(world: World, transfer: str) -> None:
    d, p = pair(world, transfer, d_listen=True)
    ph, dh = p.register(), d.register()
    assert d.link(_port(p), 1, local_ip=False) == [S]
    _linked(world, d, ph, dh)


def test_s36_chain(world: World, transfer: str) -> None:
    # D (listening) links to P; P2 links to D: all succeed; both unlinks succeed.
    d, p = pair(world, transfer, d_listen=True)
    p2 = world.peer(3)
    p2.initialize(listen=transfer == "hixl", transfer=transfer)
    ph, dh = p.register(), d.register()
    p2h = p2.register()
    assert link(d, p) == [S]
    assert link(p2, d) == [S]
    _linked(world, d, ph, dh)
    pull_cache_checked(world, p2, dh, p2h)  # P2 reads D's memory over its link
    assert unlink(p2, d) == [S]
    assert unlink(d, p) == [S]
    _not_linked(world, d, ph, dh)


@pytest.mark.parametrize("force", [True, False])
def test_s37_unlink_never_linked(world: World, transfer: str, force: bool) -> None:
    d, p = pair(world, transfer)
    if force or transfer == "hixl":
        # force (or hixl, which never contacts the peer): empty remote_ip_infos allowed
        assert d.unlink_clusters([ClusterInfo(remote_cluster_id=1)], force=force) == [S]
    # non-force on comm connects to the peer, which answers (absent entity -> success)
    assert unlink(d, p, force=force) == [S]


def test_s38_non_force_unlink_refused(world: World) -> None:
    d, p = pair(world, "comm")
    ph, dh = p.register(), d.register()
    link(d, p)
    port = _port(p)
    p.finalize()  # stops listening
    with raises(UNLINK_FAILED, rets=[Status.LLM_UNLINK_FAILED]):
        d.unlink(port, 1)
    with raises(UNLINK_FAILED, rets=[Status.LLM_UNLINK_FAILED]):
        d.unlink(free_port(), 5)


def test_comm_non_force_unlink_needs_one_remote_ip(world: World) -> None:
    d, p = pair(world, "comm")
    link(d, p)
    with raises(PARAM_INVALID, rets=[PI]):
        d.unlink_clusters([ClusterInfo(remote_cluster_id=1)])


def test_comm_force_unlink_is_local_only(world: World) -> None:
    # §3.6: force destroys only the local entity; the peer keeps its own (docs: force both sides).
    d, p = pair(world, "comm")
    ph, dh = p.register(), d.register()
    link(d, p)
    assert d.unlink_clusters([ClusterInfo(remote_cluster_id=1)], force=True) == [S]
    _not_linked(world, d, ph, dh)
    d.set_role(LlmRole.DECODER)  # no link left on D
    with raises(EXIST_LINK):
        p.set_role(LlmRole.PROMPT)  # P still has its entity


def test_comm_non_force_unlink_tears_down_both_sides(world: World) -> None:
    d, p = pair(world, "comm")
    ph, dh = p.register(), d.register()
    link(d, p)
    assert unlink(d, p) == [S]
    _not_linked(world, d, ph, dh)
    with world.rejects(NOT_YET_LINK):
        p.pull_kv_cache(dh.index(), ph.cache())
    p.set_role(LlmRole.PROMPT)
    d.set_role(LlmRole.DECODER)


def test_comm_link_is_bidirectional(world: World) -> None:
    # §2.3 / §7.19: the acceptor (P, a sim peer as caller) can pull from and push to D.
    d, p = pair(world, "comm")
    ph, dh = p.register(), d.register()
    link(d, p)
    pull_cache_checked(world, p, dh, ph, batch_index=1, src_batch=2)
    push_cache_checked(world, p, ph, dh, src_batch_index=3, dst_batch=0)


def test_hixl_link_is_one_way(world: World) -> None:
    # §2.3 / §7.19: only the initiator has an entity.
    d, p = pair(world, "hixl")
    ph, dh = p.register(), d.register()
    link(d, p)
    _linked(world, d, ph, dh)
    with world.rejects(NOT_YET_LINK):
        p.pull_kv_cache(dh.index(), ph.cache())
    with world.rejects(NOT_YET_LINK):
        p.push_kv_cache(ph.cache(), dh.index())
    p.set_role(LlmRole.PROMPT)


def test_comm_keyed_by_real_peer_id(world: World) -> None:
    # §2.3 / §7.18: a wrong remote_cluster_id still links, relinks each time, and the entity is the
    # peer's real id.
    d, p = pair(world, "comm")
    ph, dh = p.register(), d.register()
    assert link(d, p, remote_cluster_id=99) == [S]
    assert link(d, p, remote_cluster_id=99) == [S]  # never ALREADY_LINK: force relink
    _linked(world, d, ph, dh)
    _not_linked(world, d, ph, dh, cluster_id=99)
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p)  # the real id has an entity on both sides


def test_comm_non_force_unlink_with_wrong_id_keeps_local_entity(world: World) -> None:
    # §7.18: the peer destroys its side, the local destroy uses the wrong id.
    d, p = pair(world, "comm")
    p.register()
    link(d, p, remote_cluster_id=99)
    assert unlink(d, p, remote_cluster_id=99) == [S]
    p.set_role(LlmRole.PROMPT)  # P's entity is gone
    with raises(EXIST_LINK):
        d.set_role(LlmRole.DECODER)  # D's entity (key 1) is alive


def test_comm_link_after_a_one_sided_unlink_is_refused_by_the_local_side(world: World) -> None:
    # §3.5 d-e: after a non-force unlink with a wrong id D keeps its entity for P's real id and P
    # has none; a link by the real id is then not forced: P accepts, D's own acceptance refuses
    d, p = pair(world, "comm")
    p.register()
    link(d, p, remote_cluster_id=99)
    assert unlink(d, p, remote_cluster_id=99) == [S]
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p)


def test_hixl_keyed_by_user_id(world: World) -> None:
    d, p = pair(world, "hixl")
    ph, dh = p.register(), d.register()
    assert link(d, p, remote_cluster_id=99) == [S]
    _linked(world, d, ph, dh, cluster_id=99)
    _not_linked(world, d, ph, dh)  # the real id 1 is not a key
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p)  # the connection is keyed by ip:port
    assert d.unlink_clusters([ClusterInfo(remote_cluster_id=99)]) == [S]
    _not_linked(world, d, ph, dh, cluster_id=99)


def test_hixl_same_user_id_overwrites(world: World) -> None:
    # §3.5 HIXL: the entity is stored under remote_cluster_id, overwriting any previous mapping.
    d, p = pair(world, "hixl")
    p2 = world.peer(3)
    p2.initialize(listen=True, transfer="hixl")
    ph, p2h, dh = p.register(), p2.register(), d.register()
    link(d, p)
    assert link(d, p2, remote_cluster_id=1) == [S]
    _linked(world, d, p2h, dh, cluster_id=1)


def test_hixl_unlink_is_local_and_ignores_force(world: World) -> None:
    # §3.6 HIXL / §7.20: force ignored, peer never contacted (works with the peer gone).
    d, p = pair(world, "hixl")
    ph, dh = p.register(), d.register()
    link(d, p)
    port = _port(p)
    p.finalize()
    assert d.unlink(port, 1, force=False) == [S]
    _not_linked(world, d, ph, dh)


def test_no_cluster_count_limit(world: World, transfer: str) -> None:
    # §7.1: LLM_CLUSTER_NUM_EXCEED_LIMIT is never returned (docs say 16).
    d = world.dut()
    d.initialize(transfer=transfer)
    peers = []
    for cid in range(10, 27):
        q = world.peer(cid)
        q.initialize(listen=True, transfer=transfer)
        peers.append(q)
    rets = d.link_clusters([cluster(_port(q), q.cluster_id) for q in peers])
    assert rets == [S] * 17
    assert d.unlink_clusters([cluster(_port(q), q.cluster_id) for q in peers]) == [S] * 17


def test_remote_role_type_ignored(world: World, transfer: str) -> None:
    # §7.31: ClusterInfo.remote_role_type is ignored.
    d, p = pair(world, transfer)
    ph, dh = p.register(), d.register()
    c = ClusterInfo(remote_cluster_id=1, remote_role_type=-7,
                    remote_ip_infos=(IpInfo(LOCALHOST, _port(p)),),
                    local_ip_infos=(IpInfo(LOCALHOST, 0),))
    assert d.link_clusters([c]) == [S]
    _linked(world, d, ph, dh)
