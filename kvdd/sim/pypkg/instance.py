"""The simulator instance behind the package's engine: kvdd's :class:`~kvdd.sim.engine.SimBackend`
plus what the Python path adds to a link handshake (PYPKG.md §3.3, §3.4, §4.9 items 4-5).

* **Remote-cache-accessible flags must match on both ends** (``cache_access_table.cc:337-353``):
  each side states its ``llm.EnableRemoteCacheAccessible`` in the authenticated hello (a fabric
  handshake extension, :func:`kvdd.sim.fabric.register_extension`); the acceptor refuses a
  mismatch with ``LLM_PARAM_INVALID`` before making its entity, so the initiator's cluster status
  is ``LLM_PARAM_INVALID`` (``link_clusters``) or its rank-table prepare fails.  A peer that states
  nothing is kvdd's C++ face, whose instances are always remote-accessible (SEMANTICS.md §3.2 step 5).
* **Rank-table domains**: the initiator of a rank-table link names the domain (``comm_name`` and
  its ``cluster_rank_info``); the acceptor accepts only while it prepares the same domain with the
  same members (:class:`DomainGate`, implemented by :mod:`.ranktable`), and both sides offer the
  caches registered when they called ``link`` (the snapshot rule, §4.9 item 2, PYPKG.md §9.4).

What one side states travels on the calling thread: the initiator sets it around its
``link_llm_clusters`` (:func:`stating`); the handshake reads it there (the hello's extension, or
directly for a peer in this process, whose ``serve_link`` runs on the same thread); the acceptor's
extension callback and its ``serve_link`` also run on one thread (the fabric's handshake thread).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from ...status import PARAM_INVALID, Status
from .. import fabric
from ..engine import SimBackend
from ..entries import CacheEntry
from ..fabric import LinkOffer, PeerHandle, RemoteCache
from ..fabric.auth import Session

__all__ = ["Claim", "DomainGate", "PkgInstance", "Snapshot", "stating", "EXTENSION", "MALFORMED",
           "register_extension"]

#: The handshake extension's name.
EXTENSION = "llm_datadist"
_MAX_CLAIM = 3000  # bytes of one claim (the fabric bounds all extensions to 4096)
_CLAIM_TTL_S = 30.0  # a received claim older than this is not used

#: The caches one side offers over a link: the snapshot and the live entries behind it.
Snapshot = tuple[dict[int, RemoteCache], dict[int, CacheEntry]]


@dataclass(frozen=True)
class Claim:
    """What one side of a link states: its remote-accessible mode, and for a rank-table link the
    domain (``comm_name`` and ``{cluster_id: rank}``)."""

    cluster_id: int
    remote_accessible: bool
    comm_name: str | None = None
    members: tuple[tuple[int, int], ...] = ()

    def encode(self) -> bytes:
        return json.dumps({"ra": self.remote_accessible, "comm": self.comm_name,
                           "members": [list(m) for m in self.members]}).encode()

    @classmethod
    def decode(cls, cluster_id: int, data: bytes) -> Claim | None:
        """The peer's claim, or None when it is malformed (untrusted input, bounded)."""
        if len(data) > _MAX_CLAIM:
            return None
        try:
            obj = json.loads(data)
            ra, comm, members = obj["ra"], obj["comm"], obj["members"]
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        if not isinstance(ra, bool) or not (comm is None or isinstance(comm, str)):
            return None
        if not isinstance(members, list) or len(members) > 64:
            return None
        out: list[tuple[int, int]] = []
        for m in members:
            if (not isinstance(m, list) or len(m) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in m)):
                return None
            out.append((m[0], m[1]))
        return cls(cluster_id, ra, comm, tuple(out))


class DomainGate(Protocol):
    """The rank-table domains an instance prepares (implemented by :mod:`.ranktable`)."""

    def admit(self, claim: Claim, remote_accessible: bool) -> tuple[int, str, Snapshot | None]:
        """Whether to accept ``claim``'s rank-table link (we are ``remote_accessible``):
        ``(status, why, snapshot to offer)``; a mismatch of members or flags also fails the
        domain here (PYPKG.md §9.3)."""
        ...

    def joined(self, claim: Claim) -> None:
        """The link of ``claim`` was made (our entity for its cluster exists)."""
        ...


_tls = threading.local()


@contextmanager
def stating(claim: Claim, snapshot: Snapshot | None = None) -> Iterator[None]:
    """Around an initiator's ``link_llm_clusters`` on this thread: state ``claim`` in the
    handshake and offer ``snapshot`` (None: the caches registered now)."""
    _tls.outgoing = claim
    _tls.outgoing_snapshot = snapshot
    try:
        yield
    finally:
        _tls.outgoing = None
        _tls.outgoing_snapshot = None


def _offer(session: Session, owner: fabric.LinkOwner) -> bytes | None:
    if session.initiator:
        claim: Claim | None = getattr(_tls, "outgoing", None)
        return None if claim is None else claim.encode()
    if isinstance(owner, PkgInstance):  # the acceptor's reply: its mode only
        return Claim(owner.cluster_id, owner.remote_accessible).encode()
    return None


def _accept(session: Session, value: bytes) -> object:
    if not session.initiator:  # the acceptor keeps the initiator's claim for its serve_link
        _tls.incoming = (Claim.decode(session.peer_cluster_id, value), time.monotonic())
    return None


def register_extension() -> None:
    """(Re-)register this module's handshake extension (done once at import)."""
    fabric.register_extension(EXTENSION, _offer, _accept)


register_extension()


#: What :func:`_take_claim` returns for a claim the peer sent that cannot be used.
MALFORMED = Claim(-1, False)


def _take_claim(peer_cluster_id: int) -> Claim | None:
    """The claim of the peer whose link this thread serves now (see the module docstring); None
    when it stated none, :data:`MALFORMED` when what it stated is unusable."""
    got: tuple[Claim | None, float] | None = getattr(_tls, "incoming", None)
    _tls.incoming = None
    if got is not None:
        claim, at = got
        if claim is not None and claim.cluster_id == peer_cluster_id \
                and time.monotonic() - at < _CLAIM_TTL_S:
            return claim
        return MALFORMED
    out: Claim | None = getattr(_tls, "outgoing", None)  # a peer in this process, same thread
    if out is not None and out.cluster_id == peer_cluster_id:
        return out
    return None


class PkgInstance(SimBackend):
    """A :class:`SimBackend` with the Python path's per-engine mode and rank-table domains.

    Parameters
    ----------
    cluster_id, role : int
        As for :class:`SimBackend`.
    remote_accessible : bool
        ``llm.EnableRemoteCacheAccessible == "1"``.
    """

    def __init__(self, cluster_id: int, role: int, remote_accessible: bool) -> None:
        super().__init__(cluster_id, role)
        self.remote_accessible = remote_accessible
        self.domains: DomainGate | None = None  # set by the rank-table manager

    def snapshot_for_link(self) -> Snapshot:
        """The initiator's snapshot stated by :func:`stating`, else the caches registered now."""
        key = "serving_snapshot" if getattr(_tls, "serving", False) else "outgoing_snapshot"
        snap: Snapshot | None = getattr(_tls, key, None)
        if snap is not None:
            return snap
        return super().snapshot_for_link()

    def serve_link(self, peer: LinkOffer, force_link: bool, make_handle: Callable[[], PeerHandle]
                   ) -> tuple[int, str, Snapshot | None]:
        """The acceptor's side (:meth:`SimBackend.serve_link`) after the Python path's checks:
        remote-accessible flags equal on both ends (else PARAM_INVALID), and a rank-table link
        only into a domain we prepare with the same members."""
        claim = _take_claim(peer.cluster_id)
        if claim is MALFORMED:  # untrusted input: refused before anything is made
            return (Status.LLM_LINK_FAILED, f"cluster {peer.cluster_id} sent a malformed "
                    f"{EXTENSION!r} handshake entry", None)
        if claim is None:
            claim = Claim(peer.cluster_id, True)  # kvdd's C++ face: always remote-accessible
        gate = self.domains
        if claim.comm_name is not None:
            if gate is None:
                return (Status.LLM_LINK_FAILED, f"cluster {self.cluster_id} is not preparing comm "
                        f"domain {claim.comm_name!r}", None)
            status, why, snap = gate.admit(claim, self.remote_accessible)
            if status != Status.LLM_SUCCESS:
                return status, why, None
        else:
            snap = None
        if self.initialized and peer.transfer_backend == self.transfer_backend \
                and claim.remote_accessible != self.remote_accessible:
            return (PARAM_INVALID, f"remote-cache-accessible differs: cluster {self.cluster_id} "
                    f"has {int(self.remote_accessible)}, cluster {peer.cluster_id} has "
                    f"{int(claim.remote_accessible)} (llm.EnableRemoteCacheAccessible must be "
                    "equal on both ends)", None)
        _tls.serving = True
        _tls.serving_snapshot = snap
        try:
            status, why, mine = super().serve_link(peer, force_link, make_handle)
        finally:
            _tls.serving = False
            _tls.serving_snapshot = None
        if status == Status.LLM_SUCCESS and claim.comm_name is not None and gate is not None:
            gate.joined(claim)
        return status, why, mine
