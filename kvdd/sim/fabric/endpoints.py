"""Which connections each local instance has (finalize, or the teardown of a dropped instance,
closes them)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .protocol import LinkOwner

if TYPE_CHECKING:
    from .channel import Channel

__all__ = ["add_endpoint", "discard_endpoint", "take_endpoint", "close_channels",
           "close_endpoint"]


_lock = threading.Lock()
# by id() of the instance, not a weak key: a cycle's collector clears weak references before the
# instance's __del__ runs its teardown, which must still find its connections here (SEMANTICS.md
# §3.1, kvdd.sim.reaper); the connections hold their instance only weakly
_endpoints: dict[int, set[Channel]] = {}
_key_of: dict[Channel, int] = {}


def _after_fork_in_child() -> None:
    # a thread of the parent may have held the lock at the fork; the tables are kept (a
    # child's close of an inherited connection does nothing: Channel.kill / close)
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def add_endpoint(owner: LinkOwner, chan: Channel) -> None:
    with _lock:
        key = id(owner)
        _endpoints.setdefault(key, set()).add(chan)
        _key_of[chan] = key


def discard_endpoint(owner: LinkOwner | None, chan: Channel) -> None:
    """``chan`` ended (``owner`` may already be gone: the connection knows whose it is)."""
    with _lock:
        key = _key_of.pop(chan, None)
        chans = None if key is None else _endpoints.get(key)
        if key is not None and chans is not None:
            chans.discard(chan)
            if not chans:
                del _endpoints[key]


def take_endpoint(owner: LinkOwner) -> list[Channel]:
    """Finalize, first half: the connections of ``owner`` (to close once its caches are retired;
    until then they keep serving lease releases)."""
    with _lock:
        chans = list(_endpoints.pop(id(owner), ()))
        for chan in chans:
            _key_of.pop(chan, None)
        return chans


def close_channels(chans: Sequence[Channel]) -> None:
    """Finalize, second half: tell every connected peer (GOODBYE) and close the connections."""
    for chan in chans:
        chan.close(goodbye=True)


def close_endpoint(owner: LinkOwner) -> None:
    """GOODBYE to every peer connected to ``owner`` and close those connections."""
    close_channels(take_endpoint(owner))
