"""The state and the checks of the simulator-vs-model machine (test_sim_vs_model.py holds its rules):
two simulator instances and their model twins over one shared guarded arena, how a rule picks an
instance, a peer address, clusters, caches and indices, and how an outcome is compared with the
model's prediction.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, IpInfo, LLMError
from kvdd.sim import faults

from . import model as M
from .arena import GuardedArena
from .strategies import BATCH

__all__ = ["ARENA", "GUARD", "LOCAL", "shared_arena", "dead_port", "outcome", "MachineBase"]

ARENA = 32 << 10
GUARD = 16 << 10  # larger than any tensor generated: a range off the arena end hits the guard
LOCAL = "127.0.0.1"
T = TypeVar("T")

_arena: GuardedArena | None = None
_dead: socket.socket | None = None
_seeds = itertools.count(1)


def shared_arena() -> GuardedArena:
    """One arena for the whole session (refilled per example; instances are finalized first)."""
    global _arena
    if _arena is None:
        _arena = GuardedArena(ARENA, GUARD)
    return _arena


def dead_port() -> int:
    """A port bound on 127.0.0.1 but never listening: connecting is refused, and nobody else can
    take it while the session runs."""
    global _dead
    if _dead is None:
        _dead = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _dead.bind((LOCAL, 0))
    port: int = _dead.getsockname()[1]
    return port


STATUS_VALUES = {int(s) for s in kvdd.Status}


def outcome(fn: Callable[[], T]) -> tuple[int, T | None, list[int] | None]:
    """Run a facade call: (status, result, rets)."""
    try:
        result = fn()
    except LLMError as exc:
        return int(exc.status), None, None if exc.rets is None else [int(r) for r in exc.rets]
    return M.SUCCESS, result, None


class MachineBase(RuleBasedStateMachine):
    """Two instances (``dds``) and their model twins (``insts``); no rules (see SimVsModel)."""

    def __init__(self) -> None:
        super().__init__()
        self.arena = shared_arena()
        self.arena.fill(next(_seeds))
        self.world = M.World(M.Arena(self.arena.base, self.arena.bytes()))
        self.dds: list[kvdd.LlmDataDist] = []
        self.insts: list[M.Instance] = []
        self.backend = "comm"
        self.injections: list[faults.Injection] = []

    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, len(self.dds) - 1), label="instance")

    def refresh_ports(self) -> None:
        for dd, inst in zip(self.dds, self.insts):
            port = dd.listen_port
            assert (port is not None) == inst.listening, (
                f"cluster {inst.cluster_id}: listening {port is not None}, model says {inst.listening}")
            inst.port = port

    def target(self, data: st.DataObject, i: int) -> tuple[int, int]:
        """(remote_cluster_id, port) for a link/unlink from instance i: usually the other one."""
        other = self.insts[1 - i]
        port = other.port if other.port is not None else dead_port()
        if data.draw(st.integers(0, 9)) == 0:
            port = dead_port()
        cid = data.draw(st.sampled_from([other.cluster_id] * 6 + [77, self.insts[i].cluster_id]),
                        label="remote_cluster_id")
        return cid, port

    def clusters(self, data: st.DataObject, i: int) -> list[ClusterInfo]:
        out = []
        for _ in range(data.draw(st.sampled_from([1, 1, 1, 1, 2, 0]), label="n_clusters")):
            cid, port = self.target(data, i)
            remote: tuple[IpInfo, ...] = (IpInfo(LOCAL, port),)
            shape = data.draw(st.integers(0, 12), label="remote_ip_shape")
            if shape == 0:
                remote = ()
            elif shape == 1:
                remote = (IpInfo(LOCAL, port), IpInfo(LOCAL, port))
            elif shape == 2:
                remote = (IpInfo(data.draw(st.sampled_from(["", "::1", "localhost", "1.2.3"])), port),)
            local: tuple[IpInfo, ...] = data.draw(st.sampled_from(
                [(IpInfo(LOCAL),), (IpInfo(LOCAL),), (), (IpInfo(LOCAL), IpInfo(LOCAL)),
                 (IpInfo("::1"),)]), label="local_ip_infos")
            out.append(ClusterInfo(remote_cluster_id=cid, local_ip_infos=local, remote_ip_infos=remote))
        return out

    def cache_id(self, data: st.DataObject, owner: int) -> int:
        known = sorted(self.insts[owner].caches) or [1]
        return data.draw(st.sampled_from(known * 4 + [0, -1, 1, 2, 99]), label="cache_id")

    def index(self, data: st.DataObject, i: int) -> CacheIndex:
        other = 1 - i
        cid = data.draw(st.sampled_from([self.insts[other].cluster_id] * 6 + [self.insts[i].cluster_id, 99]),
                        label="cluster_id")
        return CacheIndex(cluster_id=cid, cache_id=self.cache_id(data, other), batch_index=data.draw(BATCH))

    def src_cache(self, data: st.DataObject, i: int) -> Cache:
        cid = self.cache_id(data, i)
        reg = self.insts[i].caches.get(cid)
        n = reg.n if reg is not None else 4
        huge = [2**32 - 1]
        num = data.draw(st.sampled_from([n, n, n, 0, 1, 3, 12, *huge]), label="num_tensors")
        placement = data.draw(st.sampled_from([1, 1, 1, 1, 0, 7]), label="placement")
        return Cache(cache_id=cid, cache_desc=CacheDesc(num_tensors=num, placement=placement))

    def check(self, what: str, got: tuple[int, Any, list[int] | None], want_status: int,
              want_result: object = None, want_rets: list[int] | None = None) -> None:
        status, result, rets = got
        event(f"{what.split('(')[0]} -> {kvdd.Status(want_status).name if want_status in STATUS_VALUES else want_status}")
        assert status == want_status, (
            f"{what}: got {kvdd.status_name(status)}, model predicts {kvdd.status_name(want_status)}")
        if want_status == M.SUCCESS and want_result is not None:
            assert result == want_result, f"{what}: got result {result!r}, model predicts {want_result!r}"
        if want_rets is not None and want_status != M.SUCCESS:
            assert rets == want_rets, f"{what}: got rets {rets}, model predicts {want_rets}"
        if want_rets is not None and want_status == M.SUCCESS:
            assert [int(r) for r in result] == want_rets, f"{what}: got rets {result}, model {want_rets}"

    def do_initialize(self, i: int, opts: dict[str, str]) -> None:
        got = outcome(lambda: self.dds[i].initialize(opts))
        self.check(f"initialize({opts})", got, self.world.initialize(self.insts[i], opts))
        self.refresh_ports()

    def teardown(self) -> None:
        for inj in self.injections:
            inj.remove()
        for dd in self.dds:
            dd.finalize()
