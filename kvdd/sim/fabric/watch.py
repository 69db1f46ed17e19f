"""A link's receiving while no caller reads it: watched by the reactor, led by a pool thread.

The pool's side of :class:`~.channel.Channel` (a mixin: the state it names is the channel's own,
one object, one lock).  Callers lead the connection's receive side while they are active (see
:mod:`~.channel`); once none was active for :data:`IDLE_S` (a look is scheduled on the watchdog
when the last one ends) the socket is armed in the reactor (:mod:`~.reactor`), and when bytes
arrive a pool thread leads: it handles the frames that are all there, serves a one-run LEASE_READ
in compiled code, and leaves a frame whose bytes have not all arrived half-read (``_rxs``, a
:data:`~.rx.Steps`) for the next leader, a caller (blocking, on its own thread) or the pool again
when more arrives.  It stops leading as soon as a caller waits (that caller leads on), and after
:data:`_FRAMES_SHARE` frames queues itself behind the other connections' work.  A leader that
leaves bytes in the buffer hands them to the pool at once.

States of the pool's side (``_bg``, under the channel lock): *parked* (not watched: callers lead,
or a look is scheduled), *armed* (the reactor notifies each arrival of bytes), *queued* (a pool
task runs or will; bytes arriving meanwhile make it look once more before it is armed again).  A
caller that begins a request parks an armed connection (its reply would only wake a pool thread),
so the reactor is told of a change once per burst of calls, not per call; while callers keep the
connection busy, the look after the last one backs off from :data:`IDLE_S` to :data:`IDLE_MAX_S`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import fcntl
import socket
import termios
import threading
import time
from collections.abc import Mapping

from ...status import PARAM_INVALID
from ..faults import injections as _injections
from .protocol import ServedCache
from .reactor import HUP, IN, Reactor
from .rx import Rx, Steps
from .watchdog import WATCHDOG
from .wire import HDR, SMALL_BYTES

__all__ = ["Watch", "IDLE_S", "IDLE_MAX_S", "ARMED"]

IDLE_S = 0.001  # the pool leads once no caller was active for this long (seconds)
IDLE_MAX_S = 0.008  # the longest between two looks while callers keep the socket busy (seconds)
_POOL = object()  # the leader token of a pool thread
_PARKED, ARMED, _QUEUED = 0, 1, 2  # the pool's side: left to callers / watched / on the pool
_ARMED = ARMED
_FRAMES_SHARE = 64  # frames a pool task handles before it queues itself behind the others
_ONE_RUN_FRAME = HDR.size + 36  # a one-run LEASE_READ frame, served in compiled code
_FIONREAD = termios.FIONREAD
_INT0 = bytes(4)


def _inq(sock: socket.socket) -> int:
    """Bytes readable from ``sock`` now (FIONREAD)."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), _FIONREAD, _INT0), "little")


class Watch:
    """The pool's side of receiving (a mixin of :class:`~.channel.Channel`: see the module)."""

    sock: socket.socket
    rx: Rx
    served: Mapping[int, ServedCache]
    dead: threading.Event
    _lock: threading.Lock
    _rx_cv: threading.Condition
    _leader: object | None
    _waiters: int
    _active: int
    _last_active: float
    _started: bool
    _reactor: Reactor
    _fd: int

    if TYPE_CHECKING:  # defined by Channel and the other mixins
        def _here(self) -> bool: ...
        def _frame_steps(self) -> Steps[None]: ...
        def _answer(self, req: int, data: bytes) -> None: ...
        def _fail(self, exc: BaseException) -> None: ...
        def _grant_resolving_owner(self, _owner: object, served: Mapping[int, ServedCache],
                                   cache_id: int) -> tuple[int, ServedCache | None]: ...

    def _watch_init(self) -> None:
        self._rxs: Steps[None] | None = None  # a frame half-read by a pool thread (the leader's)
        self._rx_need = 0  # the bytes it waits for
        self._bg = _PARKED  # the pool's side of receiving (under _lock)
        self._bg_timer = False  # a look after IDLE_S is scheduled
        self._bg_wait = IDLE_S  # the next look's delay (doubles while callers stay busy)
        self._hup = False  # the reactor saw the connection's end (or an error)
        self._bg_in = False  # the reactor notifies this connection's arrivals (armed, or queued)
        self._bg_again = False  # bytes arrived while a pool task led: it looks once more

    def _bg_set_locked(self, state: int) -> None:
        """Parked (not watched) or armed (watched): the reactor is told only of a change."""
        self._bg = state
        if state == _ARMED and not self._bg_in:
            self._bg_in = True
            self._reactor.arm(self._fd, self, IN)
        elif state == _PARKED and self._bg_in:
            self._bg_in = False
            self._reactor.disarm(self._fd, self, IN)

    def _bg_quiet_locked(self) -> None:
        """A caller begins a request: it reads its own reply, so the socket is no longer watched
        (its reply would only wake a pool thread for nothing) (the lock held)."""
        if self._bg == _ARMED:
            self._bg_set_locked(_PARKED)

    def _bg_find_end(self) -> None:
        """The connection was aborted: whoever reads next finds its end (a pool thread, when
        nobody reads)."""
        with self._lock:
            if self._bg == _PARKED and not self.dead.is_set() and self._here():
                self._bg_set_locked(_ARMED)

    def _unlead(self) -> None:
        with self._lock:
            self._leader = None
            if self._waiters:
                self._rx_cv.notify_all()
            self._bg_poke_locked()

    def _bg_wants(self) -> bool:
        """Whether the pool may lead now (the channel lock held)."""
        return self._leader is None and not self._waiters and bool(
            self.rx.buffered or self._hup or not self._active
            and time.monotonic() - self._last_active >= IDLE_S)

    def _bg_poke_locked(self) -> None:
        """Nobody may lead now: the pool's side looks again when it may (the lock held; a caller
        calls it as it stops leading or ends a request)."""
        if (self._bg == _QUEUED or not self._started or self._leader is not None
                or self._waiters or self.dead.is_set() or not self._here()):
            return
        if self.rx.buffered:  # a leader left bytes behind (the socket may have none): at once
            self._bg = _QUEUED
            self._reactor.submit(self._bg_run)
        elif self._bg == _PARKED and not self._active:
            idle = time.monotonic() - self._last_active
            if idle >= IDLE_S:
                self._bg_wait = IDLE_S
                self._bg_set_locked(_ARMED)
            elif not self._bg_timer:
                self._bg_timer = True
                WATCHDOG.schedule(max(IDLE_S - idle, self._bg_wait), self._bg_on_timer)

    def _bg_on_timer(self) -> None:
        with self._lock:
            self._bg_timer = False
            # callers keep the connection busy: look less often (up to IDLE_MAX_S)
            self._bg_wait = min(self._bg_wait * 2, IDLE_MAX_S)
            self._bg_poke_locked()

    def on_readable(self, events: int) -> None:
        """The socket has bytes (or ended): the reactor's notification, on a pool thread."""
        if events & HUP:
            self._hup = True
        self._bg_run(True)

    def _bg_run(self, armed: bool = False) -> None:
        """A pool thread leads while it may and the bytes are there (never waiting for more)."""
        with self._lock:
            if armed:  # a notification: bytes arrived
                if self._bg == _QUEUED:  # while a task leads: it looks once more
                    self._bg_again = True
                    return
                if self._bg != _ARMED:  # a late one (parked meanwhile): callers read
                    return
                self._bg = _QUEUED
            if self.dead.is_set():
                self._bg = _PARKED
                return
            if not self._bg_wants():
                self._bg_set_locked(_PARKED)
                self._bg_poke_locked()  # (a look after IDLE_S, when that is what it waits for)
                return
            self._leader = _POOL
            self._bg_again = False
        more = False
        try:
            more = self._bg_lead()
        except BaseException as exc:
            with self._lock:
                self._leader = None
                self._bg = _PARKED
                if self._waiters:
                    self._rx_cv.notify_all()
            self._fail(exc)
            return
        with self._lock:
            self._leader = None
            if self._waiters:
                self._rx_cv.notify_all()
            if self.dead.is_set():
                self._bg = _PARKED
                return
            wants = self._bg_wants()
            if (more or self._bg_again) and wants:  # (others' turn first)
                self._bg_again = False
                self._bg = _QUEUED
                self._reactor.submit_after(self._bg_run)
            elif wants or self._rxs is not None:  # wait for the bytes
                self._bg_set_locked(_ARMED)
            else:
                self._bg_set_locked(_PARKED)
                self._bg_poke_locked()

    def _bg_lead(self) -> bool:
        """Handle the frames that have arrived (a share of them): True when more may be there."""
        rx = self.rx
        steps_left = 4 * _FRAMES_SHARE  # reads within frames (a request's DATA) count too
        for _ in range(_FRAMES_SHARE):
            steps = self._rxs
            if steps is None:
                avail = rx.buffered
                if avail < _ONE_RUN_FRAME:
                    avail += _inq(self.sock)
                if avail == 0:
                    if self._hup:
                        self._at_end()
                    return False
                if avail >= _ONE_RUN_FRAME and not _injections.armed:
                    got = rx.serve_lease_read(self._grant_resolving_owner, None, self.served,
                                              SMALL_BYTES, PARAM_INVALID)
                    if got is not None:  # a one-run LEASE_READ, served in compiled code
                        self._answer(*got)
                        if not self._bg_goes_on():
                            return False
                        continue
                steps = self._frame_steps()
                need = next(steps)
            else:
                self._rxs = None
                need = self._rx_need
            while True:
                avail = rx.buffered
                if avail < need:
                    avail += _inq(self.sock)
                    if avail < need:  # the rest has not arrived: the next leader finishes it
                        self._rxs, self._rx_need = steps, need
                        if self._hup:
                            self._at_end()
                        return False
                if steps_left <= 0:  # others' turn: the next task goes on with this frame
                    self._rxs, self._rx_need = steps, need
                    return True
                steps_left -= 1
                try:
                    need = steps.send(avail)
                except StopIteration:
                    break
            if not self._bg_goes_on():
                return False
        return True

    def _bg_goes_on(self) -> bool:
        """Whether the pool keeps leading after a frame (read without the lock: a caller arriving
        meanwhile finds its reply read by this leader, as when it arrives just after)."""
        return not (self._waiters or self.dead.is_set()) and bool(
            self.rx.buffered or self._hup or not self._active
            and time.monotonic() - self._last_active >= IDLE_S)

    def _at_end(self) -> None:
        """Nothing more to read now: ConnectionError when the connection ended (else None)."""
        if not self._hup:
            return
        try:
            got = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            self._hup = False  # (a stale notification)
            return
        raise ConnectionError(f"connection closed by the peer ({len(got)} byte(s) of a frame left)"
                              if got else "connection closed by the peer")
