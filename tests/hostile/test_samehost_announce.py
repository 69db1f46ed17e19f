"""The same-host announcement in the acceptor's authentication answer, against hostile initiators.

The acceptor names its endpoint after the MAC of its answer (``AUTH_OK``) and the endpoint expects
the session from then on; the initiator's proof may come before the link is decided (it is then
answered once the link reply is sent) or never.  Every wrong use gets a clear refusal (the AF_UNIX
connection closed) and costs a bounded, released amount: a proof for a session never announced,
a second proof of one session, a wrong proof, the initiator's table before our proof, a proof whose
link hello never comes (its TCP connection closed, or silent past the hello deadline), and an
announcement changed in transit (the initiator's authentication fails).

A hostile initiator process (one for the module) proves from a raw AF_UNIX socket: the endpoint
attests the sender of each proof, so it must be another process than the endpoint's.
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvdd
from kvdd import OPTION_LISTEN_IP_INFO, LlmDataDist, LlmRole, Status
from kvdd.sim.fabric import listener, samehost, samehost_endpoint, samehost_link, wire
from kvdd.sim.fabric.auth import NONCE_BYTES, answer_transcript, load_secret, mac
from kvdd.sim.fabric.handshake import connect, transcript_of

from hostile import rawpeer
from hostile.endpoint_sessions import (Calls, InitiatorProcess, Session, bound_session,
                                      emptied_endpoint, new_session, settled)

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

# The hostile initiator: one command a line, one answer a line.
#   prove|badproof|final_first TAG KEY TRANSCRIPT CHANNEL NAME -> "SENT" (its hello, or its hello
#     and its table as soon as the endpoint takes files, before any reply, on a new connection TAG)
#   auth TAG PORT -> "AUTH <key> <transcript> <channel> <announced>" (a raw TCP authentication,
#     held open as TAG, no hello sent)
#   hello TAG BACKEND CLUSTER -> "REPLY <status>" (a link hello offering the path on TAG)
#   unlink TAG CLUSTER -> "REPLY <status>" (an unlink hello on TAG)
#   closetcp TAG -> "OK";  wait TAG -> "<what came: R, CLOSED or TIMEOUT> <ms>"
_INITIATOR = r"""
import socket, struct, sys, time
from dataclasses import dataclass
sys.path.insert(0, sys.argv[1])
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.auth import channel_binding
from kvdd.sim.fabric.samehost_attest import pass_pidfd, recv_msg, close_fd
from kvdd.sim.fabric.samehost_path import new_table_fd
import rawpeer

@dataclass(frozen=True)
class S:
    key: bytes
    transcript: bytes
    channel: bytes
    initiator: bool = True

held = {}
for line in sys.stdin:
    cmd, tag, *rest = line.split()
    if cmd in ("prove", "badproof", "final_first"):
        key, tr, chan, name = (b"" if x == "-" else bytes.fromhex(x) for x in rest)
        s = S(key, tr, chan)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pass_pidfd(sock)
        sock.connect(name)
        sock.settimeout(5)
        proof = bytes(32) if cmd == "badproof" else samehost.proof_of(s, b"initiator")
        samehost.send_message(sock, samehost.M_HELLO, samehost.session_id(s) + proof)
        if cmd == "final_first":  # once the endpoint takes files (after it checked our proof)
            fd = new_table_fd(1)
            for _ in range(200):
                try:
                    samehost.send_message(sock, samehost.M_FINAL, struct.pack("<I", 1), fd)
                    break
                except PermissionError:  # SO_PASSRIGHTS still off: the proof not checked yet
                    time.sleep(0.01)
            close_fd(fd)
        held[tag] = sock
        print("SENT", flush=True)
    elif cmd == "auth":
        tcp = rawpeer.connect(int(rest[0]))
        a = rawpeer.authenticate(tcp)
        held[tag] = tcp
        print("AUTH", a.key.hex(), a.transcript.hex(),
              channel_binding(tcp, initiator=True).hex() or "-", a.announced.hex() or "-",
              flush=True)
    elif cmd == "hello":  # a link hello offering the same-host path on the held connection
        tcp = held[tag]
        entry = samehost.offer() + struct.pack("<I", 1000)
        tcp.sendall(rawpeer.frame(rawpeer.wire.F_HELLO_LINK, rawpeer.hello_link(
            int(rest[1]), backend=rest[0], extensions={samehost.EXTENSION: entry})))
        ftype, _req, body = rawpeer.read_frame(tcp)
        print("REPLY", rawpeer.wire.Reader(body).u("I"), flush=True)
    elif cmd == "unlink":  # an unlink hello on the held connection
        tcp = held[tag]
        tcp.sendall(rawpeer.frame(rawpeer.wire.F_HELLO_UNLINK, struct.pack("<Q", int(rest[0]))))
        ftype, _req, body = rawpeer.read_frame(tcp)
        print("REPLY", struct.unpack("<I", body)[0], flush=True)
    elif cmd == "closetcp":
        held.pop(tag).close()
        print("OK", flush=True)
    elif cmd == "wait":
        sock = held.pop(tag)
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
        sock.close()
        print(what, int((time.monotonic() - t0) * 1000), flush=True)
"""


class Initiator(InitiatorProcess):
    def __init__(self) -> None:
        super().__init__(_INITIATOR, str(Path(__file__).resolve().parent))

    def prove(self, cmd: str, tag: str, s: Session, name: bytes) -> None:
        assert self.ask(cmd, tag, s.key.hex(), s.transcript.hex(), s.channel.hex() or "-",
                        name.hex()) == ["SENT"]

    def wait(self, tag: str) -> tuple[str, int]:
        what, ms = self.ask("wait", tag)
        return what, int(ms)



@pytest.fixture(scope="module")
def initiator() -> Iterator[Initiator]:
    i = Initiator()
    try:
        yield i
    finally:
        i.close()


def _expected() -> tuple[samehost_endpoint.Endpoint, Session, Calls]:
    ep = samehost.endpoint()
    s, calls = bound_session(ep)
    return ep, s, calls


@pytest.fixture(autouse=True)
def _no_sessions_left_by_others() -> None:
    """Each test starts with the endpoint holding no session and no proof connection
    (:func:`settled` counts from zero)."""
    emptied_endpoint(proven=False)


def test_a_proof_for_a_session_never_announced_is_refused_at_once(initiator: Initiator) -> None:
    ep = samehost.endpoint()
    s = new_session()
    initiator.prove("prove", "a", s, ep.name)
    what, ms = initiator.wait("a")
    assert what == "CLOSED" and ms < 1000
    settled(ep, 0, 0)


def test_a_proof_waits_for_the_link_decision_and_is_then_answered(initiator: Initiator) -> None:
    """The proof came first (the initiator's hello is still being served): it is answered as
    soon as the link is decided, once; a second proof of the same session is refused."""
    ep, s, calls = _expected()
    initiator.prove("prove", "a", s, ep.name)
    settled(ep, 1, 1, 1)  # (proven: its connection claimed the session)
    initiator.prove("prove", "b", s, ep.name)
    what, ms = initiator.wait("b")
    assert what == "CLOSED" and ms < 1000  # the second proof: refused, the first unaffected
    assert calls.tables == 0 and calls.proven == 0  # nothing of ours before the decision
    ep.decide(s)
    assert initiator.wait("a")[0] == "R"  # our proof and table, once, attached before it left
    assert calls.tables == 1 and calls.proven == 1
    assert calls.told.wait(5) and calls.links == [None]  # it closed without its table
    settled(ep, 0, 0)


def test_a_wrong_proof_is_refused_and_gives_the_session_up(initiator: Initiator) -> None:
    ep, s, calls = _expected()
    initiator.prove("badproof", "a", s, ep.name)
    what, ms = initiator.wait("a")
    assert what == "CLOSED" and ms < 1000
    assert calls.told.wait(5) and calls.links == [None] and calls.tables == 0 and calls.proven == 0
    settled(ep, 0, 0)


def test_the_initiators_table_before_our_proof_is_refused(initiator: Initiator,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Its table came, the link is not decided: refused once SETUP_TIMEOUT_S passed without our
    reply; the session never reaches a link."""
    monkeypatch.setattr(samehost_endpoint, "SETUP_TIMEOUT_S", 0.3)
    ep, s, calls = _expected()
    initiator.prove("final_first", "a", s, ep.name)
    what, ms = initiator.wait("a")
    assert what == "CLOSED" and ms < 2000
    assert calls.told.wait(5) and calls.links == [None] and calls.tables == 0 and calls.proven == 0
    settled(ep, 0, 0)


def test_an_abandoned_session_shuts_its_waiting_proof_down(initiator: Initiator) -> None:
    ep, s, calls = _expected()
    initiator.prove("prove", "a", s, ep.name)
    settled(ep, 1, 1, 1)
    ep.abandon(s)  # e.g. the link was refused
    what, ms = initiator.wait("a")
    assert what == "CLOSED" and ms < 1000
    assert calls.told.wait(5) and calls.links == [None] and calls.tables == 0 and calls.proven == 0
    settled(ep, 0, 0)


@pytest.fixture
def acceptor() -> Iterator[int]:
    """A listening instance of this process (its endpoint is this process's): its port."""
    with LlmDataDist(61, LlmRole.PROMPT, backend="sim") as dd:
        dd.initialize({OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "0"})
        assert dd.listen_port
        yield dd.listen_port


def _auth(initiator: Initiator, tag: str, port: int) -> tuple[Session, bytes]:
    word, key, tr, chan, announced = initiator.ask("auth", tag, str(port))
    assert word == "AUTH" and announced != "-"  # the answer announced the endpoint
    return (Session(bytes.fromhex(key), bytes.fromhex(tr), b"" if chan == "-" else bytes.fromhex(chan)),
            bytes.fromhex(announced))


def test_a_proof_whose_link_hello_never_comes_is_closed_with_its_connection(
        initiator: Initiator, acceptor: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Authenticated, proven at the announced endpoint, then no hello: the session and its proof
    connection end when the TCP connection does (closed by the initiator, or silent past the
    hello deadline), not when the session would expire."""
    monkeypatch.setattr(listener, "HELLO_TIMEOUT_S", 0.3)
    ep = samehost.endpoint()
    s, announced = _auth(initiator, "t1", acceptor)
    assert announced.endswith(ep.name)
    initiator.prove("prove", "a", s, ep.name)
    settled(ep, 1, 1, 1)
    assert initiator.ask("closetcp", "t1") == ["OK"]
    what, ms = initiator.wait("a")
    assert what == "CLOSED" and ms < 1000
    settled(ep, 0, 0)
    s, announced = _auth(initiator, "t2", acceptor)  # silent: the hello deadline ends it
    initiator.prove("prove", "b", s, ep.name)
    what, ms = initiator.wait("b")
    assert what == "CLOSED" and ms < 2000
    settled(ep, 0, 0)
    initiator.ask("closetcp", "t2")


def test_a_proof_of_a_refused_link_is_closed_with_the_refusal(
        initiator: Initiator, acceptor: int) -> None:
    """The link is refused (another transfer backend): the session it was announced to is
    abandoned with the reply, and the proof waiting for it closed, none of ours sent; the link's
    same-host state goes with it (kept, 1024 refused hellos turned the path off for 30 s)."""
    ep = samehost.endpoint()
    s, _announced = _auth(initiator, "t", acceptor)
    initiator.prove("prove", "a", s, ep.name)
    settled(ep, 1, 1, 1)
    states = samehost_link.held_states()
    assert initiator.ask("hello", "t", "hixl", "91") == ["REPLY", str(int(Status.LLM_LINK_FAILED))]
    what, ms = initiator.wait("a")
    assert what == "CLOSED" and ms < 1000
    settled(ep, 0, 0)
    assert samehost_link.held_states() == states
    initiator.ask("closetcp", "t")


def test_authenticated_connections_hold_expected_sessions_only_while_they_last(
        initiator: Initiator, acceptor: int) -> None:
    """Held until the connection closes, or its hello turns out to be an unlink."""
    ep = samehost.endpoint()
    for i in range(8):
        _auth(initiator, f"c{i}", acceptor)
    settled(ep, 8, 0)
    assert initiator.ask("unlink", "c0", "77")[0] == "REPLY"
    settled(ep, 7, 0)  # (its connection still open)
    for i in range(8):
        initiator.ask("closetcp", f"c{i}")
    settled(ep, 0, 0)


def _fake_acceptor(srv: socket.socket, announced: bytes, sent: bytes) -> None:
    """Holds the secret; its answer's MAC covers ``announced`` but carries ``sent``; then answers
    an unlink hello with success."""
    conn, _ = srv.accept()
    with conn:
        conn.settimeout(10)
        key = load_secret().key
        _t, _r, hello = rawpeer.read_frame(conn)
        nonce_a = secrets.token_bytes(NONCE_BYTES)
        challenge = nonce_a + hello[NONCE_BYTES:]
        conn.sendall(rawpeer.frame(wire.F_AUTH_CHALLENGE, challenge))
        t0 = transcript_of(hello, challenge)
        _t, _r, proof = rawpeer.read_frame(conn)
        answer = mac(key, "acceptor", hello[:NONCE_BYTES], nonce_a,
                     answer_transcript(t0, proof, announced))
        conn.sendall(rawpeer.frame(wire.F_AUTH_OK, answer + sent))
        try:
            ftype, _r, _body = rawpeer.read_frame(conn)
        except (ConnectionError, OSError):
            return
        if ftype == wire.F_HELLO_UNLINK:
            conn.sendall(rawpeer.frame(wire.F_UNLINK_REPLY, (0).to_bytes(4, "little")))
            conn.recv(1)


@pytest.mark.parametrize("changed", [False, True])
def test_an_announcement_changed_in_transit_fails_authentication(changed: bool) -> None:
    """Its MAC covers the announcement: a relay that changes (or strips) it makes the
    initiator refuse the acceptor's answer."""
    announced = samehost.offer() + b"\0kvdd-sh-1-" + hashlib.sha256(b"x").hexdigest()[:24].encode()
    sent = announced[:-1] + b"0" if changed else announced
    srv = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=_fake_acceptor, args=(srv, announced, sent))
    t.start()
    try:
        status, conn = connect("127.0.0.1", srv.getsockname()[1], 5000)
        assert status == Status.LLM_SUCCESS and conn is not None
        try:
            got = conn.notify_unlink(rawpeer.MinimalOwner())  # type: ignore[arg-type]
        finally:
            conn.close()
        assert got == (Status.LLM_UNLINK_FAILED if changed else Status.LLM_SUCCESS)
    finally:
        t.join(10)
        srv.close()
