"""HIXL link bookkeeping: SEMANTICS.md §3.5 (HIXL per-cluster: re-linking an id re-points it and
keeps the old connection open) and §3.6 (HIXL unlink closes only the entity the id names)."""

from __future__ import annotations

from kvdd import ClusterInfo, Status

from .checked import (
    pull_cache_checked,
)
from .harness import (
    ALREADY_LINK,
    NOT_YET_LINK,
    CacheHandle,
    Node,
    World,
    link,
    pair,
    raises,
)

S = Status.LLM_SUCCESS
ALREADY = [Status.LLM_ALREADY_LINK]


def _reaches(world: World, d: Node, dh: CacheHandle, h: CacheHandle, cluster_id: int) -> None:
    """D's link named ``cluster_id`` reads ``h`` (every byte checked)."""
    pull_cache_checked(world, d, h, dh, index=h.index(cluster_id=cluster_id))


def _unlink_id(d: Node, cluster_id: int) -> list[Status]:
    return d.unlink_clusters([ClusterInfo(remote_cluster_id=cluster_id)])


def test_relink_repoints_the_id_and_keeps_the_old_connection(world: World) -> None:
    d, p = pair(world, "hixl")
    p2 = world.peer(3)
    p2.initialize(listen=True, transfer="hixl")
    ph, p2h, dh = p.register(), p2.register(), d.register()
    assert link(d, p) == [S]  # id 1 -> P
    _reaches(world, d, dh, ph, 1)
    assert link(d, p2, remote_cluster_id=1) == [S]  # §3.5: id 1 re-pointed to P2
    _reaches(world, d, dh, p2h, 1)
    # the entity id 1 named before was not finalized: its connection to P is still open
    with raises(ALREADY_LINK, rets=ALREADY):
        link(d, p, remote_cluster_id=5)
    with raises(ALREADY_LINK, rets=ALREADY):
        link(d, p)
    with world.rejects(NOT_YET_LINK):  # no id names P
        d.pull_kv_cache(ph.index(cluster_id=5), dh.cache())


def test_unlink_closes_only_the_entity_the_id_names(world: World) -> None:
    d, p = pair(world, "hixl")
    p2 = world.peer(3)
    p2.initialize(listen=True, transfer="hixl")
    ph, p2h, dh = p.register(), p2.register(), d.register()
    link(d, p)
    link(d, p2, remote_cluster_id=1)
    assert _unlink_id(d, 1) == [S]  # §3.6: P2's connection closes
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(p2h.index(cluster_id=1), dh.cache())
    assert link(d, p2, remote_cluster_id=7) == [S]
    _reaches(world, d, dh, p2h, 7)
    with raises(ALREADY_LINK, rets=ALREADY):  # the re-pointed entity still holds P's connection
        link(d, p, remote_cluster_id=5)
    assert _unlink_id(d, 1) == [S]  # nothing named 1 any more: success, nothing closed
    _reaches(world, d, dh, p2h, 7)


def test_finalize_closes_repointed_connections(world: World) -> None:
    d, p = pair(world, "hixl")
    p2 = world.peer(3)
    p2.initialize(listen=True, transfer="hixl")
    ph = p.register()
    link(d, p)
    link(d, p2, remote_cluster_id=1)
    d.finalize()
    d.initialize(transfer="hixl")
    dh = d.register()
    assert link(d, p, remote_cluster_id=5) == [S]
    _reaches(world, d, dh, ph, 5)


def test_same_engine_same_id_is_already_linked_and_kept(world: World) -> None:
    # §3.5: connecting to an engine already connected -> LLM_ALREADY_LINK; the link stays usable.
    d, p = pair(world, "hixl")
    ph, dh = p.register(), d.register()
    link(d, p)
    with raises(ALREADY_LINK, rets=ALREADY):
        link(d, p)
    _reaches(world, d, dh, ph, 1)
