"""Listening and linking for the simulator: how one instance reaches a peer's registered memory.

The engine (:mod:`kvdd.sim.engine`) keeps all LLM-DataDist semantics; this module gives it

* :class:`Listener` — the real TCP socket bound for ``llm.ListenIpInfo`` (SEMANTICS.md §10 rule 6)
  and the in-process registry of listening instances keyed by ``(ip, port)``;
* :func:`connect` — "dial" a peer address: an instance listening in this process, or (through
  the cross-process fabric) one in another process/host; refused → LINK_FAILED at once;
* :class:`PeerHandle` — what a link entity uses to reach the peer: the snapshot of its caches at
  link time, leases on a remote cache for the duration of a transfer (the owner's unregister and
  finalize wait for them, §10 rule 5), reads and writes of remote tensor bytes, and the link /
  unlink handshakes.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..status import Status
from .memory import Region, copy_runs

if TYPE_CHECKING:
    from .engine import CacheEntry, SimBackend

__all__ = [
    "RemoteCache",
    "PeerHandle",
    "InProcessPeer",
    "Listener",
    "connect",
    "lookup_listener",
]


@dataclass(frozen=True)
class RemoteCache:
    """What a link's snapshot knows of one of the peer's caches (SEMANTICS.md §2.4)."""

    cache_id: int
    num_tensors: int
    tensor_nbytes: int  # T
    batch_size: int  # B
    stride_nbytes: int  # S (0 when B > T: only possible for ragged sub-byte caches)
    ragged: bool  # T % S != 0 or S == 0 (kvdd rule 10)
    token: object  # identifies this registration on its owner (ids restart after re-Initialize)


class PeerHandle(Protocol):
    """The engine's view of the peer at the other end of a link."""

    peer_cluster_id: int
    transfer_backend: str

    def snapshot(self) -> dict[int, RemoteCache]:
        """The peer's caches registered before this link was created (visibility rule)."""
        ...

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        """Check the cache is still registered and take a lease on it: ``(status, lease)``.

        LLM_KV_CACHE_NOT_EXIST when the owner unregistered it or finalized (§10 rule 2),
        LLM_TIMEOUT when the owner cannot be reached."""
        ...

    def release(self, lease: object) -> None: ...

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        """remote[tensors[k]] bytes at src_off[j] → dst[k] at dst_off[j] (length[j]); a status."""
        ...

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        """src[k] at src_off[j] → remote[tensors[k]] at dst_off[j] (length[j]); a status."""
        ...

    def close(self) -> None:
        """Drop the connection (local teardown; the peer is not told)."""
        ...


class InProcessPeer:
    """A peer instance living in this process: copies go straight through the copy kernels."""

    def __init__(self, peer: SimBackend, snapshot: dict[int, RemoteCache],
                 entries: dict[int, CacheEntry]) -> None:
        self.peer = peer
        self.peer_cluster_id = peer.cluster_id
        self.transfer_backend = peer.transfer_backend
        self._snapshot = snapshot
        self._entries = entries  # token -> live entry objects at snapshot time

    def snapshot(self) -> dict[int, RemoteCache]:
        return self._snapshot

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        entry: CacheEntry = rc.token  # type: ignore[assignment]
        if not entry.acquire():
            return Status.LLM_KV_CACHE_NOT_EXIST, None
        return Status.LLM_SUCCESS, entry

    def release(self, lease: object) -> None:
        entry: CacheEntry = lease  # type: ignore[assignment]
        entry.release()

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        entry: CacheEntry = lease  # type: ignore[assignment]
        src = [entry.regions[i] for i in tensors]
        copy_runs(src, dst, src_off, dst_off, length)
        return Status.LLM_SUCCESS

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        entry: CacheEntry = lease  # type: ignore[assignment]
        dst = [entry.regions[i] for i in tensors]
        copy_runs(src, dst, src_off, dst_off, length)
        return Status.LLM_SUCCESS

    def close(self) -> None:
        pass


# ---- listening --------------------------------------------------------------------------------

_registry_lock = threading.Lock()
_registry: dict[tuple[str, int], SimBackend] = {}


def _norm_ip(ip: str) -> str:
    try:
        if ":" in ip:
            return socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, ip))
        return socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, ip))
    except OSError:
        return ip


class Listener:
    """A real listening TCP socket for one instance, registered for in-process lookup."""

    def __init__(self, owner: SimBackend, ip: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, port & 0xFFFF))  # upstream accepts ports up to 2**32-1; htons keeps 16 bits
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.ip = _norm_ip(ip)
        self.port: int = sock.getsockname()[1]
        self.owner = owner
        with _registry_lock:
            _registry[(self.ip, self.port)] = owner

    def close(self) -> None:
        with _registry_lock:
            if _registry.get((self.ip, self.port)) is self.owner:
                del _registry[(self.ip, self.port)]
        try:
            self.sock.close()
        except OSError:
            pass


def lookup_listener(ip: str, port: int) -> SimBackend | None:
    """The in-process instance listening on ``ip:port`` (or on the wildcard address), if any."""
    ip = _norm_ip(ip)
    with _registry_lock:
        found = _registry.get((ip, port))
        if found is None:
            found = _registry.get(("0.0.0.0", port)) or _registry.get(("::", port))
    return found


def connect(ip: str, port: int, timeout_ms: int) -> tuple[int, Any]:
    """Reach whatever listens on ``ip:port``: ``(status, SimBackend | connection)``.

    An instance of this process is returned directly.  Otherwise a real TCP connection is tried:
    refused / unreachable → LLM_LINK_FAILED at once; no answer in ``timeout_ms`` → LLM_TIMEOUT
    (SEMANTICS.md §10 rule 6).
    """
    peer = lookup_listener(ip, port)
    if peer is not None:
        return Status.LLM_SUCCESS, peer
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout_ms / 1000.0
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect((ip, port))
    except socket.timeout:
        sock.close()
        return Status.LLM_TIMEOUT, None
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH,
                         errno.EADDRNOTAVAIL, errno.ECONNRESET):
            return Status.LLM_LINK_FAILED, None
        return Status.LLM_LINK_FAILED, None
    # Something listens but is not an instance of this process: the cross-process fabric
    # handles it (not available in this build) -> the link cannot be established.
    sock.close()
    return Status.LLM_LINK_FAILED, None
