"""The same-host one-sided path end to end: two processes link, the kernel attests who is where,
transfers move exact bytes with no message to the owner (a stopped owner is still read, SEMANTICS.md
§10 rules 2 and 9 as updated), removal waits for copies (rule 5), and a fake peer that
authenticated and announces another process's endpoint reads or writes nothing there.

Every successful transfer is checked byte for byte over every arena of both processes (guards
included) by the conformance harness."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvdd
from kvdd import LlmRole, Status
from kvdd.sim import fabric
from kvdd.sim.fabric import samehost, wire
from kvdd.sim.fabric.auth import NONCE_BYTES, answer_transcript, load_secret, mac
from kvdd.sim.fabric.handshake import transcript_of
from kvdd.sim.fabric.samehost_path import OneSidedPeer

import peer_node
from conformance import reference as ref
from conformance.checked import (
    pull_blocks_checked,
    pull_cache_checked,
    push_blocks_checked,
    push_cache_checked,
)
from conformance.harness import (
    KV_CACHE_NOT_EXIST,
    CacheHandle,
    Node,
    Spec,
    World,
    link,
    register,
)
from hostile import rawpeer
from peer_node import ProcessNode
from peer_proc import PeerProcess

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])
S = Status.LLM_SUCCESS
WAIT = "llm.SyncKvCacheWaitTime"


@pytest.fixture(scope="module")
def proc() -> Iterator[PeerProcess]:
    with PeerProcess(env={fabric.ENV_XPROC: "auto"}) as p:
        yield p


@pytest.fixture
def own_proc() -> Iterator[PeerProcess]:
    with PeerProcess(env={fabric.ENV_XPROC: "auto"}) as p:
        yield p


def _world(p: PeerProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    monkeypatch.setenv(fabric.ENV_XPROC, "auto")
    with peer_node.process_world(p) as w:
        yield w


@pytest.fixture
def world(proc: PeerProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield from _world(proc, monkeypatch)


@pytest.fixture
def own_world(own_proc: PeerProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield from _world(own_proc, monkeypatch)


def _setup(world: World, *, d_listen: bool = False, d_extra: dict[str, str] | None = None,
           p_extra: dict[str, str] | None = None
           ) -> tuple[Node, ProcessNode, CacheHandle, CacheHandle]:
    p = world.peer(1, LlmRole.PROMPT)
    assert isinstance(p, ProcessNode)
    p.initialize(listen=True, extra=p_extra)
    d = world.dut(2, LlmRole.DECODER)
    d.initialize(listen=d_listen, extra=d_extra)
    return d, p, register(d, Spec()), register(p, Spec())


def _path(d: Node, peer: int) -> str | None:
    backend = d.dd.backend
    assert isinstance(backend, kvdd.sim.SimBackend)
    return backend.link_data_path(peer)


def test_link_is_one_sided_both_ways(world: World) -> None:
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    assert _path(d, 1) == "process_vm"
    assert p.data_path(2) == "process_vm"  # comm: the acceptor reads us one-sided too
    pull_cache_checked(world, d, ph, dh, batch_index=1, src_batch=2)
    push_cache_checked(world, d, dh, ph, src_batch_index=3, dst_batch=0)
    pull_blocks_checked(world, d, ph, dh, [0, 2, 3], [3, 2, 1])
    push_blocks_checked(world, d, dh, ph, [1, 2], [3, 0])
    pull_cache_checked(world, p, dh, ph)  # and the acceptor's direction
    push_blocks_checked(world, p, ph, dh, [0], [3])


def test_kvdd_sim_xproc_tcp_keeps_tcp(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fabric.ENV_XPROC, "tcp")
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    assert _path(d, 1) == "tcp" and p.data_path(2) == "tcp"
    pull_cache_checked(world, d, ph, dh)


def test_stopped_owner_is_still_read(own_world: World, own_proc: PeerProcess) -> None:
    """Like RDMA: no answer from the owner's CPU is needed (the TCP path times out instead:
    tests/sim/test_fabric_leases.py::test_silent_peer_times_out)."""
    world = own_world
    d, p, dh, ph = _setup(world, d_extra={WAIT: "1000"})
    assert link(d, p) == [S]
    before = world.snapshot()  # (the harness reads the peer's arenas by RPC: not while stopped)
    own_proc.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        d.pull_kv_cache(ph.index(1), dh.cache(), 2)
        took = time.monotonic() - t0
    finally:
        own_proc.signal(signal.SIGCONT)
    assert took < 0.9  # far from the 1 s wait: nobody waited for the owner
    expected = before.copy()
    ref.pull_cache(expected.tensors(dh), before.tensors(ph), dh.geom, src_batch=1, dst_batch=2)
    world.assert_memory(expected, "after a pull from a stopped owner: ")


class _SlowCopies:
    """Make this process's one-sided copies sleep after their lease (slot) was entered (through
    the Python path: the compiled path, which does not call OneSidedPeer.move, is off)."""

    def __init__(self, seconds: float) -> None:
        from kvdd.sim import _fastpath
        self._fast = _fastpath
        self._was = _fastpath.set_enabled(False)
        self.entered = threading.Event()
        self.finished: list[float] = []
        self._orig = orig = OneSidedPeer.move

        def slow(peer: OneSidedPeer, *args: Any) -> int:
            self.entered.set()
            time.sleep(seconds)
            try:
                return orig(peer, *args)
            finally:
                self.finished.append(time.monotonic())

        OneSidedPeer.move = slow  # type: ignore[method-assign,assignment]

    def __enter__(self) -> _SlowCopies:
        return self

    def __exit__(self, *exc: object) -> None:
        OneSidedPeer.move = self._orig  # type: ignore[method-assign]
        self._fast.set_enabled(self._was)


def test_owner_unregister_waits_for_a_one_sided_copy(world: World) -> None:
    """Rule 5: the owner (other process) unregisters while our copy runs: its unregister returns
    only after the copy ended; the copy moved the exact bytes; later pulls find nothing."""
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    before = world.snapshot()
    with _SlowCopies(0.5) as slow:
        t = threading.Thread(target=lambda: d.pull_kv_cache(ph.index(), dh.cache()))
        t.start()
        assert slow.entered.wait(30)
        call = p.start("unregister", ph.cache_id)
        call.result()
        unregistered_at = time.monotonic()
        t.join(30)
    assert slow.finished and slow.finished[0] <= unregistered_at
    expected = before.copy()
    ref.pull_cache(expected.tensors(dh), before.tensors(ph), dh.geom)
    world.assert_memory(expected, "after a one-sided pull that raced the owner's unregister: ")
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())


def test_owner_finalize_waits_then_not_found(world: World) -> None:
    d, p, dh, ph = _setup(world)
    assert link(d, p) == [S]
    with _SlowCopies(0.4) as slow:
        t = threading.Thread(target=lambda: d.pull_kv_cache(ph.index(), dh.cache()))
        t.start()
        assert slow.entered.wait(30)
        p.start("finalize").result()
        finalized_at = time.monotonic()
        t.join(30)
    assert slow.finished and slow.finished[0] <= finalized_at
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())


def test_reader_killed_under_load_releases(own_world: World, own_proc: PeerProcess) -> None:
    """The reader (other process) is killed while pulling in a loop: our unregister returns at
    once, whatever its counts in the lease table say."""
    world = own_world
    d, p, dh, ph = _setup(world, d_listen=True, p_extra={WAIT: "60000"})
    assert link(p, d) == [S]
    assert p.data_path(2) == "process_vm"
    for _ in range(20):
        p.start("pull_kv_cache", dh.index(), ph.cache())
    time.sleep(0.05)
    own_proc.kill()
    world.nodes.remove(p)
    t0 = time.monotonic()
    d.unregister(dh.cache_id)
    assert time.monotonic() - t0 < 5.0


# ---- a fake peer that authenticated and announces another process's endpoint --------------------


def _serve_fake_acceptor(srv: socket.socket, victim_announced: bytes, victim_addrs: list[int],
                         nbytes: int, done: threading.Event) -> None:
    """Accept one connection, authenticate as the acceptor (it holds the secret) announcing the
    victim's endpoint, answer the link hello with a snapshot of the victim's addresses and a
    samehost entry."""
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(10)
        key = load_secret().key
        _t, _r, hello = rawpeer.read_frame(conn)
        nonce_i = hello[:NONCE_BYTES]
        nonce_a = secrets.token_bytes(NONCE_BYTES)
        challenge = nonce_a + hello[NONCE_BYTES:NONCE_BYTES + 1]
        conn.sendall(rawpeer.frame(wire.F_AUTH_CHALLENGE, challenge))
        t0 = transcript_of(hello, challenge)
        _t, _r, proof = rawpeer.read_frame(conn)
        t1 = answer_transcript(t0, proof, victim_announced)
        answer = mac(key, "acceptor", nonce_i, nonce_a, t1)
        conn.sendall(rawpeer.frame(wire.F_AUTH_OK, answer + victim_announced))
        _t, _r, _hello_link = rawpeer.read_frame(conn)
        w = wire.Writer().pack("I", 0).text("")
        wire.encode_offer(w, fabric.LinkOffer(66, "comm", None, 60000))
        w.text(samehost.boot_id())
        w.pack("I", 1)
        w.raw(wire.RC.pack(9, len(victim_addrs), nbytes, 1, nbytes, 0, 0))
        w.raw(np.asarray(victim_addrs, dtype="<u8").tobytes())
        wire.encode_extensions(w, {samehost.EXTENSION: samehost.offer() + struct.pack("<I", 1000)})
        conn.sendall(rawpeer.frame(wire.F_LINK_REPLY, bytes(w.buf)))
        done.wait(30)


def test_spoofed_endpoint_reads_and_writes_nothing_in_a_third_process(
        world: World, proc: PeerProcess) -> None:
    """F links to the victim V (gets V's real announcement: V's endpoint name), then announces
    V's endpoint in its own authentication answer and answers our link with V's cache addresses
    as its own.  Our proof at V's endpoint fails (V has no session with our transcript, and our
    channel is not V's): the link uses TCP to F, and not one byte of V (guards included) or of
    ours changes."""
    victim = world.peer(1, LlmRole.PROMPT)
    assert isinstance(victim, ProcessNode)
    victim.initialize(listen=True)
    vh = register(victim, Spec())
    d = world.dut(2, LlmRole.DECODER)
    d.initialize(extra={WAIT: "1000"})
    dh = register(d, Spec())
    # F links to V as a kvdd initiator would (authenticated, offering samehost)
    vs = rawpeer.connect(victim.listen_port or 0)
    victim_announced = rawpeer.authenticate(vs).announced
    assert victim_announced  # V announced its endpoint
    offer = samehost.offer() + struct.pack("<I", 1000)
    vs.sendall(rawpeer.frame(wire.F_HELLO_LINK, rawpeer.hello_link(
        77, extensions={samehost.EXTENSION: offer})))
    ftype, _req, body = rawpeer.read_frame(vs)
    assert ftype == wire.F_LINK_REPLY
    r = wire.Reader(body)
    assert r.u("I") == 0
    r.text()
    wire.decode_offer(r)
    r.text()
    snap, addrs = wire.decode_snapshot(r)
    victim_addrs = list(addrs[vh.cache_id])
    rc = snap[vh.cache_id]
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()
    t = threading.Thread(target=_serve_fake_acceptor,
                         args=(srv, victim_announced, victim_addrs, rc.tensor_nbytes, done))
    t.start()
    before = world.snapshot()
    try:
        assert d.link(srv.getsockname()[1], 66) == [S]
        assert _path(d, 66) == "tcp"  # the proof failed: no one-sided access to anyone
        calls: list[Callable[[], None]] = [
            lambda: d.pull_kv_cache(kvdd.CacheIndex(66, 9, 0), dh.cache()),
            lambda: d.push_kv_cache(dh.cache(), kvdd.CacheIndex(66, 9, 0))]
        for call in calls:
            try:
                call()
            except kvdd.LLMError as exc:
                assert exc.status in (Status.LLM_TIMEOUT, Status.LLM_KV_CACHE_NOT_EXIST,
                                      Status.LLM_PARAM_INVALID)
        world.assert_memory(before, "after a spoofed same-host endpoint: ")
    finally:
        done.set()
        t.join(30)
        srv.close()
        vs.close()


def test_relinking_keeps_descriptors_bounded(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linking and unlinking again and again: this process keeps at most a bounded number of
    owner tables (and pidfds) per reader process; the newest link is still one-sided."""
    from kvdd.sim.fabric import samehost_tables
    monkeypatch.setattr(samehost_tables, "MAX_TABLES_PER_READER", 3)
    d, p, dh, ph = _setup(world)
    port = p.listen_port or 0
    fds0 = len(os.listdir("/proc/self/fd"))
    for _ in range(12):
        assert link(d, p) == [S]
        assert _path(d, 1) == "process_vm"
        assert d.unlink(port, 1, force=True) == [S]
    assert len(os.listdir("/proc/self/fd")) - fds0 <= 3 + 2
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)
    pull_cache_checked(world, p, dh, ph)
