"""HIXL's "already linked" check comes before any dialling (SEMANTICS.md §3.5, HIXL per-cluster).

A link to an address this instance still holds a connection to returns LLM_ALREADY_LINK without
connecting: so it does even when the peer has gone away meanwhile, and an injected link fault
(which stands in for the connection attempt) does not fire.
"""

from __future__ import annotations

import pytest

from kvdd import ClusterInfo, IpInfo, Status

from .harness import ALREADY_LINK, LOCALHOST, Node, World, link, pair, raises

S = Status.LLM_SUCCESS
ALREADY = [Status.LLM_ALREADY_LINK]


def _relink(d: Node, port: int, cluster_id: int) -> list[Status]:
    return d.link_clusters([ClusterInfo(remote_cluster_id=cluster_id,
                                        remote_ip_infos=[IpInfo(LOCALHOST, port)],
                                        local_ip_infos=[IpInfo(LOCALHOST, 0)])])


def test_relink_to_a_vanished_peer_is_already_linked(world: World) -> None:
    d, p = pair(world, "hixl")
    port = p.listen_port
    assert port
    assert link(d, p) == [S]
    p.finalize()  # the peer's listener is gone: dialling it now would fail
    with raises(ALREADY_LINK, rets=ALREADY):
        _relink(d, port, p.cluster_id)
    with raises(ALREADY_LINK, rets=ALREADY):  # under another id, too: the address decides
        _relink(d, port, p.cluster_id + 10)


@pytest.mark.kvdd_sim_only("fault injection is the simulator's")
def test_relink_is_already_linked_before_an_armed_link_fault(world: World) -> None:
    from kvdd.sim import faults

    d, p = pair(world, "hixl")
    assert link(d, p) == [S]
    with faults.inject("link", status=Status.LLM_LINK_FAILED, count=1) as inj:
        with raises(ALREADY_LINK, rets=ALREADY):
            link(d, p)
        assert inj.fired == 0
