"""Leases, dead and silent peers across processes (kvdd.sim.fabric; SEMANTICS.md §10 rules 2, 5, 8,
9): a removal waits for remote readers, a dead reader releases at once, a stuck one's lease
expires, and a peer killed or stopped mid-transfer gives LLM_TIMEOUT, never a hang."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvdd
from kvdd import DataType, LlmRole, Status
from kvdd.sim import fabric
from kvdd.sim.fabric import wire

from conformance import reference as ref
from conformance.checked import pull_blocks_checked, pull_cache_checked, push_cache_checked
from conformance.harness import (
    KV_CACHE_NOT_EXIST,
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
from peer_node import ProcessNode
from peer_proc import PeerProcess
from fabric_world import (
    S,
    WAIT,
    peer_env,
    xproc,
    proc,
    world,
    own_proc,
    own_world,
    setup_pair,
)

# ---- leases, dead and silent peers -----------------------------------------------------------------


class _Hold:
    """Make this process's cross-process transfers sleep after their lease was granted: before
    a READ's answer is read (a READ is sent with its LEASE) or before the transfer is sent."""

    _SEAMS = ("move", "receive")

    def __init__(self, seconds: float) -> None:
        self.leased = threading.Event()
        self._orig = {name: getattr(fabric.RemotePeer, name) for name in self._SEAMS}

        def slowed(orig: Callable[..., int]) -> Callable[..., int]:
            def slow(peer: fabric.RemotePeer, *args: Any) -> int:
                self.leased.set()
                time.sleep(seconds)
                return orig(peer, *args)
            return slow

        for name, orig in self._orig.items():
            setattr(fabric.RemotePeer, name, slowed(orig))

    def __enter__(self) -> _Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        for name, orig in self._orig.items():
            setattr(fabric.RemotePeer, name, orig)


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
    d, p, dh, ph = setup_pair(world, d_extra={WAIT: "30000"})
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
    with PeerProcess(env=peer_env(xproc)) as p2proc:
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
    d, p, dh, ph = setup_pair(world, d_extra={WAIT: "30000"})
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
    d, p, dh, ph = setup_pair(world, d_extra={WAIT: "1000"})
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


#: Rows of 2 x 64 KiB: above wire.SMALL_BYTES, so a pull takes a LEASE, which it holds until its
#: RELEASE (a small transfer's lease lives only inside its one LEASE_READ / LEASE_WRITE request)
LEASED = Spec(n=2, dtype=DataType.DT_UINT8, shape=(4, 1 << 16))


def _reader_setup(world: World, p_wait: str) -> tuple[Node, ProcessNode, CacheHandle, CacheHandle]:
    """D owns the cache; P (other process) reads it over a link P initiated (rows big enough
    for a separate LEASE: the tests hold the reader after its LEASE's answer, before it reads
    its READ's, so that it holds the lease meanwhile)."""
    d, p, dh, ph = setup_pair(world, d_listen=True, p_extra={WAIT: p_wait}, spec=LEASED)
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
    d, p, dh, ph = setup_pair(world, spec=spec)
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
    d, p, dh, ph = setup_pair(world)
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
    d, p, dh, ph = setup_pair(world)
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
