"""Link and unlink handshakes, both sides (SEMANTICS.md §3.5, §3.6, §10 rule 6).

* :func:`connect` — "dial" a peer address and get a :class:`~.protocol.Connection` whose ``link`` /
  ``notify_unlink`` work identically for a peer in this process (:class:`InProcessConnection`) and
  one elsewhere (:class:`RemoteConnection`); refused → LINK_FAILED at once, silence → TIMEOUT;
* :func:`serve_link` / :func:`serve_unlink` — the acceptor's side, run by the listener on the first
  frame of an accepted connection.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

from ...status import Status
from .channel import Channel
from .hostprobe import decode_host, encode_host, my_host
from .peers import InProcessPeer, RemotePeer
from .protocol import Connection, LinkOffer, LinkOwner, LinkResult, PeerHandle
from .registry import lookup_listener
from .wire import (F_HELLO_LINK, F_HELLO_UNLINK, F_LINK_REPLY, F_UNLINK_REPLY, HANDSHAKE_TIMEOUT_S,
                   MAX_HELLO, PROTOCOL_VERSION, ProtocolError, Reader, Writer, decode_offer,
                   decode_snapshot, encode_offer, encode_snapshot, frame, read_header, recv_exact)

logger = logging.getLogger(__name__)

__all__ = ["InProcessConnection", "RemoteConnection", "connect", "serve_link", "serve_unlink",
           "linger"]

S_OK = Status.LLM_SUCCESS
TIMEOUT = Status.LLM_TIMEOUT


class InProcessConnection:
    """The peer listens in this process: the handshake is a pair of method calls."""

    def __init__(self, peer: LinkOwner) -> None:
        self.peer = peer

    def link(self, local: LinkOwner, force_link: bool) -> LinkResult:
        # our snapshot is taken before the peer's lock is held (no nested instance locks)
        mine = local.snapshot_for_link()
        status, detail, snap = self.peer.serve_link(LinkOffer.of(local), force_link,
                                                    lambda: InProcessPeer(local, *mine))
        if status != S_OK or snap is None:
            return LinkResult(status, detail)
        return LinkResult(S_OK, "", LinkOffer.of(self.peer), InProcessPeer(self.peer, *snap))

    def notify_unlink(self, local: LinkOwner) -> int:
        if self.peer is local:
            return S_OK
        return self.peer.peer_unlinked(local.cluster_id)

    def close(self) -> None:
        pass


class RemoteConnection:
    """A TCP connection to a peer in another process (or host), before / during a handshake."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock: socket.socket | None = sock
        self.deadline = deadline

    def _exchange(self, ftype: int, payload: bytes, reply_type: int) -> tuple[int, bytes | None]:
        sock = self.sock
        assert sock is not None
        try:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return TIMEOUT, None
            sock.settimeout(left)
            sock.sendall(frame(ftype, 0, payload))
            rtype, _req, length = read_header(sock)
            if rtype != reply_type:
                raise ProtocolError("unexpected reply")
            sock.settimeout(max(self.deadline - time.monotonic(), 0.001))
            return S_OK, bytes(recv_exact(sock, length))
        except socket.timeout:
            return TIMEOUT, None
        except (OSError, ProtocolError):
            return Status.LLM_LINK_FAILED, None

    def link(self, local: LinkOwner, force_link: bool) -> LinkResult:
        comm = local.transfer_backend == "comm"
        snap, entries = local.snapshot_for_link() if comm else ({}, {})
        w = Writer()
        encode_offer(w, LinkOffer.of(local))
        w.pack("B", int(force_link))
        encode_host(w, my_host())
        encode_snapshot(w, entries)
        if len(w.buf) > MAX_HELLO:
            return LinkResult(Status.LLM_FAILED, "the local cache table is too large to link")
        status, reply = self._exchange(F_HELLO_LINK, bytes(w.buf), F_LINK_REPLY)
        if status != S_OK or reply is None:
            why = "no answer within the timeout" if status == TIMEOUT else "the handshake failed"
            return LinkResult(status, why)
        try:
            r = Reader(reply)
            peer_status = r.u("I")
            detail = r.text() or ""
            if peer_status != S_OK:
                return LinkResult(peer_status, detail or "the peer refused the link")
            offer = decode_offer(r)
            host = decode_host(r)
            peer_snap, addrs = decode_snapshot(r)
            r.end()
        except (ProtocolError, struct.error):
            return LinkResult(Status.LLM_LINK_FAILED, "malformed handshake reply")
        sock = self.sock
        assert sock is not None
        self.sock = None  # adopted by the channel
        chan = Channel(sock, local, f"{local.cluster_id}->{offer.cluster_id}")
        chan.served = entries
        chan.peer_wait_ms = offer.sync_wait_ms
        chan.peer_user = comm  # comm: the acceptor made an entity for us over this connection
        chan.local_user = True
        handle = RemotePeer(chan, offer, peer_snap, addrs, host)
        chan.start()
        return LinkResult(S_OK, "", offer, handle)

    def notify_unlink(self, local: LinkOwner) -> int:
        status, reply = self._exchange(F_HELLO_UNLINK,
                                       struct.pack("<BQ", PROTOCOL_VERSION, local.cluster_id),
                                       F_UNLINK_REPLY)
        if status != S_OK or reply is None:
            return Status.LLM_UNLINK_FAILED if status == Status.LLM_LINK_FAILED else status
        try:
            (peer_status,) = struct.unpack("<I", reply)
        except struct.error:
            return Status.LLM_UNLINK_FAILED
        return int(peer_status)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


def connect(ip: str, port: int, timeout_ms: int) -> tuple[int, Connection | None]:
    """Reach whatever listens on ``ip:port``: ``(status, connection)``.

    An instance of this process gives an :class:`InProcessConnection`.  Otherwise a real TCP
    connection is opened: refused / unreachable → LLM_LINK_FAILED at once; no answer in
    ``timeout_ms`` → LLM_TIMEOUT (SEMANTICS.md §10 rule 6).  The handshake that follows (``link``
    / ``notify_unlink``) must complete within the same ``timeout_ms``.
    """
    port &= 0xFFFF
    peer = lookup_listener(ip, port)
    if peer is not None:
        return Status.LLM_SUCCESS, InProcessConnection(peer)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    deadline = time.monotonic() + timeout_ms / 1000.0
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect((ip, port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (socket.timeout, TimeoutError):
        sock.close()
        return Status.LLM_TIMEOUT, None
    except (OSError, OverflowError):
        # ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EADDRNOTAVAIL, ...: at once, no retry
        sock.close()
        return Status.LLM_LINK_FAILED, None
    return Status.LLM_SUCCESS, RemoteConnection(sock, deadline)


# ---- the acceptor's side --------------------------------------------------------------------------


def serve_unlink(owner: LinkOwner, conn: socket.socket, payload: bytearray) -> None:
    """The acceptor's side of a non-force unlink (§3.6)."""
    r = Reader(payload)
    version, cluster_id = r.unpack("BQ")
    r.end()
    if version != PROTOCOL_VERSION:
        raise ProtocolError("protocol version")
    status = owner.peer_unlinked(cluster_id)
    conn.sendall(frame(F_UNLINK_REPLY, 0, struct.pack("<I", status)))
    linger(conn)


def serve_link(owner: LinkOwner, conn: socket.socket, payload: bytearray) -> bool:
    """The acceptor's side of a link handshake; True when the connection became a link."""
    r = Reader(payload)
    offer = decode_offer(r)
    force_link = bool(r.u("B"))
    host = decode_host(r)
    snap, addrs = decode_snapshot(r)
    r.end()
    chan = Channel(conn, owner, f"{owner.cluster_id}<-{offer.cluster_id}")
    chan.peer_wait_ms = offer.sync_wait_ms
    made: list[RemotePeer] = []

    def make_handle() -> PeerHandle:
        # comm: our entity for the initiator lives on this same connection
        handle = RemotePeer(chan, offer, snap, addrs, host)
        chan.local_user = True
        made.append(handle)
        return handle

    # Our handle may be used as soon as the entity exists: hold the send lock until the
    # reply is out, so no request of ours can precede it on the wire.
    with chan.send_lock:
        status, detail, mine = owner.serve_link(offer, force_link, make_handle)
        w = Writer().pack("I", status).text(detail[:4000])
        if status == S_OK and mine is not None:
            encode_offer(w, LinkOffer.of(owner))
            encode_host(w, my_host())
            encode_snapshot(w, mine[1])
            if len(w.buf) > MAX_HELLO:
                w = Writer().pack("I", Status.LLM_FAILED).text("cache table too large")
                status = Status.LLM_FAILED
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn.sendall(frame(F_LINK_REPLY, 0, bytes(w.buf)))
        except OSError:
            status = Status.LLM_FAILED
        if status != S_OK or mine is None:
            for handle in made:
                handle.pvm = False
            chan.local_user = False
            if made:  # our entity exists but its connection is gone: transfers time out
                chan.dead.set()
            linger(conn)
            return False
        chan.served = mine[1]
        chan.peer_user = True
    chan.start()
    return True


def linger(conn: socket.socket, seconds: float = 1.0) -> None:
    """Close after the peer read our last frame: FIN, then wait (at most ``seconds`` in all) for
    its FIN, so that closing does not reset the connection under our reply."""
    end = time.monotonic() + seconds
    try:
        conn.shutdown(socket.SHUT_WR)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            conn.settimeout(left)
            if not conn.recv(4096):
                return
    except OSError as exc:  # reset or timed out: nothing left to wait for
        logger.debug("kvdd fabric: linger ended: %s", exc)


