"""The fabric's server side and its outer interfaces (kvdd.sim.fabric): hostile and slow input, two
independent Python processes and two hosts (network namespaces), handshake extensions over a real
connection, and the owner's streaming of a request."""

from __future__ import annotations

import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvdd
from kvdd import DataType, LlmRole, Status
from kvdd.sim import fabric
from kvdd.sim.fabric import listener_auth
from kvdd.sim.fabric import wire

import peer_node
from hostile import rawpeer
from conformance.checked import pull_blocks_checked, pull_cache_checked, push_blocks_checked
from conformance.harness import CacheHandle, Spec, World, cluster, link, register
from peer_proc import PeerProcess
from fabric_world import (
    S,
    peer_env,
    xproc,
    proc,
    world,
    setup_pair,
    d_path,
)

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
    d, p, dh, ph = setup_pair(world, d_listen=True)
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
    monkeypatch.setattr(listener_auth, "PREAUTH_TIMEOUT_S", 0.5)
    d, p, dh, ph = setup_pair(world, d_listen=True)
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
    env = dict(os.environ, **peer_env(xproc), KVDD_BACKEND="sim")
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
    with PeerProcess(env=peer_env("tcp"), prefix=["ip", "netns", "exec", ns]) as pp:
        make, cleanup = peer_node.process_peer_factory(pp)
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
            assert d_path(d, 1) == "tcp"
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
