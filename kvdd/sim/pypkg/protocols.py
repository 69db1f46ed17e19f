"""The typed boundary inside :mod:`kvdd.sim.pypkg`: lifecycle and links vs registration and transfers.

The lifecycle modules (:mod:`.lifecycle`, :mod:`.links`, :mod:`.ranktable`, :mod:`.rendezvous`)
own the process's one engine (``initialize_v2`` / ``finalize_v2``, PYPKG.md §2.3, §3.1-3.5); the
wrapper (:mod:`.wrapper`) registers caches and moves bytes through it.  Everything the wrapper may
read of an engine is declared here; neither side uses the other's private names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..engine import SimBackend

__all__ = ["PkgEngine"]


class PkgEngine(Protocol):
    """The process's engine as registration and transfers see it (one per process, §3.0).

    Attributes
    ----------
    cluster_id : int
        The cluster id given to ``initialize_v2`` (the engine's real id on every link).
    instance : SimBackend
        The simulator instance behind it: its caches, link entities (keyed by cluster id, SEMANTICS
        §2.3), listener and snapshots.  Initialized; it stays the same object until ``finalize_v2``.
    remote_accessible : bool
        ``llm.EnableRemoteCacheAccessible == "1"`` (absent = False, PYPKG.md §2.3).
    sync_wait_ms : int
        ``llm.SyncKvCacheWaitTime`` in ms (default 1000): every pull/push time limit.
    transfer_backend : str
        ``"comm"`` or ``"hixl"``.
    mem_pool_config, host_mem_pool_config : str
        The raw ``llm.MemPoolConfig`` / ``llm.HostMemPoolConfig`` values ("" when absent);
        already validated by ``initialize_v2``.
    """

    @property
    def cluster_id(self) -> int: ...

    @property
    def instance(self) -> SimBackend: ...

    @property
    def remote_accessible(self) -> bool: ...

    @property
    def sync_wait_ms(self) -> int: ...

    @property
    def transfer_backend(self) -> str: ...

    @property
    def mem_pool_config(self) -> str: ...

    @property
    def host_mem_pool_config(self) -> str: ...

    def link_pending(self, remote_cluster_id: int) -> bool:
        """True while a rank-table ``link`` whose domain includes ``remote_cluster_id`` has not
        finished preparing (its status is PREPARING): a transfer naming that cluster then returns
        ``LLM_NOT_YET_LINK`` at the point where a missing link entity would (PYPKG.md §3.3)."""
        ...
