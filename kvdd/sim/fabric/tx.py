"""A link's answers, sent on the fabric's pool: the connection's queue of jobs, in order.

The peer's requests that are not answered inline by the receiving leader (READ, PING, a lease
the owner resolves, a LEASE while fault injections are armed, a WRITE's DONE, answers that did
not fit the socket) and this end's own frames that need no reply (RELEASE and CLOSE_HANDLE when
something else is being sent or waits to be, the closing GOODBYE and FIN) are *jobs* of the
connection, sent in the order they were queued by one task at a time on the fabric's pool
(:mod:`~.reactor`).  The task holds the connection's ``send_lock`` from a job's first byte to its last (a READ's DATA
frames and DONE are never interleaved with other frames, as when a thread sent them) and sends
without blocking: when the socket is full it asks the reactor for a writable notification and
returns, keeping the lock (a caller that wants to send meanwhile waits for it, until its
deadline, as it waited for the sending thread before); when another thread holds the lock it
returns and that thread queues it again once it released it.  A peer that does not read its
socket therefore costs no thread, and its connection is cut off by the queue bounds
(:meth:`Sender._enqueue`) as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import socket
import struct
import threading
from collections import deque
from collections.abc import Generator, Mapping

from ..._native._gather import GatherSender
from .leases import LeaseTable
from .protocol import LinkOwner, ServedCache
from .reactor import OUT, Reactor
from .serving import Step, serve_read_steps
from .small import serve_small_read
from .streams import advance
from .watchdog import WATCHDOG
from .wire import (F_DONE, F_GOODBYE, F_LEASE, F_LEASE_READ, F_LEASE_REPLY, F_PING, F_PONG,
                   F_READ, MAX_JOBS, MAX_QUEUED_BYTES, ProtocolError, frame)

logger = logging.getLogger(__name__)

__all__ = ["Sender", "ANSWER_CHARGE", "TX_SHARE", "WAIT_LOCK"]

_J_SEND = -1  # job: send this end's own frame (RELEASE, CLOSE_HANDLE)
_J_CLOSE = -2  # job: (GOODBYE and) FIN, after every frame queued before
_J_TAIL = -3  # job: the rest of this end's frame begun at once (``_tail``, sent first)
_J_REPLY = 101  # job: send an answer the reader prepared (counted in the queue bounds)
_J_FLUSH = 102  # job: send the rest of an answer the reader began (``_tail``)
ANSWER_CHARGE = 4096  # queue bytes a prepared answer counts as, at least (2,048 fit the bound)
TX_SHARE = 4 << 20  # bytes one pool task sends before it queues itself behind the others
TX_CALL = 64 << 10  # what one system call counts in that share, at least (64 calls a task)
TX_STEP = 16 << 10  # what one step of an answer's generator counts in it (256 steps a task)
WAIT_LOCK = 1  # the sending task waits for send_lock (its holder queues it again)
_WAIT_OUT = 2  # it waits for the socket to be writable (the reactor queues it again)
_LOCK_RETRY_S = 0.01  # and looks again after this, should a holder not queue it
_DONTWAIT = socket.MSG_DONTWAIT

Job = tuple[int, int, "bytes | bytearray | int"]


def _charge(ftype: int, payload: bytes | bytearray | int) -> tuple[int, int]:
    """What a queued job counts in the bounds: (requests, bytes)."""
    if ftype in (_J_REPLY, _J_FLUSH):
        return 0, max(len(payload) if not isinstance(payload, int) else 0, ANSWER_CHARGE)
    return 1, 0 if isinstance(payload, int) else len(payload)


class Sender:
    """The sending side of a :class:`~.channel.Channel` (a mixin: the state it names is the
    channel's own, one object, one lock)."""

    sock: socket.socket
    label: str
    send_lock: threading.Lock
    leases: LeaseTable
    served: Mapping[int, ServedCache]
    peer_wait_ms: int
    dead: threading.Event
    _lock: threading.Lock
    _closed_wr: threading.Event
    _closing: bool
    _started: bool
    _tail: bytes | None
    _reactor: Reactor
    _fd: int

    if TYPE_CHECKING:  # defined by Channel and the other mixins
        @property
        def owner(self) -> LinkOwner: ...
        def kill(self) -> None: ...
        def _here(self) -> bool: ...
        def _grant_small(self, cache_id: int) -> tuple[int, ServedCache | None]: ...

    def _tx_init(self) -> None:
        self._jobs: deque[Job | None] = deque()
        self._queued_jobs = 0  # the peer's requests waiting to be answered
        self._queued_bytes = 0
        self._tx_sched = False  # a sending task is queued, running or waiting (_tx_wait)
        self._tx_wait = 0
        self._tx_holding = False  # the sending task holds send_lock (between its tasks too)
        self._tx_gen: Generator[Step, None, None] | None = None  # the job being sent
        self._tx_bufs: Step = []  # what is left of its current system call, or its compiled sender
        self._tx_last = False  # the job being sent is the close: nothing is sent after it
        self._tx_over = False  # nothing more is sent (closed, failed, dead)

    # -- queueing -------------------------------------------------------------------------------
    def _tx_kick_locked(self) -> None:
        """Make sure a sending task runs for the queued jobs (the channel lock held)."""
        if not self._tx_sched and self._started and not self._tx_over and self._here():
            self._tx_sched = True
            self._reactor.submit_after(self._tx_run)  # (on the pool: after the reader's turn)

    def _enqueue(self, ftype: int, req: int, payload: bytes | bytearray | int) -> None:
        """Queue work for the sending task: at most MAX_JOBS requests of the peer and
        MAX_QUEUED_BYTES wait; a peer sending more (one that does not read our answers) loses
        its connection.  Answers already prepared (small replies waiting for the send side)
        count in the bytes only, each as at least ANSWER_CHARGE: a peer that reads, only late,
        may have many small requests in flight, and one that never reads is still cut off."""
        jobs, size = _charge(ftype, payload)
        with self._lock:
            if (self._queued_jobs + jobs > MAX_JOBS
                    or self._queued_bytes + size > MAX_QUEUED_BYTES):
                raise ProtocolError(f"too many queued requests ({self._queued_jobs}, "
                                    f"{self._queued_bytes} bytes)")
            self._queued_jobs += jobs
            self._queued_bytes += size
            self._jobs.append((ftype, req, payload))
            self._tx_kick_locked()

    def send_oneway(self, ftype: int, payload: bytes) -> None:
        """A frame with no reply (RELEASE, CLOSE_HANDLE): sent at once, without blocking, when
        nothing else is being sent or waits to be; else by the sending task after what was
        queued before it: the caller never waits behind a long transfer sent in the other
        direction (a RELEASE that comes late only keeps a lease until it arrives or
        expires)."""
        if self.dead.is_set():
            return
        data = frame(ftype, 0, payload)
        if self.send_lock.acquire(False):  # nobody sending: at once when the socket takes it
            try:
                with self._lock:
                    now = (self._tail is None and not self._jobs and not self._tx_sched
                           and not self._closing and self._started and self._here())
                if now:
                    try:
                        sent = self.sock.send(data, _DONTWAIT)
                    except BlockingIOError:
                        sent = 0
                    except OSError:  # the connection ends: its reader finds out
                        return
                    if sent == len(data):
                        return
                    data = data[sent:]
                    if sent:  # nobody may send before the rest of this frame
                        self._tail = data
                        with self._lock:
                            self._jobs.append((_J_TAIL, 0, b""))
                            self._tx_kick_locked()
                        return
            finally:
                self.send_lock.release()
                if self._tx_wait == WAIT_LOCK:
                    self._tx_unblock()
        with self._lock:
            if not self._closing:
                self._jobs.append((_J_SEND, 0, data))
                self._tx_kick_locked()

    def _queue_close(self, goodbye: bool) -> None:
        with self._lock:  # after the frames already queued (CLOSE_HANDLE, RELEASE)
            self._jobs.append((_J_CLOSE, int(goodbye), b""))
            self._tx_kick_locked()

    def _answer(self, req: int, data: bytes) -> None:
        """A leader's answer to a small request, never blocking: a non-blocking send when no
        other thread is sending; what does not fit is the sending task's (counted in the queue
        bounds, so a peer that does not read its answers loses its connection)."""
        if self.send_lock.acquire(False):
            try:
                if self._tail is None:
                    try:
                        sent = self.sock.send(data, _DONTWAIT)
                    except BlockingIOError:
                        sent = 0
                    if sent == len(data):
                        return
                    if sent:  # nobody may send before the rest of this frame
                        self._tail = data[sent:]
                        self._enqueue(_J_FLUSH, req, self._tail)
                        return
            finally:
                self.send_lock.release()
                if self._tx_wait == WAIT_LOCK:
                    self._tx_unblock()
        self._enqueue(_J_REPLY, req, data)

    def _flush_tail(self) -> None:
        """Send the rest of a frame a leader began (a caller, blocking, with send_lock held)."""
        tail, self._tail = self._tail, None
        if tail:
            self.sock.sendall(tail)

    def _tx_unblock(self) -> None:
        """send_lock was released: queue the sending task that waits for it."""
        with self._lock:
            if self._tx_wait == WAIT_LOCK:
                self._tx_wait = 0
                self._reactor.submit(self._tx_run)

    def _tx_wake_dead(self) -> None:
        """The connection died: a waiting sending task runs once more to let go (channel lock)."""
        if self._tx_wait and self._here():
            self._tx_wait = 0
            self._reactor.submit(self._tx_run)

    def on_writable(self) -> None:
        """The socket takes bytes again (the reactor's notification)."""
        with self._lock:
            if self._tx_wait != _WAIT_OUT:
                return
            self._tx_wait = 0
        self._tx_run()

    # -- the sending task -----------------------------------------------------------------------
    def _tx_run(self) -> None:
        try:
            self._tx_step()
        except OSError as exc:  # the connection ends; the owner's leases are dropped on its end
            logger.debug("kvdd fabric %s: send failed: %s", self.label, exc)
            self._tx_stop()
            self.kill()
        except Exception:  # a bug: log it; the connection ends (transfers get LLM_TIMEOUT)
            logger.exception("kvdd fabric %s: sending failed", self.label)
            self._tx_stop()
            self.kill()

    def _tx_stop(self) -> None:
        """Nothing more is sent: the job in progress ends (its lease is let go), send_lock too."""
        gen, self._tx_gen = self._tx_gen, None
        self._tx_bufs = []
        with self._lock:
            self._tx_over = True
            self._tx_sched = False
            self._tx_wait = 0
            self._jobs.clear()
        try:
            if gen is not None:
                gen.close()
        finally:
            if self._tx_holding:
                self._tx_holding = False
                self.send_lock.release()

    def _tx_step(self) -> None:
        if self.dead.is_set() or self._tx_over:
            self._tx_stop()
            return
        if not self._tx_holding:
            with self._lock:  # (send_lock is never waited for under the channel lock)
                got = self.send_lock.acquire(False)
                if not got:
                    self._tx_wait = WAIT_LOCK  # the holder queues us when it lets go
            if not got:
                WATCHDOG.schedule(_LOCK_RETRY_S, self._tx_unblock)
                return
            self._tx_holding = True
            tail, self._tail = self._tail, None
            if tail:  # the rest of a frame a leader began
                self._tx_bufs = [memoryview(tail)]
        share = TX_SHARE
        while True:
            if self._tx_bufs:  # tiny frames (a READ of many tensors) count per system call
                sent, full = self._send_some(share)
                share -= max(sent, TX_CALL)
                if full:  # the socket is full: go on when it takes bytes again
                    with self._lock:
                        self._tx_wait = _WAIT_OUT
                    self._reactor.arm(self._fd, self, OUT)
                    return
                if share <= 0:  # others' turn: queue again, keeping send_lock
                    self._reactor.submit_after(self._tx_run)
                    return
            elif self._tx_gen is not None:
                if share <= 0:  # (steps that send nothing, e.g. planning, count too)
                    self._reactor.submit_after(self._tx_run)
                    return
                share -= TX_STEP
                bufs = next(self._tx_gen, None)
                if bufs is None:
                    self._tx_gen = None
                    if self._tx_last:
                        self._tx_stop()
                        return
                else:
                    self._tx_bufs = bufs
            else:
                with self._lock:
                    if not self._jobs:
                        self._tx_holding = False
                        self.send_lock.release()
                        self._tx_sched = False
                        return
                    job = self._jobs.popleft()
                    if job is not None and job[0] > 0:
                        jobs, size = _charge(job[0], job[2])
                        self._queued_jobs -= jobs
                        self._queued_bytes -= size
                if job is None:  # the connection died
                    self._tx_stop()
                    return
                self._tx_begin(*job)

    def _send_some(self, share: int) -> tuple[int, bool]:
        """Send what the socket takes of ``_tx_bufs`` now (a compiled sender: at most about
        ``share`` bytes): the bytes sent, and whether the socket is full."""
        bufs = self._tx_bufs
        if isinstance(bufs, GatherSender):
            sent = bufs.send(self.sock, share)
            if bufs.done:
                self._tx_bufs = []
            return sent, bufs.blocked
        total = 0
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs[:64], (), _DONTWAIT)
            except BlockingIOError:
                break
            total += sent
            advance(bufs, sent)
        return total, bool(bufs)

    def _tx_begin(self, ftype: int, req: int, payload: bytes | bytearray | int) -> None:
        """Start sending one job (its first buffers, or the generator of them)."""
        if isinstance(payload, int):  # F_DONE of a WRITE
            out = frame(F_DONE, req, struct.pack("<I", payload))
        elif ftype == F_LEASE:
            out = frame(F_LEASE_REPLY, req, self.leases.grant(
                self.owner, self.served, bytes(payload), self.peer_wait_ms, req))
        elif ftype == F_READ:
            self._tx_gen = serve_read_steps(self.leases, self.owner, req, payload)
            return
        elif ftype == F_LEASE_READ:
            out = serve_small_read(self.owner, self._grant_small, req, bytes(payload))
        elif ftype in (_J_REPLY, _J_SEND):
            out = bytes(payload)
        elif ftype in (_J_FLUSH, _J_TAIL):  # the tail went first, when send_lock was taken
            return
        elif ftype == F_PING:
            out = frame(F_PONG, req, b"")
        elif ftype == _J_CLOSE:
            self._tx_last = True
            self._tx_gen = self._close_steps(bool(req))
            return
        else:
            raise AssertionError(f"unknown job {ftype}")
        self._tx_bufs = [memoryview(out)]

    def _close_steps(self, goodbye: bool) -> Generator[list[memoryview], None, None]:
        """GOODBYE (if asked) and FIN; the receiving side reads on until the peer closes too."""
        try:
            if goodbye:
                yield [memoryview(frame(F_GOODBYE, 0))]
            self.sock.shutdown(socket.SHUT_WR)
        finally:
            self._closed_wr.set()
