"""Fault injection (kvdd.sim.faults): statuses, consequences, scope, determinism, env var.

Also SEMANTICS.md §6 scenarios that need a hardware fault: #14 (auto local comm res), #30 (HCCL
prepare timeout on link) and #58 (stream-sync timeout on a transfer, then the link is broken: §10
rule 8).  Every transfer test checks the exact destination bytes, and that a failed transfer moved
none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

import kvdd
from kvdd import (
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LLMError,
    Status,
)
from kvdd.sim import faults

LOCAL = "127.0.0.1"
N, SHAPE = 4, (4, 16)  # 4 tensors of int32 (4, 16): T = 256 B, B = 4, S = 64 B
DESC = CacheDesc(num_tensors=N, data_type=DataType.DT_INT32, shape=SHAPE)
U8 = npt.NDArray[np.uint8]


@pytest.fixture(autouse=True)
def _no_leftover_faults() -> Iterator[None]:
    faults.clear()
    yield
    faults.clear()


@dataclass
class Node:
    dd: kvdd.LlmDataDist
    mem: list[U8]
    cache_id: int

    @property
    def cid(self) -> int:
        return self.dd.cluster_id

    def snapshot(self) -> list[bytes]:
        return [m.tobytes() for m in self.mem]


def make_node(cluster_id: int, listen: bool, fill: int, options: dict[str, str] | None = None) -> Node:
    dd = kvdd.LlmDataDist(cluster_id, kvdd.LlmRole.MIX, backend="sim")
    opts = {kvdd.OPTION_DEVICE_ID: "0"}
    if listen:
        opts[kvdd.OPTION_LISTEN_IP_INFO] = f"{LOCAL}:0"
    opts.update(options or {})
    dd.initialize(opts)
    rng = np.random.default_rng(fill)
    mem = [rng.integers(0, 256, 256, dtype=np.uint8) for _ in range(N)]
    cache_id = dd.register_kv_cache(DESC, kvdd.tensor_addrs(mem))
    return Node(dd, mem, cache_id)


def cluster(to: Node) -> ClusterInfo:
    port = to.dd.listen_port
    assert port is not None
    return ClusterInfo(remote_cluster_id=to.cid, local_ip_infos=(IpInfo(LOCAL),),
                       remote_ip_infos=(IpInfo(LOCAL, port),))


@dataclass
class Pair:
    p: Node  # listens, cluster 1
    d: Node  # links to p, cluster 2

    def link(self) -> list[Status]:
        return self.d.dd.link_llm_clusters([cluster(self.p)])

    def unlink(self, force: bool = False) -> list[Status]:
        return self.d.dd.unlink_llm_clusters([cluster(self.p)], force=force)

    def pull(self, batch: int = 0) -> None:
        self.d.dd.pull_kv_cache(CacheIndex(self.p.cid, self.p.cache_id, batch), Cache(cache_id=self.d.cache_id),
                                batch)

    def pull_blocks(self, src: list[int], dst: list[int]) -> None:
        self.d.dd.pull_kv_blocks(CacheIndex(self.p.cid, self.p.cache_id), Cache(cache_id=self.d.cache_id), src, dst)

    def push(self, batch: int = 0, ext: KvCacheExtParam | None = None) -> None:
        src = Cache(cache_id=self.d.cache_id, cache_desc=DESC)
        self.d.dd.push_kv_cache(src, CacheIndex(self.p.cid, self.p.cache_id, batch), batch, ext_param=ext)

    def push_blocks(self, src: list[int], dst: list[int]) -> None:
        self.d.dd.push_kv_blocks(Cache(cache_id=self.d.cache_id, cache_desc=DESC),
                                 CacheIndex(self.p.cid, self.p.cache_id), src, dst)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = make_node(1, listen=True, fill=11)
    d = make_node(2, listen=False, fill=22)
    pr = Pair(p, d)
    pr.link()
    yield pr
    d.dd.finalize()
    p.dd.finalize()


def expect(status: Status, fn: Callable[[], object]) -> LLMError:
    with pytest.raises(LLMError) as info:
        fn()
    assert info.value.status == status, f"got {info.value}"
    assert type(info.value) is type(LLMError.from_status(status, ""))
    return info.value


def rows(mem: list[U8], batch: int) -> list[bytes]:
    return [m[batch * 64:(batch + 1) * 64].tobytes() for m in mem]


# ---- the API itself --------------------------------------------------------------------------


def test_inject_is_a_context_manager_and_removes_itself() -> None:
    with faults.inject("link", status=Status.LLM_LINK_FAILED) as inj:
        assert inj.active and faults.active() == (inj,)
        assert inj.kinds == frozenset({"link"}) and inj.status == Status.LLM_LINK_FAILED
    assert not inj.active and faults.active() == ()
    inj.remove()  # idempotent


def test_groups_and_status_names() -> None:
    inj = faults.inject(["transfer", "register"], status="timeout")
    assert inj.kinds == frozenset({*faults.TRANSFER_KINDS, "register"})
    assert inj.status == Status.LLM_TIMEOUT
    assert faults.inject("all", status="0x5010B009").kinds == frozenset(faults.CALL_KINDS)
    assert faults.inject("push", status=507053).status == 507053  # raw ACL codes are allowed


@pytest.mark.parametrize("kwargs, exc", [
    ({"kinds": "pull_kv", "status": "LLM_TIMEOUT"}, ValueError),
    ({"kinds": "link"}, ValueError),  # nothing to inject
    ({"kinds": "link", "status": "LLM_SUCCESS"}, ValueError),
    ({"kinds": "link", "status": "NOPE"}, ValueError),
    ({"kinds": "link", "status": 2**32}, ValueError),
    ({"kinds": "link", "status": True}, TypeError),
    ({"kinds": "link", "status": 1.5}, TypeError),
    ({"kinds": "link", "status": "LLM_FAILED", "probability": 1.5}, ValueError),
    ({"kinds": "link", "status": "LLM_FAILED", "count": -1}, ValueError),
    ({"kinds": "link", "status": "LLM_FAILED", "after": -1}, ValueError),
    ({"kinds": "link", "delay_ms": -1.0}, ValueError),
    ({"kinds": "link", "delay_ms": float("nan")}, ValueError),
    ({"kinds": "pull", "bandwidth": 0}, ValueError),
    ({"kinds": "link", "status": "LLM_FAILED", "instance": -1}, ValueError),
    ({"kinds": "link", "status": "LLM_FAILED", "peer": "2"}, TypeError),
    ({"kinds": 7, "status": "LLM_FAILED"}, TypeError),
])
def test_inject_rejects_bad_arguments(kwargs: dict[str, object], exc: type[Exception]) -> None:
    kinds = kwargs.pop("kinds")
    with pytest.raises(exc):
        faults.inject(kinds, **kwargs)  # type: ignore[arg-type]
    assert faults.active() == ()


def test_env_syntax_round_trips() -> None:
    text = ("push_kv_blocks:status=LLM_TIMEOUT:count=1;link:status=LLM_LINK_FAILED:probability=0.5:seed=3;"
            "peer_loss:peer=2:instance=1:after=4;transfer:delay_ms=5:bandwidth=100M;"
            "register,unlink:status=0x1234:p=0.25")
    parsed = faults.parse(text)
    assert [i.active for i in parsed] == [False] * 5
    assert parsed[0].kinds == {"push_kv_blocks"} and parsed[0].count == 1
    assert parsed[1].probability == 0.5 and parsed[1].seed == 3
    assert parsed[2].peer_loss and parsed[2].peer == 2 and parsed[2].instance == 1 and parsed[2].after == 4
    assert parsed[3].bandwidth == 100e6 and parsed[3].delay_ms == 5.0
    assert parsed[3].kinds == set(faults.TRANSFER_KINDS)
    assert parsed[4].status == 0x1234 and parsed[4].kinds == {"register", "unlink"}
    again = faults.parse(";".join(i.spec() for i in parsed))
    assert [i.spec() for i in again] == [i.spec() for i in parsed]
    loaded = faults.load(text)
    assert faults.active() == tuple(loaded)
    assert faults.parse(faults.env_value())[2].spec() == parsed[2].spec()
    assert faults.parse(" ; ;") == []
    assert faults.parse("pull:bandwidth=1Mi")[0].bandwidth == 2**20


@pytest.mark.parametrize("text", [
    "link", "bogus:status=LLM_FAILED", "link:status", "link:status=LLM_FAILED:count=x",
    "link:status=LLM_FAILED:colour=red", "link:status=LLM_FAILED:count=1:count=2",
    "peer_loss:status=LLM_FAILED", "peer_loss:kinds=register", "link:status=LLM_FAILED:kinds=link",
])
def test_env_syntax_errors_name_the_problem(text: str) -> None:
    with pytest.raises(ValueError, match="fault #1"):
        faults.parse(text)


def _child(code: str, env_value: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop(faults.ENV_VAR, None)
    if env_value is not None:
        env[faults.ENV_VAR] = env_value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=60)


def test_env_var_reaches_an_unmodified_child_program() -> None:
    code = """
        import kvdd
        a = kvdd.LlmDataDist(1, 1, backend="sim"); a.initialize({"llm.DeviceId": "0", "llm.ListenIpInfo": "127.0.0.1:0"})
        b = kvdd.LlmDataDist(2, 2, backend="sim"); b.initialize({"llm.DeviceId": "0"})
        c = kvdd.ClusterInfo(remote_cluster_id=1, local_ip_infos=(kvdd.IpInfo("127.0.0.1"),),
                             remote_ip_infos=(kvdd.IpInfo("127.0.0.1", a.listen_port),))
        for attempt in range(3):
            try:
                b.link_llm_clusters([c]); print("linked", attempt); break
            except kvdd.LLMLinkFailedError:
                print("failed", attempt)
    """
    out = _child(code, "link:status=LLM_LINK_FAILED:count=2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["failed 0", "failed 1", "linked 2"]


def test_malformed_env_var_fails_loudly() -> None:
    out = _child("import kvdd; kvdd.LlmDataDist(1, 1, backend='sim')", "link:stauts=LLM_FAILED")
    assert out.returncode != 0
    assert "KVDD_SIM_FAULTS" in out.stderr and "stauts" in out.stderr


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


# ---- scope and determinism --------------------------------------------------------------------


def test_scope_by_instance_and_peer(pair: Pair) -> None:
    with faults.inject("pull_kv_cache", status="LLM_FAILED", instance=1):
        pair.pull()  # instance 2 performs the pull: not affected
    with faults.inject("pull_kv_cache", status="LLM_FAILED", peer=7):
        pair.pull()
    with faults.inject("pull_kv_cache", status="LLM_FAILED", instance=pair.d.dd, peer=1):
        expect(Status.LLM_FAILED, pair.pull)
    # the acceptor side of a default-backend link may transfer too; it is instance 1
    with faults.inject("push_kv_cache", status="LLM_FAILED", instance=1, count=1):
        src = Cache(cache_id=pair.p.cache_id, cache_desc=DESC)
        expect(Status.LLM_FAILED, lambda: pair.p.dd.push_kv_cache(src, CacheIndex(2, pair.d.cache_id)))
        pair.p.dd.push_kv_cache(src, CacheIndex(2, pair.d.cache_id))
    assert rows(pair.d.mem, 0) == rows(pair.p.mem, 0)


def test_count_and_after(pair: Pair) -> None:
    with faults.inject("pull_kv_cache", status="LLM_FAILED", after=2, count=2) as inj:
        results = []
        for _ in range(6):
            try:
                pair.pull()
                results.append(0)
            except LLMError as exc:
                results.append(int(exc.status))
    F = int(Status.LLM_FAILED)
    assert results == [0, 0, F, F, 0, 0]
    assert (inj.seen, inj.fired, inj.exhausted) == (6, 2, True)


def _pattern(seed: int) -> list[int]:
    p = make_node(1, True, 1)
    d = make_node(2, False, 2)
    try:
        d.dd.link_llm_clusters([cluster(p)])
        out = []
        with faults.inject("pull_kv_cache", status=Status.LLM_KV_CACHE_NOT_EXIST, probability=0.5, seed=seed):
            for _ in range(40):
                try:
                    d.dd.pull_kv_cache(CacheIndex(1, p.cache_id), Cache(cache_id=d.cache_id))
                    out.append(0)
                except kvdd.LLMKvCacheNotExistError:
                    out.append(1)
        return out
    finally:
        d.dd.finalize()
        p.dd.finalize()


def test_probability_is_deterministic_per_seed() -> None:
    a, b, c = _pattern(3), _pattern(3), _pattern(4)
    assert a == b
    assert a != c
    assert 5 < sum(a) < 35


def test_paused_suspends_injection_in_this_thread(pair: Pair) -> None:
    with faults.inject("pull", status="LLM_FAILED") as inj:
        with faults.paused():
            pair.pull()
        assert inj.seen == 0
        expect(Status.LLM_FAILED, pair.pull)


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


# ---- the README example: testing a retry loop --------------------------------------------------


def pull_with_retry(dd: kvdd.LlmDataDist, peer: ClusterInfo, idx: CacheIndex, dst: Cache,
                    attempts: int = 4) -> int:
    """What an engine does: retry a pull, relinking after a timeout (the link is then broken)."""
    for attempt in range(attempts):
        try:
            dd.pull_kv_cache(idx, dst)
            return attempt
        except kvdd.LLMTimeoutError:
            dd.unlink_llm_clusters([peer], force=True)
            dd.link_llm_clusters([peer])
    raise RuntimeError("gave up")


def test_retry_loop_example(pair: Pair) -> None:
    idx, dst = CacheIndex(1, pair.p.cache_id, 1), Cache(cache_id=pair.d.cache_id)
    with faults.inject("pull_kv_cache", status=Status.LLM_TIMEOUT, count=2):
        assert pull_with_retry(pair.d.dd, cluster(pair.p), idx, dst) == 2
    assert rows(pair.d.mem, 0) == rows(pair.p.mem, 1)  # remote row 1 landed in local row 0
    with faults.inject("pull_kv_cache", status=Status.LLM_TIMEOUT):
        with pytest.raises(RuntimeError):
            pull_with_retry(pair.d.dd, cluster(pair.p), idx, dst)


# ---- the serving side (cross-process fabric) --------------------------------------------------


@dataclass
class _FakeOwner:
    cluster_id: int
    sync_wait_ms: int = 1000

    def note_failure(self, status: int, detail: str) -> int:
        return status


def test_serve_injections_apply_only_on_the_serving_side(pair: Pair) -> None:
    with faults.inject("pull", delay_ms=1, peer=1, serve=True, count=2) as inj:
        pair.pull()  # the caller's side ignores serve injections
        assert inj.seen == 0
        faults.on_serve(_FakeOwner(7), "lease")  # another serving instance: not matched
        assert inj.seen == 0
        for _ in range(3):
            faults.on_serve(_FakeOwner(1), "lease")
        assert (inj.seen, inj.fired) == (3, 2)
        faults.on_serve(_FakeOwner(1), "write", 1 << 20)  # a push: no pull kind, nothing to pay
    assert faults.parse(inj.spec())[0].serve


@pytest.mark.parametrize("kwargs", [
    {"status": "LLM_TIMEOUT"}, {"delay_ms": 1.0, "instance": 2}, {"delay_ms": 1.0, "kinds": "link"},
])
def test_serve_injections_take_delays_and_bandwidth_only(kwargs: dict[str, object]) -> None:
    kinds = kwargs.pop("kinds", "pull")
    with pytest.raises(ValueError):
        faults.inject(kinds, serve=True, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="serve"):
        faults.parse("pull:delay_ms=1:serve=yes")
