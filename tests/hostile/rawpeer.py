"""A peer speaking the fabric's wire protocol from a raw socket, for tests that play an attacker.

Only public names of :mod:`kvdd.sim.fabric` are used (``wire``, ``auth`` helpers): what an
attacker who read the source could send.
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import struct
from dataclasses import dataclass

import numpy as np

from kvdd.sim.fabric import LinkOffer, RemoteCache, wire
from kvdd.sim.fabric.auth import NONCE_BYTES, answer_transcript, load_secret, mac, session_key
from kvdd.sim.fabric.handshake import transcript_of

HDR = struct.Struct("<2sBBII")


class MinimalOwner:
    """The least a :class:`~kvdd.sim.fabric.channel.Channel` needs of its instance, for tests
    that drive a bare connection (it serves no cache)."""

    cluster_id = 7
    transfer_backend = "comm"
    comm_res_text: str | None = None
    sync_wait_ms = 2000
    initialized = True


def hdr(ftype: int, length: int, req: int = 0, magic: bytes = b"KV",
        version: int = wire.PROTOCOL_VERSION) -> bytes:
    return HDR.pack(magic, version, ftype, req, length)


def frame(ftype: int, payload: bytes = b"", req: int = 0) -> bytes:
    return hdr(ftype, len(payload), req) + payload


def connect(port: int, timeout: float = 5.0, ip: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection((ip, port), timeout=timeout)
    s.settimeout(timeout)
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def read_frame(s: socket.socket) -> tuple[int, int, bytes]:
    """(type, request id, payload) of the next frame."""
    _m, _v, ftype, req, n = HDR.unpack(recv_exact(s, HDR.size))
    return ftype, req, recv_exact(s, n)


@dataclass
class Auth:
    """What an initiator learned in a handshake (enough to replay it, which must not help)."""

    hello: bytes
    challenge: bytes
    proof: bytes
    answer: bytes
    key: bytes  # session key (zero bytes when authentication failed)
    announced: bytes = b""  # what the acceptor's answer announced after its MAC (its endpoint)
    transcript: bytes = b""


def refusal(payload: bytes) -> str:
    r = wire.Reader(payload)
    status = r.u("I")
    return f"{status:#x}: {r.text()}"


def authenticate(s: socket.socket, key: bytes | None = None, auth_off: bool = False,
                 nonce: bytes | None = None, proof: bytes | None = None) -> Auth:
    """Run the initiator's side of the challenge-response with ``key`` (default: this process's
    secret); ``proof`` replaces the computed MAC (replay/reflection attempts).  Raises
    ConnectionError when the peer closes, PermissionError (with its message) when it refuses."""
    if key is None:
        key = load_secret().key
    nonce_i = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
    hello = nonce_i + bytes([int(auth_off)])
    s.sendall(frame(wire.F_AUTH_HELLO, hello))
    ftype, _req, challenge = read_frame(s)
    if ftype == wire.F_AUTH_REFUSED:
        raise PermissionError(refusal(challenge))
    assert ftype == wire.F_AUTH_CHALLENGE, ftype
    nonce_a = challenge[:NONCE_BYTES]
    t0 = transcript_of(hello, challenge)
    my_proof = proof if proof is not None else mac(key, "initiator", nonce_i, nonce_a, t0)
    s.sendall(frame(wire.F_AUTH_PROOF, my_proof))
    ftype, _req, payload = read_frame(s)
    if ftype == wire.F_AUTH_REFUSED:
        raise PermissionError(refusal(payload))
    assert ftype == wire.F_AUTH_OK, ftype
    answer, announced = payload[:32], payload[32:]
    t1 = answer_transcript(t0, my_proof, announced)
    assert answer == mac(key, "acceptor", nonce_i, nonce_a, t1), "the server's proof is wrong"
    transcript = hashlib.sha256(t1 + answer).digest()
    return Auth(hello, challenge, my_proof, answer, session_key(key, nonce_i, nonce_a, transcript),
                announced, transcript)


def hello_link(cluster_id: int, force: bool = True, backend: str = "comm", wait_ms: int = 1000,
               caches: int = 0, extensions: dict[str, bytes] | None = None) -> bytes:
    """A HELLO_LINK payload announcing ``caches`` one-tensor caches (fake addresses)."""
    w = wire.Writer()
    wire.encode_offer(w, LinkOffer(cluster_id, backend, None, wait_ms))
    w.pack("B", int(force))
    w.text("not-a-boot-id")
    w.pack("I", caches)
    rc = wire.RC
    if caches:
        one = rc.pack(0, 1, 64, 1, 64, 0, 0) + struct.pack("<Q", 0x1000)
        body = bytearray(one * caches)
        ids = np.arange(1, caches + 1, dtype="<u8")
        view = np.frombuffer(body, dtype=np.uint8).reshape(caches, len(one))
        view[:, :8] = ids.view(np.uint8).reshape(caches, 8)
        w.raw(bytes(body))
    wire.encode_extensions(w, extensions or {})
    return bytes(w.buf)


def link(port: int, cluster_id: int, **kw: object) -> tuple[socket.socket, dict[int, RemoteCache]]:
    """An authenticated raw connection that completed a link handshake: (socket, peer snapshot)."""
    s = connect(port)
    authenticate(s)
    s.sendall(frame(wire.F_HELLO_LINK, hello_link(cluster_id, **kw)))  # type: ignore[arg-type]
    ftype, _req, body = read_frame(s)
    assert ftype == wire.F_LINK_REPLY
    r = wire.Reader(body)
    status = r.u("I")
    detail = r.text()
    assert status == 0, (hex(status), detail)
    wire.decode_offer(r)
    r.text()
    snap, _addrs = wire.decode_snapshot(r)
    wire.decode_extensions(r)
    return s, snap


def lease(s: socket.socket, cache_id: int, req: int = 1) -> tuple[int, int]:
    """(status, lease id) of a LEASE request on a linked raw connection."""
    s.sendall(frame(wire.F_LEASE, struct.pack("<Q", cache_id), req))
    while True:
        ftype, rreq, body = read_frame(s)
        if ftype == wire.F_LEASE_REPLY and rreq == req:
            status, lease_id = struct.unpack("<IQ", body)
            return status, lease_id
