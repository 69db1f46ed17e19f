"""This end's requests on a link's connection: the calling side of :class:`~.channel.Channel`.

A caller registers its request (:class:`~.rx.Pending`), sends it under the channel's
``send_lock`` and waits for its reply, reading the socket itself when no other thread does (it
then *leads* the receive side, handling every frame it reads, see :mod:`~.channel`).  A small READ
of one tensor and one run (:meth:`Calls.read_small`) takes the lead as it registers the request
when the connection is free, and takes its own DATA and DONE through the compiled
:meth:`~.rx.Rx.small_reply` into a :class:`~.rx.Stage`.  The connection's
:class:`~.watchdog.DeadlineGuard` closes it when a request outlives its deadline.

:class:`Calls` is a mixin of :class:`~.channel.Channel`: the state it names below is the
channel's own (one object, one lock; split in two modules by concern).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import socket
import struct
import threading
import time

from .rx import Pending, Rx, Sink, Stage, Steps
from .small import encode_one_run
from .tx import WAIT_LOCK
from .watch import ARMED
from .streams import Layout, send_stream
from .watchdog import DeadlineGuard
from .wire import (CHAINED_LEASE, F_LEASE, F_LEASE_READ, F_READ, HDR, MAGIC, PROTOCOL_VERSION,
                   frame)

__all__ = ["Calls"]

_LEASE_READ_1 = struct.Struct("<2sBBIIQIIIqq")  # a LEASE_READ frame of one tensor and one run
_CACHE_ID = struct.Struct("<Q")  # a LEASE on a cache
_ONE_RUN_LEN = _LEASE_READ_1.size - HDR.size  # its payload: encode_one_run's layout
assert len(encode_one_run(0, 0, 0, 0)) == _ONE_RUN_LEN


def _reply(p: Pending) -> bytes | None:
    """A request's reply, None when it failed or got none."""
    if p.failed or not p.done:
        return None
    reply = p.reply
    assert not isinstance(reply, int)
    return reply


class Calls:
    """The requests of this end of a :class:`~.channel.Channel` (a mixin: see the module)."""

    # the channel's state and methods this side uses (set and defined by Channel)
    sock: socket.socket
    send_lock: threading.Lock
    rx: Rx
    dead: threading.Event
    _lock: threading.Lock
    _sink_lock: threading.Lock
    _rx_cv: threading.Condition
    _pending: dict[int, Pending]
    _guard: DeadlineGuard
    _req_ids: int
    _leader: object | None
    _waiters: int
    _active: int
    _last_active: float
    _started: bool
    _running: threading.Event
    _tail: bytes | None
    _rxs: Steps[None] | None  # a frame a pool thread left half-read (finished by _frame)
    _tx_wait: int
    _bg: int

    if TYPE_CHECKING:  # defined by Channel and the other mixins
        def kill(self) -> None: ...
        def _frame(self) -> None: ...
        def _fail(self, exc: BaseException) -> None: ...
        def _flush_tail(self) -> None: ...
        def _unlead(self) -> None: ...
        def _bg_poke_locked(self) -> None: ...
        def _bg_quiet_locked(self) -> None: ...
        def _tx_unblock(self) -> None: ...

    def _release_send(self) -> None:
        """Let go of send_lock (a sending task waiting for it is queued again)."""
        self.send_lock.release()
        if self._tx_wait == WAIT_LOCK:
            self._tx_unblock()

    def request(self, ftype: int, payload: bytes, deadline: float, sink: Sink | None = None,
                data: Layout | None = None) -> bytes | None:
        """Send a request (and WRITE data) and wait for its reply until ``deadline``, reading
        the socket itself when no other thread does (see the module docstring).

        None when the peer did not answer in time (the connection is then closed: the link is
        broken) or the connection died."""
        p = self._submit(ftype, payload, deadline, sink, data)
        if p is None:
            return None
        try:
            self._await_or_kill(p, deadline)
            if p.sink is not None or p.failed or not p.done:
                with self._sink_lock:  # no DATA reaches the sink once we return (§10 rule 5)
                    p.cancelled = True
            return _reply(p)
        finally:
            self._end(p)

    def lease_read(self, cache_id: int, prepare: Callable[[int], tuple[bytes, Sink]],
                   deadline: float) -> tuple[bytes | None, Pending | None]:
        """A LEASE on the peer's cache ``cache_id`` and the READ under it, in one round trip.

        The LEASE is sent first; ``prepare(lease field)`` then gives the READ's payload, whose
        lease field names the LEASE's request (CHAINED_LEASE), and the sink its DATA lands in:
        it runs while the LEASE is on its way.  Returns the LEASE's reply (None as for
        :meth:`request`) and the READ's request (None when it could not be sent), which the
        caller ends with :meth:`finish_read` whatever the reply said (a refused LEASE's READ
        is answered by a DONE without DATA: the owner has no lease for it).  ``prepare``
        raising breaks the link (the LEASE may have been granted)."""
        p1 = self._submit(F_LEASE, _CACHE_ID.pack(cache_id), deadline, None, None)
        if p1 is None:
            return None, None
        p2: Pending | None = None
        try:
            payload, sink = prepare(CHAINED_LEASE | p1.req)
            p2 = self._submit(F_READ, payload, deadline, sink, None)
            self._await_or_kill(p1, deadline)
            return _reply(p1), p2
        except BaseException:  # (``prepare`` failing, a signal handler's exception)
            if p2 is not None:
                self.abandon(p2)  # the READ ends here too (the link broken)
            else:
                self.kill()  # the LEASE may have been granted, a READ half sent
            raise
        finally:
            self._end(p1)

    def finish_read(self, p: Pending, deadline: float) -> bytes | None:
        """The DONE payload of a READ sent by :meth:`lease_read`: None as for :meth:`request`,
        and when ``deadline`` passed before this was called, whatever arrived (the caller held
        its lease too long: as a READ sent late; the link is then broken); no DATA reaches its
        sink once this returns or raises (an exception breaks the link)."""
        try:
            if deadline <= time.monotonic():  # late: as a READ not sent in time, whatever came
                self.kill()  # (its answer may still be on the way)
                return None
            self._await_or_kill(p, deadline)
            return _reply(p)
        except BaseException:  # (a signal handler's exception) its answer may still come
            self.kill()
            raise
        finally:
            with self._sink_lock:  # no DATA reaches the sink once we return (§10 rule 5)
                p.cancelled = True
            self._end(p)

    def abandon(self, p: Pending) -> None:
        """Give up a READ sent by :meth:`lease_read` without its answer (its caller raised): its
        answer may still come, so the link is broken, and no DATA reaches its sink.  A READ
        already ended (by :meth:`finish_read`) is left alone."""
        with self._lock:
            if self._pending.get(p.req) is not p:
                return
        self.kill()
        with self._sink_lock:
            p.cancelled = True
        self._end(p)

    def read_small(self, cache_id: int, tensor: int, off: int, stage: Stage,
                   deadline: float) -> int | None:
        """One LEASE_READ of ``stage.size`` bytes at ``off`` of tensor ``tensor`` of the peer's
        cache ``cache_id``, landing in ``stage``: the status DONE carried, or None as for
        :meth:`request`.  The caller leading the receive side takes its own DATA and DONE
        through the compiled :meth:`~.rx.Rx.small_reply`; anything else on the connection goes
        through :meth:`_frame` as always.  When the connection is free (nobody sending, nobody
        reading) the caller takes the lead as it registers the request, before sending it.  No
        DATA reaches ``stage`` once this returns (``stage`` is full when DONE arrives; more
        DATA breaks the protocol)."""
        if self.dead.is_set():
            return None
        lead = False
        if self.send_lock.acquire(False):  # the common case: one lock section, then send
            try:
                with self._lock:
                    self._req_ids = req = (self._req_ids + 1) & 0xFFFFFFFF
                    p = Pending(req, deadline, stage)
                    self._pending[req] = p
                    self._active += 1
                    if self._bg == ARMED:
                        self._bg_quiet_locked()
                    if self._leader is None and self._started:  # reading may begin
                        self._leader = p
                        lead = True
                guard = self._guard
                if guard.armed_until is None or guard.armed_until > deadline:
                    guard.arm(deadline)
                try:
                    if self._tail is not None:
                        self._flush_tail()
                    self.sock.sendall(_LEASE_READ_1.pack(
                        MAGIC, PROTOCOL_VERSION, F_LEASE_READ, req, _ONE_RUN_LEN, cache_id, 1,
                        1, tensor, off, stage.size))
                except OSError:
                    self.kill()
                    self._end(p, lead)
                    return None
            finally:
                self._release_send()
        else:
            q = self._submit(F_LEASE_READ, encode_one_run(cache_id, tensor, off, stage.size),
                             deadline, stage, None)
            if q is None:
                return None
            p = q
        try:
            if lead:  # as _lead, for this request's own answer
                rx = self.rx
                try:
                    while not p.done:
                        if self._rxs is not None:  # a frame left half-read comes first
                            self._frame()
                            continue
                        status = rx.small_reply(req, stage)
                        if status >= 0:
                            p.reply = status
                            p.done = True
                            break
                        self._frame()  # something else came first
                except BaseException as exc:
                    if rx.interrupted:  # a signal handler's exception: the caller's (abandoned)
                        self.kill()
                        raise
                    self._fail(exc)
                    if not isinstance(exc, Exception):
                        raise
            else:
                self._await_or_kill(p, deadline)
            if p.failed or not p.done:
                with self._sink_lock:
                    p.cancelled = True
                return None
            reply = p.reply
            if isinstance(reply, int):
                return reply
            if reply is None or len(reply) != 4:  # a malformed DONE: the link is broken
                self.kill()
                return None
            return int.from_bytes(reply, "little")
        finally:
            self._end(p, lead)

    def _end(self, p: Pending, lead: bool = False) -> None:
        """A request ends: no longer pending (and :meth:`_unlead`, in the same lock section, for
        a caller that took the lead as it registered the request)."""
        with self._lock:
            if lead:
                self._leader = None
                if self._waiters:
                    self._rx_cv.notify_all()
            self._pending.pop(p.req, None)
            self._active -= 1
            self._last_active = time.monotonic()
            self._bg_poke_locked()

    def _submit(self, ftype: int, payload: bytes, deadline: float, sink: Sink | None,
                data: Layout | None) -> Pending | None:
        """Register a request and send it (and its WRITE data); None when it was not sent."""
        if self.dead.is_set():
            return None
        with self._lock:
            self._req_ids = req = (self._req_ids + 1) & 0xFFFFFFFF
            p = Pending(req, deadline, sink)
            self._pending[req] = p
            self._active += 1
            if self._bg == ARMED:
                self._bg_quiet_locked()
        guard = self._guard
        if guard.armed_until is None or guard.armed_until > deadline:  # else no lock needed
            guard.arm(deadline)
        sent = False
        try:
            if not self.send_lock.acquire(False):
                left = deadline - time.monotonic()
                if left <= 0 or not self.send_lock.acquire(timeout=left):
                    return None
            try:
                self._flush_tail()
                self.sock.sendall(frame(ftype, req, payload))
                if data is not None:
                    send_stream(self.sock, req, data)
            except OSError:
                self.kill()
                return None
            finally:
                self._release_send()
            sent = True
            return p
        finally:
            if not sent:
                self._end(p)

    def _await_or_kill(self, p: Pending, deadline: float) -> None:
        """Wait for ``p``'s reply; a silent peer past ``deadline`` breaks the link (so that
        nothing it sends later touches our memory)."""
        if not self._await(p, deadline):
            self.kill()

    def _waiting(self) -> list[float]:
        """The deadlines of the requests still waiting (for the guard)."""
        with self._lock:
            return [p.deadline for p in self._pending.values() if not p.done]

    def _await(self, p: Pending, deadline: float) -> bool:
        """Wait for ``p``'s reply, leading the receive side when nobody does; False when the
        deadline passed first."""
        if not self._running.is_set():  # an acceptor's handle used before its handshake ended
            self._running.wait(max(deadline - time.monotonic(), 0.0))
        with self._lock:
            while not p.done:
                if self._leader is None:
                    self._leader = p
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._waiters += 1
                try:
                    self._rx_cv.wait(left)
                finally:
                    self._waiters -= 1
            else:
                return True
        return self._lead(p)

    def _lead(self, p: Pending) -> bool:
        """Read frames as the leader until ``p``'s reply is in (or the connection fails)."""
        try:
            sink = p.sink
            if type(sink) is Stage:  # a small READ: its own DATA and DONE in compiled code
                rx = self.rx
                while not p.done:
                    if self._rxs is not None:  # a frame left half-read comes first
                        self._frame()
                        continue
                    status = rx.small_reply(p.req, sink)
                    if status >= 0:
                        p.reply = status
                        p.done = True
                        break
                    self._frame()  # something else came first
            while not p.done:
                self._frame()
        except BaseException as exc:
            if self.rx.interrupted:  # a signal handler's exception: the caller's (it abandons
                self.kill()  # its request mid-answer: the link cannot be read on)
                raise
            self._fail(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._unlead()
        return True
