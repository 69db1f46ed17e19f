"""The same-host identity proof against hostile peers (kvdd.sim.fabric.samehost).

A peer that authenticated may claim anything; the reader uses process_vm only on the process the
kernel names at the end of an AF_UNIX socket that proved it holds *this* session's key."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvdd._native import _xproc
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.samehost_path import check_table_fd, new_table_fd

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])


@dataclass(frozen=True)
class Session:
    key: bytes
    transcript: bytes
    initiator: bool = True


def _session() -> Session:
    return Session(secrets.token_bytes(32), secrets.token_bytes(96))


# An acceptor in a child process: expects the session given on its command line, prints its
# extension reply, then reports "LINK <pid> <slots>" or "NONE" when the proof ends.
_ACCEPTOR = r"""
import os, sys
from dataclasses import dataclass
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.samehost_path import new_table_fd

@dataclass(frozen=True)
class S:
    key: bytes
    transcript: bytes
    initiator: bool = False

s = S(bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2]))
def on_link(link):
    print("LINK" if link is None else f"LINK {link.peer_pid} {link.table_slots}", flush=True)
    if link is not None:
        link.close()
offer = samehost.offer()
reply = samehost.accept(offer, s, lambda: (new_table_fd(3), 3), lambda _l: True, on_link)
print(reply.hex(), flush=True)
sys.stdin.readline()
"""


class Acceptor:
    def __init__(self, session: Session) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ACCEPTOR, session.key.hex(), session.transcript.hex()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.reply = bytes.fromhex(self.proc.stdout.readline().strip())

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
        finally:
            self.proc.wait(10)


@pytest.fixture
def acceptor() -> Iterator[tuple[Session, Acceptor]]:
    s = _session()
    a = Acceptor(s)
    try:
        yield s, a
    finally:
        a.close()


def _prove(reply: bytes, s: samehost.SessionKeys, attached: list[samehost.SameHostLink] | None = None
           ) -> samehost.SameHostLink:
    return samehost.prove(reply, s, lambda: (new_table_fd(2), 2),
                          lambda link: attached.append(link) if attached is not None else None)


def test_honest_proof_names_the_processes(acceptor: tuple[Session, Acceptor]) -> None:
    s, a = acceptor
    seen: list[samehost.SameHostLink] = []
    link = _prove(a.reply, s, seen)
    try:
        assert link.peer_pid == a.proc.pid and link.peer_uid == os.getuid()
        assert link.table_slots == 3 and link.table_fd >= 0 and seen == [link]
        assert link.alive()
        check_table_fd(link.table_fd, 3, _xproc.LEASE_HEADER + 3 * _xproc.LEASE_SLOT)
        assert a.line() == f"LINK {os.getpid()} 2"  # the acceptor attested us, with our table
    finally:
        link.close()
    # the session is used once: a second proof for it is refused
    with pytest.raises(samehost.SameHostRefused):
        _prove(a.reply, s)


def test_relayed_endpoint_is_refused() -> None:
    """A fake peer F (session s1 with us) announces a victim V's endpoint (V expects s2, its own
    session with F): V refuses our proof and cannot give its own; nothing is attached on either
    side, and V's session stays claimable by F only."""
    s1, s2 = _session(), _session()
    victim = Acceptor(s2)
    try:
        spoof = samehost.offer() + victim.reply[len(samehost.offer()):]
        seen: list[samehost.SameHostLink] = []
        with pytest.raises(samehost.SameHostRefused):
            _prove(spoof, s1, seen)
        assert seen == []
        link = _prove(victim.reply, s2)  # the victim's real session partner still gets it
        assert link.peer_pid == victim.proc.pid
        link.close()
        assert victim.line() == f"LINK {os.getpid()} 2"
    finally:
        victim.close()


# A fake endpoint in another process: answers the hello with a guessed proof and a table.
_FAKE_ENDPOINT = r"""
import os, secrets, socket, sys
from kvdd.sim.fabric.samehost_path import new_table_fd
srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
srv.bind(bytes.fromhex(sys.argv[1]))
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
conn.recv(512)
socket.send_fds(conn, [b"kvdd-samehost/2R" + secrets.token_bytes(32) + b"\x01\0\0\0"],
                [new_table_fd(1)])
conn.settimeout(5)
print("final" if conn.recv(512) else "closed", flush=True)
"""


def test_spoofed_endpoint_is_refused(acceptor: tuple[Session, Acceptor]) -> None:
    """A fake endpoint that cannot prove the session key is refused before anything of ours is
    sent; an endpoint name outside kvdd's namespace is not even dialled."""
    s, _a = acceptor
    fake_name = b"\0kvdd-sh-fake-%d" % os.getpid()
    fake = subprocess.Popen([sys.executable, "-c", _FAKE_ENDPOINT, fake_name.hex()],
                            stdout=subprocess.PIPE, text=True)
    assert fake.stdout is not None
    try:
        assert fake.stdout.readline().strip() == "ready"
        offer = samehost.offer()
        seen: list[samehost.SameHostLink] = []
        with pytest.raises(samehost.SameHostRefused, match="does not hold the session key"):
            _prove(offer + fake_name, s, seen)
        assert seen == [] and fake.stdout.readline().strip() == "closed"  # no table of ours
        with pytest.raises(samehost.SameHostRefused, match="malformed"):
            _prove(offer + b"\0someone-else", s)
        with pytest.raises(samehost.SameHostRefused, match="declined"):
            _prove(b"", s)
    finally:
        fake.kill()
        fake.wait()


def _closed_without_answer(c: socket.socket) -> bool:
    try:
        return c.recv(512) == b""
    except ConnectionResetError:
        return True


def _connect_as_another_uid(a: Acceptor, then: str) -> subprocess.CompletedProcess[str]:
    """A child of uid 65534 connects to the endpoint ``a`` named (socket ``c``, 5 s timeout)
    and runs ``then``."""
    code = ("import os, socket, sys, time\nos.setgid(65534)\nos.setuid(65534)\n"
            "c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\nc.settimeout(5)\n"
            "c.connect(bytes.fromhex(sys.argv[1]))\n" + then)
    name = a.reply[len(samehost.offer()):]
    return subprocess.run([sys.executable, "-c", code, name.hex()], capture_output=True, text=True,
                          timeout=30)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process of another uid")
def test_other_uid_is_closed_at_once(acceptor: tuple[Session, Acceptor]) -> None:
    s, a = acceptor
    out = _connect_as_another_uid(a, "try:\n c.send(b'kvdd-samehost/2H' + bytes(64))\n"
                                     " print(c.recv(512) == b'')\n"
                                     "except (ConnectionResetError, BrokenPipeError):\n print(True)\n")
    assert out.stdout.strip() == "True", out.stderr
    link = _prove(a.reply, s)  # the legitimate initiator is unaffected
    link.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process of another uid")
def test_a_silent_connection_of_another_uid_is_closed_before_it_is_read(
        acceptor: tuple[Session, Acceptor]) -> None:
    """By its kernel credentials, right after accept: it never waits for a message (which would
    hold one of the MAX_SETUPS proof slots for SETUP_TIMEOUT_S each)."""
    s, a = acceptor
    out = _connect_as_another_uid(a, "t0 = time.monotonic()\n"
                                     "try:\n got = c.recv(512)\nexcept ConnectionResetError:\n got = b''\n"
                                     "print(got == b'', time.monotonic() - t0)\n")
    closed, waited = out.stdout.split()
    assert closed == "True", out.stderr
    assert float(waited) < samehost.SETUP_TIMEOUT_S / 2  # not dropped at the message deadline
    link = _prove(a.reply, s)
    link.close()


def test_slow_and_garbage_connections_do_not_block_proofs(
        acceptor: tuple[Session, Acceptor]) -> None:
    s, a = acceptor
    name = a.reply[len(samehost.offer()):]
    idle = []
    for _ in range(8):  # connected and silent (each is dropped after SETUP_TIMEOUT_S)
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.connect(name)
        idle.append(c)
    for junk in (b"", b"x" * 511, b"kvdd-samehost/2H" + bytes(63), b"kvdd-samehost/2F\0\0\0\0"):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.settimeout(5)
        c.connect(name)
        if junk:
            c.send(junk)
        else:
            c.shutdown(socket.SHUT_WR)
        assert _closed_without_answer(c)
        c.close()
    t0 = time.monotonic()
    link = _prove(a.reply, s)
    assert time.monotonic() - t0 < samehost.SETUP_TIMEOUT_S
    assert link.peer_pid == a.proc.pid
    link.close()
    for c in idle:
        c.close()


@dataclass(frozen=True)
class BoundSession:
    key: bytes
    transcript: bytes
    initiator: bool
    channel: bytes


_BOUND_ACCEPTOR = _ACCEPTOR.replace(
    "    initiator: bool = False\n",
    "    initiator: bool = False\n    channel: bytes = bytes.fromhex(sys.argv[3])\n")


def test_relay_with_one_transcript_but_two_channels_is_refused() -> None:
    """A relay holding the shared secret can give its two sessions (with us, with the victim) one
    transcript and so one key; it cannot give them one TCP channel: the proof binds the channel
    each side's kernel reports, and the victim refuses."""
    key, transcript = secrets.token_bytes(32), secrets.token_bytes(32)
    victim_channel = b"127.0.0.1|40001|127.0.0.1|5000"  # F -> V
    our_channel = b"127.0.0.1|40002|127.0.0.1|6000"  # us -> F
    def victim() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _BOUND_ACCEPTOR, key.hex(), transcript.hex(),
                                 victim_channel.hex()], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

    for channel, honest in ((our_channel, False), (victim_channel, True)):
        v = victim()
        assert v.stdout is not None and v.stdin is not None
        try:
            reply = bytes.fromhex(v.stdout.readline().strip())
            s = BoundSession(key, transcript, True, channel)
            if honest:  # the same session on the same channel is proven
                link = _prove(reply, s)
                assert link.peer_pid == v.pid
                link.close()
            else:
                with pytest.raises(samehost.SameHostRefused):
                    _prove(reply, s)
                assert v.stdout.readline().strip() == "LINK"  # the victim attached nothing
        finally:
            v.stdin.close()
            v.wait(10)


def test_doctor_says_whether_and_why(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdd.cli import main
    assert main(["doctor"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("same-host links:")]
    assert line == [f"same-host links: one-sided: {samehost.availability()[1]}"]
    monkeypatch.setenv(samehost.ENV_XPROC, "tcp")
    assert main(["doctor"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("same-host links:")]
    assert line == ["same-host links: TCP: KVDD_SIM_XPROC=tcp: same-host links use TCP"]


# An acceptor expecting many sessions at once; it reports how many proofs succeeded, the most
# proof workers it ran at once, and how many are left a moment after the last proof.
_BUSY_ACCEPTOR = r"""
import sys, threading, time
from dataclasses import dataclass
from kvdd.sim.fabric import samehost, samehost_endpoint as E
from kvdd.sim.fabric.samehost_path import new_table_fd

@dataclass(frozen=True)
class S:
    key: bytes
    transcript: bytes
    initiator: bool = False

E.PROOF_IDLE_S = 0.3
lock, now, most, links = threading.Lock(), [0], [0], []
work = E.Endpoint._work
def counted(self):
    with lock:
        now[0] += 1
        most[0] = max(most[0], now[0])
    try:
        work(self)
    finally:
        with lock:
            now[0] -= 1
E.Endpoint._work = counted
def on_link(link):
    links.append(link)
    if link is not None:
        link.close()
for line in sys.stdin.readline().split():
    key, transcript = line.split(":")
    s = S(bytes.fromhex(key), bytes.fromhex(transcript))
    print(samehost.accept(samehost.offer(), s, lambda: (new_table_fd(1), 1), lambda _l: True, on_link).hex(), flush=True)
sys.stdin.readline()  # the proofs are done
time.sleep(1.0)
alive = sum(t.name == "kvdd-samehost-proof" for t in threading.enumerate())
print(sum(link is not None for link in links), most[0], alive, flush=True)
"""


def test_concurrent_proofs_are_served_by_at_most_max_setups_workers_that_then_end() -> None:
    """MAX_SETUPS initiators prove at once: every proof succeeds, no more than MAX_SETUPS proof
    workers ever run, and they end once idle (PROOF_IDLE_S, shortened here)."""
    import threading

    from kvdd.sim.fabric.samehost_endpoint import MAX_SETUPS

    sessions = [_session() for _ in range(MAX_SETUPS)]
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_ACCEPTOR], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(" ".join(f"{s.key.hex()}:{s.transcript.hex()}" for s in sessions) + "\n")
        proc.stdin.flush()
        replies = [bytes.fromhex(proc.stdout.readline().strip()) for _ in sessions]
        results: list[object] = [None] * len(sessions)
        start = threading.Barrier(len(sessions))

        def run(i: int) -> None:
            start.wait()
            try:
                results[i] = _prove(replies[i], sessions[i])
            except samehost.SameHostRefused as exc:
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        links = [r for r in results if isinstance(r, samehost.SameHostLink)]
        assert len(links) == len(sessions), results
        assert all(link.peer_pid == proc.pid for link in links)
        for link in links:
            link.close()
        proc.stdin.write("done\n")
        proc.stdin.flush()
        proven, most, alive = (int(x) for x in proc.stdout.readline().split())
        assert proven == len(sessions)
        assert 1 <= most <= MAX_SETUPS
        assert alive == 0  # idle workers ended
    finally:
        proc.kill()
        proc.wait(10)
