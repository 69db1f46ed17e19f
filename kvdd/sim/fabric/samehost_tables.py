"""The owner tables this process serves to proven same-host readers, kept bounded per reader.

A table (:class:`~.samehost_path.ServedTable`) is kept from its attachment (the reader proven)
until its link's data path closes it, or its reader process exits.  Per reader process:

* at most ``MAX_TABLES_PER_READER`` tables serve (older links of that reader then use TCP for
  their reads of us): the oldest beyond is *evicted*, which revokes it at once (no new copy
  starts) and never waits on the thread that links (a link call, a handshake worker): the table
  stays attached, so an unregister of one of its caches still waits for a copy the reader counts
  (bounded, once), and nothing moves once that unregister returned;
* an evicted table (or one revoked after a failed proof) is closed without a wait as soon as a
  sweep sees it idle (no count left after the revocation: :meth:`~.ServedTable.close_if_idle`),
  or its reader exited;
* at most ``MAX_EVICTED_PER_READER`` evicted tables still counted wait so; while a reader holds
  that many, a new link of that reader is not served a table (the table, never attached, is
  closed without a wait: the reader's reads of us on that link use TCP).

So one reader process holds at most ``MAX_TABLES_PER_READER + MAX_EVICTED_PER_READER`` tables
here, each with its memory (64 bytes per cache served, plus a header), a pidfd and at most one
memory-announcement memfd.  Sweeps run whenever a link is proven here.  A forked child forgets
the parent's tables (their mappings are the parent's tables too: an eviction or close there
would revoke them in the parent).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter

from .samehost import SameHostLink
from .samehost_path import ServedTable

logger = logging.getLogger(__name__)

__all__ = ["MAX_TABLES_PER_READER", "MAX_EVICTED_PER_READER", "serve", "sweep", "live_tables",
           "evicted_tables"]

MAX_TABLES_PER_READER = 64  # tables serving one reader process (older links use TCP)
MAX_EVICTED_PER_READER = 64  # evicted tables of one reader still counted (newer links: TCP)

_lock = threading.Lock()
_tables: list[ServedTable] = []  # attached to proven readers and serving, oldest first
_evicted: list[ServedTable] = []  # evicted (revoked), still counted by their reader


def live_tables() -> int:
    """Owner tables held now (serving and evicted; they go when idle or their reader exits)."""
    with _lock:
        return len(_tables) + len(_evicted)


def evicted_tables() -> int:
    """Evicted tables held now because their reader still counted a copy at the last sweep."""
    with _lock:
        return len(_evicted)


def serve(table: ServedTable, link: SameHostLink, peer_wait_ms: int) -> bool:
    """Attach ``table`` to the proven reader of ``link`` and keep it; False (the table closed,
    never attached, so without a wait) while that reader holds ``MAX_EVICTED_PER_READER``
    evicted tables still counted."""
    sweep()
    with _lock:  # (the count and the append together: concurrent links of one reader)
        full = sum(t.reader_pid == link.peer_pid for t in _evicted) >= MAX_EVICTED_PER_READER
        if not full:
            table.attach(link, peer_wait_ms)
            _tables.append(table)
    if full:
        logger.warning("kvdd same-host: reader pid %d holds %d evicted lease tables still counted; "
                       "its new link reads us over TCP", link.peer_pid, MAX_EVICTED_PER_READER)
        table.close()
        return False
    sweep()
    return True


def sweep() -> None:
    """Drop the tables of readers that exited; evict the oldest of a reader beyond
    ``MAX_TABLES_PER_READER`` (revoked at once, kept until idle); close the revoked tables seen
    idle.  Never waits for a reader's copy."""
    with _lock:
        gone = [t for t in (*_tables, *_evicted) if t.closed or t.reader_gone]
        for t in gone:
            (_tables if t in _tables else _evicted).remove(t)
        per: Counter[int] = Counter()
        evict = []
        for t in reversed(_tables):
            per[t.reader_pid] += 1
            if per[t.reader_pid] > MAX_TABLES_PER_READER:
                evict.append(t)
        for t in evict:
            _tables.remove(t)
            _evicted.append(t)
        revoked = [t for t in (*_tables, *_evicted) if t.revoked or t in evict]
    for t in gone:  # (no wait: closed already, or its reader exited)
        t.close()
    idle = [t for t in revoked if t.close_if_idle()]  # revokes first (the evicted ones: now)
    if idle:
        with _lock:
            for t in idle:
                if t in _tables:
                    _tables.remove(t)
                elif t in _evicted:
                    _evicted.remove(t)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _tables.clear()  # the parent's: never evicted or closed (revoked) from here
    _evicted.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
