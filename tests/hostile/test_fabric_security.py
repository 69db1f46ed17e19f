"""Security of the cross-process fabric's same-host path and its secret, as bounded tests.

Attestation: the same-host path attests the process that *sent the key proof* (SCM_PIDFD), not the
    one that called listen()/connect() (SO_PEERCRED), on both sides of the proof; no PR_SET_PTRACER.
Reader waits: the owner's wait for a reader is capped by the TCP path's constant and never repeated
    on a table whose reader died or whose wait already ran out.
Secret directory: the automatic secret never lands in a directory another user controls.
Deadlines: a copy never starts past the reader's deadline, one that ends past it is LLM_TIMEOUT,
    and unregister waits for a living reader whose copy is still in flight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import mmap
import os
import secrets
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvdd import Status
from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import auth, samehost, samehost_path, wire
from kvdd.sim.fabric.auth import Session
from kvdd.sim.fabric.samehost_path import STATE_CLOSED, ServedTable, new_table_fd
from shared_support import FakeServedCache as _Entry

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=f"same-host path unavailable: {samehost.availability()[1]}")

_PROTO = b"kvdd-samehost/2"  # the proof's wire format, spoken from raw sockets below
_RAW = r"""
import hashlib, hmac, os, socket, struct, sys, time
from kvdd._native import _xproc
from kvdd.sim.fabric.samehost_path import new_table_fd
key, tr = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
P = b"kvdd-samehost/2"
def proof(role):
    return hmac.new(key, P + b" " + role + b"\0" + tr + b"\0", hashlib.sha256).digest()
def table(slots):
    fd = new_table_fd(slots)
    _xproc.LeaseTable(fd, slots, True)
    return fd
"""

# The fake acceptor M: a child K calls listen() on M's endpoint and stays alive; M answers.
_FAKE_ACCEPTOR = _RAW + r"""
name = b"\0kvdd-sh-attest-" + os.urandom(8).hex().encode()
ls = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
ls.bind(name)
r, w = os.pipe()
k = os.fork()
if k == 0:
    ls.listen(8); os.write(w, b"x"); time.sleep(30); os._exit(0)
os.read(r, 1)
print(k, name.hex(), flush=True)
conn, _ = ls.accept()
conn.settimeout(10)
try:
    socket.recv_fds(conn, 512, 1)
    socket.send_fds(conn, [P + b"R" + proof(b"acceptor") + struct.pack("<I", 1)], [table(1)])
    socket.recv_fds(conn, 512, 1)
    conn.sendall(P + b"K")
except OSError:
    pass
os.kill(k, 9)
"""

# The fake initiator M: a child K connects to the honest endpoint, hands M the socket, stays alive.
_FAKE_INITIATOR = _RAW + r"""
name = bytes.fromhex(sys.argv[3])
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
k = os.fork()
if k == 0:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); c.connect(name)
    socket.send_fds(theirs, [b"x"], [c.fileno()]); time.sleep(30); os._exit(0)
_, fds, _, _ = socket.recv_fds(ours, 16, 1)
conn = socket.socket(fileno=fds[0])
conn.settimeout(10)
conn.setsockopt(socket.SOL_SOCKET, 76, 1)  # SO_PASSPIDFD: the kernel then always records M
print(k, flush=True)
sid = hashlib.sha256(P + b" session\0" + tr).digest()
try:
    conn.sendall(P + b"H" + sid + proof(b"initiator"))
    socket.recv_fds(conn, 512, 1)
    socket.send_fds(conn, [P + b"F" + struct.pack("<I", 0)], [table(0)])
    conn.recv(64)
except OSError:
    pass
os.kill(k, 9)
"""


class _Session:
    def __init__(self, initiator: bool) -> None:
        self.key = secrets.token_bytes(32)
        self.transcript = secrets.token_bytes(32)
        self.initiator = initiator
        self.channel = b""


def _spawn(script: str, s: _Session, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, s.key.hex(), s.transcript.hex(), *extra],
                            stdout=subprocess.PIPE, text=True)


def test_initiator_attests_the_sender_of_the_proof_not_the_listen_caller() -> None:
    """Before: SO_PEERCRED named K (listen() caller) and the honest side read/wrote K."""
    s = _Session(initiator=True)
    m = _spawn(_FAKE_ACCEPTOR, s)
    try:
        assert m.stdout is not None
        k_text, name_hex = m.stdout.readline().split()
        link = samehost.prove(samehost.offer() + bytes.fromhex(name_hex), s,
                              lambda: (new_table_fd(0), 0), lambda _link: None, timeout_s=10)
        try:
            assert link.peer_pid == m.pid != int(k_text)
            assert link.alive()
        finally:
            link.close()
    finally:
        m.wait(10)


def test_acceptor_attests_the_sender_of_the_proof_not_the_connect_caller() -> None:
    """Before: SO_PEERCRED of the accepted socket named K (connect() caller)."""
    s = _Session(initiator=False)
    got: list[samehost.SameHostLink | None] = []
    done = threading.Event()

    def on_link(link: samehost.SameHostLink | None) -> None:
        got.append(link)
        done.set()

    reply = samehost.accept(samehost.offer(), s, lambda: (new_table_fd(1), 1), lambda _l: True, on_link)
    name = reply[len(samehost.offer()):]
    m = _spawn(_FAKE_INITIATOR, s, name.hex())
    try:
        assert m.stdout is not None
        k = int(m.stdout.readline())
        assert done.wait(10)
        link = got[0]
        assert link is not None and link.peer_pid == m.pid != k
        link.close()
    finally:
        m.wait(10)


def test_yama_scope_1_means_tcp_without_ptracer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Yama ptrace_scope >= 1: the path is not offered (no PR_SET_PTRACER grant), doctor says so."""
    monkeypatch.setattr(samehost, "ptrace_scope", lambda: 1)
    ok, why = samehost.availability()
    assert not ok and "ptrace_scope=1" in why and "TCP" in why
    assert samehost.offer() == b""
    assert samehost.accept(b"x" * 41, _Session(False), lambda: (-1, 0), lambda _l: True, lambda _l: None) == b""


def _served(cids: tuple[int, ...], cap_ms: int = wire.MAX_LEASE_MS) -> tuple[list[_Entry], ServedTable, int]:
    entries = [_Entry(c) for c in cids]
    table = {e.cache_id: e for e in entries}
    served = (ServedTable(table) if cap_ms == wire.MAX_LEASE_MS  # type: ignore[arg-type]
              else ServedTable(table, cap_ms))  # type: ignore[arg-type]
    fd, _slots = served.take_fd()
    return entries, served, fd


def test_reader_limit_is_capped_like_tcp_and_never_waited_twice() -> None:
    """Before: a peer's limit was honoured up to 600 s and every later unregister waited again."""
    assert samehost_path.MAX_LEASE_MS == wire.MAX_LEASE_MS == 60_000
    entries, served, fd = _served((3, 5, 7), cap_ms=200)
    me = os.getpid()
    try:
        served.attach(samehost.SameHostLink(me, os.getuid(), _xproc.pidfd_open(me)), 0xFFFFFFFF)
        assert served.reader_limit_ms == wire.MAX_LEASE_MS
        m = mmap.mmap(fd, _xproc.LEASE_HEADER + 3 * _xproc.LEASE_SLOT)
        for s in range(3):  # the hostile peer: every in-flight count nonzero, for good
            off = _xproc.LEASE_HEADER + s * _xproc.LEASE_SLOT
            m[off:off + 8] = (1).to_bytes(8, "little")
        took = []
        for e in entries:
            t0 = time.monotonic()
            e.unregister()
            took.append(time.monotonic() - t0)
        assert 0.19 < took[0] < 0.45 + 1.0  # the cap (+ the grace), once
        assert max(took[1:]) < 0.1  # not again: the table's wait already ran out
        assert served.table.state(-1) == STATE_CLOSED
        t0 = time.monotonic()
        served.close()
        assert time.monotonic() - t0 < 0.1
        m.close()
    finally:
        served.close()
        os.close(fd)


def test_no_copy_starts_past_the_deadline() -> None:
    """The deadline is checked before the first process_vm call: a 0 ms budget moves no byte
    (before: the whole first 16 MiB batch was copied, then the deadline looked at)."""
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, np.uint8)
    one = np.array([0], np.int64)
    with pytest.raises(TimeoutError):
        _xproc.pvm_copy(os.getpid(), [Region(int(dst.ctypes.data), 4096, dst)],
                        [int(src.ctypes.data)], 4096, one, one, np.array([4096], np.int64), False,
                        timeout_ms=0)
    assert not dst.any()


_READER = r"""
import os, sys, numpy as np
from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.samehost_path import OneSidedPeer
from kvdd.sim.fabric.protocol import RemoteCache
owner, fd, addr = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
print(os.getpid(), flush=True); sys.stdin.readline()
r = OneSidedPeer(samehost.SameHostLink(owner, os.getuid(), _xproc.pidfd_open(owner), fd, 1))
st, lease = r.acquire(RemoteCache(3, 1, 4096, 1, 4096, False, 3), (addr,), 300)
src = np.full(4096, 0xAB, np.uint8); one = np.array([0], np.int64)
st = r.move(lease, [0], [Region(int(src.ctypes.data), 4096, src)], one, one,
            np.array([4096], np.int64), True)
r.release(lease); print(int(st), flush=True)
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to delay a system call")
def test_unregister_waits_for_a_living_reader_in_a_delayed_copy() -> None:
    """A reader whose pwrite to the owner's memory is delayed 1.5 s past its 300 ms deadline
    (strace): the
    owner's unregister returns only after the copy, and the reader reports LLM_TIMEOUT.  Before:
    unregister returned after 300 + 250 ms and the bytes landed after it."""
    arena = np.zeros(4096, np.uint8)
    entries, served, fd = _served((3,))
    p = subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=pwrite64",
                          "-e", "inject=pwrite64:delay_enter=1500000",
                          sys.executable, "-c", _READER, str(os.getpid()), str(fd),
                          str(int(arena.ctypes.data))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=[fd])
    try:
        assert p.stdout is not None and p.stdin is not None
        rpid = int(p.stdout.readline())
        served.attach(samehost.SameHostLink(rpid, os.getuid(), _xproc.pidfd_open(rpid)), 300)
        p.stdin.write("\n")
        p.stdin.flush()
        deadline = time.monotonic() + 5
        while served.table.inflight(0) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert served.table.inflight(0) == 1  # the reader is in its slot, its syscall delayed
        entries[0].unregister()
        landed = int((arena == 0xAB).sum())
        arena[:] = 0  # the owner reuses the memory at once
        st = int(p.stdout.readline())
        p.wait(10)
        assert landed in (0, 4096)  # before unregister returned, if at all
        assert not arena.any()  # nothing after it
        assert st == Status.LLM_TIMEOUT  # it ran past its deadline: not reported as done
    finally:
        p.kill()
        p.wait()
        served.close()
        os.close(fd)


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in (auth.ENV_SECRET, auth.ENV_SECRET_FILE, auth.ENV_AUTH):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    return tmp_path


def test_world_writable_runtime_dir_is_not_used(secret_env: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """XDG_RUNTIME_DIR=/tmp-like (sticky, world-writable): the secret goes to ~/.config."""
    shared = secret_env / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
    path = auth.default_secret_path()
    assert path == secret_env / "home" / ".config" / "kvdd" / "fabric.secret"
    assert len(auth.load_secret().key) == 32
    assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
    assert not (shared / "kvdd").exists()


def test_secret_dir_must_be_ours_and_0700(secret_env: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    run = secret_env / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    squat = run / "kvdd"
    squat.mkdir()
    squat.chmod(0o777)  # as another user's squatted directory would be
    with pytest.raises(auth.SecretError, match=f"mode 777.*{auth.ENV_SECRET_FILE}"):
        auth.load_secret()
    with pytest.raises(auth.SecretError, match="mode 777"):
        auth.load_secret(create=False)
    assert not (squat / "fabric.secret").exists()
    squat.rmdir()
    elsewhere = secret_env / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    squat.symlink_to(elsewhere)
    with pytest.raises(auth.SecretError, match="symbolic link"):
        auth.load_secret()
    assert not any(elsewhere.iterdir())
    squat.unlink()
    if os.geteuid() == 0:
        squat.mkdir(mode=0o700)
        os.chown(squat, 12345, 12345)
        with pytest.raises(auth.SecretError, match="belongs to uid 12345"):
            auth.load_secret()
        squat.rmdir()
    assert len(auth.load_secret().key) == 32  # created by us, 0700: fine
    assert stat.S_IMODE(os.lstat(squat).st_mode) == 0o700


_PID_REUSE = _RAW + r"""
import subprocess, threading
name = b"\0kvdd-sh-attest-" + os.urandom(8).hex().encode()
ls = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
ls.bind(name)
k = os.fork()
if k == 0:
    ls.listen(8); os._exit(0)
os.waitpid(k, 0)
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(k - 1))
VICTIM = (
    "import ctypes, sys\n"
    "buf = ctypes.create_string_buffer(b'V' * 64, 64)\n"
    "print(ctypes.addressof(buf), flush=True); sys.stdin.readline()\n"
    "print(buf.raw.hex(), flush=True)\n")
v = subprocess.Popen([sys.executable, "-c", VICTIM], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True)
v_addr = int(v.stdout.readline())
def serve():
    conn, _ = ls.accept()
    conn.settimeout(10)
    try:
        socket.recv_fds(conn, 512, 1)
        fd = new_table_fd(1); t = _xproc.LeaseTable(fd, 1, True); t.store(0, 2, 7)
        socket.send_fds(conn, [P + b"R" + proof(b"acceptor") + struct.pack("<I", 1)], [fd])
        socket.recv_fds(conn, 512, 1)
        conn.sendall(P + b"K")
    except OSError:
        pass
threading.Thread(target=serve, daemon=True).start()
HONEST = (
    "import sys, numpy as np\n"
    "from kvdd.sim.fabric import samehost\n"
    "from kvdd.sim.fabric.samehost_path import OneSidedPeer, new_table_fd\n"
    "from kvdd.sim.fabric.protocol import RemoteCache\n"
    "from kvdd._native._copy import Region\n"
    "class S: pass\n"
    "s = S(); s.key = bytes.fromhex(sys.argv[1]); s.transcript = bytes.fromhex(sys.argv[2])\n"
    "s.initiator = True; s.channel = b''\n"
    "link = samehost.prove(samehost.offer() + bytes.fromhex(sys.argv[3]), s,\n"
    "                      lambda: (new_table_fd(0), 0), lambda l: None)\n"
    "r = OneSidedPeer(link); rc = RemoteCache(7, 1, 64, 1, 64, False, 7)\n"
    "src = np.full(64, 0x41, np.uint8); one = np.array([0], np.int64)\n"
    "st, lease = r.acquire(rc, (int(sys.argv[4]),), 5000)\n"
    "st = r.move(lease, [0], [Region(int(src.ctypes.data), 64, src)], one, one,\n"
    "            np.array([64], np.int64), True)\n"
    "print(link.peer_pid, int(st), flush=True)\n")
c = subprocess.run([sys.executable, "-c", HONEST, key.hex(), tr.hex(), name.hex(), str(v_addr)],
                   capture_output=True, text=True, timeout=30)
v.stdin.write("\n"); v.stdin.flush()
print(k, v.pid, os.getpid(), c.stdout.strip(), v.stdout.readline().strip(), flush=True)
v.wait(10)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare (a private pid namespace to reuse a pid)")
def test_reused_pid_of_the_listen_caller_is_never_touched() -> None:
    """The pid-reuse attack: K called listen() and exited, its pid now names a victim V; the key
    holder M answers the proof.  The honest initiator attests M (pid 1 in the namespace), never V,
    and V's memory is unchanged (attesting the listen caller would write 64 bytes into V)."""
    s = _Session(initiator=False)
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                          _PID_REUSE, s.key.hex(), s.transcript.hex()],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "unshare" in out.stderr:
        pytest.skip(f"unshare failed: {out.stderr.strip()[-200:]}")
    k, v, m, attested, status, victim = out.stdout.split()
    assert k == v  # the pid was reused
    assert attested == m == "1"  # the sender of the proof, not the victim
    assert bytes.fromhex(victim) == b"V" * 64  # (the write, if any, went to M's own memory)
    assert int(status) in (Status.LLM_SUCCESS, Status.LLM_FAILED, Status.LLM_TIMEOUT)


def test_a_linked_session_keeps_every_field_but_the_three_the_hello_names() -> None:
    """``Session.linked`` (the link's cluster ids and the peer's boot id) is
    :func:`dataclasses.replace` of exactly those three fields: the key, transcript, role,
    channel and announcement stay what authentication proved."""
    s = Session(b"k" * 32, b"t" * 32, True, 1, 2, "boot", True, b"chan", b"ann")
    got = s.linked(7, 8, "peer-boot")
    assert got == dataclasses.replace(s, local_cluster_id=7, peer_cluster_id=8,
                                      peer_boot_id="peer-boot")
    assert [f.name for f in dataclasses.fields(Session)] == [
        "key", "transcript", "initiator", "local_cluster_id", "peer_cluster_id", "peer_boot_id",
        "auth_off", "channel", "announced"]  # a new field must be carried by linked() too


def test_a_proof_whose_callback_fails_frees_its_worker_and_slot(caplog: pytest.LogCaptureFixture) -> None:
    """An unexpected error in the caller's ``on_link`` (a bug) is logged and ends that proof
    alone: its slot is freed and the endpoint serves the next proof (before, the worker thread
    died holding its slot and its count; 16 such proofs turned the path off for the process)."""
    from kvdd.sim.fabric.samehost_endpoint import endpoint

    def boom(link: samehost.SameHostLink | None) -> None:
        if link is not None:
            link.close()
            raise RuntimeError("a bug in on_link")

    s = _Session(initiator=False)
    reply = samehost.accept(samehost.offer(), s, lambda: (new_table_fd(1), 1), lambda _l: True, boom)
    m = _spawn(_FAKE_INITIATOR, s, reply[len(samehost.offer()):].hex())
    try:
        assert m.stdout is not None
        m.stdout.readline()
    finally:
        m.wait(10)
    deadline = time.monotonic() + 5
    while endpoint().held()["proving"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert endpoint().held()["proving"] == 0
    assert "a proof failed" in caplog.text and "a bug in on_link" in caplog.text
    test_acceptor_attests_the_sender_of_the_proof_not_the_connect_caller()  # the next one is served
