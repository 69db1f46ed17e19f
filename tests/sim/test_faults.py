"""Fault injection (kvdd.sim.faults), the API: injections and their arguments, the
``KVDD_SIM_FAULTS`` syntax (also in a child process), scope and determinism, the README's retry
loop, and the serving side.  Where each injection fires: test_fault_points.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

import kvdd
from kvdd import Cache, CacheIndex, ClusterInfo, LLMError, Status
from kvdd.sim import faults

from fault_pair import DESC, Pair, cluster, expect, make_node, rows
from fault_pair import no_leftover_faults, pair  # noqa: F401  (the modules' fixtures)



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


def _pull_statuses(pair: Pair, n: int) -> list[int]:
    """The status of each of ``n`` pulls in turn (0: it succeeded)."""
    results = []
    for _ in range(n):
        try:
            pair.pull()
            results.append(0)
        except LLMError as exc:
            results.append(int(exc.status))
    return results


def test_count_and_after(pair: Pair) -> None:
    with faults.inject("pull_kv_cache", status="LLM_FAILED", after=2, count=2) as inj:
        results = _pull_statuses(pair, 6)
    F = int(Status.LLM_FAILED)
    assert results == [0, 0, F, F, 0, 0]
    assert (inj.seen, inj.fired, inj.exhausted) == (6, 2, True)


def test_a_call_an_earlier_injection_failed_is_not_counted_by_later_ones(pair: Pair) -> None:
    # docs/faults.md's retry example: two busy pulls, four that go through, then a timeout
    busy = faults.inject("pull_kv_cache", status="LLM_LINK_BUSY", count=2)
    late = faults.inject("pull_kv_cache", status="LLM_FAILED", count=1, after=4)
    try:
        results = _pull_statuses(pair, 8)
    finally:
        busy.remove()
        late.remove()
    B, F = int(Status.LLM_LINK_BUSY), int(Status.LLM_FAILED)
    assert results == [B, B, 0, 0, 0, 0, F, 0]
    assert (busy.seen, busy.fired) == (8, 2)
    assert (late.seen, late.fired) == (6, 1)


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
