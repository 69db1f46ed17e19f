"""Which connections each local instance has (finalize closes them; a dead one leaves)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .protocol import LinkOwner

if TYPE_CHECKING:
    from .channel import Channel

__all__ = ["add_endpoint", "discard_endpoint", "take_endpoint", "close_channels",
           "close_endpoint"]


_lock = threading.Lock()
_endpoints: weakref.WeakKeyDictionary[LinkOwner, set[Channel]] = weakref.WeakKeyDictionary()


def add_endpoint(owner: LinkOwner, chan: Channel) -> None:
    with _lock:
        _endpoints.setdefault(owner, set()).add(chan)


def discard_endpoint(owner: LinkOwner, chan: Channel) -> None:
    with _lock:
        chans = _endpoints.get(owner)
        if chans is not None:
            chans.discard(chan)


def take_endpoint(owner: LinkOwner) -> list[Channel]:
    """Finalize, first half: the connections of ``owner`` (to close once its caches are retired;
    until then they keep serving lease releases)."""
    with _lock:
        return list(_endpoints.pop(owner, ()))


def close_channels(chans: Sequence[Channel]) -> None:
    """Finalize, second half: tell every connected peer (GOODBYE) and close the connections."""
    for chan in chans:
        chan.close(goodbye=True)


def close_endpoint(owner: LinkOwner) -> None:
    """GOODBYE to every peer connected to ``owner`` and close those connections."""
    close_channels(take_endpoint(owner))
