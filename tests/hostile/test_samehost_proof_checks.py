"""The checks of the same-host proof on what is announced and offered (:mod:`.announce`,
:mod:`.samehost_link`) and of the acceptor's endpoint (:mod:`.samehost_endpoint`) on what it
expects and on the initiator's messages, each at its boundary.

* an announcement holds at most ``MAX_ANNOUNCEMENT`` bytes (exactly that many goes out, one more
  announces nothing);
* an acceptor binds no session for an initiator whose hints name another uid, boot or version,
  and an initiator offers nothing for an announcement whose endpoint name is malformed;
* a session is expected once and bound once; at most ``MAX_PENDING`` wait (exactly that many are
  taken, one more is not, and the announcement then offers nothing);
* a proof that comes after its session expired is refused at once, and the link decision then
  sends nothing to it;
* the initiator's table must come from the very process attested at its hello (not a child that
  inherited the socket), with at most ``max_slots()`` slots (exactly that many is taken), and that
  process must still be alive when the table is taken (an exited one, not yet reaped, still has
  its pid).

The hostile initiator is another process (the endpoint attests the sender of each message).
"""

from __future__ import annotations

import os
import secrets
import select
import struct
import time
from collections.abc import Iterator

import pytest

from kvdd.sim.fabric import announce, samehost, samehost_attest, samehost_endpoint, samehost_link
from kvdd.sim.fabric.auth import Session as AuthSession

from hostile import rawpeer
from hostile.endpoint_sessions import (Calls, InitiatorProcess, Session, bound_session,
                                      emptied_endpoint, new_session, settled)

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

# One command a line, one answer a line:
#   prove TAG KEY TRANSCRIPT NAME -> "SENT" (its hello, with the right proof, on a new connection)
#   reply TAG -> "<R, CLOSED or TIMEOUT> <ms>" (what came next; the connection stays)
#   final TAG SLOTS -> "SENT" (its table, claiming SLOTS slots)
#   childfinal TAG -> "SENT" (its table, sent by a child that inherited the socket, which stays)
#   wait TAG -> "<CLOSED or TIMEOUT> <ms>" (then the connection is closed)
#   exit - -> exits at once (its parent, the test, reaps it later)
_INITIATOR = r"""
import os, socket, struct, sys, time
from dataclasses import dataclass
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.samehost_attest import pass_pidfd, recv_msg, close_fd
from kvdd.sim.fabric.samehost_path import new_table_fd

@dataclass(frozen=True)
class S:
    key: bytes
    transcript: bytes
    channel: bytes = b""
    initiator: bool = True

def what_comes(sock):
    t0 = time.monotonic()
    try:
        data, fds, pidfd = recv_msg(sock, 512)
        for fd in fds + [pidfd]:
            close_fd(fd)
        what = "CLOSED" if not data else data[len(b"kvdd-samehost/2"):][:1].decode()
    except socket.timeout:
        what = "TIMEOUT"
    except OSError:
        what = "CLOSED"
    return f"{what} {int((time.monotonic() - t0) * 1000)}"

held = {}
for line in sys.stdin:
    cmd, tag, *rest = line.split()
    if cmd == "prove":
        s = S(bytes.fromhex(rest[0]), bytes.fromhex(rest[1]))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pass_pidfd(sock)
        sock.connect(bytes.fromhex(rest[2]))
        sock.settimeout(5)
        samehost.send_message(sock, samehost.M_HELLO,
                              samehost.session_id(s) + samehost.proof_of(s, b"initiator"))
        held[tag] = sock
        print("SENT", flush=True)
    elif cmd == "reply":
        print(what_comes(held[tag]), flush=True)
    elif cmd in ("final", "childfinal"):
        sock = held[tag]
        slots = int(rest[0]) if rest else 1
        fd = new_table_fd(1)
        if cmd == "final":
            samehost.send_message(sock, samehost.M_FINAL, struct.pack("<I", slots), fd)
        else:
            r, w = os.pipe()
            child = os.fork()
            if child == 0:
                samehost.send_message(sock, samehost.M_FINAL, struct.pack("<I", slots), fd)
                os.write(w, b"x")
                time.sleep(3)
                os._exit(0)
            os.read(r, 1)
            os.close(r)
            os.close(w)
        close_fd(fd)
        print("SENT", flush=True)
    elif cmd == "exit":
        os._exit(0)
    elif cmd == "wait":
        sock = held.pop(tag)
        got = what_comes(sock)
        sock.close()
        print(got, flush=True)
"""


class Initiator(InitiatorProcess):
    def __init__(self) -> None:
        super().__init__(_INITIATOR)

    def prove(self, tag: str, s: Session, name: bytes) -> None:
        assert self.ask("prove", tag, s.key.hex(), s.transcript.hex(), name.hex()) == ["SENT"]

    def next(self, cmd: str, tag: str) -> tuple[str, int]:
        what, ms = self.ask(cmd, tag)
        return what, int(ms)



@pytest.fixture(scope="module")
def initiator() -> Iterator[Initiator]:
    i = Initiator()
    try:
        yield i
    finally:
        i.close()


@pytest.fixture(autouse=True)
def ep() -> samehost_endpoint.Endpoint:
    """This process's endpoint, holding nothing."""
    return emptied_endpoint(proven=True)


def _settled(ep: samehost_endpoint.Endpoint, pending: int, proving: int) -> None:
    settled(ep, pending, proving, None)


# ---- what is announced and offered ------------------------------------------------------------------------


class _Announcing:
    def __init__(self, value: bytes) -> None:
        self.value = value

    def announcement(self) -> bytes:
        return self.value


@pytest.mark.parametrize("extra,sent", [(0, True), (1, False)])
def test_an_announcement_holds_at_most_max_announcement_bytes(
        monkeypatch: pytest.MonkeyPatch, extra: int, sent: bool) -> None:
    value = secrets.token_bytes(announce.MAX_ANNOUNCEMENT + extra)
    monkeypatch.setattr(announce, "_announcer", _Announcing(value))
    assert announce.announcement() == (value if sent else b"")


_HINTS = struct.Struct("<BI36s")  # the offer's hints: version, uid, boot id


@pytest.mark.parametrize("field", ["version", "uid", "boot"])
def test_an_acceptor_binds_nothing_for_hints_of_another_uid_boot_or_version(
        ep: samehost_endpoint.Endpoint, field: str) -> None:
    version, uid, boot = _HINTS.unpack(samehost.offer())
    hints = _HINTS.pack(version + (field == "version"), uid + (field == "uid"),
                        boot[::-1] if field == "boot" else boot)
    s = new_session()
    assert ep.expect(s)
    try:
        assert samehost_link.extension_accept(s, hints + struct.pack("<I", 1000)) is not None
        assert samehost_link.extension_offer(s, rawpeer.MinimalOwner()) is None  # type: ignore[arg-type]
        calls = Calls()
        assert ep.bind(s, calls.make_table, calls.on_proven, calls.on_link)  # (still unbound)
    finally:
        ep.abandon(s)


@pytest.mark.parametrize("name", [b"\0kvdd-sh", b"\0other-" + b"x" * 16,
                                  b"\0kvdd-sh-" + b"x" * 56], ids=["short", "other", "long"])
def test_an_initiator_offers_nothing_for_a_malformed_endpoint_name(name: bytes) -> None:
    s = AuthSession(secrets.token_bytes(32), secrets.token_bytes(32), True,
                    announced=samehost.offer() + name)
    held = samehost_link.held_states()
    assert samehost_link.extension_offer(s, rawpeer.MinimalOwner()) is None  # type: ignore[arg-type]
    assert samehost_link.held_states() == held


def test_an_initiator_offers_the_path_for_a_well_formed_announcement() -> None:
    s = AuthSession(secrets.token_bytes(32), secrets.token_bytes(32), True,
                    announced=samehost.offer() + b"\0kvdd-sh-" + b"x" * 55)
    try:
        assert samehost_link.extension_offer(s, rawpeer.MinimalOwner()) is not None  # type: ignore[arg-type]
    finally:
        announce.discard(s)


# ---- what the endpoint expects ---------------------------------------------------------------------------


def test_a_session_is_expected_once_and_bound_once(ep: samehost_endpoint.Endpoint) -> None:
    s, calls = bound_session(ep)
    assert not ep.expect(s)  # (would replace what is bound to it)
    other = Calls()
    assert not ep.bind(s, other.make_table, other.on_proven, other.on_link)
    assert ep.held()["pending"] == 1
    ep.abandon(s)
    assert calls.links == [None] and other.links == []  # the first binding is the one told
    assert ep.held()["pending"] == 0


def test_exactly_max_pending_sessions_wait(ep: samehost_endpoint.Endpoint) -> None:
    sessions = [new_session() for _ in range(samehost_endpoint.MAX_PENDING)]
    try:
        for i, s in enumerate(sessions):
            assert ep.room()
            assert ep.expect(s), i
        assert ep.held()["pending"] == samehost_endpoint.MAX_PENDING
        assert not ep.room()
        assert samehost.announcement() == b""  # nothing announced once full
        one_more = new_session()
        assert not ep.expect(one_more)
        assert ep.held()["pending"] == samehost_endpoint.MAX_PENDING
    finally:
        for s in sessions:
            ep.abandon(s)
    assert ep.held()["pending"] == 0 and ep.room()


def test_a_proof_after_its_session_expired_is_refused_and_never_answered(
        ep: samehost_endpoint.Endpoint, initiator: Initiator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(samehost_endpoint, "PENDING_TTL_S", 0.2)
    s, calls = bound_session(ep)
    time.sleep(0.4)
    initiator.prove("a", s, ep.name)
    ep.decide(s)  # (the link decided meanwhile: nothing goes to a refused connection)
    what, ms = initiator.next("wait", "a")
    assert what == "CLOSED" and ms < 1000
    assert calls.tables == 0 and calls.proven == 0
    probe = new_session()
    assert ep.expect(probe)  # drops the expired session: its caller is told
    ep.abandon(probe)
    assert calls.told.wait(5) and calls.links == [None]
    _settled(ep, 0, 0)


# ---- the initiator's table --------------------------------------------------------------------------------


def _proven(ep: samehost_endpoint.Endpoint, initiator: Initiator) -> tuple[Session, Calls]:
    """A session bound, proven by ``initiator`` (its connection "a"), decided and answered."""
    s, calls = bound_session(ep)
    initiator.prove("a", s, ep.name)
    ep.decide(s)
    what, _ms = initiator.next("reply", "a")
    assert what == "R" and calls.tables == 1 and calls.proven == 1
    return s, calls


def test_a_table_from_a_child_of_the_attested_process_is_refused(
        ep: samehost_endpoint.Endpoint, initiator: Initiator) -> None:
    _s, calls = _proven(ep, initiator)
    assert initiator.ask("childfinal", "a") == ["SENT"]
    what, ms = initiator.next("wait", "a")
    assert what == "CLOSED" and ms < 1000
    assert calls.told.wait(5) and calls.links == [None]
    _settled(ep, 0, 0)


@pytest.mark.parametrize("over", [0, 1])
def test_a_table_of_at_most_max_slots_is_taken(ep: samehost_endpoint.Endpoint,
                                               initiator: Initiator, over: int) -> None:
    _s, calls = _proven(ep, initiator)
    slots = samehost.max_slots() + over
    assert initiator.ask("final", "a", str(slots)) == ["SENT"]
    assert calls.told.wait(5)
    assert calls.links == ([None] if over else [(initiator.proc.pid, slots)])
    what, _ms = initiator.next("wait", "a")
    assert what == "CLOSED"
    _settled(ep, 0, 0)


def test_a_table_whose_sender_exited_before_it_was_taken_is_refused(
        ep: samehost_endpoint.Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    real = samehost_attest.same_sender

    def after_its_exit(sender: int, pid: int) -> None:
        # exited (every thread: its pidfd is readable); its parent, this test, has not reaped it,
        # so its pid is still its own
        fd = os.pidfd_open(pid)
        try:
            assert select.select([fd], [], [], 5)[0] == [fd]
        finally:
            os.close(fd)
        real(sender, pid)

    monkeypatch.setattr(samehost_endpoint, "same_sender", after_its_exit)
    doomed = Initiator()
    try:
        _s, calls = _proven(ep, doomed)
        assert doomed.ask("final", "a", "1") == ["SENT"]
        assert doomed.proc.stdin is not None
        doomed.proc.stdin.write("exit -\n")
        doomed.proc.stdin.flush()
        assert calls.told.wait(10)
        assert calls.links == [None]
    finally:
        doomed.close()
    _settled(ep, 0, 0)
