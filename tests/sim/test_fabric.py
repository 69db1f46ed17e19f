"""Links and transfers between processes and hosts (kvdd.sim.fabric; SEMANTICS.md §2.3-2.4,
§3.3, §3.5-3.6, §10 rules 2, 5, 6, 8, 9, 13).

The node under test ("D") lives in this process; its peers ("P") live in a separate Python process
(:mod:`peer_proc`), reached only through the simulator's fabric: authenticated TCP connections for
links, control and data (the same-host one-sided path has its own tests, ``tests/hostile/test_samehost*``
and the bench).  Every successful transfer is checked byte for byte over every arena of both processes
(the harness's reference model), so bytes outside the targets are checked too.  Tests that kill or
stop a peer get their own process.  Nothing here asserts on speed; the time bounds are "no hang"
bounds, far above what the operations take.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvdd
from kvdd import DataType, LlmRole, Status
from kvdd._native import _xproc
from kvdd.sim import fabric
from kvdd.sim.fabric import listener as fabric_listener
from kvdd.sim.fabric import wire

import peer_proc
from hostile import rawpeer
from conformance import reference as ref
from conformance.checked import (
    pull_blocks_checked,
    pull_cache_checked,
    push_blocks_checked,
    push_cache_checked,
)
from conformance.harness import (
    ALREADY_LINK,
    KV_CACHE_NOT_EXIST,
    LINK_FAILED,
    NOT_YET_LINK,
    TIMEOUT,
    UNLINK_FAILED,
    CacheHandle,
    Node,
    Spec,
    World,
    cluster,
    link,
    raises,
    register,
    unlink,
)
from peer_proc import PeerProcess, ProcessNode

S = Status.LLM_SUCCESS
WAIT = "llm.SyncKvCacheWaitTime"
XPROC_ENV = {"tcp": "tcp"}


def _env(xproc: str) -> dict[str, str]:
    return {fabric.ENV_XPROC: XPROC_ENV[xproc]}


@pytest.fixture(scope="module", params=["tcp"])
def xproc(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def proc(xproc: str) -> Iterator[PeerProcess]:
    """One peer process per data path, shared by the module's tests that do not kill it."""
    with PeerProcess(env=_env(xproc)) as p:
        yield p


def _world(p: PeerProcess, monkeypatch: pytest.MonkeyPatch, xproc: str) -> Iterator[World]:
    monkeypatch.setenv(fabric.ENV_XPROC, XPROC_ENV[xproc])
    with peer_proc.process_world(p) as w:
        yield w


@pytest.fixture
def world(proc: PeerProcess, xproc: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield from _world(proc, monkeypatch, xproc)


@pytest.fixture
def own_proc(xproc: str) -> Iterator[PeerProcess]:
    """A peer process for one test (killed or stopped by it); always cleaned up."""
    with PeerProcess(env=_env(xproc)) as p:
        yield p


@pytest.fixture
def own_world(own_proc: PeerProcess, xproc: str,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield from _world(own_proc, monkeypatch, xproc)


def _setup(world: World, transfer: str = "comm", *, d_listen: bool = False,
           d_extra: dict[str, str] | None = None, p_extra: dict[str, str] | None = None,
           spec: Spec = Spec()) -> tuple[Node, ProcessNode, CacheHandle, CacheHandle]:
    """P (other process, listening) and D (here), each with one registered cache, not linked."""
    p = world.peer(1, LlmRole.PROMPT)
    assert isinstance(p, ProcessNode)
    p.initialize(listen=True, transfer=transfer, extra=p_extra)
    d = world.dut(2, LlmRole.DECODER)
    d.initialize(listen=d_listen, transfer=transfer, extra=d_extra)
    return d, p, register(d, spec), register(p, spec)


def _d_path(d: Node, peer_cluster_id: int) -> str:
    entity = d.dd.backend.entities[peer_cluster_id]  # type: ignore[attr-defined]
    return str(getattr(entity.peer, "data_path", "in_process"))


def _expected_paths(xproc: str, p: PeerProcess) -> tuple[str, str]:
    """(D→P, P→D) data paths: TCP (a same-host path exists only with a kernel-attested identity
    proof, registered as a handshake extension; none is registered in these tests)."""
    return "tcp", "tcp"


# ---- the process_vm kernel (kvdd._native._xproc) ------------------------------------------------


def _arena(n: int, seed: int) -> tuple[np.ndarray, Any]:
    from kvdd._native._copy import Region
    a = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return a, Region(int(a.ctypes.data), n, a)


@pytest.mark.parametrize("write", [False, True])
def test_pvm_copy_runs_exact(write: bool) -> None:
    """pvm_copy on this very process: runs k outer, j inner, bytes outside untouched."""
    from kvdd._native._copy import Region
    local, _ = _arena(4 * 1024, 1)
    remote, _ = _arena(4 * 1024, 2)
    loc = [Region(int(local.ctypes.data) + k * 1024, 1024, local) for k in range(4)]
    rem = [int(remote.ctypes.data) + k * 1024 for k in (3, 1, 2, 0)]
    lo, ro, ln = (np.array(v, np.int64) for v in ([0, 100, 1000], [512, 0, 1020], [100, 300, 4]))
    exp_local, exp_remote = local.copy(), remote.copy()
    for k, rk in enumerate((3, 1, 2, 0)):
        for j in range(3):
            a, b = k * 1024 + int(lo[j]), rk * 1024 + int(ro[j])
            if write:
                exp_remote[b:b + ln[j]] = exp_local[a:a + ln[j]]
            else:
                exp_local[a:a + ln[j]] = exp_remote[b:b + ln[j]]
    n = _xproc.pvm_copy(os.getpid(), loc, rem, 1024, lo, ro, ln, write, chunk=4096)
    assert n == 4 * 404
    assert np.array_equal(local, exp_local) and np.array_equal(remote, exp_remote)


def test_pvm_copy_errors() -> None:
    import mmap
    local, reg = _arena(8192, 3)
    before = local.copy()
    one = np.array([0], np.int64)
    with pytest.raises(ValueError):  # remote run past the remote tensor: nothing moves
        _xproc.pvm_copy(os.getpid(), [reg], [int(local.ctypes.data)], 100, one, one,
                        np.array([101], np.int64), False)
    with pytest.raises(ValueError):  # local run past the local region
        _xproc.pvm_copy(os.getpid(), [reg], [int(local.ctypes.data)], 1 << 20,
                        np.array([8000], np.int64), one, np.array([300], np.int64), False)
    assert np.array_equal(local, before)
    # EFAULT after a partial transfer: the second run's remote page is not mapped
    m = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    buf = np.frombuffer(m, dtype=np.uint8)
    base = int(buf.ctypes.data)
    gap = mmap.mmap(-1, mmap.PAGESIZE)
    addr_gap = int(np.frombuffer(gap, dtype=np.uint8).ctypes.data)
    del buf
    gap.close()  # unmapped now
    with pytest.raises(OSError) as info:
        _xproc.pvm_copy(os.getpid(), [reg, reg], [base, addr_gap], 4096, one, one,
                        np.array([64], np.int64), False)
    assert info.value.errno == 14 and "after 64 bytes" in str(info.value)  # EFAULT
    assert not local[:64].any() and np.array_equal(local[64:], before[64:])  # the partial part
    before = local.copy()
    m.close()
    # ESRCH: a process that no longer exists
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        _xproc.pvm_copy(child.pid, [reg], [base], 64, one, one, np.array([8], np.int64), False)
    # a deadline checked between system calls
    _big, breg = _arena(1 << 22, 4)
    with pytest.raises(TimeoutError):
        _xproc.pvm_copy(os.getpid(), [breg], [int(local.ctypes.data)], 8192, np.array(
            [0] * 512, np.int64), np.array([0] * 512, np.int64), np.array([8192] * 512, np.int64),
            False, timeout_ms=0, chunk=4096)
    assert np.array_equal(local, before)


# ---- link, data path, every transfer kind in both directions -----------------------------------


def test_link_uses_the_expected_data_path(world: World, proc: PeerProcess, xproc: str) -> None:
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    d_to_p, p_to_d = _expected_paths(xproc, proc)
    assert _d_path(d, 1) == d_to_p
    assert p.data_path(2) == p_to_d  # comm: the acceptor has an entity for D's real id
    assert p.entity_keys() == [2]
    pull_cache_checked(world, d, ph, dh)


Kind = Callable[[World, Node, CacheHandle, CacheHandle], None]


def _pull_cache(w: World, caller: Node, mine: CacheHandle, theirs: CacheHandle) -> None:
    pull_cache_checked(w, caller, theirs, mine, batch_index=1, src_batch=2)


def _pull_blocks(w: World, caller: Node, mine: CacheHandle, theirs: CacheHandle) -> None:
    pull_blocks_checked(w, caller, theirs, mine, [0, 1, 3, 2], [3, 0, 1, 1])


def _push_cache(w: World, caller: Node, mine: CacheHandle, theirs: CacheHandle) -> None:
    push_cache_checked(w, caller, mine, theirs, src_batch_index=1, dst_batch=3)


def _push_blocks(w: World, caller: Node, mine: CacheHandle, theirs: CacheHandle) -> None:
    push_blocks_checked(w, caller, mine, theirs, [1, 2, 0], [0, 3, 2])


KINDS: dict[str, Kind] = {"pull_cache": _pull_cache, "pull_blocks": _pull_blocks,
                          "push_cache": _push_cache, "push_blocks": _push_blocks}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("caller", ["initiator", "acceptor"])
@pytest.mark.parametrize("initiator", ["here", "peer"])
def test_transfer_kinds_both_directions(world: World, kind: str, caller: str,
                                        initiator: str) -> None:
    """D links to P or P links to D (comm: bidirectional); then the initiator or the acceptor
    pulls / pushes; every byte of both processes is checked."""
    d, p, dh, ph = _setup(world, d_listen=initiator == "peer")
    init: Node = d if initiator == "here" else p
    acc: Node = p if initiator == "here" else d
    assert link(init, acc) == [S]
    who = init if caller == "initiator" else acc
    mine, theirs = (dh, ph) if who is d else (ph, dh)
    KINDS[kind](world, who, mine, theirs)
    KINDS[kind](world, who, mine, theirs)  # a second transfer over the same link


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_large_rows_and_layer_ranges(world: World, kind: str) -> None:
    """Rows of 256 KiB (the TCP path sends / receives them in place rather than staging them) and
    a layer range; both directions."""
    big = Spec(n=4, dtype=DataType.DT_INT32, shape=(4, 65536))
    d, p, dh, ph = _setup(world, spec=big)
    assert link(d, p) == [S]
    KINDS[kind](world, d, dh, ph)
    KINDS[kind](world, p, ph, dh)
    e = kvdd.KvCacheExtParam(src_layer_range=(1, 1), dst_layer_range=(0, 0), tensor_num_per_layer=2)
    if kind == "pull_cache":
        pull_cache_checked(world, d, ph, dh, ext_param=e, src_batch=3)
    elif kind == "push_blocks":
        push_blocks_checked(world, p, ph, dh, [3], [0], ext_param=e)


def test_many_small_runs(world: World) -> None:
    """4096 one-block runs of 64 bytes (staged through one buffer on the TCP path)."""
    spec = Spec(n=2, dtype=DataType.DT_UINT8, shape=(8192, 64))
    d, p, dh, ph = _setup(world, spec=spec)
    assert link(d, p) == [S]
    rng = random.Random(7)
    src = list(range(0, 8192, 2))
    dst = rng.sample(range(8192), len(src))
    pull_blocks_checked(world, d, ph, dh, src, dst)
    push_blocks_checked(world, d, dh, ph, dst, src)


# ---- link semantics across processes ---------------------------------------------------------


def test_visibility_snapshot_at_link_time(world: World) -> None:
    """§2.4 / rule 3: caches registered after the link are not found over it (either side)."""
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    late_p = register(p, Spec())
    late_d = register(d, Spec())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(late_p.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        p.pull_kv_cache(late_d.index(), ph.cache())
    pull_cache_checked(world, d, ph, dh)
    assert unlink(d, p) == [S]
    assert link(d, p) == [S]
    pull_cache_checked(world, d, late_p, dh)
    pull_cache_checked(world, p, late_d, ph)


def test_unregistered_remote_cache_is_not_found(world: World) -> None:
    """Rule 2: an unregistered cache of the peer is not found (never read)."""
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    p.unregister(ph.cache_id)
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_cache(dh.cache(), ph.index())


def test_already_link_unlink_relink(world: World) -> None:
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p)
    assert p.entity_keys() == [2]
    assert unlink(d, p) == [S]  # non-force: P drops its entity for D too (§3.6)
    assert p.entity_keys() == []
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(NOT_YET_LINK):
        p.pull_kv_cache(dh.index(), ph.cache())
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)
    push_blocks_checked(world, p, ph, dh, [0], [1])


def test_force_unlink_is_local(world: World) -> None:
    """§3.6: a force unlink never tells the peer; P's entity for D keeps working."""
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    assert unlink(d, p, force=True) == [S]
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(), dh.cache())
    assert p.entity_keys() == [2]
    pull_cache_checked(world, p, dh, ph)
    # linking again: D has no entity (force link), P replaces its stale one
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)
    pull_cache_checked(world, p, dh, ph)


def test_wrong_remote_cluster_id_relinks(world: World) -> None:
    """§7.18: keyed by real ids; a wrong remote_cluster_id force-relinks every time."""
    d, p, dh, ph = _setup(world)
    assert link(d, p, remote_cluster_id=9) == [S]
    assert link(d, p, remote_cluster_id=9) == [S]
    pull_cache_checked(world, d, ph, dh)
    pull_cache_checked(world, p, dh, ph)


def test_hixl_is_one_way(world: World) -> None:
    """§2.3: on hixl only the initiator has an entity, keyed by the user-supplied id."""
    d, p, dh, ph = _setup(world, "hixl")
    assert link(d, p, remote_cluster_id=5) == [S]
    assert p.entity_keys() == []
    pull_cache_checked(world, d, ph, dh, index=ph.index(cluster_id=5))
    push_cache_checked(world, d, dh, ph, index=ph.index(cluster_id=5))
    with world.rejects(NOT_YET_LINK):
        p.pull_kv_cache(dh.index(), ph.cache())
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p, remote_cluster_id=6)
    assert unlink(d, p, remote_cluster_id=5) == [S]  # local only
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(cluster_id=5), dh.cache())
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)


def test_backend_mismatch_fails_to_link(world: World) -> None:
    p = world.peer(1, LlmRole.PROMPT)
    p.initialize(listen=True, transfer="hixl")
    d = world.dut(2, LlmRole.DECODER)
    d.initialize()
    with raises(LINK_FAILED, rets=[Status.LLM_LINK_FAILED]):
        link(d, p)


def test_peer_finalize_caches_not_found(world: World) -> None:
    """A peer that finalized says so: its caches are not found (KV_CACHE_NOT_EXIST), both ways."""
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    p.finalize()
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [0])
    # the stale entity stays until unlinked (§3.3); relinking a fresh P works
    p.initialize(listen=True)
    ph2 = register(p, Spec())
    assert unlink(d, p, force=True) == [S]
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph2, dh)


def test_local_finalize_with_links(world: World) -> None:
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    d.finalize()
    with world.rejects(KV_CACHE_NOT_EXIST):  # D finalized: P's stale entity finds nothing
        p.pull_kv_cache(dh.index(), ph.cache())
    d.initialize()
    dh2 = register(d, Spec())
    assert link(d, p) == [S]  # P force-relinks (D has no entity)
    pull_cache_checked(world, p, dh2, ph)


def test_sync_wait_zero_times_out(world: World) -> None:
    """Rule 9: llm.SyncKvCacheWaitTime=0 → every transfer that must wait for another process times
    out; the link is then broken (rule 8)."""
    d, p, dh, ph = _setup(world, d_extra={WAIT: "0"})
    assert link(d, p) == [S]
    with world.rejects(TIMEOUT):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(TIMEOUT):
        d.push_kv_cache(dh.cache(), ph.index())


def test_concurrent_links_in_both_directions(world: World) -> None:
    """Transfers over different links run in parallel (rule 5); two peers, both directions."""
    d, p, dh, ph = _setup(world, d_listen=True)
    p2 = world.peer(3, LlmRole.PROMPT)
    p2.initialize()
    p2h = register(p2, Spec())
    assert link(d, p) == [S]
    assert link(p2, d) == [S]
    errors: list[BaseException] = []

    def loop(fn: Callable[[], None]) -> None:
        try:
            for _ in range(20):
                fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(f,)) for f in (
        lambda: d.pull_kv_cache(ph.index(1), dh.cache(), 1),
        lambda: p.push_kv_cache(ph.cache(), dh.index(2), 3),
        lambda: p2.pull_kv_blocks(dh.index(), p2h.cache(), [0], [3]),
    )]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # the final state is well defined: check it with one more checked transfer each
    pull_cache_checked(world, d, ph, dh, batch_index=1, src_batch=1)
    pull_blocks_checked(world, p2, dh, p2h, [0], [3])


# ---- leases, dead and silent peers -----------------------------------------------------------------


class _Hold:
    """Make this process's cross-process transfers sleep after their lease was granted."""

    def __init__(self, seconds: float) -> None:
        self.leased = threading.Event()
        self._orig = orig = fabric.RemotePeer.move

        def slow(peer: fabric.RemotePeer, *args: Any) -> int:
            self.leased.set()
            time.sleep(seconds)
            return orig(peer, *args)

        fabric.RemotePeer.move = slow  # type: ignore[method-assign,assignment]

    def __enter__(self) -> _Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        fabric.RemotePeer.move = self._orig  # type: ignore[method-assign]


def _inflight(d: Node, h: CacheHandle) -> int:
    entry = d.dd.backend.caches[h.cache_id]  # type: ignore[attr-defined]
    n: int = entry.inflight
    return n


def _wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def test_peer_sigkill_mid_transfer(own_world: World, own_proc: PeerProcess, xproc: str) -> None:
    """The peer dies while we hold a lease on its cache: LLM_TIMEOUT at once (not after the 30 s
    wait), the link stays broken until relinked, nothing hangs."""
    world = own_world
    d, p, dh, ph = _setup(world, d_extra={WAIT: "30000"})
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)
    result: list[object] = []

    def pull() -> None:
        t0 = time.monotonic()
        try:
            d.pull_kv_cache(ph.index(), dh.cache())
            result.append(S)
        except kvdd.LLMError as exc:
            result.append(exc.status)
        result.append(time.monotonic() - t0)

    with _Hold(0.5) as hold:
        t = threading.Thread(target=pull)
        t.start()
        assert hold.leased.wait(30)
        own_proc.kill()
        world.nodes.remove(p)
        t.join(60)
    assert not t.is_alive()
    assert result[0] == Status.LLM_TIMEOUT
    assert isinstance(result[1], float) and result[1] < 20.0  # far below the 30 s wait
    t0 = time.monotonic()
    with raises(TIMEOUT):  # broken until relinked (rule 8): at once
        d.dd.pull_kv_cache(ph.index(), dh.cache())
    assert time.monotonic() - t0 < 5.0
    # a new peer process on a new port: force-unlink the stale link, link again
    d.dd.unlink_llm_clusters([cluster(1, 1)], 1000, True)
    with PeerProcess(env=_env(xproc)) as p2proc:
        p2 = ProcessNode(p2proc, 1, LlmRole.PROMPT)
        world.nodes.append(p2)
        p2.initialize(listen=True)
        p2h = register(p2, Spec())
        assert link(d, p2) == [S]
        pull_cache_checked(world, d, p2h, dh)
        world.nodes.remove(p2)
        p2.close()


def test_peer_sigkill_between_transfers(own_world: World, own_proc: PeerProcess) -> None:
    """Connection reset: the next transfer gives LLM_TIMEOUT at once, then stays broken; a
    non-force unlink of a dead peer fails (connection refused), a force unlink works."""
    world = own_world
    d, p, dh, ph = _setup(world, d_extra={WAIT: "30000"})
    assert link(d, p) == [S]
    port = p.listen_port
    assert port
    own_proc.kill()
    world.nodes.remove(p)
    for _ in range(2):
        t0 = time.monotonic()
        with raises(TIMEOUT):
            d.push_kv_cache(dh.cache(), ph.index())
        assert time.monotonic() - t0 < 20.0
    with raises(UNLINK_FAILED):  # nobody listens there any more
        d.unlink(port, 1)
    assert d.unlink(port, 1, force=True) == [S]
    with raises(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(), dh.cache())


def test_silent_peer_times_out(own_world: World, own_proc: PeerProcess) -> None:
    """A stopped peer: LLM_TIMEOUT after llm.SyncKvCacheWaitTime, then broken until relinked."""
    world = own_world
    d, p, dh, ph = _setup(world, d_extra={WAIT: "1000"})
    assert link(d, p) == [S]
    own_proc.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with raises(TIMEOUT):
            d.dd.pull_kv_cache(ph.index(), dh.cache())
        assert 0.9 < time.monotonic() - t0 < 20.0
        t0 = time.monotonic()
        with raises(TIMEOUT):
            d.dd.pull_kv_cache(ph.index(), dh.cache())
        assert time.monotonic() - t0 < 0.9  # broken: at once
    finally:
        own_proc.signal(signal.SIGCONT)
    assert d.unlink(p.listen_port or 0, 1, force=True) == [S]
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)


#: Rows of 2 x 64 KiB: above wire.SMALL_BYTES, so a pull takes a LEASE before its READ (a small
#: transfer's lease lives only inside its one LEASE_READ / LEASE_WRITE request)
LEASED = Spec(n=2, dtype=DataType.DT_UINT8, shape=(4, 1 << 16))


def _reader_setup(world: World, p_wait: str) -> tuple[Node, ProcessNode, CacheHandle, CacheHandle]:
    """D owns the cache; P (other process) reads it over a link P initiated (rows big enough
    for a separate LEASE: the tests hold the transfer between lease and READ)."""
    d, p, dh, ph = _setup(world, d_listen=True, p_extra={WAIT: p_wait}, spec=LEASED)
    assert link(p, d) == [S]
    return d, p, dh, ph


def test_unregister_waits_for_a_remote_reader(world: World, proc: PeerProcess) -> None:
    """Rule 5 across processes: D's unregister returns only after P's in-flight pull (holding a
    lease) finished; the pull got the right bytes; later pulls find nothing."""
    d, p, dh, ph = _reader_setup(world, "30000")
    before = world.snapshot()
    proc.root("hold", 600)
    try:
        n0 = len(proc.root("released"))
        call = p.start("pull_kv_cache", dh.index(), ph.cache())
        _wait_for(lambda: _inflight(d, dh) > 0)
        d.unregister(dh.cache_id)
        unregistered_at = time.monotonic()
        call.result()
        released = proc.root("released")[n0:]
    finally:
        proc.root("hold", 0)
    assert len(released) == 1 and released[0] <= unregistered_at
    # the pull completed with the exact bytes
    expected = before.copy()
    ref.pull_cache(expected.tensors(ph), before.tensors(dh), ph.geom)
    world.assert_memory(expected, "after a pull that raced an unregister: ")
    with world.rejects(KV_CACHE_NOT_EXIST):
        p.pull_kv_cache(dh.index(), ph.cache())


def test_second_unregister_waits_too(world: World, proc: PeerProcess) -> None:
    """Rule 5, any number of callers: while P's pull holds a lease on D's cache, two threads of D
    unregister it; neither returns before the pull finished (it used to return at once)."""
    d, p, dh, ph = _reader_setup(world, "30000")
    proc.root("hold", 500)
    try:
        n0 = len(proc.root("released"))
        call = p.start("pull_kv_cache", dh.index(), ph.cache())
        _wait_for(lambda: _inflight(d, dh) > 0)
        returned: list[float] = []

        def unregister() -> None:
            d.unregister(dh.cache_id)
            returned.append(time.monotonic())

        threads = [threading.Thread(target=unregister) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.05)  # the second call comes while the first waits
        for t in threads:
            t.join(30)
        call.result()
        released = proc.root("released")[n0:]
    finally:
        proc.root("hold", 0)
    assert len(returned) == 2 and len(released) == 1
    assert min(returned) >= released[0], "an unregister returned while the pull still held the cache"


@pytest.mark.parametrize("extra", [0, 32])
def test_small_transfers_around_the_one_request_limit(world: World, extra: int) -> None:
    """Rows of exactly wire.SMALL_BYTES (one LEASE_READ / LEASE_WRITE) and just above it (LEASE,
    then READ / WRITE): exact bytes both ways, in both directions of the link."""
    spec = Spec(n=2, dtype=DataType.DT_UINT8, shape=(2, wire.SMALL_BYTES // 2 + extra))
    d, p, dh, ph = _setup(world, spec=spec)
    assert link(d, p) == [S]
    for who, mine, theirs in ((d, dh, ph), (p, ph, dh)):
        pull_cache_checked(world, who, theirs, mine, batch_index=1)
        push_cache_checked(world, who, mine, theirs, dst_batch=1)
        pull_blocks_checked(world, who, theirs, mine, [1, 0], [0, 1])


@pytest.mark.parametrize("push", [False, True])
def test_small_transfers_racing_an_unregister(world: World, push: bool) -> None:
    """§10 rules 2 and 5 for one-request small transfers: while D pulls (pushes) 64-byte rows in a
    loop, P unregisters the cache; every call returns LLM_SUCCESS (exact bytes) or
    LLM_KV_CACHE_NOT_EXIST, every call after the unregister returned finds nothing, and P's
    memory does not change after it returned."""
    d, p, dh, ph = _setup(world)
    for trial in range(3):
        if trial:
            ph = register(p, Spec())
        assert link(d, p) == [S]
        before = world.snapshot()
        results: list[tuple[float, float, int]] = []  # (started, returned, status)
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    if push:
                        d.dd.push_kv_cache(dh.cache(), ph.index())
                    else:
                        d.dd.pull_kv_cache(ph.index(), dh.cache())
                    status = int(S)
                except kvdd.LLMError as exc:
                    status = int(exc.status)
                results.append((t0, time.monotonic(), status))

        t = threading.Thread(target=loop)
        t.start()
        try:
            _wait_for(lambda: len(results) >= 5)
            p.unregister(ph.cache_id)
            returned = time.monotonic()
            after = world.snapshot()
            n = len(results)
            _wait_for(lambda: len(results) >= n + 5)
        finally:
            stop.set()
            t.join(30)
        statuses = {st for _a, _b, st in results}
        assert statuses <= {int(S), int(Status.LLM_KV_CACHE_NOT_EXIST)}, [hex(x) for x in statuses]
        assert all(st != S for a, _b, st in results if a > returned)
        assert any(st == S for _a, _b, st in results)
        expected = before.copy()
        if push:
            ref.pull_cache(expected.tensors(ph), before.tensors(dh), ph.geom)
        else:
            ref.pull_cache(expected.tensors(dh), before.tensors(ph), ph.geom)
        world.assert_memory(expected, "small transfers racing an unregister: ")
        assert np.array_equal(after.arenas[(ph.owner, ph.slot)],
                              world.snapshot().arenas[(ph.owner, ph.slot)])
        assert unlink(d, p) == [S]


def test_pull_racing_its_unlink(world: World) -> None:
    """A pull racing a local unlink of its own link either completes (the unlink waits for it)
    or returns LLM_NOT_YET_LINK; never LLM_TIMEOUT from a living peer."""
    d, p, dh, ph = _setup(world)
    for _trial in range(3):
        assert link(d, p) == [S]
        results: dict[str, int] = {}

        def pull(name: str) -> None:
            try:
                d.dd.pull_kv_cache(ph.index(), dh.cache())
                results[name] = S
            except kvdd.LLMError as exc:
                results[name] = exc.status

        with _Hold(0.3) as hold:
            first = threading.Thread(target=pull, args=("first",))
            first.start()
            assert hold.leased.wait(10)
            second = threading.Thread(target=pull, args=("second",))
            second.start()
            time.sleep(0.05)  # the second pull waits for the link behind the first
            t0 = time.monotonic()
            assert unlink(d, p, force=True) == [S]
            waited = time.monotonic() - t0
            first.join(10)
            second.join(10)
        assert results["first"] == S and waited > 0.1  # the unlink waited for the first pull
        assert results["second"] in (S, NOT_YET_LINK), hex(results["second"])
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)


def test_dead_reader_releases_its_lease(own_world: World, own_proc: PeerProcess) -> None:
    """A reader killed while holding a lease (with a 60 s wait): unregister returns at once."""
    world = own_world
    d, p, dh, ph = _reader_setup(world, "60000")
    own_proc.root("hold", 60000)
    p.start("pull_kv_cache", dh.index(), ph.cache())
    _wait_for(lambda: _inflight(d, dh) > 0)
    own_proc.kill()
    world.nodes.remove(p)
    t0 = time.monotonic()
    d.unregister(dh.cache_id)
    assert time.monotonic() - t0 < 20.0


def test_lease_expires_for_a_stuck_reader(own_world: World, own_proc: PeerProcess) -> None:
    """A reader that holds its lease past its own wait time (1 s): the owner's unregister waits at
    most that long (plus a grace), and finalize does not hang either."""
    world = own_world
    d, p, dh, ph = _reader_setup(world, "1000")
    own_proc.root("hold", 5000)
    call = p.start("pull_kv_cache", dh.index(), ph.cache())
    _wait_for(lambda: _inflight(d, dh) > 0)
    own_proc.signal(signal.SIGSTOP)  # and it does not even answer any more
    try:
        t0 = time.monotonic()
        d.unregister(dh.cache_id)
        assert time.monotonic() - t0 < 20.0
        t0 = time.monotonic()
        d.finalize()
        assert time.monotonic() - t0 < 20.0
    finally:
        own_proc.signal(signal.SIGCONT)
    with raises(TIMEOUT):  # the reader's own deadline passed while it held the lease
        call.result()


def test_finalize_waits_for_a_remote_reader(world: World, proc: PeerProcess) -> None:
    d, p, dh, ph = _reader_setup(world, "30000")
    proc.root("hold", 400)
    try:
        call = p.start("pull_kv_cache", dh.index(), ph.cache())
        _wait_for(lambda: _inflight(d, dh) > 0)
        d.finalize()
        call.result()  # it completed before finalize released the memory
    finally:
        proc.root("hold", 0)
    with world.rejects(KV_CACHE_NOT_EXIST):
        p.pull_kv_cache(dh.index(), ph.cache())


# ---- the server under hostile input ------------------------------------------------------------


def _hdr(ftype: int, length: int, req: int = 0, magic: bytes = b"KV",
         version: int = wire.PROTOCOL_VERSION) -> bytes:
    return rawpeer.hdr(ftype, length, req, magic, version)


def _hello(cluster_id: int, backend: int = 0) -> bytes:
    """A well-formed HELLO_LINK payload with an empty snapshot."""
    return rawpeer.hello_link(cluster_id, backend=wire.BACKENDS[backend])


def _connect(port: int) -> socket.socket:
    return rawpeer.connect(port)


def _linked_raw(port: int, cluster_id: int) -> tuple[socket.socket, dict[int, fabric.RemoteCache]]:
    """An authenticated raw socket that completed a real link handshake (comm: the server makes
    an entity)."""
    return rawpeer.link(port, cluster_id)


def _garbage(rng: random.Random, port: int, cache_ids: list[int]) -> None:
    """One hostile connection: a random kind of malformed, truncated or oversized input."""
    case = rng.randrange(12)
    s = _connect(port)
    try:
        if case == 0:
            s.sendall(rng.randbytes(rng.randrange(1, 4096)))
        elif case == 1:  # truncated header
            s.sendall(_hdr(wire.F_HELLO_LINK, 100)[:rng.randrange(1, 12)])
        elif case == 2:  # bad magic / version / type
            s.sendall(rng.choice([_hdr(1, 10, magic=b"XX"), _hdr(1, 10, version=9),
                                  _hdr(rng.randrange(24, 256), 10)]) + bytes(10))
        elif case == 3:  # oversized frame
            s.sendall(_hdr(rng.choice([wire.F_HELLO_LINK, wire.F_HELLO_UNLINK, wire.F_DATA]),
                           rng.choice([wire.MAX_HELLO + 1, 0xFFFFFFFF])))
        elif case == 4:  # a request before any handshake
            s.sendall(_hdr(rng.choice([wire.F_LEASE, wire.F_READ, wire.F_WRITE,
                                       wire.F_DATA, wire.F_GOODBYE]), 8) + bytes(8))
        elif case == 5:  # HELLO_LINK with a random or truncated payload
            body = _hello(rng.randrange(100, 1 << 60))
            body = rng.choice([rng.randbytes(len(body)), body[:rng.randrange(len(body))],
                               body + rng.randbytes(5)])
            s.sendall(_hdr(wire.F_HELLO_LINK, len(body)) + body)
        elif case == 6:  # HELLO_LINK announcing more than it sends, then hang up
            s.sendall(_hdr(wire.F_HELLO_LINK, 5000) + rng.randbytes(100))
        elif case == 7:  # an authentication attempt with random nonce and proof
            s.sendall(_hdr(wire.F_AUTH_HELLO, 33) + rng.randbytes(33))
            s.recv(256)
            s.sendall(_hdr(wire.F_AUTH_PROOF, 32) + rng.randbytes(32))
        else:  # a real handshake, then hostile frames on the link
            s.close()
            s, snap = _linked_raw(port, rng.randrange(100, 1 << 60))
            frames = []
            for _ in range(rng.randrange(1, 6)):
                k = rng.randrange(8)
                if k == 0:
                    frames.append(_hdr(wire.F_LEASE, 8, 1) + struct.pack("<Q", rng.choice(
                        [*cache_ids, 0, 77, 1 << 63])))
                elif k == 1:  # forged lease / out-of-range tensors and runs
                    req = wire.encode_request(rng.randrange(1 << 20), [rng.randrange(20)],
                                                 np.array([rng.randrange(-10, 1 << 40)], np.int64),
                                                 np.array([rng.randrange(-10, 1 << 40)], np.int64))
                    frames.append(_hdr(wire.F_READ, len(req), 2) + req)
                elif k == 2:
                    req = wire.encode_request(1, [0], np.array([0], np.int64),
                                                 np.array([64], np.int64))
                    frames.append(_hdr(wire.F_WRITE, len(req), 3) + req + _hdr(wire.F_DATA, 64, 3)
                                  + rng.randbytes(64))
                elif k == 3:
                    frames.append(_hdr(wire.F_DATA, 16, 4) + rng.randbytes(16))
                elif k == 4:
                    frames.append(_hdr(wire.F_RELEASE, 8) + struct.pack("<Q", rng.randrange(1 << 64)))
                elif k == 5:
                    frames.append(_hdr(wire.F_READ, 7) + rng.randbytes(7))  # truncated request
                elif k == 6:
                    frames.append(rng.randbytes(rng.randrange(1, 64)))
                else:
                    frames.append(_hdr(wire.F_PING, 0, 5))
            data = b"".join(frames)
            if case == 11:
                data = data[:rng.randrange(1, len(data) + 1)]
            s.sendall(data)
            # a legitimate lease on a visible cache is answered; anything else may close
            try:
                s.settimeout(0.2)
                while s.recv(65536):
                    pass
            except OSError:
                pass
    except OSError:
        pass  # the server may close on us at any point
    finally:
        s.close()


def _tensor_mask(h: CacheHandle, size: int) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    for o in h.offsets:
        mask[o:o + h.nbytes] = True
    return mask


@pytest.mark.parametrize("xproc", ["tcp"], indirect=True)
def test_server_survives_fuzz(world: World, proc: PeerProcess) -> None:
    """Random, truncated, oversized and out-of-protocol frames, before and after a handshake: no
    byte outside a registered, visible tensor changes (fuzz links that completed a handshake may
    legitimately write into D's visible cache), the owner's calls keep working, and a real peer
    is still served."""
    cases = int(os.environ.get("KVDD_FABRIC_FUZZ_CASES", "300"))
    d, p, dh, ph = _setup(world, d_listen=True)
    gone = register(d, Spec())
    d.unregister(gone.cache_id)  # its memory stays; nobody may reach it
    assert link(p, d) == [S]
    port = d.listen_port
    assert port
    rng = random.Random(int(os.environ.get("KVDD_FABRIC_FUZZ_SEED", "1234")))
    before = world.snapshot()
    for _ in range(cases):
        _garbage(rng, port, [dh.cache_id, gone.cache_id])
    after = world.snapshot()
    for key, exp in before.arenas.items():
        got = after.arenas[key]
        allowed = (_tensor_mask(dh, exp.size) if key == (d.uid, dh.slot)
                   else np.zeros(exp.size, dtype=bool))
        changed = np.flatnonzero((exp != got) & ~allowed)
        assert changed.size == 0, f"the fuzz changed {changed.size} protected byte(s) of arena {key}"
    # the owner's API calls were never blocked, and the real peer is still served both ways
    extra = register(d, Spec())
    d.unregister(extra.cache_id)
    pull_cache_checked(world, p, dh, ph)
    push_blocks_checked(world, p, ph, dh, [1], [2])


@pytest.mark.parametrize("xproc", ["tcp"], indirect=True)
def test_server_drops_slow_handshakes(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections that send nothing, or drip an authentication hello byte by byte, are closed
    when the pre-authentication deadline passes, and never keep a real peer from linking."""
    monkeypatch.setattr(fabric_listener, "PREAUTH_TIMEOUT_S", 0.5)
    d, p, dh, ph = _setup(world, d_listen=True)
    port = d.listen_port
    assert port
    idle = [_connect(port) for _ in range(100)]
    drip = idle[0]
    hello = _hdr(wire.F_AUTH_HELLO, 33) + bytes(33)
    assert link(p, d) == [S]  # while 100 connections sit in their handshake
    try:
        for i in range(len(hello)):  # one byte every 50 ms: each recv is fast, the whole is not
            drip.sendall(hello[i:i + 1])
            time.sleep(0.05)
    except OSError:
        pass  # closed by the server: what we expect
    for s in idle:
        s.settimeout(5)
        try:
            assert s.recv(1) == b""  # closed by the server, no reply
        except ConnectionResetError:
            pass
        s.close()
    pull_cache_checked(world, p, dh, ph)


@pytest.mark.slow
@pytest.mark.parametrize("xproc", ["tcp"], indirect=True)
def test_server_survives_long_fuzz(world: World, proc: PeerProcess,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDD_FABRIC_FUZZ_CASES", os.environ.get("KVDD_FABRIC_FUZZ_CASES", "5000"))
    test_server_survives_fuzz(world, proc)


def test_listener_binds_only_its_address(world: World) -> None:
    """The listen socket is bound to the configured address only: listening on 127.0.0.1, the
    same port on 127.0.0.2 (also this host's loopback) refuses connections."""
    d = world.dut(2, LlmRole.DECODER)
    d.initialize(listen=True)
    port = d.listen_port
    assert port
    _connect(port).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


# ---- independent processes, other hosts -----------------------------------------------------------

_SERVER = textwrap.dedent("""
    import sys, numpy as np, kvdd
    dd = kvdd.LlmDataDist(1, kvdd.LlmRole.PROMPT)
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    kv = np.arange(4 * 4096, dtype=np.uint8).reshape(4, 4096) * 3
    desc = kvdd.CacheDesc(num_tensors=4, data_type=kvdd.DataType.DT_UINT8, shape=(8, 512))
    cid = dd.register_kv_cache(desc, kvdd.tensor_addrs(list(kv)))
    print(dd.listen_port, cid, flush=True)
    sys.stdin.readline()
    print(int(kv.astype(np.int64).sum()), flush=True)
    dd.finalize()
""")

_CLIENT = textwrap.dedent("""
    import sys, numpy as np, kvdd
    port, cid = int(sys.argv[1]), int(sys.argv[2])
    dd = kvdd.LlmDataDist(2, kvdd.LlmRole.DECODER)
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
    kv = np.zeros((4, 4096), dtype=np.uint8)
    desc = kvdd.CacheDesc(num_tensors=4, data_type=kvdd.DataType.DT_UINT8, shape=(8, 512))
    mine = dd.register_kv_cache(desc, kvdd.tensor_addrs(list(kv)))
    peer = kvdd.ClusterInfo(remote_cluster_id=1, remote_ip_infos=(kvdd.IpInfo("127.0.0.1", port),),
                            local_ip_infos=(kvdd.IpInfo("127.0.0.1", 0),))
    dd.link_llm_clusters([peer])
    dd.pull_kv_blocks(kvdd.CacheIndex(1, cid), kvdd.Cache(cache_id=mine), list(range(8)), list(range(8)))
    expect = np.arange(4 * 4096, dtype=np.uint8).reshape(4, 4096) * 3
    print("exact" if np.array_equal(kv, expect) else "WRONG", flush=True)
    dd.unlink_llm_clusters([peer])
    dd.finalize()
""")


@pytest.mark.parametrize("xproc", ["tcp"])
def test_two_independent_python_processes(xproc: str) -> None:
    """What the README documents: two plain ``python`` programs link and pull byte-exactly."""
    env = dict(os.environ, **_env(xproc), KVDD_BACKEND="sim")
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stdout is not None and server.stdin is not None
        port, cid = server.stdout.readline().split()
        out = subprocess.run([sys.executable, "-c", _CLIENT, port, cid], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "exact"
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline().strip()  # the server's memory was only read
    finally:
        server.kill()
        server.wait(10)


def _netns_available() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux to create network namespaces"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"kvdd-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture
def netns() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: (namespace, our ip, its ip)."""
    why = _netns_available()
    if why:
        pytest.skip(f"two-host test skipped: {why}")
    ns = f"kvdd-{os.getpid()}"
    host, peer = f"kv{os.getpid() % 100000}a", f"kv{os.getpid() % 100000}b"
    net = 16 + os.getpid() % 200
    ours, theirs = f"10.213.{net}.1", f"10.213.{net}.2"
    cmds = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host, "type", "veth", "peer", "name", peer],
        ["ip", "link", "set", peer, "netns", ns],
        ["ip", "addr", "add", f"{ours}/24", "dev", host],
        ["ip", "link", "set", host, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{theirs}/24", "dev", peer],
        ["ip", "netns", "exec", ns, "ip", "link", "set", peer, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"two-host test skipped: {' '.join(cmd)}: {r.stderr.strip()}")
        yield ns, ours, theirs
    finally:
        subprocess.run(["ip", "link", "del", host], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_hosts_over_a_veth_pair(netns: tuple[str, str, str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer in another network namespace ("another host"): link, transfers both ways over TCP."""
    ns, ours, theirs = netns
    monkeypatch.setenv(fabric.ENV_XPROC, "tcp")  # other hosts have no process_vm
    with PeerProcess(env=_env("tcp"), prefix=["ip", "netns", "exec", ns]) as pp:
        make, cleanup = peer_proc.process_peer_factory(pp)
        world = World("sim", make)
        try:
            p = world.peer(1, LlmRole.PROMPT)
            p.initialize_raw({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"{theirs}:0"})
            d = world.dut(2, LlmRole.DECODER)
            d.initialize_raw({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"{ours}:0"})
            ph, dh = register(p, Spec()), register(d, Spec())
            port = p.listen_port
            assert port
            assert d.link_clusters([cluster(port, 1, ip=theirs)]) == [S]
            assert _d_path(d, 1) == "tcp"
            pull_cache_checked(world, d, ph, dh, src_batch=1)
            push_blocks_checked(world, d, dh, ph, [0, 1], [2, 3])
            pull_blocks_checked(world, p, dh, ph, [3], [0])  # the acceptor, back over the link
            assert d.unlink_clusters([cluster(port, 1, ip=theirs)]) == [S]
            assert p.entity_keys() == []  # type: ignore[attr-defined]
        finally:
            for node in reversed(world.nodes):
                node.close()
            cleanup()


# ---- handshake extensions (the interface of the same-host data path) -----------------------------


class _FakePath:
    """A DataPath that takes nothing over (acquire -> None: TCP), recording what it saw."""

    name = "fake"

    def __init__(self, session: fabric.Session, value: bytes) -> None:
        self.session = session
        self.value = value
        self.asked = 0
        self.closed = False

    def acquire(self, rc: fabric.RemoteCache, addrs: tuple[int, ...],
                timeout_ms: int) -> tuple[int, object] | None:
        self.asked += 1
        return None

    def release(self, lease: object) -> None:
        raise AssertionError("never leased")

    def read(self, lease: object, tensors: Any, src_off: np.ndarray, dst: Any,
             dst_off: np.ndarray, length: np.ndarray, timeout_ms: int) -> int:
        raise AssertionError("never leased")

    def write(self, lease: object, tensors: Any, src: Any, src_off: np.ndarray,
              dst_off: np.ndarray, length: np.ndarray, timeout_ms: int) -> int:
        raise AssertionError("never leased")

    def close(self) -> None:
        self.closed = True


def test_extensions_and_sessions_over_a_real_connection() -> None:
    """Two instances of this process linked over a real TCP connection (RemoteConnection on the
    listener's port): each side's offer reaches the other's accept with a session whose key and
    transcript both sides share, the accepted DataPath becomes the link's data path, a transfer
    it declines goes over TCP with the right bytes, and unlinking closes it."""
    from kvdd.sim.engine import SimBackend
    from kvdd.sim.entries import Entity
    from kvdd.types import Cache, CacheDesc, CacheIndex, KvCacheExtParam, RegisterCfg

    seen: list[_FakePath] = []

    def offer(session: fabric.Session, owner: fabric.LinkOwner) -> bytes:
        return f"{'I' if session.initiator else 'A'}{owner.cluster_id}".encode()

    def accept(session: fabric.Session, value: bytes) -> object:
        path = _FakePath(session, value)
        seen.append(path)
        return path

    fabric.register_extension("fake", offer, accept)
    a, b = SimBackend(71, 1), SimBackend(72, 2)
    try:
        assert a.initialize({"llm.DeviceId": "0", "llm.ListenIpInfo": "127.0.0.1:0"}) == S
        assert b.initialize({"llm.DeviceId": "0", "llm.ListenIpInfo": "127.0.0.1:0"}) == S
        src = np.arange(256, dtype=np.uint8)
        dst = np.zeros(256, dtype=np.uint8)
        desc = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(4, 64))
        st, a_cache = a.register_kv_cache(desc, kvdd.tensor_addrs([src]), RegisterCfg())
        assert st == S
        st, b_cache = b.register_kv_cache(desc, kvdd.tensor_addrs([dst]), RegisterCfg())
        assert st == S
        port = a.listen_port
        assert port
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn = fabric.RemoteConnection(sock, time.monotonic() + 5)
        res = conn.link(b, True)
        conn.close()
        assert res.status == S and isinstance(res.handle, fabric.RemotePeer)
        assert res.handle.data_path == "fake"
        mine = res.handle.session
        assert mine.initiator and mine.local_cluster_id == 72 and mine.peer_cluster_id == 71
        theirs = a.entities[72].peer
        assert isinstance(theirs, fabric.RemotePeer)
        assert not theirs.session.initiator and theirs.session.peer_cluster_id == 72
        assert theirs.session.key == mine.key and len(mine.key) == 32
        assert theirs.session.transcript == mine.transcript
        assert sorted(p.value for p in seen) == [b"A71", b"I72"]
        b.entities[71] = Entity(res.handle, ("127.0.0.1", port))  # what LinkLlmClusters keeps
        idx = CacheIndex(cluster_id=71, cache_id=a_cache, batch_index=1)
        cache = Cache(cache_id=b_cache, cache_desc=desc, tensor_addrs=[int(dst.ctypes.data)])
        assert b.pull_kv_cache(idx, cache, 2, -1, KvCacheExtParam()) == S
        assert (dst[128:192] == src[64:128]).all() and not dst[:128].any() and not dst[192:].any()
        path = next(p for p in seen if p.session.initiator)
        assert path.asked == 1  # asked first, declined: the bytes went over TCP
        res.handle.close()
        assert path.closed
    finally:
        fabric.unregister_extension("fake")
        b.finalize()
        a.finalize()


# ---- the owner's streaming of a request (kvdd.sim.fabric.serving) ---------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_served_runs_stream_exactly(seed: int) -> None:
    """RunPlan.send / receive move exactly the bytes of runs (off[j], length[j]) of tensors k
    (k outer, j inner), with short runs staged in chunks, long runs direct, DATA frames of any
    size on receive, and nothing outside the runs touched."""
    from kvdd._native._copy import Region
    from kvdd.sim.fabric.rx import Rx
    from kvdd.sim.fabric.serving import RunPlan, check_request

    rng = np.random.default_rng(seed)
    t_bytes = 1 << 23
    src = [rng.integers(0, 256, t_bytes, dtype=np.uint8) for _ in range(3)]
    dst = [rng.integers(0, 256, t_bytes, dtype=np.uint8) for _ in range(3)]
    src_r = [Region(int(a.ctypes.data), t_bytes, a) for a in src]
    dst_r = [Region(int(a.ctypes.data), t_bytes, a) for a in dst]
    lengths = np.where(rng.random(400) < 0.1, rng.integers(70 << 10, 200 << 10, 400),
                       rng.integers(0, 50_000, 400)).astype(np.int64)
    lengths[:200] = rng.integers(1, 40, 200)  # a long stretch of tiny runs
    starts = np.sort(rng.integers(0, t_bytes - (200 << 10), 400)).astype(np.int64)
    tensors = np.array([2, 0, 2], np.int64)
    assert check_request(3, t_bytes, tensors, starts, lengths) == S
    expected = [d.copy() for d in dst]
    # reference: the byte stream, then scattered into the same runs of the destination tensors
    stream = np.concatenate([src[k][o:o + n] for k in tensors.tolist()
                             for o, n in zip(starts.tolist(), lengths.tolist())])
    pos = 0
    for k in tensors.tolist():
        for o, n in zip(starts.tolist(), lengths.tolist()):
            expected[k][o:o + n] = stream[pos:pos + n]
            pos += n
    a, b = socket.socketpair()
    sender = RunPlan(src_r, tensors, starts, lengths)
    assert sender.total == len(stream)
    done = threading.Thread(target=sender.send, args=(a, 5))
    done.start()
    RunPlan(dst_r, tensors, starts, lengths).receive(Rx(b), 5)
    done.join()
    a.close()
    b.close()
    for got, exp in zip(dst, expected):
        assert np.array_equal(got, exp)
    assert check_request(3, t_bytes, np.array([3]), starts, lengths) == Status.LLM_PARAM_INVALID
    bad = starts.copy()
    bad[-1] = t_bytes - int(lengths[-1]) + 1
    assert check_request(3, t_bytes, tensors, bad, lengths) == Status.LLM_PARAM_INVALID


def test_deadline_guard_fires_for_late_requests_only() -> None:
    """One timer watches many deadlines: it calls back when a waiting request's deadline has
    passed, re-arms for a later one when the earliest request already ended, and never fires
    when nothing waits."""
    from kvdd.sim.fabric.watchdog import DeadlineGuard

    waiting: list[float] = []
    fired = threading.Event()
    guard = DeadlineGuard(lambda: list(waiting), fired.set)
    t0 = time.monotonic()
    guard.arm(t0 + 0.05)  # that request ends at once: nothing waits when the timer runs
    assert not fired.wait(0.2)
    later = time.monotonic() + 0.3
    waiting.append(later)
    guard.arm(time.monotonic() + 0.05)  # an earlier deadline whose request ended ...
    guard.arm(later)  # ... and a later one still waiting: re-armed for it, fired after it
    assert fired.wait(5.0)
    assert time.monotonic() >= later
