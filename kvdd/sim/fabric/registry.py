"""The in-process registry of listening instances, keyed by ``(ip, port)`` (SEMANTICS.md §10 rule 6).

A link to an address on which an instance of this process listens is made in-process (no socket).
Instances are held weakly: the registry never keeps one alive (SEMANTICS.md §3.1); a dropped one
is simply not found."""

from __future__ import annotations

import socket
import threading
import weakref

from .protocol import LinkOwner

__all__ = ["norm_ip", "register", "unregister", "lookup_listener"]

_lock = threading.Lock()
_registry: dict[tuple[str, int], weakref.ref[LinkOwner]] = {}


def norm_ip(ip: str) -> str:
    """``ip`` in its canonical text form (unchanged when it is not an IP literal)."""
    try:
        if ":" in ip:
            return socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, ip))
        return socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, ip))
    except OSError:
        return ip


def register(ip: str, port: int, owner: LinkOwner) -> None:
    with _lock:
        _registry[(ip, port)] = weakref.ref(owner)


def unregister(ip: str, port: int, owner: LinkOwner | None) -> None:
    """Forget ``ip:port`` if ``owner`` (or an instance already gone, None) is registered there."""
    with _lock:
        ref = _registry.get((ip, port))
        if ref is not None and ref() in (owner, None):
            del _registry[(ip, port)]


def lookup_listener(ip: str, port: int) -> LinkOwner | None:
    """The in-process instance listening on ``ip:port`` (or on the wildcard address), if any."""
    ip = norm_ip(ip)
    with _lock:
        for key in ((ip, port), ("0.0.0.0", port), ("::", port)):
            ref = _registry.get(key)
            found = None if ref is None else ref()
            if found is not None:
                return found
    return None
