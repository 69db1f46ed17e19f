"""Teardown of simulated instances that became unreachable without ``finalize()`` (SEMANTICS.md §3.1).

Upstream's destructor tears a still-initialized instance down as Finalize does.  A Python object
has no destructor that may block or take locks safely: the last reference can go in any thread, at
any point (a garbage collection may run while that thread holds a lock the teardown needs).  So a
dropped instance is handled in two parts:

* at once, in the thread that dropped it, only steps that take no lock: its listening sockets stop
  accepting (a fresh connection to its port is refused from then on) and it refuses new links;
* then a single daemon thread (:func:`submit`) runs the full teardown (``destroy()``: Finalize,
  and the port a failed Initialize left bound) and lets the object go.

The fabric holds instances only through weak references (its listeners, registries, connections
and peer handles), so nothing but the user's own references keeps an instance alive.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Protocol

__all__ = ["Destroyable", "submit", "start"]

logger = logging.getLogger(__name__)


class Destroyable(Protocol):
    """What the reaper calls on a dropped instance."""

    def destroy(self) -> None:
        """Tear down as upstream's destructor does (never raises for a status)."""
        ...


# SimpleQueue.put is reentrant: safe from __del__ and weakref callbacks (queue module docs)
_pending: queue.SimpleQueue[Destroyable] = queue.SimpleQueue()
_start_lock = threading.Lock()
_thread: threading.Thread | None = None


def _run() -> None:
    while True:
        item = _pending.get()
        try:
            item.destroy()
        except Exception:  # a bug: log it; the next dropped instance is still torn down
            logger.exception("kvdd sim: tearing down a dropped instance failed")
        del item  # the last reference: the object is freed here


def start() -> None:
    """Start the reaper thread (idempotent).  Called when an instance is constructed, never from a
    finalizer (starting a thread takes locks)."""
    global _thread
    if _thread is not None:
        return
    with _start_lock:
        if _thread is None:
            thread = threading.Thread(target=_run, name="kvdd-sim-reaper", daemon=True)
            thread.start()
            _thread = thread


def _after_fork_in_child() -> None:
    # the thread did not survive the fork: the child starts its own (and drops the parent's queue,
    # whose instances belong to the parent)
    global _pending, _start_lock, _thread
    _pending = queue.SimpleQueue()
    _start_lock = threading.Lock()
    _thread = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def submit(instance: Destroyable) -> None:
    """Queue ``instance`` for :meth:`Destroyable.destroy` on the reaper thread (lock-free; safe in
    ``__del__``)."""
    if _thread is None:  # a forked child that has not constructed an instance yet
        return
    _pending.put(instance)
