"""One daemon thread running callbacks at deadlines (lease expiry, I/O deadlines, handshakes)."""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["Timer", "Watchdog", "WATCHDOG", "DeadlineGuard"]

class Timer:
    __slots__ = ("deadline", "seq", "fn", "alive")

    def __init__(self, deadline: float, seq: int, fn: Callable[[], None]) -> None:
        self.deadline = deadline
        self.seq = seq
        self.fn = fn
        self.alive = True

    def __lt__(self, other: Timer) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class Watchdog:
    """One daemon thread running callbacks at deadlines (lease expiry, I/O deadlines)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._heap: list[Timer] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._cancelled = 0  # timers cancelled since the heap was last compacted (approximate)

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        timer = Timer(time.monotonic() + max(delay_s, 0.0), next(self._seq), fn)
        with self._cv:
            if self._cancelled > 1024 and 2 * self._cancelled > len(self._heap):
                # most timers are cancelled long before their deadline: drop them now rather
                # than when they reach the top (memory, and the collector's work)
                self._heap = [t for t in self._heap if t.alive]
                heapq.heapify(self._heap)
                self._cancelled = 0
            heapq.heappush(self._heap, timer)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvdd-sim-watchdog",
                                                daemon=True)
                self._thread.start()
            if self._heap[0] is timer:  # else the thread wakes earlier anyway (no wake-up per
                self._cv.notify()       # request: most timers are cancelled long before)
        return timer

    def cancel(self, timer: Timer | None) -> None:
        if timer is not None and timer.alive:
            timer.alive = False
            self._cancelled += 1

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._heap and not self._heap[0].alive:
                    heapq.heappop(self._heap)
                    self._cancelled = max(0, self._cancelled - 1)
                if not self._heap:
                    self._cv.wait(5.0)
                    continue
                delay = self._heap[0].deadline - time.monotonic()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                timer = heapq.heappop(self._heap)
            if timer.alive:
                timer.alive = False
                try:
                    timer.fn()
                except Exception:  # a callback must never stop the watchdog
                    logger.exception("kvdd fabric: a deadline callback failed")


    def after_fork_in_child(self) -> None:
        """A forked child starts with no timers: the inherited ones are its parent's (they would
        act on connections the child only shares), and so is the lock's state."""
        self._cv = threading.Condition(threading.Lock())
        self._heap = []
        self._thread = None
        self._cancelled = 0


WATCHDOG = Watchdog()
os.register_at_fork(after_in_child=WATCHDOG.after_fork_in_child)




class DeadlineGuard:
    """One timer for the deadlines of many requests: ``on_late()`` runs when one of the
    deadlines ``waiting()`` returns has passed.  A request that ends before the earliest armed
    deadline costs no timer (sequential calls with similar deadlines arm one now and then)."""

    def __init__(self, waiting: Callable[[], list[float]], on_late: Callable[[], None]) -> None:
        self._waiting = waiting
        self._on_late = on_late
        self._lock = threading.Lock()
        self._timer: Timer | None = None
        #: The deadline a check is armed for (None: none); a caller whose deadline is no earlier
        #: may skip :meth:`arm` (it registered its deadline with ``waiting`` before).  Written
        #: under the guard's lock only.
        self.armed_until: float | None = None

    def arm(self, deadline: float) -> None:
        """Make sure a check runs no later than ``deadline``."""
        with self._lock:
            if self.armed_until is not None and self.armed_until <= deadline:
                return
            WATCHDOG.cancel(self._timer)
            self.armed_until = deadline
            self._timer = WATCHDOG.schedule(deadline - time.monotonic(), self._fire)

    def _fire(self) -> None:
        with self._lock:
            self.armed_until = None
        waiting = self._waiting()
        now = time.monotonic()
        if any(d <= now for d in waiting):
            self._on_late()
        elif waiting:
            self.arm(min(waiting))
