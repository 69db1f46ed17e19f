"""The acceptor's answers to an initiator's authentication (:mod:`kvdd.sim.fabric.listener_auth`)
and the initiator's checks of them (:mod:`kvdd.sim.fabric.handshake`), exactly.

Each test names a rule of docs/security.md (*The handshake*) and plays the other side with the
shared secret in hand, so a check that accepts a near miss fails here:

* a hello is exactly a nonce and a mode byte: one byte short or one over is malformed;
* a hello of the other authentication mode is refused with what to set, and draws no challenge;
* the initiator's proof is compared whole: the right proof with its last byte changed is refused
  with the wrong-secret reason and no session, and no answer of ours goes out for it;
* an initiator refuses a challenge one byte short or over, and an answer whose MAC is another
  role's, is made for other nonces, or is one byte off, without a link hello.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

import pytest

from kvdd import Status
from kvdd.sim.fabric import handshake, listener_auth, wire
from kvdd.sim.fabric.auth import (NONCE_BYTES, Secret, Session, answer_transcript, channel_binding,
                                 mac)
from kvdd.sim.fabric.channel import GoneOwner
from kvdd.sim.fabric.handshake import RemoteConnection, decode_refusal, transcript_of
from kvdd.sim.fabric.listener_auth import PreAuth, answer_hello, answer_proof
from kvdd.sim.fabric.protocol import LinkOwner

from hostile import rawpeer

ON = Secret(secrets.token_bytes(32), "test")
WRONG_SECRET = ("authentication failed: the two sides hold different fabric secrets; set the same "
                "KVDD_FABRIC_SECRET (or KVDD_FABRIC_SECRET_FILE) on both sides")
NO_PROOF = "the peer did not prove that it holds the fabric secret"


@pytest.fixture
def secret_on(monkeypatch: pytest.MonkeyPatch) -> Secret:
    monkeypatch.setattr(listener_auth, "load_secret", lambda: ON)
    monkeypatch.setattr(handshake, "load_secret", lambda: ON)
    return ON


@pytest.fixture
def state() -> Iterator[PreAuth]:
    a, b = socket.socketpair()
    with a, b:
        yield PreAuth(a, "test", "test")


def _parse(data: bytes) -> tuple[int, bytes]:
    _magic, _version, ftype, _req, length = wire.HDR.unpack(data[:wire.HDR.size])
    payload = data[wire.HDR.size:]
    assert len(payload) == length
    return ftype, payload


# ---- the hello ---------------------------------------------------------------------------------------


def test_a_hello_of_exactly_a_nonce_and_a_mode_gets_a_challenge(secret_on: Secret,
                                                                state: PreAuth) -> None:
    hello = secrets.token_bytes(NONCE_BYTES) + b"\x00"
    data, why = answer_hello(state, hello, "test")
    assert why is None
    ftype, challenge = _parse(data)
    assert ftype == wire.F_AUTH_CHALLENGE and len(challenge) == NONCE_BYTES + 1
    assert challenge[NONCE_BYTES] == 0 and state.stage == listener_auth.READING_PROOF
    assert state.nonce_i == hello[:NONCE_BYTES] and state.t0 == transcript_of(hello, challenge)


@pytest.mark.parametrize("size", [NONCE_BYTES, NONCE_BYTES + 2])
def test_a_hello_one_byte_short_or_over_is_malformed(secret_on: Secret, state: PreAuth,
                                                     size: int) -> None:
    with pytest.raises(wire.ProtocolError, match="malformed authentication hello"):
        answer_hello(state, secrets.token_bytes(size - 1) + b"\x00", "test")
    assert state.stage == listener_auth.READING_HELLO and state.nonce_a == b""


def test_a_hello_of_the_other_mode_is_refused_with_what_to_set_and_no_challenge(
        secret_on: Secret, state: PreAuth) -> None:
    data, why = answer_hello(state, secrets.token_bytes(NONCE_BYTES) + b"\x01", "test")
    assert why == "KVDD_FABRIC_AUTH differs"
    ftype, payload = _parse(data)
    assert ftype == wire.F_AUTH_REFUSED
    status, detail = decode_refusal(payload)
    assert status == Status.LLM_LINK_FAILED
    # (written for the peer to read: it is the side with authentication off)
    assert detail.startswith("the peer requires authentication but this process has "
                             "KVDD_FABRIC_AUTH=off: unset it")
    assert state.stage == listener_auth.READING_HELLO and state.nonce_a == b"" and state.key == b""


# ---- the initiator's proof ---------------------------------------------------------------------------


def _challenged(state: PreAuth) -> bytes:
    """The hello answered: the initiator's right proof."""
    hello = secrets.token_bytes(NONCE_BYTES) + b"\x00"
    data, why = answer_hello(state, hello, "test")
    assert why is None
    _ftype, challenge = _parse(data)
    return mac(ON.key, "initiator", hello[:NONCE_BYTES], challenge[:NONCE_BYTES],
               transcript_of(hello, challenge))


def test_the_right_proof_gets_the_answer_and_a_session(secret_on: Secret, state: PreAuth) -> None:
    proof = _challenged(state)
    data, why, session = answer_proof(state, proof, 7)
    assert why is None and isinstance(session, Session) and not session.initiator
    ftype, payload = _parse(data)
    assert ftype == wire.F_AUTH_OK
    t1 = answer_transcript(state.t0, proof, payload[32:])
    assert payload[:32] == mac(ON.key, "acceptor", state.nonce_i, state.nonce_a, t1)


@pytest.mark.parametrize("where", [0, 15, 16, 31])
def test_a_proof_off_by_one_byte_anywhere_is_refused_without_an_answer(
        secret_on: Secret, state: PreAuth, where: int) -> None:
    proof = bytearray(_challenged(state))
    proof[where] ^= 1
    data, why, session = answer_proof(state, bytes(proof), 7)
    assert why == "wrong secret" and session is None
    ftype, payload = _parse(data)
    assert ftype == wire.F_AUTH_REFUSED
    status, detail = decode_refusal(payload)
    assert status == Status.LLM_LINK_FAILED and detail.startswith(WRONG_SECRET)


@pytest.mark.parametrize("size", [0, 31, 33])
def test_a_proof_of_another_length_is_refused(secret_on: Secret, state: PreAuth, size: int) -> None:
    proof = _challenged(state)
    proof = (proof + b"\x00")[:size]
    data, why, session = answer_proof(state, proof, 7)
    assert why == "wrong secret" and session is None
    assert _parse(data)[0] == wire.F_AUTH_REFUSED


# ---- the initiator's checks of the acceptor -----------------------------------------------------------


def _stub_owner() -> LinkOwner:
    return cast(LinkOwner, GoneOwner(5))


def _frames(s: socket.socket, timeout: float) -> list[int]:
    """The frame types ``s`` received until the other side closed (or ``timeout`` passed)."""
    got: list[int] = []
    s.settimeout(timeout)
    try:
        while True:
            ftype, _req, _payload = rawpeer.read_frame(s)
            got.append(ftype)
    except (ConnectionError, OSError):
        return got


Answer = Callable[[bytes, bytes, bytes, bytes], bytes]  # (hello, challenge, t0, proof) -> AUTH_OK


def _link_against(answer: Answer, challenge_size: int = NONCE_BYTES + 1,
                  answer_type: int = wire.F_AUTH_OK) -> tuple[int, str, list[int]]:
    """An initiator's link to a raw acceptor holding the secret whose answer is ``answer``: its
    status, its detail and the frame types it sent."""
    a, b = socket.socketpair()
    sent: list[int] = []

    def acceptor() -> None:
        with b:
            b.settimeout(5.0)
            try:
                ftype, _r, hello = rawpeer.read_frame(b)
                sent.append(ftype)
                challenge = secrets.token_bytes(challenge_size - 1) + b"\x00"
                b.sendall(rawpeer.frame(wire.F_AUTH_CHALLENGE, challenge))
                ftype, _r, proof = rawpeer.read_frame(b)
                sent.append(ftype)
                b.sendall(rawpeer.frame(answer_type, answer(hello, challenge,
                                                               transcript_of(hello, challenge),
                                                               proof)))
            except (ConnectionError, OSError):
                return
            sent.extend(_frames(b, 2.0))

    t = threading.Thread(target=acceptor, daemon=True)
    t.start()
    conn = RemoteConnection(a, time.monotonic() + 3.0)
    try:
        res = conn.link(_stub_owner(), False)
    finally:
        conn.close()
    t.join(10)
    assert not t.is_alive()
    return res.status, res.detail, sent


def _acceptor_mac(hello: bytes, challenge: bytes, t0: bytes, proof: bytes) -> bytes:
    return mac(ON.key, "acceptor", hello[:NONCE_BYTES], challenge[:NONCE_BYTES],
               answer_transcript(t0, proof, b""))


@pytest.mark.parametrize("size", [NONCE_BYTES, NONCE_BYTES + 2])
def test_a_challenge_one_byte_short_or_over_gets_no_proof(secret_on: Secret, size: int) -> None:
    status, detail, sent = _link_against(_acceptor_mac, challenge_size=size)
    assert status == Status.LLM_LINK_FAILED and "malformed challenge" in detail
    assert sent == [wire.F_AUTH_HELLO]


def test_an_answer_of_the_initiator_s_role_is_refused(secret_on: Secret) -> None:
    """The initiator's own proof reflected back (or the acceptor role's MAC made with the
    initiator's label) proves nothing."""
    status, detail, sent = _link_against(lambda h, c, t0, proof: proof)
    assert (status, sent) == (Status.LLM_LINK_FAILED, [wire.F_AUTH_HELLO, wire.F_AUTH_PROOF])
    assert detail.startswith(NO_PROOF)


def test_an_answer_for_other_nonces_is_refused(secret_on: Secret) -> None:
    def other_nonces(hello: bytes, challenge: bytes, t0: bytes, proof: bytes) -> bytes:
        return mac(ON.key, "acceptor", secrets.token_bytes(NONCE_BYTES), challenge[:NONCE_BYTES],
                   answer_transcript(t0, proof, b""))

    status, detail, sent = _link_against(other_nonces)
    assert (status, sent) == (Status.LLM_LINK_FAILED, [wire.F_AUTH_HELLO, wire.F_AUTH_PROOF])
    assert detail.startswith(NO_PROOF)


@pytest.mark.parametrize("where", [0, 31])
def test_an_answer_off_by_one_byte_is_refused(secret_on: Secret, where: int) -> None:
    def off_by_one(hello: bytes, challenge: bytes, t0: bytes, proof: bytes) -> bytes:
        answer = bytearray(_acceptor_mac(hello, challenge, t0, proof))
        answer[where] ^= 1
        return bytes(answer)

    status, detail, sent = _link_against(off_by_one)
    assert (status, sent) == (Status.LLM_LINK_FAILED, [wire.F_AUTH_HELLO, wire.F_AUTH_PROOF])
    assert detail.startswith(NO_PROOF)


@pytest.mark.parametrize("answer_type", [wire.F_AUTH_CHALLENGE, wire.F_AUTH_PROOF, wire.F_LINK_REPLY],
                         ids=["challenge", "proof", "link-reply"])
def test_the_right_answer_in_a_frame_of_another_type_is_refused(secret_on: Secret,
                                                                answer_type: int) -> None:
    status, detail, sent = _link_against(_acceptor_mac, answer_type=answer_type)
    assert (status, sent) == (Status.LLM_LINK_FAILED, [wire.F_AUTH_HELLO, wire.F_AUTH_PROOF])
    assert detail.startswith(NO_PROOF)


def test_the_right_answer_gets_the_link_hello(secret_on: Secret) -> None:
    """(The raw acceptor of these tests answers as an honest one: the refusals above are theirs.)"""
    _status, _detail, sent = _link_against(_acceptor_mac)
    assert sent[:3] == [wire.F_AUTH_HELLO, wire.F_AUTH_PROOF, wire.F_HELLO_LINK]


# ---- the channel binding -------------------------------------------------------------------------------


def test_the_channel_binding_names_both_ends_with_their_ports() -> None:
    """Two connections between the same two addresses differ by their ports: a relay that gives
    two sessions one transcript still cannot give them one binding."""
    srv = socket.create_server(("127.0.0.1", 0))
    with srv:
        bindings = []
        for _ in range(2):
            c = socket.create_connection(srv.getsockname()[:2], timeout=5)
            a, _addr = srv.accept()
            with c, a:
                mine = channel_binding(c, initiator=True)
                assert mine == channel_binding(a, initiator=False)  # both sides agree
                ip, port = c.getsockname()[:2]
                assert mine == f"{ip}|{port}|127.0.0.1|{srv.getsockname()[1]}".encode()
                bindings.append(mine)
        assert bindings[0] != bindings[1]
    x, y = socket.socketpair()
    with x, y:
        assert channel_binding(x, initiator=True) == b""  # no addresses


def test_a_connection_must_authenticate_within_preauth_timeout_of_its_accept() -> None:
    a, b = socket.socketpair()
    with a, b:
        before = time.monotonic()
        state = PreAuth(a, "test", "test")
        after = time.monotonic()
        assert before + wire.PREAUTH_TIMEOUT_S <= state.deadline <= after + wire.PREAUTH_TIMEOUT_S
