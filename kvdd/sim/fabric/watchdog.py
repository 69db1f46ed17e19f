"""One daemon thread running callbacks at deadlines (lease expiry, I/O deadlines, handshakes)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["Timer", "Watchdog", "WATCHDOG"]

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

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        timer = Timer(time.monotonic() + max(delay_s, 0.0), next(self._seq), fn)
        with self._cv:
            heapq.heappush(self._heap, timer)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvdd-sim-watchdog",
                                                daemon=True)
                self._thread.start()
            if self._heap[0] is timer:  # else the thread wakes earlier anyway (no wake-up per
                self._cv.notify()       # request: most timers are cancelled long before)
        return timer

    @staticmethod
    def cancel(timer: Timer | None) -> None:
        if timer is not None:
            timer.alive = False

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._heap and not self._heap[0].alive:
                    heapq.heappop(self._heap)
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


WATCHDOG = Watchdog()


