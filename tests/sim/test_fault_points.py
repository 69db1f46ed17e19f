"""Fault injection (kvdd.sim.faults), where faults fire: link, unlink, register, the four
transfers and a lost peer, each after the call's own checks, with upstream's consequences.

Also SEMANTICS.md §6 scenarios that need a hardware fault: #14 (auto local comm res), #30 (HCCL
prepare timeout on link) and #58 (stream-sync timeout on a transfer, then the link is broken: §10
rule 8).  Every transfer test checks the exact destination bytes, and that a failed transfer moved
none.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, IpInfo, Status
from kvdd.sim import faults

from fault_pair import DESC, LOCAL, N, SHAPE, Pair, cluster, expect, make_node, rows
from fault_pair import no_leftover_faults, pair  # noqa: F401  (the modules' fixtures)



# ---- link ------------------------------------------------------------------------------------


def test_scenario_30_link_prepare_timeout() -> None:
    """§6 #30: HCCL prepare times out → LinkLlmClusters returns LLM_TIMEOUT (rets too)."""
    p, d = make_node(1, True, 1), make_node(2, False, 2)
    try:
        with faults.inject("link", status=Status.LLM_TIMEOUT, count=1) as inj:
            err = expect(Status.LLM_TIMEOUT, lambda: d.dd.link_llm_clusters([cluster(p)]))
            assert err.rets == [Status.LLM_TIMEOUT]
            assert isinstance(err, kvdd.LLMTimeoutError)
            assert inj.fired == 1
        # nothing was created on either side: both can still change role, the retry links
        p.dd.set_role(kvdd.LlmRole.PROMPT, {kvdd.OPTION_LISTEN_IP_INFO: f"{LOCAL}:0"})
        d.dd.set_role(kvdd.LlmRole.DECODER)
        assert d.dd.link_llm_clusters([cluster(p)]) == [Status.LLM_SUCCESS]
    finally:
        d.dd.finalize()
        p.dd.finalize()


def test_link_fault_is_per_cluster_and_last_failure_wins() -> None:
    p1, p2, d = make_node(1, True, 1), make_node(3, True, 3), make_node(2, False, 2)
    try:
        with faults.inject("link", status="LLM_LINK_FAILED", peer=1):
            err = expect(Status.LLM_LINK_FAILED, lambda: d.dd.link_llm_clusters([cluster(p1), cluster(p2)]))
        assert err.rets == [Status.LLM_LINK_FAILED, Status.LLM_SUCCESS]
        d.dd.pull_kv_cache(CacheIndex(3, p2.cache_id), Cache(cache_id=d.cache_id))
        expect(Status.LLM_NOT_YET_LINK, lambda: d.dd.pull_kv_cache(CacheIndex(1, p1.cache_id),
                                                                    Cache(cache_id=d.cache_id)))
    finally:
        for n in (d, p1, p2):
            n.dd.finalize()


def test_link_validation_wins_over_faults() -> None:
    p, d = make_node(1, True, 1), make_node(2, False, 2)
    try:
        with faults.inject("link", status="LLM_LINK_FAILED") as inj:
            expect(Status.LLM_PARAM_INVALID, lambda: d.dd.link_llm_clusters([cluster(p)], timeout_ms=0))
            expect(Status.LLM_PARAM_INVALID, lambda: d.dd.link_llm_clusters([]))
            two = ClusterInfo(remote_cluster_id=1, local_ip_infos=(IpInfo(LOCAL),),
                              remote_ip_infos=(IpInfo(LOCAL, 1), IpInfo(LOCAL, 2)))
            err = expect(Status.LLM_PARAM_INVALID, lambda: d.dd.link_llm_clusters([two]))
            assert err.rets == [Status.LLM_PARAM_INVALID]
            no_local = ClusterInfo(remote_cluster_id=1, remote_ip_infos=(IpInfo(LOCAL, 1),))
            expect(Status.LLM_PARAM_INVALID, lambda: d.dd.link_llm_clusters([no_local]))
            assert inj.seen == 0  # never reached the injection point
            d.dd.finalize()
            expect(Status.LLM_FAILED, lambda: d.dd.link_llm_clusters([cluster(p)]))
            assert inj.seen == 0
    finally:
        d.dd.finalize()
        p.dd.finalize()


def test_link_delay_beyond_the_timeout_is_a_timeout() -> None:
    p, d = make_node(1, True, 1), make_node(2, False, 2)
    try:
        with faults.inject("link", delay_ms=30):
            expect(Status.LLM_TIMEOUT, lambda: d.dd.link_llm_clusters([cluster(p)], timeout_ms=10))
            assert d.dd.link_llm_clusters([cluster(p)], timeout_ms=1000) == [Status.LLM_SUCCESS]
    finally:
        d.dd.finalize()
        p.dd.finalize()


# ---- unlink ----------------------------------------------------------------------------------


def test_unlink_fault_keeps_the_link(pair: Pair) -> None:
    with faults.inject("unlink", status=Status.LLM_UNLINK_FAILED, count=1):
        err = expect(Status.LLM_UNLINK_FAILED, pair.unlink)
        assert err.rets == [Status.LLM_UNLINK_FAILED]
    pair.pull(1)  # still linked on both sides
    assert rows(pair.d.mem, 1) == rows(pair.p.mem, 1)
    assert pair.unlink() == [Status.LLM_SUCCESS]
    expect(Status.LLM_NOT_YET_LINK, pair.pull)


def test_force_unlink_fault(pair: Pair) -> None:
    with faults.inject("unlink", status="LLM_FAILED", count=1):
        expect(Status.LLM_FAILED, lambda: pair.unlink(force=True))
    pair.pull()
    assert pair.unlink(force=True) == [Status.LLM_SUCCESS]


# ---- register --------------------------------------------------------------------------------


def test_register_fault_burns_an_id_and_validation_wins() -> None:
    n = make_node(1, False, 1)
    try:
        mem = [np.zeros(256, np.uint8) for _ in range(N)]
        with faults.inject("register", status=Status.LLM_OUT_OF_MEMORY, count=1) as inj:
            expect(Status.LLM_PARAM_INVALID, lambda: n.dd.register_kv_cache(DESC, []))
            expect(Status.LLM_PARAM_INVALID, lambda: n.dd.register_kv_cache(CacheDesc(N, 28, SHAPE),
                                                                             kvdd.tensor_addrs(mem)))
            assert inj.seen == 0
            expect(Status.LLM_OUT_OF_MEMORY, lambda: n.dd.register_kv_cache(DESC, kvdd.tensor_addrs(mem)))
        # ids: 1 (fixture), 2 burnt by the bad dtype (§3.7 step 7), 3 burnt by the fault
        assert n.dd.register_kv_cache(DESC, kvdd.tensor_addrs(mem)) == 4
    finally:
        n.dd.finalize()


# ---- transfers -------------------------------------------------------------------------------

TRANSFERS: dict[str, Callable[[Pair], None]] = {
    "pull_kv_cache": lambda pr: pr.pull(2),
    "pull_kv_blocks": lambda pr: pr.pull_blocks([0, 1, 3], [2, 3, 0]),
    "push_kv_cache": lambda pr: pr.push(2),
    "push_kv_blocks": lambda pr: pr.push_blocks([0, 1, 3], [2, 3, 0]),
}


@pytest.mark.parametrize("kind", faults.TRANSFER_KINDS)
def test_transfer_timeout_moves_no_bytes_and_breaks_the_link(pair: Pair, kind: str) -> None:
    """§10 rules 7-9: an injected TIMEOUT moves nothing; the link then times out at once until
    relinked; validation errors still come first and do not consume the fault."""
    before = (pair.p.snapshot(), pair.d.snapshot())
    with faults.inject(kind, status=Status.LLM_TIMEOUT, count=1) as inj:
        if kind.startswith("pull"):
            expect(Status.LLM_PARAM_INVALID, lambda: pair.d.dd.pull_kv_cache(
                CacheIndex(1, pair.p.cache_id), Cache(cache_id=pair.d.cache_id), size=0))
            expect(Status.LLM_PARAM_INVALID, lambda: pair.pull_blocks([0], [4]))
        else:
            expect(Status.LLM_PARAM_INVALID, lambda: pair.push(4))
            expect(Status.LLM_PARAM_INVALID, lambda: pair.push_blocks([4], [0]))
        expect(Status.LLM_KV_CACHE_NOT_EXIST, lambda: pair.d.dd.pull_kv_cache(
            CacheIndex(1, 99), Cache(cache_id=pair.d.cache_id)))
        assert inj.fired == 0
        expect(Status.LLM_TIMEOUT, lambda: TRANSFERS[kind](pair))
        assert inj.fired == 1
    assert (pair.p.snapshot(), pair.d.snapshot()) == before
    for other in TRANSFERS.values():  # broken for every kind of transfer, without any fault
        err = expect(Status.LLM_TIMEOUT, lambda: other(pair))
        assert "kvdd rule 8" in str(err)
    assert (pair.p.snapshot(), pair.d.snapshot()) == before
    # validation still comes before the broken link
    expect(Status.LLM_PARAM_INVALID, lambda: pair.push(4))
    pair.unlink()
    pair.link()
    pair.pull(1)
    assert rows(pair.d.mem, 1) == rows(pair.p.mem, 1)


def test_scenario_58_stream_sync_timeout_on_pull_blocks(pair: Pair) -> None:
    """§6 #58 (PullCache_D2D_B2B_BatchGet): the stream sync times out → LLM_TIMEOUT, link broken."""
    before = pair.d.snapshot()
    with faults.inject("pull_kv_blocks", status=Status.LLM_TIMEOUT, count=1):
        expect(Status.LLM_TIMEOUT, lambda: pair.pull_blocks([0, 1], [1, 2]))
    assert pair.d.snapshot() == before
    expect(Status.LLM_TIMEOUT, lambda: pair.pull_blocks([0, 1], [1, 2]))
    pair.unlink()
    pair.link()
    pair.pull_blocks([0, 1], [1, 2])
    assert [m[64:192].tobytes() for m in pair.d.mem] == [m[0:128].tobytes() for m in pair.p.mem]


def test_scenario_58_by_a_slow_link(pair: Pair) -> None:
    """The same timeout produced by slowness: a transfer that would take longer than
    llm.SyncKvCacheWaitTime (here 20 ms) returns LLM_TIMEOUT after that time, moving no bytes."""
    d = make_node(3, False, 3, {kvdd.OPTION_SYNC_CACHE_WAIT_TIME: "20"})
    try:
        d.dd.link_llm_clusters([cluster(pair.p)])
        idx = CacheIndex(1, pair.p.cache_id)
        before = d.snapshot()
        with faults.inject("pull", bandwidth=1000, instance=3):  # 256 bytes at 1 kB/s: 256 ms
            expect(Status.LLM_TIMEOUT, lambda: d.dd.pull_kv_cache(idx, Cache(cache_id=d.cache_id)))
        assert d.snapshot() == before
        expect(Status.LLM_TIMEOUT, lambda: d.dd.pull_kv_cache(idx, Cache(cache_id=d.cache_id)))
        pair.pull()  # instance 2's link to 1 is a different link: unaffected
        with faults.inject("pull", delay_ms=1, bandwidth=1e9):  # fast enough: bytes move
            pair.pull(3)
        assert rows(pair.d.mem, 3) == rows(pair.p.mem, 3)
    finally:
        d.dd.finalize()


def test_non_timeout_transfer_fault_leaves_the_link_usable(pair: Pair) -> None:
    with faults.inject("push_kv_cache", status=Status.LLM_KV_CACHE_NOT_EXIST, count=1):
        before = pair.p.snapshot()
        expect(Status.LLM_KV_CACHE_NOT_EXIST, lambda: pair.push(1))
        assert pair.p.snapshot() == before
    pair.push(1)
    assert rows(pair.p.mem, 1) == rows(pair.d.mem, 1)


def test_multi_layer_push_fault_writes_no_layer(pair: Pair) -> None:
    """A multi-layer push is one call with one decision, before any layer is written."""
    before = pair.p.snapshot()
    with faults.inject("push_kv_cache", status=Status.LLM_TIMEOUT, count=1):
        expect(Status.LLM_TIMEOUT, lambda: pair.push(0))  # default ext: all 2 layers
    assert pair.p.snapshot() == before
    # the layers of one call do not count as separate calls
    pair.unlink()
    pair.link()
    with faults.inject("push_kv_cache", status=Status.LLM_TIMEOUT, after=1) as inj:
        pair.push(0)
        assert inj.seen == 1 and inj.fired == 0
        assert rows(pair.p.mem, 0) == rows(pair.d.mem, 0)
        expect(Status.LLM_TIMEOUT, lambda: pair.push(1))


# ---- peer loss --------------------------------------------------------------------------------


def test_peer_loss(pair: Pair) -> None:
    before = (pair.p.snapshot(), pair.d.snapshot())
    with faults.lose_peer(peer=1, instance=2) as inj:
        assert inj.peer_loss
        expect(Status.LLM_TIMEOUT, pair.pull)  # §10 rule 2: the owner cannot be reached
        assert (pair.p.snapshot(), pair.d.snapshot()) == before
        err = expect(Status.LLM_UNLINK_FAILED, pair.unlink)
        assert err.rets == [Status.LLM_UNLINK_FAILED]
        expect(Status.LLM_TIMEOUT, lambda: pair.push(0))  # broken (rule 8) and lost
        pair.d.dd.register_kv_cache(DESC, kvdd.tensor_addrs(pair.d.mem))  # local: unaffected
        assert pair.unlink(force=True) == [Status.LLM_SUCCESS]  # local only: no network needed
        expect(Status.LLM_LINK_FAILED, pair.link)
        src = Cache(cache_id=pair.p.cache_id, cache_desc=DESC)
        pair.p.dd.push_kv_cache(src, CacheIndex(2, pair.d.cache_id))  # the peer itself is fine
    assert rows(pair.d.mem, 0) == rows(pair.p.mem, 0)
    pair.link()
    pair.pull(2)
    assert rows(pair.d.mem, 2) == rows(pair.p.mem, 2)


def test_peer_loss_from_env_syntax(pair: Pair) -> None:
    (inj,) = faults.load("peer_loss:peer=1:kinds=pull_kv_cache+pull_kv_blocks")
    expect(Status.LLM_TIMEOUT, pair.pull)
    inj.remove()
    expect(Status.LLM_TIMEOUT, lambda: pair.push(0))  # the link stays broken until relinked
    pair.unlink()
    pair.link()
    pair.push(0)


# ---- SEMANTICS.md §6 #14 ----------------------------------------------------------------------


def test_scenario_14_auto_local_comm_res_with_device_9() -> None:
    """§6 #14 (TestAutoLocalCommResWithoutDeviceIp): no llm.LocalCommRes, device 9 (no device IP
    known) and a listen IP → Initialize SUCCESS; the generated resource is good enough to link."""
    p = make_node(1, True, 1, {kvdd.OPTION_DEVICE_ID: "9"})
    d = make_node(2, False, 2)
    try:
        assert p.dd.listen_port is not None
        assert d.dd.link_llm_clusters([cluster(p)]) == [Status.LLM_SUCCESS]
        d.dd.pull_kv_cache(CacheIndex(1, p.cache_id), Cache(cache_id=d.cache_id))
        assert rows(d.mem, 0) == rows(p.mem, 0)
    finally:
        d.dd.finalize()
        p.dd.finalize()
