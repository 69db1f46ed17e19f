"""The typed boundary between the engine and the fabric (SEMANTICS.md §2.3-2.4, §10 rules 2, 3, 5).

The engine implements :class:`LinkOwner` (one simulated instance) and :class:`ServedCache` (one of
its registered caches); the fabric implements :class:`PeerHandle` (the engine's view of a linked
peer) and :class:`Connection` (a dialled peer before/while linking).  Neither side uses the other's
private names: everything crossing the boundary is declared here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..memory import Region, RegionTable

__all__ = ["KIND_MIX", "KIND_CACHE", "KIND_BLOCKS", "RemoteCache", "PeerHandle", "ServedCache", "LinkOwner", "LinkOffer", "LinkResult",
           "Connection", "Snapshot", "DataPath"]


#: Entry types (docs/spec/PYPKG.md §4.1 step 6): the C++ face registers MIX entries (B = N =
#: shape[0]); CANN's Python package CACHE (B = shape[0], no blocks) or BLOCKS (B = 1, N = shape[0]).
KIND_MIX = 0
KIND_CACHE = 1
KIND_BLOCKS = 2


@dataclass(frozen=True)
class RemoteCache:
    """What a link's snapshot knows of one of the peer's caches (SEMANTICS.md §2.4; the last four
    fields: PYPKG.md §4.1 "remote-visible cache table", defaults = a C++-face MIX entry)."""

    cache_id: int
    num_tensors: int
    tensor_nbytes: int  # T
    batch_size: int  # B
    stride_nbytes: int  # S (0 when B > T: only possible for ragged sub-byte caches)
    ragged: bool  # T % S != 0 or S == 0 (kvdd rule 10)
    token: object  # identifies this registration on its owner (ids restart after re-Initialize)
    kind: int = KIND_MIX
    num_blocks: int = -1  # N; -1 = B (a MIX entry)
    remote_accessible: bool = True  # False: listed, never served (PYPKG.md §4.4)
    keys: tuple[tuple[int, int, int], ...] = ()  # (req_id, model_id, batch position) -> this entry

    @property
    def blocks(self) -> int:
        """N: the block count (``B`` for a MIX entry, 0 for a CACHE entry)."""
        return self.batch_size if self.num_blocks < 0 else self.num_blocks


class ServedCache(Protocol):
    """A cache registered on its owner, as the fabric serves it to linked peers.

    ``acquire`` counts one in-flight transfer (False once unregistered); ``release`` ends it.
    Unregister, unlink and finalize wait until every acquired transfer released (§10 rule 5)."""

    cache_id: int
    n: int  # tensors
    T: int  # bytes per tensor
    B: int
    S: int
    ragged: bool
    placement: int
    addrs: tuple[int, ...]
    regions: list[Region]
    table: RegionTable  # the regions in C memory (the compiled in-process path)

    def acquire(self) -> bool: ...

    def release(self) -> None: ...

    def add_drain(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` on unregister after new leases are refused and before waiting for held
        ones (the same-host one-sided path revokes its slots there); a callable ``fn`` returns,
        ``wait(start)``, runs once every drain ran, bounded from that common ``start`` (the
        one-sided path waits for its copies there); False (not added) once unregistered."""
        ...

    def remove_drain(self, fn: Callable[[], object]) -> None: ...


#: What a link exposes of one side: the peer-facing snapshot and the live entries behind it.
Snapshot = tuple[dict[int, RemoteCache], Mapping[int, ServedCache]]


@dataclass(frozen=True)
class LinkOffer:
    """One side's identity in a link handshake (the fields the acceptance logic of §3.5 e reads)."""

    cluster_id: int  # the real cluster id (constructor argument)
    transfer_backend: str  # "comm" or "hixl"
    comm_res_text: str | None  # llm.LocalCommRes, validated by both sides
    sync_wait_ms: int  # llm.SyncKvCacheWaitTime: the lifetime of this side's leases on the peer

    @classmethod
    def of(cls, owner: LinkOwner) -> LinkOffer:
        """The offer ``owner`` makes in a handshake now."""
        return cls(owner.cluster_id, owner.transfer_backend, owner.comm_res_text,
                   owner.sync_wait_ms)


class PeerHandle(Protocol):
    """The engine's view of the peer at the other end of a link."""

    peer_cluster_id: int
    transfer_backend: str

    def snapshot(self) -> dict[int, RemoteCache]:
        """The peer's caches registered before this link was created (visibility rule)."""
        ...

    def addresses(self, cache_id: int) -> tuple[int, ...]:
        """The tensor addresses of the peer's served cache ``cache_id`` as its snapshot announced
        them (empty when not served): for writes to raw destination addresses, which the simulator
        maps onto a served tensor (CANN's Python package, PYPKG.md §4.10)."""
        ...

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        """Check the cache is still registered and take a lease on it: ``(status, lease)``.

        LLM_KV_CACHE_NOT_EXIST when the owner unregistered it or finalized (§10 rule 2),
        LLM_TIMEOUT when the owner cannot be reached, LLM_NOT_YET_LINK when this handle was
        closed (a local unlink won the race, §10 rule 5)."""
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


@runtime_checkable
class DataPath(Protocol):
    """A per-link data path replacing TCP for one handle (e.g. same-host, from an extension).

    :class:`~kvdd.sim.fabric.RemotePeer` asks it first: ``acquire`` returning None means "use the
    TCP lease and data path for this transfer"; otherwise ``(status, lease)`` and the transfer's
    ``read``/``write``/``release`` go to the data path with that lease.  ``addrs`` are the peer's
    tensor addresses of that cache as its snapshot announced them (untrusted input)."""

    name: str

    def acquire(self, rc: RemoteCache, addrs: tuple[int, ...],
                timeout_ms: int) -> tuple[int, object] | None: ...

    def release(self, lease: object) -> None: ...

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int: ...

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int: ...

    def close(self) -> None: ...


class LinkOwner(Protocol):
    """What the fabric needs from a simulated instance that links and serves links."""

    cluster_id: int
    transfer_backend: str
    comm_res_text: str | None
    sync_wait_ms: int
    initialized: bool

    def snapshot_for_link(self) -> Snapshot:
        """The caches a peer linking now may use (registered before the link, §10 rule 3)."""
        ...

    def serve_link(self, peer: LinkOffer, force_link: bool,
                   make_handle: Callable[[], PeerHandle]) -> tuple[int, str, Snapshot | None]:
        """The acceptor's side of a link (§3.5): status, why it failed, our snapshot on success."""
        ...

    def peer_unlinked(self, peer_cluster_id: int) -> int:
        """A peer asked (non-force unlink, §3.6) to drop our entity for it; absent is success."""
        ...


@dataclass
class LinkResult:
    """What ``Connection.link`` returns: the peer's status (and why), its offer, our handle on it."""

    status: int
    detail: str = ""
    offer: LinkOffer | None = None
    handle: PeerHandle | None = None


class Connection(Protocol):
    """A dialled peer (see :func:`kvdd.sim.fabric.connect`); ``close`` keeps what a handle adopted."""

    def link(self, local: LinkOwner, force_link: bool) -> LinkResult:
        """Run the peer's side of a link handshake (§3.5: comm acceptance / hixl connect)."""
        ...

    def notify_unlink(self, local: LinkOwner) -> int:
        """Non-force comm unlink: the peer drops its entity for ``local``'s real id (§3.6)."""
        ...

    def close(self) -> None: ...
