"""Handshake extensions: named, bounded blobs in the authenticated hello and its reply.

A module (e.g. the same-host data path, ``samehost*.py``) registers an extension once::

    register_extension("samehost", offer, accept)

* ``offer(session, owner) -> bytes | None`` — what this side puts into its hello (initiator, before
  the peer's cluster id is known: ``session.peer_cluster_id == 0``) or into its reply (acceptor);
  None leaves the entry out;
* ``accept(session, value) -> object | None`` — called with the peer's entry (after mutual
  authentication; ``session`` complete).  A result that implements
  :class:`~kvdd.sim.fabric.protocol.DataPath` replaces the TCP data path of this link's handle on
  that peer (the first such result wins); None keeps TCP.

A hello carries at most ``MAX_EXTENSIONS`` entries of at most ``MAX_EXTENSION_BYTES`` in all;
anything larger is refused.  A callback that raises is logged and treated as None.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .auth import Session
from .protocol import LinkOwner
from .wire import MAX_EXTENSION_BYTES, MAX_EXTENSIONS

logger = logging.getLogger(__name__)

__all__ = ["Extension", "register_extension", "unregister_extension", "offer_extensions",
           "accept_extensions"]

Offer = Callable[[Session, LinkOwner], "bytes | None"]
Accept = Callable[[Session, bytes], object]


@dataclass(frozen=True)
class Extension:
    name: str
    offer: Offer
    accept: Accept


_lock = threading.Lock()
_registry: dict[str, Extension] = {}


def register_extension(name: str, offer: Offer, accept: Accept) -> None:
    """Register (or replace) the extension ``name`` for every later handshake of this process."""
    if not name or len(name.encode()) > 64:
        raise ValueError("an extension name is 1..64 bytes")
    with _lock:
        if name not in _registry and len(_registry) >= MAX_EXTENSIONS:
            raise ValueError(f"at most {MAX_EXTENSIONS} extensions")
        _registry[name] = Extension(name, offer, accept)


def unregister_extension(name: str) -> None:
    with _lock:
        _registry.pop(name, None)


def offer_extensions(session: Session, owner: LinkOwner) -> dict[str, bytes]:
    """This side's entries for a hello or reply (within the bounds; extras are dropped, logged)."""
    with _lock:
        exts = list(_registry.values())
    out: dict[str, bytes] = {}
    total = 0
    for ext in exts:
        try:
            value = ext.offer(session, owner)
        except Exception:
            logger.exception("kvdd fabric: extension %r failed to offer", ext.name)
            continue
        if value is None:
            continue
        total += len(ext.name.encode()) + len(value)
        if total > MAX_EXTENSION_BYTES:
            logger.warning("kvdd fabric: extension %r left out: hello extensions exceed %d bytes",
                           ext.name, MAX_EXTENSION_BYTES)
            continue
        out[ext.name] = bytes(value)
    return out


def accept_extensions(session: Session, values: dict[str, bytes]) -> dict[str, object]:
    """The accepted results of the peer's entries, by name (unknown names are ignored)."""
    with _lock:
        exts = {name: _registry.get(name) for name in values}
    out: dict[str, object] = {}
    for name, value in values.items():
        ext = exts.get(name)
        if ext is None:
            continue
        try:
            result = ext.accept(session, value)
        except Exception:
            logger.exception("kvdd fabric: extension %r failed to accept the peer's offer", name)
            continue
        if result is not None:
            out[name] = result
    return out
