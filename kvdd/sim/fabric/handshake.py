"""Link and unlink handshakes, both sides (SEMANTICS.md §3.5, §3.6, §10 rule 6).

* :func:`connect` — "dial" a peer address and get a :class:`~.protocol.Connection` whose ``link`` /
  ``notify_unlink`` work identically for a peer in this process (:class:`InProcessConnection`) and
  one elsewhere (:class:`RemoteConnection`); refused → LINK_FAILED at once, silence → TIMEOUT,
  accepted then closed without an answer → LLM_FAILED (SEMANTICS.md §3.5 g, §3.6);
* :func:`serve_link` / :func:`serve_unlink` — the acceptor's side, run by a handshake worker
  (:mod:`.gate`) on the whole hello of an authenticated connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol, TypeVar, cast

from ...status import S_OK, TIMEOUT, Status
from . import announce
from .auth import (ENV_AUTH, ENV_SECRET, ENV_SECRET_FILE, NONCE_BYTES, SecretError, Session,
                   answer_transcript, channel_binding, load_secret, mac, session_key)
from .channel import Channel
from .extensions import accept_extensions, offer_extensions
from .peers import InProcessPeer, RemotePeer
from .protocol import (Connection, DataPath, LinkOffer, LinkOwner, LinkResult, PeerHandle,
                       RemoteCache)
from .registry import lookup_listener
from .wire import (F_AUTH_CHALLENGE, F_AUTH_HELLO, F_AUTH_OK, F_AUTH_PROOF, F_AUTH_REFUSED,
                   F_HELLO_LINK, F_HELLO_UNLINK, F_LINK_REPLY, F_UNLINK_REPLY, REPLY_TIMEOUT_S,
                   MAX_HELLO, ProtocolError, Reader, VersionMismatch, Writer, decode_extensions,
                   decode_offer, decode_snapshot, decode_table_extras, encode_extensions,
                   encode_offer, encode_snapshot, encode_table_extras,
                   frame, read_header, recv_exact)

logger = logging.getLogger(__name__)

__all__ = ["InProcessConnection", "RemoteConnection", "connect", "serve_link", "LinkAdmission",
           "serve_unlink", "linger", "transcript_of", "auth_refusal", "mode_mismatch", "BOOT_ID"]

_T = TypeVar("_T")


class InProcessConnection:
    """The peer listens in this process: the handshake is a pair of method calls."""

    def __init__(self, peer: LinkOwner) -> None:
        self.peer = peer

    def link(self, local: LinkOwner, force_link: bool) -> LinkResult:
        # our snapshot is taken before the peer's lock is held (no nested instance locks)
        mine = local.snapshot_for_link()
        status, detail, snap = self.peer.serve_link(LinkOffer.of(local), force_link,
                                                    lambda: InProcessPeer(local, *mine))
        # serve_link (SimBackend's, PkgInstance's) gives a snapshot exactly when its status is
        # S_OK, so "and" decides as "or" does
        if status != S_OK or snap is None:  # mutation: equivalent(or -> and)
            return LinkResult(status, detail)
        return LinkResult(S_OK, "", LinkOffer.of(self.peer), InProcessPeer(self.peer, *snap))

    def notify_unlink(self, local: LinkOwner) -> int:
        if self.peer is local:
            return S_OK
        return self.peer.peer_unlinked(local.cluster_id)

    def close(self) -> None:
        pass


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:64]
    except OSError:
        return ""


BOOT_ID = _boot_id()
_LABEL = b"kvdd-fabric/2 transcript\0"


def transcript_of(hello: bytes, challenge: bytes) -> bytes:
    """SHA-256 of the first two authentication payloads (initiator's, acceptor's)."""
    return hashlib.sha256(_LABEL + hello + challenge).digest()


def auth_refusal(status: int, why: str) -> bytes:
    return frame(F_AUTH_REFUSED, 0, bytes(Writer().pack("I", status).text(why[:200]).buf))


def decode_refusal(payload: bytes) -> tuple[int, str]:
    try:
        r = Reader(payload)
        status = r.u("I")
        return status, r.text() or ""
    except (ProtocolError, struct.error):
        return Status.LLM_LINK_FAILED, "malformed refusal"


_IS_PATH: dict[type, bool] = {}  # by class: whether its objects are DataPaths (a Protocol's
#                                  isinstance looks up every member: ~30 µs, on each link)


def _is_path(result: object) -> bool:
    kind = type(result)
    known = _IS_PATH.get(kind)
    if known is None:
        known = _IS_PATH[kind] = isinstance(result, DataPath)
    return known


def _pick_path(accepted: dict[str, object]) -> DataPath | None:
    """The first accepted extension result that is a data path; the others are closed."""
    path: DataPath | None = None
    for result in accepted.values():
        if path is None and _is_path(result):
            path = cast(DataPath, result)
    return path


class _Failed(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _Hello:
    """Our link hello but its extensions (which depend on the session): the offer, the flags and
    our cache table, then the table's extra fields."""

    def __init__(self, local: LinkOwner, force_link: bool) -> None:
        self.comm = local.transfer_backend == "comm"
        snap, self.entries = local.snapshot_for_link() if self.comm else ({}, {})
        w = Writer()
        encode_offer(w, LinkOffer.of(local))
        w.pack("B", int(force_link))
        w.text(BOOT_ID)
        encode_snapshot(w, self.entries)
        self.head = bytes(w.buf)
        w = Writer()
        encode_table_extras(w, self.entries, snap)
        self.tail = bytes(w.buf)


class RemoteConnection:
    """A TCP connection to a peer in another process (or host), before / during a handshake.

    Every handshake starts with mutual authentication (:mod:`.auth`); the link or unlink request
    follows on the authenticated connection.  All of it must complete by ``deadline``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock: socket.socket | None = sock
        self.deadline = deadline

    # -- framing within the deadline --------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        sock = self.sock
        assert sock is not None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Failed(TIMEOUT, "no answer within the timeout")
        sock.settimeout(left)
        sock.sendall(data)

    def _recv(self) -> tuple[int, bytes]:
        sock = self.sock
        assert sock is not None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Failed(TIMEOUT, "no answer within the timeout")
        sock.settimeout(left)
        ftype, _req, length = read_header(sock)
        sock.settimeout(max(self.deadline - time.monotonic(), 0.001))
        return ftype, bytes(recv_exact(sock, length))

    def _guarded(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except _Failed:
            raise
        except socket.timeout:
            raise _Failed(TIMEOUT, "no answer within the timeout") from None
        except VersionMismatch as exc:
            raise _Failed(Status.LLM_LINK_FAILED, str(exc)) from None
        except ConnectionError:
            # accepted, then closed without answering: upstream's RecvMsg fails -> ge::FAILED
            # (SEMANTICS.md §3.5 g, §3.6); LINK_FAILED is for connect failures and refusals
            raise _Failed(Status.LLM_FAILED,
                          "the peer accepted the connection and closed it without answering "
                          "(a kvdd of another fabric protocol version, or one that is shutting "
                          "down?)") from None
        except (OSError, ProtocolError, struct.error) as exc:
            raise _Failed(Status.LLM_LINK_FAILED, f"the handshake failed: {exc}") from None

    def _authenticate(self, local: LinkOwner,
                      meanwhile: Callable[[], None] | None = None) -> Session:
        """Mutual challenge-response (initiator side); the session on success.  ``meanwhile``
        runs while the acceptor checks our proof (work of ours that needs no answer)."""
        try:
            secret = load_secret()
        except SecretError as exc:
            raise _Failed(Status.LLM_LINK_FAILED, f"no fabric secret: {exc}") from None
        nonce_i = secrets.token_bytes(NONCE_BYTES)
        hello = nonce_i + bytes([int(secret.auth_off)])
        self._send(frame(F_AUTH_HELLO, 0, hello))
        ftype, challenge = self._recv()
        if ftype == F_AUTH_REFUSED:
            raise _Failed(*decode_refusal(challenge))
        if ftype != F_AUTH_CHALLENGE or len(challenge) != NONCE_BYTES + 1:
            raise ProtocolError("malformed challenge")
        nonce_a, peer_off = challenge[:NONCE_BYTES], bool(challenge[NONCE_BYTES])
        if peer_off != secret.auth_off:
            raise _Failed(Status.LLM_LINK_FAILED, mode_mismatch(secret.auth_off))
        t0 = transcript_of(hello, challenge)
        proof = mac(secret.key, "initiator", nonce_i, nonce_a, t0)
        self._send(frame(F_AUTH_PROOF, 0, proof))
        if meanwhile is not None:
            meanwhile()
        ftype, payload = self._recv()
        if ftype == F_AUTH_REFUSED:
            raise _Failed(*decode_refusal(payload))
        # our answer: its MAC, then what it announces (covered by the MAC: :mod:`.announce`)
        answer, announced = payload[:32], payload[32:]
        t1 = answer_transcript(t0, proof, announced)
        if ftype != F_AUTH_OK or not hmac.compare_digest(
                answer, mac(secret.key, "acceptor", nonce_i, nonce_a, t1)):
            raise _Failed(Status.LLM_LINK_FAILED,
                          "the peer did not prove that it holds the fabric secret: set the same "
                          f"{ENV_SECRET} (or {ENV_SECRET_FILE}) on both sides (`kvdd fabric-secret` "
                          "makes one)")
        transcript = hashlib.sha256(t1 + answer).digest()
        assert self.sock is not None
        return Session(session_key(secret.key, nonce_i, nonce_a, transcript), transcript, True,
                       local.cluster_id, 0, "", secret.auth_off,
                       channel_binding(self.sock, initiator=True), announced)

    # -- Connection -------------------------------------------------------------------------------
    def link(self, local: LinkOwner, force_link: bool) -> LinkResult:
        try:
            return self._guarded(lambda: self._link(local, force_link))
        except _Failed as exc:
            return LinkResult(exc.status, exc.detail)

    def _link(self, local: LinkOwner, force_link: bool) -> LinkResult:
        made: list[_Hello] = []  # our table is encoded while the acceptor checks our proof
        session = self._authenticate(local, lambda: made.append(_Hello(local, force_link)))
        try:
            return self._link_hello(local, made[0] if made else _Hello(local, force_link), session)
        finally:  # what an extension started for this link and did not finish ends with it
            announce.discard(session)

    def _link_hello(self, local: LinkOwner, hello: _Hello, session: Session) -> LinkResult:
        """The link hello and its reply, on an authenticated connection."""
        comm, entries = hello.comm, hello.entries
        w = Writer()
        w.buf += hello.head
        encode_extensions(w, offer_extensions(session, local))
        w.buf += hello.tail
        if len(w.buf) > MAX_HELLO:
            return LinkResult(Status.LLM_FAILED, "the local cache table is too large to link "
                              f"(the hello would exceed {MAX_HELLO} bytes)")
        self._send(frame(F_HELLO_LINK, 0, bytes(w.buf)))
        # (the same-host proof leaves while the peer serves our hello, bounded by our deadline)
        announce.sent(session, self.deadline)
        sock = self.sock
        assert sock is not None
        # made while the peer serves our hello (unstarted, it is dropped if the link fails)
        chan = Channel(sock, local, f"{local.cluster_id}->?")
        ftype, reply = self._recv()
        if ftype != F_LINK_REPLY:
            raise ProtocolError("unexpected reply")
        try:
            r = Reader(reply)
            peer_status = r.u("I")
            detail = r.text() or ""
            if peer_status != S_OK:
                return LinkResult(peer_status, detail or "the peer refused the link")
            offer = decode_offer(r)
            boot_id = r.text() or ""
            peer_snap, addrs = decode_snapshot(r)
            exts = decode_extensions(r)
            decode_table_extras(r, peer_snap)
            r.end()
        except (ProtocolError, struct.error) as exc:
            return LinkResult(Status.LLM_LINK_FAILED, f"malformed handshake reply: {exc}")
        session = session.linked(session.local_cluster_id, offer.cluster_id, boot_id)
        path = _pick_path(accept_extensions(session, exts))
        self.sock = None  # adopted by the channel
        chan.label = f"{local.cluster_id}->{offer.cluster_id}"
        chan.served = entries
        chan.peer_wait_ms = offer.sync_wait_ms
        chan.peer_user = comm  # comm: the acceptor made an entity for us over this connection
        chan.local_user = True
        handle = RemotePeer(chan, offer, peer_snap, addrs, session, path)
        chan.start()
        return LinkResult(S_OK, "", offer, handle)

    def notify_unlink(self, local: LinkOwner) -> int:
        def run() -> int:
            self._authenticate(local)
            self._send(frame(F_HELLO_UNLINK, 0, struct.pack("<Q", local.cluster_id)))
            ftype, reply = self._recv()
            if ftype != F_UNLINK_REPLY:
                raise ProtocolError("unexpected reply")
            (peer_status,) = struct.unpack("<I", reply)
            return int(peer_status)

        try:
            return self._guarded(run)
        except _Failed as exc:
            logger.info("kvdd fabric: unlink of cluster %d: %s", local.cluster_id, exc.detail)
            # kvdd's own refusals (authentication) keep their documented UNLINK_FAILED; a peer
            # that hung up gives LLM_FAILED (SEMANTICS.md §3.6)
            return Status.LLM_UNLINK_FAILED if exc.status == Status.LLM_LINK_FAILED else exc.status

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None


def mode_mismatch(mine_off: bool) -> str:
    """Why two sides whose ``KVDD_FABRIC_AUTH`` differ cannot link."""
    if mine_off:
        return (f"the peer requires authentication but this process has {ENV_AUTH}=off: unset it "
                f"and give both sides the same {ENV_SECRET} (or {ENV_SECRET_FILE})")
    return (f"the peer has {ENV_AUTH}=off (no authentication): set {ENV_AUTH}=off here too "
            "(trusted networks only) or remove it there")


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


# ---- the acceptor's side (after authentication) ------------------------------------------------


class LinkAdmission(Protocol):
    """The listener's link bounds for one hello (:class:`~.gate.Ticket`)."""

    def reserve(self, cluster_id: int) -> str | None: ...  # None: admitted; else why not

    def charge(self, caches: int) -> str | None: ...  # the peer's table; None: within bounds

    def attach(self, chan: Channel, cluster_id: int, handle: RemotePeer | None) -> None: ...

    def cancel(self) -> None: ...


def serve_unlink(owner: LinkOwner, conn: socket.socket, payload: bytearray | memoryview,
                 finish: Callable[[socket.socket], None] | None = None) -> None:
    """The acceptor's side of a non-force unlink (§3.6), from an authenticated peer; the
    connection then goes to ``finish`` (default: :func:`linger` here)."""
    r = Reader(payload)
    cluster_id = r.u("Q")
    r.end()
    status = owner.peer_unlinked(cluster_id)
    conn.settimeout(REPLY_TIMEOUT_S)
    conn.sendall(frame(F_UNLINK_REPLY, 0, struct.pack("<I", status)))
    (finish or linger)(conn)


def serve_link(owner: LinkOwner, conn: socket.socket, payload: bytearray | memoryview,
               session: Session,
               ticket: LinkAdmission | None = None,
               finish: Callable[[socket.socket], None] | None = None) -> bool:
    """The acceptor's side of a link handshake; True when the connection became a link.

    ``ticket`` (the listener's link bounds) is asked before any work for the link: a link over
    them gets LLM_LINK_FAILED with the reason.  A connection that does not become a link goes to
    ``finish`` after its reply (default: :func:`linger` here).  What the authentication answer
    announced for ``session`` is abandoned unless this link took it over (:mod:`.announce`)."""
    try:
        return _decode_and_serve(owner, conn, payload, session, ticket, finish or linger)
    finally:
        announce.abandon(session)  # (a no-op once the link decided it)


def _decode_and_serve(owner: LinkOwner, conn: socket.socket, payload: bytearray | memoryview,
                      session: Session, ticket: LinkAdmission | None,
                      finish: Callable[[socket.socket], None]) -> bool:
    r = Reader(payload)
    offer = decode_offer(r)
    if ticket is not None:  # before the snapshot is decoded: a refused link costs no more
        why = ticket.reserve(offer.cluster_id)
        if why is not None:
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.sendall(frame(F_LINK_REPLY, 0, bytes(
                Writer().pack("I", Status.LLM_LINK_FAILED).text(why).buf)))
            finish(conn)
            return False
    try:
        force_link = bool(r.u("B"))
        boot_id = r.text() or ""
        if ticket is not None:  # the table's size, before it is decoded
            why = ticket.charge(r.u("I"))
            if why is not None:
                conn.settimeout(REPLY_TIMEOUT_S)
                conn.sendall(frame(F_LINK_REPLY, 0, bytes(
                    Writer().pack("I", Status.LLM_LINK_FAILED).text(why).buf)))
                finish(conn)
                return False
            r.pos -= 4
        snap, addrs = decode_snapshot(r)
        exts = decode_extensions(r)
        decode_table_extras(r, snap)
        r.end()
        return _serve_link(owner, conn, offer, force_link, boot_id, snap, addrs, exts, session,
                           ticket, finish)
    finally:
        if ticket is not None:
            ticket.cancel()  # (a no-op once the link holds the slot)


def _serve_link(owner: LinkOwner, conn: socket.socket, offer: LinkOffer, force_link: bool,
                boot_id: str, snap: dict[int, RemoteCache], addrs: dict[int, tuple[int, ...]],
                exts: dict[str, bytes], session: Session, ticket: LinkAdmission | None,
                finish: Callable[[socket.socket], None]) -> bool:
    session = session.linked(owner.cluster_id, offer.cluster_id, boot_id)
    accepted = accept_extensions(session, exts)
    path = _pick_path(accepted)
    chan = Channel(conn, owner, f"{owner.cluster_id}<-{offer.cluster_id}")
    chan.peer_wait_ms = offer.sync_wait_ms
    made: list[RemotePeer] = []

    def make_handle() -> PeerHandle:
        # comm: our entity for the initiator lives on this same connection
        handle = RemotePeer(chan, offer, snap, addrs, session, path)
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
            w.text(BOOT_ID)
            encode_snapshot(w, mine[1])
            encode_extensions(w, offer_extensions(session, owner))
            encode_table_extras(w, mine[1], mine[0])
            if len(w.buf) > MAX_HELLO:
                w = Writer().pack("I", Status.LLM_FAILED).text(
                    f"the peer's cache table is too large to link (over {MAX_HELLO} bytes)")
                status = Status.LLM_FAILED
        prepare = getattr(path, "prepare", None)
        if status == S_OK and mine is not None and prepare is not None:
            # the same-host path: our lease table, then our answer to the initiator's proof
            # (now, if it came already), ahead of the reply, so that the initiator finds it
            # when the reply comes; should the reply not go out, the initiator never takes it
            # (its link failed) and the session ends with the proof's connection
            try:
                prepare(mine[1])
            except Exception:  # a bug: the link is made all the same, over TCP
                logger.exception("kvdd fabric: the same-host answer of a link failed")
        try:  # (closed under us when our side closed the link it just made: not sent either)
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.sendall(frame(F_LINK_REPLY, 0, bytes(w.buf)))
        except OSError:
            status = Status.LLM_FAILED
        if not made and path is not None:  # hixl, or refused: no handle uses the data path
            _close_path(path)
        if status != S_OK or mine is None:
            chan.local_user = False
            if made:  # our entity exists but its connection is gone: transfers time out
                chan.dead.set()
                if ticket is not None:  # a broken link: counted until the entity goes
                    ticket.attach(chan, offer.cluster_id, made[0])
            finish(conn)
            return False
        chan.served = mine[1]
        chan.peer_user = True
        if ticket is not None:  # the link holds its place while our entity or the connection lives
            ticket.attach(chan, offer.cluster_id, made[0] if made else None)
    try:
        chan.start()
    except OSError as exc:  # closed before it started (unlinked or replaced meanwhile): ended
        logger.debug("kvdd fabric: a link ended before it started: %s", exc)
        chan.kill()
    after = getattr(path, "after_reply", None)
    if after is not None:  # (the same-host path: the next link's table, made now)
        try:
            after()
        except Exception:  # a bug: the next link makes its own
            logger.exception("kvdd fabric: preparing the next same-host link failed")
    return True


def _close_path(path: DataPath) -> None:
    try:
        path.close()
    except Exception:
        logger.exception("kvdd fabric: closing an unused %s data path failed", path.name)


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


