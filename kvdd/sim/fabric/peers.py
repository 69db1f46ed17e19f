"""Peer handles: what a link entity uses to reach the peer (SEMANTICS.md §2.4, §10 rules 2, 5, 9).

* :class:`InProcessPeer` — a peer instance in this process: the copy kernels directly;
* :class:`RemotePeer` — a peer in another process or on another host: leases and DATA frames over
  the link's :class:`~kvdd.sim.fabric.channel.Channel`, or a :class:`~.protocol.DataPath` that a
  handshake extension provided (the same-host path).
"""

from __future__ import annotations

import logging
import struct
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ...status import NOT_EXIST, NOT_YET_LINK, PARAM_INVALID, S_OK, TIMEOUT, Status
from ..memory import Region, copy_runs
from .channel import Channel
from .auth import Session
from .protocol import DataPath, LinkOffer, LinkOwner, RemoteCache, ServedCache
from .rx import Pending, Sink, Stage
from .serving import check_request
from .small import SmallSink, encode_small, is_small
from .streams import Cursor, Layout
from .wire import (F_LEASE, F_LEASE_READ, F_LEASE_WRITE, F_READ, F_RELEASE, F_WRITE, MAX_RUNS,
                   SMALL_BYTES, SMALL_MAX_RUNS, encode_request)

logger = logging.getLogger(__name__)

__all__ = ["InProcessPeer", "RemotePeer", "ClientLease", "PathLease", "in_process_peer"]


class InProcessPeer:
    """A peer instance living in this process: copies go straight through the copy kernels."""

    def __init__(self, peer: LinkOwner, snapshot: dict[int, RemoteCache],
                 entries: Mapping[int, ServedCache]) -> None:
        self._peer = weakref.ref(peer)  # a link never keeps the peer alive (SEMANTICS.md §3.1)
        self.peer_cluster_id = peer.cluster_id
        self.transfer_backend = peer.transfer_backend
        self._snapshot = snapshot
        self._entries = entries  # token -> live entry objects at snapshot time
        self.closed = False  # unlinked here (read by the compiled path: kvdd.sim._fastpath)

    @property
    def peer(self) -> LinkOwner | None:
        """The peer instance, None once it is gone (its caches were retired by its teardown)."""
        return self._peer()

    def snapshot(self) -> dict[int, RemoteCache]:
        return self._snapshot

    def addresses(self, cache_id: int) -> tuple[int, ...]:
        entry = self._entries.get(cache_id)
        return () if entry is None else entry.addrs

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        if self.closed:  # a local unlink won the race for the link (§10 rule 5)
            return NOT_YET_LINK, None
        entry: ServedCache = rc.token  # type: ignore[assignment]
        if not entry.acquire():
            return Status.LLM_KV_CACHE_NOT_EXIST, None
        return Status.LLM_SUCCESS, entry

    def acquire_resolved(self, request: bytes, timeout_ms: int) -> tuple[int, object, bytes]:
        """A lease the peer resolves from ``request`` (:class:`~.leases.LeaseResolver`, the
        same checks as over TCP): ``(status, lease, the peer's answer)``."""
        if self.closed:
            return NOT_YET_LINK, None, b""
        peer = self.peer  # None once the peer instance was dropped
        resolve = getattr(peer, "resolve_lease", None)
        if peer is None or not peer.initialized or resolve is None:
            return NOT_EXIST, None, b""
        status, entry, extra, on_served = resolve(request)
        if status != S_OK or entry is None:
            return (status if status != S_OK else NOT_EXIST), None, extra
        if not entry.acquire():
            return NOT_EXIST, None, b""
        return S_OK, _Resolved(entry, on_served), extra

    def release(self, lease: object) -> None:
        if type(lease) is _Resolved:
            lease.entry.release()
            return
        entry: ServedCache = lease  # type: ignore[assignment]
        entry.release()

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        if type(lease) is _Resolved:  # checked as the owner checks a READ (kvdd rule 1)
            entry = lease.entry
            status = check_request(entry.n, entry.T, np.asarray(tensors, dtype=np.int64),
                                   np.asarray(src_off, dtype=np.int64),
                                   np.asarray(length, dtype=np.int64))
            if status != S_OK:
                return status
            copy_runs([entry.regions[i] for i in tensors], dst, src_off, dst_off, length)
            served, lease.on_served = lease.on_served, None
            if served is not None:
                served([int(t) for t in tensors])
            return Status.LLM_SUCCESS
        entry = lease  # type: ignore[assignment]
        src = [entry.regions[i] for i in tensors]
        copy_runs(src, dst, src_off, dst_off, length)
        return Status.LLM_SUCCESS

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        entry: ServedCache = lease  # type: ignore[assignment]
        dst = [entry.regions[i] for i in tensors]
        copy_runs(src, dst, src_off, dst_off, length)
        return Status.LLM_SUCCESS

    def close(self) -> None:
        self.closed = True


class _Resolved:
    """An in-process lease on an entry the peer resolved (and its action once read)."""

    __slots__ = ("entry", "on_served")

    def __init__(self, entry: ServedCache, on_served: Callable[[list[int]], None] | None) -> None:
        self.entry = entry
        self.on_served = on_served


def in_process_peer(peer: LinkOwner) -> InProcessPeer:
    """A handle on ``peer`` (same process) with its caches registered now as the snapshot."""
    snap, entries = peer.snapshot_for_link()
    return InProcessPeer(peer, snap, entries)


class ClientLease:
    """A transfer's lease on the owner over TCP: taken lazily (``lease_id`` 0 until then), since
    a small transfer asks for it in the same request as its bytes (LEASE_READ / LEASE_WRITE)."""

    __slots__ = ("lease_id", "rc", "deadline")

    def __init__(self, lease_id: int, rc: RemoteCache, deadline: float) -> None:
        self.lease_id = lease_id
        self.rc = rc
        self.deadline = deadline


class PathLease:
    """A lease granted by a link's :class:`~.protocol.DataPath` (not by the owner's TCP server)."""

    __slots__ = ("inner",)

    def __init__(self, inner: object) -> None:
        self.inner = inner


class RemotePeer:
    """A peer in another process or on another host, reached through a link's connection.

    Parameters
    ----------
    chan : Channel
        The link's authenticated connection.
    offer : LinkOffer
        The peer's identity from its hello.
    snapshot, addrs
        The peer's caches visible over this link and their tensor addresses (as announced).
    session : Session
        The authenticated session of this connection (both sides hold the same key).
    path : DataPath or None
        A data path from a handshake extension that replaces TCP where it accepts a transfer.
    """

    def __init__(self, chan: Channel, offer: LinkOffer, snapshot: dict[int, RemoteCache],
                 addrs: dict[int, tuple[int, ...]], session: Session,
                 path: DataPath | None = None) -> None:
        self._chan = chan
        self.peer_cluster_id = offer.cluster_id
        self.transfer_backend = offer.transfer_backend
        self.session = session
        self._snapshot = snapshot
        self._addrs = addrs
        self._path = path
        self._mover_of = getattr(path, "one_sided_mover", None)  # (see one_sided)
        self._closed = False
        self.on_close: Callable[[], None] | None = None  # the listener's link count (gate.py)

    @property
    def data_path(self) -> str:
        """The name of the link's data path (``"tcp"`` unless an extension provided one)."""
        return "tcp" if self._path is None else self._path.name

    def snapshot(self) -> dict[int, RemoteCache]:
        return self._snapshot

    def one_sided(self) -> object | None:
        """The compiled copy of the link's one-sided data path (``_xproc.SameHostMover``, for
        kvdd.sim._fastpath) while :meth:`acquire` would go to that path, else None."""
        mover_of = self._mover_of
        if mover_of is None or self._closed or self._chan.peer_finalized:
            return None
        return mover_of()  # type: ignore[no-any-return]

    def tensor_addrs(self, cache_id: int) -> tuple[int, ...]:
        """The peer's tensor addresses of ``cache_id`` as its hello announced them (``()``)."""
        return self.addresses(cache_id)

    def addresses(self, cache_id: int) -> tuple[int, ...]:
        return self._addrs.get(cache_id, ())

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        if self._closed:  # a local unlink won the race for the link (§10 rule 5)
            return NOT_YET_LINK, None
        chan = self._chan
        if chan.peer_finalized:
            return NOT_EXIST, None
        deadline = time.monotonic() + timeout_ms / 1000.0  # (a data path's wait counts in it)
        if self._path is not None:
            got = self._path.acquire(rc, self._addrs.get(rc.cache_id, ()), timeout_ms)
            if got is not None:
                status, inner = got
                return (status, PathLease(inner)) if status == S_OK else (status, None)
        if chan.dead.is_set() or timeout_ms <= 0:  # §10 rule 9: a 0 ms wait always times out
            return TIMEOUT, None
        # the owner's lease checks run with the transfer's first request (see :meth:`move`)
        return S_OK, ClientLease(0, rc, deadline)

    def acquire_resolved(self, request: bytes, timeout_ms: int) -> tuple[int, object, bytes]:
        """A lease the owner resolves from ``request`` (:class:`~.leases.LeaseResolver`): one
        LEASE round trip whose cache id is 0, always over TCP (a data path serves leases on
        announced caches only): ``(status, lease, the owner's answer after the lease id)``.
        LLM_TIMEOUT when the owner does not answer within ``timeout_ms`` (the link is then
        broken)."""
        if self._closed:
            return NOT_YET_LINK, None, b""
        chan = self._chan
        if chan.peer_finalized:
            return NOT_EXIST, None, b""
        if chan.dead.is_set() or timeout_ms <= 0:
            return TIMEOUT, None, b""
        deadline = time.monotonic() + timeout_ms / 1000.0
        reply = chan.request(F_LEASE, struct.pack("<Q", 0) + request, deadline)
        if reply is None:
            return (NOT_EXIST if chan.peer_finalized else TIMEOUT), None, b""
        if len(reply) < 12:
            chan.kill()
            return TIMEOUT, None, b""
        status, lease_id = struct.unpack_from("<IQ", reply)
        extra = bytes(reply[12:])
        if status != S_OK:
            return int(status), None, extra
        if lease_id == 0:
            chan.kill()
            return TIMEOUT, None, b""
        rc = RemoteCache(0, 0, 0, 0, 0, False, None)  # the owner checks every run on its entry
        return S_OK, ClientLease(int(lease_id), rc, deadline), extra

    def _take_lease(self, lease: ClientLease) -> int:
        """A LEASE round trip for a transfer too big for LEASE_READ / LEASE_WRITE; a status."""
        chan = self._chan
        return self._lease_status(lease, chan.request(F_LEASE, struct.pack("<Q", lease.rc.cache_id),
                                                      lease.deadline))

    def _lease_status(self, lease: ClientLease, reply: bytes | None) -> int:
        """A LEASE reply's status (``lease`` taken when LLM_SUCCESS); TIMEOUT, or NOT_EXIST
        from a finalized owner, for none; a malformed one breaks the link."""
        chan = self._chan
        if reply is None:
            return NOT_EXIST if chan.peer_finalized else TIMEOUT
        try:
            status, lease_id = struct.unpack("<IQ", reply)
        except struct.error:
            chan.kill()
            return TIMEOUT
        if status == S_OK:
            lease.lease_id = lease_id
        return int(status)

    def release(self, lease: object) -> None:
        if isinstance(lease, PathLease):
            assert self._path is not None
            self._path.release(lease.inner)
            return
        assert isinstance(lease, ClientLease)
        if lease.lease_id:  # a small transfer's lease ended with its request
            self._chan.send_oneway(F_RELEASE, struct.pack("<Q", lease.lease_id))

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        if type(lease) is ClientLease and not lease.lease_id and len(length) == 1 \
                and len(tensors) == 1 and len(dst) == 1:
            n = int(length[0])
            if 0 <= n <= SMALL_BYTES:
                # most small reads: one tensor, one run: :meth:`move` as one LEASE_READ whose
                # answer is staged in a compiled Stage and lands in ``dst`` only after DONE said
                # LLM_SUCCESS (the same checks, statuses and order)
                chan = self._chan
                if chan.dead.is_set() or lease.deadline <= time.monotonic():
                    return TIMEOUT
                region = dst[0]
                at = int(dst_off[0])
                if at < 0 or at + n > region.nbytes:  # the caller's checked run; kept honest
                    raise ValueError("run outside its region")
                stage = Stage(n, SMALL_BYTES)
                status = chan.read_small(lease.rc.cache_id, int(tensors[0]), int(src_off[0]),
                                         stage, lease.deadline)
                if status is None:
                    return NOT_EXIST if chan.peer_finalized else TIMEOUT
                if status == S_OK:
                    if stage.left:  # the peer claimed success without sending every byte
                        chan.kill()
                        return TIMEOUT
                    stage.land(region.addr + at)
                return status
        if isinstance(lease, PathLease):
            assert self._path is not None
            return self._path.read(lease.inner, tensors, src_off, dst, dst_off, length, timeout_ms)
        assert isinstance(lease, ClientLease)
        if not lease.lease_id and len(tensors) * len(length) <= MAX_RUNS \
                and not is_small(len(tensors), length):
            return self._lease_and_read(lease, tensors, src_off, dst, dst_off, length)
        status = self._lease_unless_small(lease, tensors, length)
        if status != S_OK:
            return status
        return self.move(lease, tensors, dst, dst_off, src_off, length, False)

    def _lease_and_read(self, lease: ClientLease, tensors: Sequence[int], remote_off: np.ndarray,
                        local: Sequence[Region], local_off: np.ndarray, length: np.ndarray) -> int:
        """A READ too big for one LEASE_READ: its LEASE and the READ in one round trip
        (:meth:`~.calls.Calls.lease_read`), with the statuses of LEASE then READ."""
        chan = self._chan
        if chan.dead.is_set():
            return TIMEOUT
        layout: Layout | None = None
        cursor: Cursor | None = None

        def prepare(field: int) -> tuple[bytes, Sink]:  # (while the LEASE travels)
            nonlocal layout, cursor
            layout = Layout(local, local_off, length)
            cursor = Cursor(layout)
            return encode_request(field, tensors, remote_off, length), cursor

        reply, read = chan.lease_read(lease.rc.cache_id, prepare, lease.deadline)
        try:
            status = self._lease_status(lease, reply)
            done = None if read is None else self.receive(read, lease.deadline)
        except BaseException:  # (a signal handler's exception): no READ is left behind
            if read is not None:
                chan.abandon(read)
            raise
        if status != S_OK:
            return status
        status = self._status(done, False)
        if status == S_OK:
            assert layout is not None and cursor is not None  # (a READ was sent)
            return self._landed(layout, cursor)
        return status

    def _landed(self, layout: Layout, cursor: Cursor) -> int:
        """A READ its owner answered LLM_SUCCESS: its bytes go to the caller's memory when every
        one arrived; otherwise the peer broke the protocol (the link is killed: TIMEOUT)."""
        if cursor.left:  # the peer claimed success without sending every byte
            self._chan.kill()
            return TIMEOUT
        layout.scatter()
        return S_OK

    def receive(self, read: Pending, deadline: float) -> bytes | None:
        """The DATA and DONE of a READ sent under a lease (:meth:`_lease_and_read`): the DONE's
        payload, None as for :meth:`~.calls.Calls.request`.  A method of its own: the point
        where a reader holds its granted lease while its answer comes (tests slow it down
        there)."""
        return self._chan.finish_read(read, deadline)

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        if isinstance(lease, PathLease):
            assert self._path is not None
            return self._path.write(lease.inner, tensors, src, src_off, dst_off, length,
                                    timeout_ms)
        assert isinstance(lease, ClientLease)
        status = self._lease_unless_small(lease, tensors, length)
        if status != S_OK:
            return status
        return self.move(lease, tensors, src, src_off, dst_off, length, True)

    def _lease_unless_small(self, lease: ClientLease, tensors: Sequence[int],
                            length: np.ndarray) -> int:
        """Take the owner's lease now (LEASE) unless the transfer is small enough for one
        LEASE_READ / LEASE_WRITE (at most SMALL_BYTES in SMALL_MAX_RUNS tensors x runs)."""
        if lease.lease_id or is_small(len(tensors), length):
            return S_OK
        if self._chan.dead.is_set():
            return TIMEOUT
        return self._take_lease(lease)

    def move(self, lease: ClientLease, tensors: Sequence[int], local: Sequence[Region],
             local_off: np.ndarray, remote_off: np.ndarray, length: np.ndarray,
             write: bool) -> int:
        """One transfer over TCP under ``lease``: a READ (DATA frames into ``local``) or a WRITE
        (``local`` bytes as DATA frames); a status.  More than MAX_RUNS tensors x runs give
        LLM_PARAM_INVALID and move nothing (the owner would refuse them).  A small transfer
        (at most SMALL_BYTES in SMALL_MAX_RUNS tensors x runs) is one LEASE_READ / LEASE_WRITE
        round trip (same statuses); a bigger one took its lease before (LEASE)."""
        chan = self._chan
        if chan.dead.is_set():
            return TIMEOUT
        if len(tensors) * len(length) > MAX_RUNS:
            return PARAM_INVALID
        if lease.deadline <= time.monotonic():
            return TIMEOUT
        if lease.lease_id == 0:
            return self._move_small(lease, tensors, local, local_off, remote_off,
                                    length.tolist(), write)
        layout = Layout(local, local_off, length)
        payload = encode_request(lease.lease_id, tensors, remote_off, length)
        cursor: Cursor | None = None
        if write:
            layout.gather()
            reply = chan.request(F_WRITE, payload, lease.deadline, data=layout)
        else:
            cursor = Cursor(layout)
            reply = chan.request(F_READ, payload, lease.deadline, sink=cursor)
        status = self._status(reply, False)
        if status == S_OK and cursor is not None:
            return self._landed(layout, cursor)
        return status

    def _move_small(self, lease: ClientLease, tensors: Sequence[int], local: Sequence[Region],
                    local_off: np.ndarray, remote_off: np.ndarray, lengths: list[int],
                    write: bool) -> int:
        """One LEASE_READ / LEASE_WRITE round trip: the bytes are staged (a READ's reach the
        caller's memory only after the owner's DONE said LLM_SUCCESS)."""
        chan = self._chan
        payload = encode_small(lease.rc.cache_id, [int(t) for t in tensors], remote_off.tolist(),
                               lengths)
        if write:
            layout = Layout(local, local_off, np.asarray(lengths, dtype=np.int64))
            layout.gather()
            return self._status(chan.request(F_LEASE_WRITE, payload, lease.deadline, data=layout),
                                True)
        sink = SmallSink(local, local_off.tolist(), lengths)
        status = self._status(chan.request(F_LEASE_READ, payload, lease.deadline, sink=sink), True)
        if status == S_OK:
            if sink.left:  # the peer claimed success without sending every byte
                chan.kill()
                return TIMEOUT
            sink.scatter()
        return status

    def _status(self, reply: bytes | None, small: bool) -> int:
        """The status of a READ / WRITE (DONE's payload); TIMEOUT (the link broken) for none."""
        chan = self._chan
        if reply is None:
            return NOT_EXIST if small and chan.peer_finalized else TIMEOUT
        try:
            (status,) = struct.unpack("<I", reply)
        except struct.error:
            chan.kill()
            return TIMEOUT
        return int(status)

    def revoke_served(self) -> None:
        """Stop the peer's one-sided copies of our caches from starting (none run once
        :meth:`close` returns): finalize does it for every link before the first close."""
        revoke = getattr(self._path, "revoke_served", None)
        if revoke is not None:
            revoke()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._path is not None:
                try:
                    self._path.close()
                except Exception:
                    logger.exception("kvdd fabric: closing the %s data path failed", self.data_path)
            self._chan.release_local_user()
            hook = self.on_close
            if hook is not None:
                try:
                    hook()
                except Exception:
                    logger.exception("kvdd fabric: the end-of-link hook failed")

    @property
    def closed(self) -> bool:
        """True once this end closed the handle (unlink, a replacing link, finalize)."""
        return self._closed
