"""The fabric's shared threads: one readiness poller and a fixed pool serving every link.

A link's connection (:class:`~.channel.Channel`) has no thread of its own.  Its socket is
watched here while nobody else reads it, and the work it has (frames the peer sent, answers to
send) runs as short tasks on a pool of :data:`POOL_THREADS` threads shared by every connection of
the process: the number of fabric threads does not grow with the number of links.

*Readiness.*  :meth:`Reactor.arm` asks for notifications when a socket can be read
(:data:`IN`: each time bytes arrive, ``epoll`` edge-triggered, until :meth:`Reactor.disarm`) or
written (:data:`OUT`: once); the pool runs the connection's :class:`Watched` method for each.
The pool is a leader/follower pool: one of its threads waits in ``epoll``, and the thread that
wakes runs the first ready task itself (no hand-off to another thread: a peer's small request is
served by the thread that saw it arrive); an idle thread is woken only for the tasks beyond the
first, and the thread polls again once its task is done (tasks are short, below).
*Tasks never block.*  Sockets are read only as far as their bytes have arrived and written with
non-blocking sends (see :mod:`~.channel`): a slow or hostile peer costs a pool thread a few
microseconds per notification, never a wait, so it cannot stall other links' service.  A task
that has much to do (a long answer, a peer sending many frames) does a bounded share and queues
itself again behind the others (:meth:`Reactor.submit_after`: the thread that ran it takes the
next task, which is that one when nothing else waits; no other thread is woken for it).

Threads (named ``kvdd-sim-fabric-<i>``) start with the first connection and stay for the life of
the process (daemon threads, as the watchdog's); a forked child gets a new reactor of its own.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Protocol

__all__ = ["Reactor", "REACTOR", "Watched", "POOL_THREADS", "IN", "OUT", "HUP", "THREAD_PREFIX"]

logger = logging.getLogger(__name__)

POOL_THREADS = 4  # the fabric's pool threads, per process (one of them polls at a time)
THREAD_PREFIX = "kvdd-sim-fabric-"
IN = select.EPOLLIN | select.EPOLLRDHUP
OUT = select.EPOLLOUT
HUP = select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP  # the peer's end, or an error
_ET = select.EPOLLET  # IN stays armed across notifications: no system call per request


class Watched(Protocol):
    """What a watched socket's owner does when it is ready (both run on a pool thread)."""

    def on_readable(self, events: int) -> None: ...

    def on_writable(self) -> None: ...


class Reactor:
    """The poller and pool (one per process: :data:`REACTOR`)."""

    def __init__(self) -> None:
        self._init()

    def _init(self) -> None:
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._tasks: deque[Callable[[], None]] = deque()
        self._watched: dict[int, tuple[Watched, int]] = {}  # fd -> (owner, armed events)
        self._ep: select.epoll | None = None
        self._wake_r = self._wake_w = -1
        self._threads: list[threading.Thread] = []
        self._polling = False  # a pool thread waits in epoll (it must be woken for new tasks)
        self._idle = 0  # pool threads waiting for a task
        self._local = threading.local()  # ``pool``: set on the pool's own threads

    # -- registration ----------------------------------------------------------------------------
    def _start(self) -> None:
        """The epoll set, the wake-up pipe and the threads (with the lock held; once)."""
        self._ep = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ep.register(self._wake_r, select.EPOLLIN)
        for i in range(POOL_THREADS):
            t = threading.Thread(target=self._run, name=f"{THREAD_PREFIX}{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def add(self, fd: int, owner: Watched) -> None:
        """Watch ``fd`` for ``owner`` (nothing armed yet)."""
        with self._lock:
            if self._ep is None:
                self._start()
            assert self._ep is not None
            self._watched[fd] = (owner, 0)
            try:
                self._ep.register(fd, _ET)
            except FileExistsError:  # a socket closed without remove() had this number
                self._ep.modify(fd, _ET)

    def remove(self, fd: int, owner: object) -> None:
        """Stop watching ``fd`` (call before closing it); a no-op when not watched for ``owner``."""
        with self._lock:
            got = self._watched.get(fd)
            if got is None or got[0] is not owner:
                return
            del self._watched[fd]
            assert self._ep is not None
            try:
                self._ep.unregister(fd)
            except OSError:  # already closed: the kernel dropped it
                pass

    def arm(self, fd: int, owner: object, events: int) -> None:
        """Notifications when ``fd`` is ready for ``events`` (:data:`IN`: at once if it is, then
        each time bytes arrive; :data:`OUT`: once)."""
        with self._lock:
            got = self._watched.get(fd)
            if got is None or got[0] is not owner or got[1] & events == events:
                return
            armed = got[1] | events
            self._watched[fd] = (owner, armed)
            assert self._ep is not None
            try:
                self._ep.modify(fd, armed | _ET)
            except OSError as exc:  # closed under us: its owner learns it from its own I/O
                if exc.errno not in (errno.EBADF, errno.ENOENT):
                    raise

    def disarm(self, fd: int, owner: object, events: int) -> None:
        """No notification for ``events`` after all (one may be on its way: owners ignore it)."""
        with self._lock:
            got = self._watched.get(fd)
            if got is None or got[0] is not owner or not got[1] & events:
                return
            armed = got[1] & ~events
            self._watched[fd] = (owner, armed)
            assert self._ep is not None
            try:
                self._ep.modify(fd, armed | _ET)
            except OSError as exc:
                if exc.errno not in (errno.EBADF, errno.ENOENT):
                    raise

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` on a pool thread, after the tasks already queued."""
        with self._lock:
            if self._ep is None:
                self._start()
            self._tasks.append(task)
            self._wake_one()

    def submit_after(self, task: Callable[[], None]) -> None:
        """Queue ``task`` behind the others for the pool thread that calls this (a task that
        queues itself again, its share of the turn spent, or the work its frame made): that
        thread takes the next task itself once its own returns (tasks are short), so no other
        thread is woken for it; from any other thread, :meth:`submit`."""
        with self._lock:
            if self._ep is None:
                self._start()
            self._tasks.append(task)
            if not getattr(self._local, "pool", False):
                self._wake_one()

    def _wake_one(self) -> None:
        """A thread for the queued tasks: an idle one, else the poller (lock held)."""
        if self._idle:
            self._cv.notify()
        elif self._polling:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full: the poller wakes anyway
                pass

    # -- the pool --------------------------------------------------------------------------------
    def _run(self) -> None:
        ep = self._ep
        assert ep is not None
        self._local.pool = True
        while True:
            harvest = False
            with self._lock:
                while not self._tasks and self._polling:
                    self._idle += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._idle -= 1
                if self._tasks and not self._polling:  # nobody polls: look before queued work
                    self._polling = harvest = True
                    task = None
                else:
                    task = self._tasks.popleft() if self._tasks else None
                    if task is None:
                        self._polling = True
            if harvest:
                got = self._poll(ep, 0)
                with self._lock:
                    if got is not None:
                        self._tasks.append(got)
                    task = self._tasks.popleft() if self._tasks else None
                if task is None:
                    continue
            elif task is None:
                task = self._poll(ep)
                if task is None:
                    continue
            try:
                task()
            except Exception:  # a bug: log it; the thread serves on
                logger.exception("kvdd fabric: a pool task failed")
            del task

    def _poll(self, ep: select.epoll, timeout: float = -1) -> Callable[[], None] | None:
        """Wait for readiness: the first task it brings, for this thread (the rest are queued,
        and an idle thread is woken for them: for the tasks beyond the one this thread takes,
        that task or the first queued one)."""
        try:
            events = ep.poll(timeout)
        except InterruptedError:
            events = []
        except OSError:  # a bug (the set closed under it?): log it; the next poll tries again,
            logger.exception("kvdd fabric: the pool's poll failed")  # never leaving the others
            time.sleep(0.01)  # waiting on a poller that is gone
            events = []
        first: Callable[[], None] | None = None
        with self._lock:
            self._polling = False
            for fd, ev in events:
                if fd == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                got = self._watched.get(fd)
                if got is None:
                    continue  # removed meanwhile
                owner, armed = got
                if ev & (select.EPOLLIN | HUP) and armed & select.EPOLLIN:
                    task: Callable[[], None] = partial(owner.on_readable, ev)
                    if first is None:
                        first = task
                    else:
                        self._tasks.append(task)
                if ev & (select.EPOLLOUT | HUP) and armed & select.EPOLLOUT:
                    if first is None:
                        first = owner.on_writable
                    else:
                        self._tasks.append(owner.on_writable)
                    armed &= ~OUT  # once
                    self._watched[fd] = (owner, armed)
                    try:
                        ep.modify(fd, armed | _ET)
                    except OSError:
                        pass
            if len(self._tasks) + (first is not None) > 1 and self._idle:
                self._cv.notify()  # help with the rest (that thread, when no task is left, polls)
        return first

    def after_fork_in_child(self) -> None:
        """Forget the parent's poller and threads (its epoll set is shared with the parent: the
        child closes its copy); connections made in the child start a new one."""
        if self._ep is not None:
            self._ep.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._init()

    @property
    def threads(self) -> int:
        """Pool threads started (0 or :data:`POOL_THREADS`)."""
        return len(self._threads)


REACTOR = Reactor()
# the pool does not survive a fork and the epoll set is the parent's: the child starts afresh
os.register_at_fork(after_in_child=REACTOR.after_fork_in_child)
