"""The acceptor's lease table for its next same-host link, made ahead.

Every link the acceptor serves over the same-host path needs a lease table of the caches the link
reply announces (:class:`~.samehost_path.ServedTable`: a sealed memfd, its mapping, the records of
the shareable memory), made on the handshake worker's thread just before the reply, while the
initiator waits.  After a link's reply is out (and while the initiator proves itself), the worker
makes one table for the owner's *next* link from the caches that link serves; the next link takes
it when it serves exactly those caches (the same entries, in the same order), else it is closed and a table
is made as before.  A table made ahead is never attached to a reader until a link takes it: its
slots are revoked then for caches unregistered meanwhile, as for any table
(:meth:`~.samehost_path.ServedTable.attach`).

Bound: at most one table made ahead per serving instance (its memfd, mapping and records memfd),
closed when the instance's listener closes (:func:`drop`, finalize) or when a link finds it stale.
A forked child forgets the parent's (its mapping is the parent's table too: closing it there
would revoke it in the parent).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from .protocol import LinkOwner, ServedCache
from .samehost_path import ServedTable

logger = logging.getLogger(__name__)

__all__ = ["make", "take", "drop", "held"]

_lock = threading.Lock()
_ahead: dict[int, tuple[weakref.ReferenceType[Any], ServedTable]] = {}  # by id(owner)


def held() -> int:
    """Tables made ahead and not taken yet (diagnostics, tests)."""
    with _lock:
        return len(_ahead)


def make(owner: LinkOwner, entries: Mapping[int, ServedCache]) -> None:
    """Make the table of ``owner``'s next link now, for the caches ``entries`` (those the link
    just made serves: the next one most likely serves the same), unless one is waiting already
    (off a link's path: after its reply).  Nothing for an instance that is not initialized."""
    key = id(owner)
    with _lock:
        got = _ahead.get(key)
        if got is not None and got[0]() is owner:
            return
    if not owner.initialized:
        return
    table = ServedTable(entries)
    table.announce()
    with _lock:
        old = _ahead.get(key)
        _ahead[key] = (weakref.ref(owner), table)
    if old is not None:
        old[1].close()
    if not owner.initialized:  # finalized meanwhile: its listener's drop() may have run already
        drop(key)


def take(owner: LinkOwner, entries: Mapping[int, ServedCache]) -> ServedTable | None:
    """The table made ahead for ``owner`` when it serves exactly ``entries`` (then it is the
    caller's), else None (a stale one is closed)."""
    with _lock:
        got = _ahead.pop(id(owner), None)
    if got is None:
        return None
    ref, table = got
    want = list(entries.values())
    if (ref() is owner and len(table.entries) == len(want)
            and all(a is b for a, b in zip(table.entries, want))):
        return table
    table.close()  # (never attached: no wait)
    return None


def drop(owner_id: int) -> None:
    """Close the table made ahead for the instance ``owner_id`` (its listener closed)."""
    with _lock:
        got = _ahead.pop(owner_id, None)
    if got is not None:
        got[1].close()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _ahead.clear()  # the parent's: never closed (revoked) from here, the memfd is shared


os.register_at_fork(after_in_child=_after_fork_in_child)
