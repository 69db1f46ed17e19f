"""The plain-socket challenge-response (:func:`kvdd.sim.fabric.auth.authenticate_socket`) at its bounds.

Each test names a rule of docs/security.md (*Authentication*) and plays one side of the exchange
from a raw socket, so a check weakened by one, or skipped, fails here:

* ``context`` is at most 255 bytes: 255 authenticates, 256 is a ValueError before a byte is sent;
* the exchange's deadline is exact: with no time left it gives up although the peer's bytes are
  waiting, with 0.9 s left (a frozen clock) it completes; an acceptor's whole exchange ends
  ``timeout`` after it started, not after its hello;
* a peer that closes mid-exchange is reported as closed at once (not as a timeout);
* a hello whose mode byte is neither 0 nor 1 is refused by both roles, and an acceptor refuses it
  without a challenge;
* two sides whose ``KVDD_FABRIC_AUTH`` differs each say what to set on their side;
* an acceptor refuses a wrong initiator proof with exactly one ``\\x00`` byte and no proof of its own,
  also the right proof with any one byte changed (the whole MAC is compared);
* an initiator refuses an acceptor that says ``\\x01`` but whose proof is random, the initiator's
  own reflected, or the right one with a byte changed, and sends nothing more.
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import threading
import time
import types
from collections.abc import Callable

import pytest

from kvdd.sim.fabric import auth
from kvdd.sim.fabric.auth import NONCE_BYTES, AuthError, Secret

CONTEXT = b"kvdd-test/1"
KEY = secrets.token_bytes(32)
ON = Secret(KEY, "test")
OFF = Secret(b"off", "off", auth_off=True)


def _nothing_sent(s: socket.socket) -> bool:
    """True when nothing is waiting on ``s`` (the other side sent no byte)."""
    s.setblocking(False)
    try:
        s.recv(1)
    except BlockingIOError:
        return True
    finally:
        s.setblocking(True)
    return False


def _both(a_side: Callable[[socket.socket], object], b_side: Callable[[socket.socket], object]
          ) -> tuple[object, object]:
    """Run ``a_side`` here and ``b_side`` in a thread on a socketpair: (result or exception) each."""
    a, b = socket.socketpair()
    out: list[object] = [None]

    def other() -> None:
        with b:
            try:
                out[0] = b_side(b)
            except Exception as exc:
                out[0] = exc

    t = threading.Thread(target=other, daemon=True)
    t.start()
    with a:
        try:
            mine: object = a_side(a)
        except Exception as exc:
            mine = exc
    t.join(10)
    assert not t.is_alive()
    return mine, out[0]


def _initiator(secret: Secret, context: bytes = CONTEXT, timeout: float = 5.0
               ) -> Callable[[socket.socket], object]:
    return lambda s: auth.authenticate_socket(s, initiator=True, context=context, timeout=timeout,
                                              secret=secret)


def _acceptor(secret: Secret, context: bytes = CONTEXT, timeout: float = 5.0
              ) -> Callable[[socket.socket], object]:
    return lambda s: auth.authenticate_socket(s, initiator=False, context=context, timeout=timeout,
                                              secret=secret)


# ---- the context: at most 255 bytes -----------------------------------------------------------------


def test_context_of_exactly_255_bytes_authenticates() -> None:
    context = bytes(range(255))
    mine, theirs = _both(_initiator(ON, context), _acceptor(ON, context))
    assert isinstance(mine, auth.Session) and isinstance(theirs, auth.Session)
    assert mine.key == theirs.key and mine.transcript == theirs.transcript
    assert (mine.initiator, theirs.initiator) == (True, False)


@pytest.mark.parametrize("initiator", [True, False])
def test_context_of_256_bytes_is_refused_before_anything_is_sent(initiator: bool) -> None:
    a, b = socket.socketpair()
    with a, b:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="context is longer than 255 bytes"):
            auth.authenticate_socket(a, initiator=initiator, context=bytes(256), timeout=2.0,
                                     secret=ON)
        assert time.monotonic() - t0 < 1.0  # refused at once, not after waiting for the peer
        assert _nothing_sent(b)


# ---- the deadline -------------------------------------------------------------------------------------


def _frozen_clock(monkeypatch: pytest.MonkeyPatch, now: float = 1000.0) -> None:
    """auth's clock stops at ``now``: the time left before a deadline is exactly what was given."""
    monkeypatch.setattr(auth, "time", types.SimpleNamespace(monotonic=lambda: now))


def test_no_time_left_gives_up_although_the_peer_s_bytes_are_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _frozen_clock(monkeypatch)
    a, b = socket.socketpair()
    with a, b:
        b.sendall(secrets.token_bytes(NONCE_BYTES) + b"\x00")  # the acceptor's challenge, already there
        with pytest.raises(AuthError, match="did not complete authentication in time"):
            auth.authenticate_socket(a, initiator=True, context=CONTEXT, timeout=0.0, secret=ON)
        # the initiator's hello went out, nothing after it (no proof without a challenge read)
        b.settimeout(1.0)
        assert len(b.recv(1 << 10)) == NONCE_BYTES + 1
        assert _nothing_sent(b)


def test_just_under_a_second_left_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    _frozen_clock(monkeypatch)  # every step has exactly 0.9 s left
    mine, theirs = _both(_initiator(ON, timeout=0.9), _acceptor(ON, timeout=0.9))
    assert isinstance(mine, auth.Session) and isinstance(theirs, auth.Session)
    assert mine.key == theirs.key


def test_a_peer_that_closes_mid_exchange_is_reported_at_once() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(secrets.token_bytes(NONCE_BYTES))  # one byte short of a challenge, then EOF
        b.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        with pytest.raises(AuthError, match="the peer closed the connection during authentication"):
            auth.authenticate_socket(a, initiator=True, context=CONTEXT, timeout=5.0, secret=ON)
        assert time.monotonic() - t0 < 2.0


# ---- the hello's mode byte ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [2, 255])
def test_acceptor_refuses_a_hello_whose_mode_is_neither_0_nor_1_without_a_challenge(mode: int) -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(secrets.token_bytes(NONCE_BYTES) + bytes([mode]))
        with pytest.raises(AuthError, match="the peer does not speak this protocol"):
            auth.authenticate_socket(a, initiator=False, context=CONTEXT, timeout=2.0, secret=ON)
        assert _nothing_sent(b)  # no challenge: the acceptor learned nothing it answers to


@pytest.mark.parametrize("mode", [2, 255])
def test_initiator_refuses_a_challenge_whose_mode_is_neither_0_nor_1(mode: int) -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(secrets.token_bytes(NONCE_BYTES) + bytes([mode]))
        with pytest.raises(AuthError, match="the peer does not speak this protocol"):
            auth.authenticate_socket(a, initiator=True, context=CONTEXT, timeout=2.0, secret=ON)
        b.settimeout(1.0)
        assert len(b.recv(1 << 10)) == NONCE_BYTES + 1  # its hello; no proof
        assert _nothing_sent(b)


@pytest.mark.parametrize("off_side", ["initiator", "acceptor"])
def test_differing_auth_modes_each_say_what_to_set(off_side: str) -> None:
    initiator_secret, acceptor_secret = (OFF, ON) if off_side == "initiator" else (ON, OFF)
    mine, theirs = _both(_initiator(initiator_secret), _acceptor(acceptor_secret))
    off_error, on_error = (mine, theirs) if off_side == "initiator" else (theirs, mine)
    assert isinstance(off_error, AuthError) and isinstance(on_error, AuthError)
    assert str(off_error).startswith(
        f"the peer requires authentication but this side has {auth.ENV_AUTH}=off")
    assert str(on_error).startswith(f"the peer has {auth.ENV_AUTH}=off (no authentication)")


# ---- the initiator's proof ------------------------------------------------------------------------------


def test_acceptor_refuses_a_wrong_proof_with_one_zero_byte_and_no_proof_of_its_own() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(secrets.token_bytes(NONCE_BYTES) + b"\x00")  # a well-formed hello
        b.sendall(secrets.token_bytes(32))  # and a proof made without the secret
        with pytest.raises(AuthError, match="the peer failed the challenge-response"):
            auth.authenticate_socket(a, initiator=False, context=CONTEXT, timeout=2.0, secret=ON)
        a.close()
        b.settimeout(2.0)
        got = b""
        while chunk := b.recv(1 << 10):
            got += chunk
        assert len(got) == NONCE_BYTES + 1 + 1  # the challenge, then the refusal, then EOF
        assert got[NONCE_BYTES] == 0 and got[-1:] == b"\x00"


# ---- the acceptor's answer ------------------------------------------------------------------------------


def _raw_acceptor(answer: Callable[[bytes, bytes, bytes, bytes], bytes]
                  ) -> Callable[[socket.socket], object]:
    """An acceptor side played from raw bytes: it accepts the initiator's proof (``\\x01``) and
    sends ``answer(hello, challenge, t0, proof)`` as its own."""

    def run(s: socket.socket) -> object:
        s.settimeout(5.0)
        hello = _recv(s, NONCE_BYTES + 1)
        challenge = secrets.token_bytes(NONCE_BYTES) + b"\x00"
        s.sendall(challenge)
        proof = _recv(s, 32)
        t0 = hashlib.sha256(bytes([len(CONTEXT)]) + CONTEXT + hello + challenge).digest()
        s.sendall(b"\x01" + answer(hello, challenge, t0, proof))
        return s.recv(1)  # b"": the initiator closed without another byte

    return run


def _recv(s: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = s.recv(n - len(got))
        assert chunk
        got += chunk
    return got


def _honest(hello: bytes, challenge: bytes, t0: bytes, proof: bytes) -> bytes:
    return auth.mac(KEY, "acceptor", hello[:NONCE_BYTES], challenge[:NONCE_BYTES],
                    hashlib.sha256(t0 + proof).digest())


def test_an_answer_made_with_the_secret_authenticates_the_acceptor() -> None:
    mine, theirs = _both(_initiator(ON), _raw_acceptor(_honest))
    assert isinstance(mine, auth.Session) and mine.initiator
    assert theirs == b""


def _off_by_one(where: int) -> Callable[[bytes, bytes, bytes, bytes], bytes]:
    def answer(hello: bytes, challenge: bytes, t0: bytes, proof: bytes) -> bytes:
        got = bytearray(_honest(hello, challenge, t0, proof))
        got[where] ^= 1
        return bytes(got)

    return answer


@pytest.mark.parametrize("answer", [
    lambda h, c, t0, proof: secrets.token_bytes(32),  # made without the secret
    lambda h, c, t0, proof: proof,  # the initiator's own proof, reflected
    _off_by_one(0), _off_by_one(31),
], ids=["random", "reflected", "first-byte", "last-byte"])
def test_initiator_refuses_an_acceptor_that_accepts_without_proving_the_secret(
        answer: Callable[[bytes, bytes, bytes, bytes], bytes]) -> None:
    mine, theirs = _both(_initiator(ON), _raw_acceptor(answer))
    assert isinstance(mine, AuthError)
    assert str(mine).startswith("the peer did not prove that it holds the secret")
    assert theirs == b""  # nothing sent after the answer


@pytest.mark.parametrize("where", [0, 15, 16, 31])
def test_acceptor_refuses_the_right_proof_with_any_one_byte_changed(where: int) -> None:
    a, b = socket.socketpair()
    with a, b:
        hello = secrets.token_bytes(NONCE_BYTES) + b"\x00"
        b.sendall(hello)
        out: list[object] = [None]

        def acceptor() -> None:
            try:
                out[0] = auth.authenticate_socket(a, initiator=False, context=CONTEXT,
                                                  timeout=5.0, secret=ON)
            except Exception as exc:
                out[0] = exc

        t = threading.Thread(target=acceptor, daemon=True)
        t.start()
        b.settimeout(5.0)
        challenge = _recv(b, NONCE_BYTES + 1)
        t0 = hashlib.sha256(bytes([len(CONTEXT)]) + CONTEXT + hello + challenge).digest()
        proof = bytearray(auth.mac(KEY, "initiator", hello[:NONCE_BYTES], challenge[:NONCE_BYTES], t0))
        proof[where] ^= 1
        b.sendall(bytes(proof))
        t.join(10)
        assert not t.is_alive()
        assert isinstance(out[0], AuthError)
        assert str(out[0]).startswith("the peer failed the challenge-response")
        a.close()
        assert _recv(b, 1) == b"\x00"  # refused, and no proof of its own
        assert b.recv(64) == b""


def test_the_acceptor_s_whole_exchange_ends_timeout_after_it_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its hello read in time, the proof (already waiting) is not read once ``timeout`` has passed
    since the start, although less than twice that has."""
    calls = [0]

    def clock() -> float:  # the start and the hello's read at 1000.0; from then on 1001.5
        calls[0] += 1
        return 1000.0 if calls[0] <= 2 else 1001.5

    monkeypatch.setattr(auth, "time", types.SimpleNamespace(monotonic=clock))
    a, b = socket.socketpair()
    with a, b:
        b.sendall(secrets.token_bytes(NONCE_BYTES) + b"\x00" + secrets.token_bytes(32))
        with pytest.raises(AuthError, match="did not complete authentication in time"):
            auth.authenticate_socket(a, initiator=False, context=CONTEXT, timeout=1.0, secret=ON)
        b.settimeout(1.0)
        assert len(_recv(b, NONCE_BYTES + 1)) == NONCE_BYTES + 1  # the challenge, nothing after it
        assert _nothing_sent(b)
