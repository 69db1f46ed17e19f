"""The acceptor's side of the challenge-response (:mod:`.auth`) on a connection the listener
(:mod:`.listener`) accepted: its state and its answers, without any socket call (the listener
reads the frames, sends what these functions return and keeps the bounds).

Per connection: the initiator's hello (its nonce and auth mode) gets our challenge (our nonce and
mode) or a refusal; its proof (``HMAC(secret, "initiator" ...)``) gets our answer or a refusal.  The
answer (``AUTH_OK``) is our MAC over the transcript so far and the announcement that follows it
(:mod:`.announce`: the same-host endpoint, expecting the session before the answer leaves), so
the initiator can start what the announcement offers before its link hello is answered.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import time

from ...status import Status
from . import announce
from .auth import (NONCE_BYTES, SecretError, Session, answer_transcript, channel_binding,
                   load_secret, mac, session_key)
from .handshake import auth_refusal, mode_mismatch, transcript_of
from .logutil import warn_limited
from .wire import (F_AUTH_CHALLENGE, F_AUTH_HELLO, F_AUTH_OK, F_AUTH_PROOF, HDR,
                   PREAUTH_TIMEOUT_S, PROTOCOL_VERSION, ProtocolError, frame)

logger = logging.getLogger(__name__)

__all__ = ["PreAuth", "AUTH_HELLO_BYTES", "whole_hello", "answer_hello", "answer_proof",
           "READING_HELLO", "READING_PROOF"]

READING_HELLO, READING_PROOF = 0, 1
AUTH_HELLO_BYTES = HDR.size + NONCE_BYTES + 1  # the initiator's first write (its whole hello)


def whole_hello(first: bytes | None) -> bool:
    """Whether the first bytes of a connection are a whole authentication hello, or at least a
    header of another protocol version (let in: it is answered with a version refusal)."""
    if first is None or len(first) < HDR.size:
        return False
    return len(first) >= AUTH_HELLO_BYTES or first[2] != PROTOCOL_VERSION


class PreAuth:
    """A connection that has not authenticated yet (lives only in the listener's loop)."""

    __slots__ = ("sock", "deadline", "stage", "buf", "ftype", "need", "nonce_i", "nonce_a",
                 "key", "auth_off", "t0", "peer", "source")

    def __init__(self, sock: socket.socket, peer: object, source: str) -> None:
        self.sock = sock
        self.peer = peer  # the address accept() gave (formatted only for the log)
        self.source = source
        self.deadline = time.monotonic() + PREAUTH_TIMEOUT_S
        self.stage = READING_HELLO
        self.buf = bytearray()
        self.ftype = -1  # the frame being read (-1: its header)
        self.need = HDR.size
        self.nonce_i = b""
        self.nonce_a = b""
        self.key = b""
        self.auth_off = False
        self.t0 = b""

    def expected(self) -> int:
        """The frame type this connection must send next."""
        return F_AUTH_HELLO if self.stage == READING_HELLO else F_AUTH_PROOF


def answer_hello(state: PreAuth, hello: bytes, where: str) -> tuple[bytes, str | None]:
    """The initiator's hello: ``(our challenge frame, None)`` (the state now reads its proof), or
    ``(a refusal frame, why)``.  Raises ProtocolError on a malformed hello."""
    if len(hello) != NONCE_BYTES + 1:
        raise ProtocolError("malformed authentication hello")
    try:
        secret = load_secret()
    except SecretError as exc:
        warn_limited(logger, "secret", "kvdd fabric: cannot authenticate links to %s: %s",
                     where, exc)
        return auth_refusal(Status.LLM_LINK_FAILED,
                            "the peer has no usable fabric secret (see its log)"), str(exc)
    peer_off = bool(hello[NONCE_BYTES])
    if peer_off != secret.auth_off:
        return (auth_refusal(Status.LLM_LINK_FAILED, mode_mismatch(peer_off)),
                "KVDD_FABRIC_AUTH differs")
    state.nonce_i = hello[:NONCE_BYTES]
    state.nonce_a = secrets.token_bytes(NONCE_BYTES)
    state.key = secret.key
    state.auth_off = secret.auth_off
    challenge = state.nonce_a + bytes([int(secret.auth_off)])
    state.t0 = transcript_of(hello, challenge)
    state.stage = READING_PROOF
    return frame(F_AUTH_CHALLENGE, 0, challenge), None


_WRONG_SECRET = auth_refusal(
    Status.LLM_LINK_FAILED,
    "authentication failed: the two sides hold different fabric secrets; set the same "
    "KVDD_FABRIC_SECRET (or KVDD_FABRIC_SECRET_FILE) on both sides (`kvdd fabric-secret` makes one)")


def _session(state: PreAuth, proof: bytes, announced: bytes, cluster_id: int
             ) -> tuple[bytes, Session]:
    t1 = answer_transcript(state.t0, proof, announced)
    answer = mac(state.key, "acceptor", state.nonce_i, state.nonce_a, t1)
    transcript = hashlib.sha256(t1 + answer).digest()
    return answer + announced, Session(
        session_key(state.key, state.nonce_i, state.nonce_a, transcript), transcript, False,
        cluster_id, 0, "", state.auth_off, channel_binding(state.sock, initiator=False), announced)


def answer_proof(state: PreAuth, proof: bytes, cluster_id: int
                 ) -> tuple[bytes, str | None, Session | None]:
    """The initiator's proof: ``(our answer frame, None, the session)``, or ``(a refusal frame,
    why, None)`` when it does not prove the secret.  The announcement in the answer is expected
    for the session before the caller sends it (:func:`.announce.expect`)."""
    expected = mac(state.key, "initiator", state.nonce_i, state.nonce_a, state.t0)
    if not hmac.compare_digest(proof, expected):
        return _WRONG_SECRET, "wrong secret", None
    announced = announce.announcement()
    payload, session = _session(state, proof, announced, cluster_id)
    if announced and not announce.expect(session):  # (no room meanwhile: announce nothing)
        payload, session = _session(state, proof, b"", cluster_id)
    return frame(F_AUTH_OK, 0, payload), None, session
