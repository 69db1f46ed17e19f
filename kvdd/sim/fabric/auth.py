"""Peer authentication: the shared secret and the mutual challenge-response of a handshake.

The secret (its sources, the files refused, its cache) is :mod:`.secret`'s; its names are
re-exported here.  ``KVDD_FABRIC_AUTH=off`` (trusted networks only) replaces it by a public
constant: the handshake still runs (and still bounds everything) but proves nothing.

The challenge-response (both sides, see :func:`mac`): the initiator sends a fresh 32-byte nonce
``Nc``, the acceptor answers with its own ``Ns``; then the initiator proves knowledge of the secret
with ``HMAC(secret, "kvdd-fabric/2 initiator" | Nc | Ns | transcript)`` and only after checking it
does the acceptor prove itself with the ``acceptor`` label.  Both roles and both nonces are bound
into each MAC, so no MAC can be reflected to the other role or replayed on another connection.  The
session key is ``HMAC(secret, "kvdd-fabric/2 session" | Nc | Ns | transcript)``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import time
from dataclasses import dataclass, field

from .secret import (ENV_AUTH, ENV_SECRET, ENV_SECRET_FILE, MIN_SECRET_BYTES, Secret, SecretError,
                     check_private_dir, default_secret_path, describe_secret, generate_secret,
                     load_secret)

__all__ = ["ENV_SECRET", "ENV_SECRET_FILE", "ENV_AUTH", "SecretError", "Secret", "Session",
           "load_secret", "generate_secret", "describe_secret", "default_secret_path", "mac", "session_key",
           "answer_transcript",
           "NONCE_BYTES", "MIN_SECRET_BYTES", "AuthError", "authenticate_socket",
           "check_private_dir"]

_log = logging.getLogger(__name__)

NONCE_BYTES = 32


class AuthError(Exception):
    """A peer failed (or refused) the challenge-response: the message says what to set."""


@dataclass(frozen=True)
class Session:
    """Both sides of an authenticated connection hold one (same ``key`` and ``transcript``).

    Attributes
    ----------
    key : bytes
        32-byte per-session key, derived from the secret, both nonces and the transcript.
    transcript : bytes
        SHA-256 of the authentication messages (32 bytes).
    initiator : bool
        True on the side that dialled.
    local_cluster_id, peer_cluster_id : int
        The real cluster ids of the two instances (0 until the hello exchange).
    peer_boot_id : str
        The peer's ``/proc/sys/kernel/random/boot_id`` as it claims it (a hint, never a proof).
    auth_off : bool
        True when ``KVDD_FABRIC_AUTH=off``: the key is then derived from a public constant.
    channel : bytes
        The connection's endpoints as this side's kernel reports them, initiator's first
        (:func:`channel_binding`): the same-host proof binds them, so a relay holding the secret,
        which can give two sessions one transcript, cannot give them one channel.
    announced : bytes
        What the acceptor announced in its authentication answer (:mod:`.announce`: the
        same-host endpoint), b"" for nothing; covered by the acceptor's MAC and the transcript
        (:func:`answer_transcript`).
    """

    key: bytes = field(repr=False)
    transcript: bytes
    initiator: bool
    local_cluster_id: int = 0
    peer_cluster_id: int = 0
    peer_boot_id: str = ""
    auth_off: bool = False
    channel: bytes = b""
    announced: bytes = b""

    def linked(self, local_cluster_id: int, peer_cluster_id: int, peer_boot_id: str) -> Session:
        """The same session with the cluster ids and the peer's boot id the link hello named
        (:func:`dataclasses.replace` costs tens of microseconds on every link)."""
        return Session(self.key, self.transcript, self.initiator, local_cluster_id,
                       peer_cluster_id, peer_boot_id, self.auth_off, self.channel, self.announced)


def channel_binding(sock: socket.socket, initiator: bool) -> bytes:
    """``"initiator ip|port|acceptor ip|port"`` of a connected socket (b"" when unknown)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):  # a socketpair has no addresses
        return b""
    try:
        mine, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
    except (OSError, TypeError, ValueError):
        return b""
    first, second = (mine, theirs) if initiator else (theirs, mine)
    return f"{first[0]}|{first[1]}|{second[0]}|{second[1]}".encode()


def mac(key: bytes, role: str, nonce_i: bytes, nonce_a: bytes, transcript: bytes) -> bytes:
    """HMAC-SHA256 proof of ``role`` ("initiator" or "acceptor") over both nonces and the
    transcript so far (32 bytes).  Compare with :func:`hmac.compare_digest`."""
    msg = b"kvdd-fabric/2 " + role.encode() + b"\0" + nonce_i + nonce_a + transcript
    return hmac.new(key, msg, hashlib.sha256).digest()


def answer_transcript(t0: bytes, proof: bytes, announced: bytes) -> bytes:
    """The transcript the acceptor's MAC covers (its ``"acceptor"`` :func:`mac`): the first two
    messages' (``t0``), the initiator's proof and the announcement the answer carries after the
    MAC, so that no one without the secret can change or strip it (32 bytes)."""
    return hashlib.sha256(t0 + proof + announced).digest()


def session_key(key: bytes, nonce_i: bytes, nonce_a: bytes, transcript: bytes) -> bytes:
    """The 32-byte per-session key both sides derive after mutual authentication."""
    return hmac.new(key, b"kvdd-fabric/2 session\0" + nonce_i + nonce_a + transcript,
                    hashlib.sha256).digest()


_SOCK_OK, _SOCK_REFUSED = b"\x01", b"\x00"


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError(f"{what} did not complete authentication in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise AuthError(f"{what} did not complete authentication in time") from None
        if not chunk:
            raise AuthError(f"{what} closed the connection during authentication")
        buf += chunk
    return bytes(buf)


def authenticate_socket(sock: socket.socket, *, initiator: bool, context: bytes, timeout: float,
                        wait: float | None = None, secret: Secret | None = None) -> Session:
    """Mutual challenge-response on a plain connected stream socket (no framing needed).

    The same proofs as a link handshake (:func:`mac`: both roles and both nonces, compared with
    :func:`hmac.compare_digest`), over fixed-size messages: ``context`` (at most 255 bytes, e.g.
    ``b"kvdd-demo-control/1"``) is the first byte string of the transcript, so a proof made for one
    protocol is worthless for another.  Initiator: ``Nc|off``; acceptor (once that is well-formed):
    ``Na|off``; initiator: its proof; acceptor: ``\x01`` and its proof, or ``\x00`` (refused) and closes.

    Parameters
    ----------
    sock : socket.socket
        Connected; its timeout is changed.
    initiator : bool
        True on the side that dialled (it proves itself first).
    context : bytes
        The protocol this authenticates (domain separation).
    timeout : float
        Seconds the whole exchange may take (after ``wait``).
    wait : float, optional
        Seconds to wait for the peer's first message (an initiator whose acceptor is busy refusing
        another connection); default ``timeout``.
    secret : Secret, optional
        Default :func:`load_secret`.

    Returns
    -------
    Session
        Keyed by the secret, both nonces and the transcript.

    Raises
    ------
    SecretError
        No usable secret on this side.
    AuthError
        The peer failed, refused or did not finish the exchange in time, or ``KVDD_FABRIC_AUTH``
        differs between the two sides; the message says what to set (never the secret).
    OSError
        The connection failed.
    """
    if len(context) > 255:
        raise ValueError("context is longer than 255 bytes")
    secret = secret if secret is not None else load_secret()
    start = time.monotonic()
    nonce = secrets.token_bytes(NONCE_BYTES)
    mine = nonce + bytes([int(secret.auth_off)])
    if initiator:
        sock.sendall(mine)
    theirs = _recv_exact(sock, NONCE_BYTES + 1, start + (timeout if wait is None else wait), "the peer")
    deadline = time.monotonic() + timeout if initiator else start + timeout
    if theirs[NONCE_BYTES] not in (0, 1):
        raise AuthError("the peer does not speak this protocol")
    if not initiator:  # its hello is well-formed: the challenge (it learns our mode from it)
        sock.sendall(mine)
    if bool(theirs[NONCE_BYTES]) != secret.auth_off:
        if secret.auth_off:
            raise AuthError(f"the peer requires authentication but this side has {ENV_AUTH}=off: unset "
                            f"it and give both sides the same {ENV_SECRET} (or {ENV_SECRET_FILE})")
        raise AuthError(f"the peer has {ENV_AUTH}=off (no authentication): set {ENV_AUTH}=off here "
                        "too (trusted networks only) or remove it there")
    hello, challenge = (mine, theirs) if initiator else (theirs, mine)
    nonce_i, nonce_a = hello[:NONCE_BYTES], challenge[:NONCE_BYTES]
    t0 = hashlib.sha256(bytes([len(context)]) + context + hello + challenge).digest()
    wrong = (f"the two sides hold different secrets: set the same {ENV_SECRET} (or "
             f"{ENV_SECRET_FILE}) on both (`kvdd fabric-secret` makes one)")
    if initiator:
        proof = mac(secret.key, "initiator", nonce_i, nonce_a, t0)
        sock.sendall(proof)
        if _recv_exact(sock, 1, deadline, "the peer") != _SOCK_OK:
            raise AuthError(f"the peer refused this side's proof: {wrong}")
        answer = _recv_exact(sock, 32, deadline, "the peer")
    else:
        proof = _recv_exact(sock, 32, deadline, "the peer")
        if not hmac.compare_digest(proof, mac(secret.key, "initiator", nonce_i, nonce_a, t0)):
            try:
                sock.sendall(_SOCK_REFUSED)
            except OSError as exc:  # it learns of the refusal from the closed connection instead
                _log.debug("could not tell a refused peer: %s", exc)
            raise AuthError(f"the peer failed the challenge-response: {wrong}")
    t1 = hashlib.sha256(t0 + proof).digest()
    expected = mac(secret.key, "acceptor", nonce_i, nonce_a, t1)
    if initiator:
        if not hmac.compare_digest(answer, expected):
            raise AuthError(f"the peer did not prove that it holds the secret: {wrong}")
    else:
        answer = expected
        sock.sendall(_SOCK_OK + answer)
    transcript = hashlib.sha256(t1 + answer).digest()
    sock.settimeout(None)
    return Session(session_key(secret.key, nonce_i, nonce_a, transcript), transcript, initiator,
                   auth_off=secret.auth_off, channel=channel_binding(sock, initiator))
