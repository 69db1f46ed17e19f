"""Pieces shared by every transfer: the remote cache lookup and the copy itself.

Checks raise :class:`kvdd.sim.checks.Rejected`; the copy returns the status of the transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..status import NOT_EXIST, S_OK, TIMEOUT
from .checks import reject

if TYPE_CHECKING:
    from .entries import CacheEntry, Entity
    from .memory import Region
    from .fabric import RemoteCache

__all__ = ["lookup_remote", "run"]


def lookup_remote(entity: Entity, cache_id: int) -> RemoteCache:
    """The remote cache ``cache_id`` as the link sees it, else ``LLM_KV_CACHE_NOT_EXIST``."""
    if cache_id <= 0:
        reject(NOT_EXIST, f"remote cache id {cache_id} is not > 0")
    rc = entity.peer.snapshot().get(cache_id)
    if rc is None:
        reject(NOT_EXIST, f"remote cache {cache_id} is not registered on cluster "
               f"{entity.peer.peer_cluster_id} (or was registered after the link)")
    return rc


def _select(regions: list[Region], tensors: Sequence[int]) -> Sequence[Region]:
    """``[regions[i] for i in tensors]``; a slice when `tensors` is a range (every layer, or a layer
    range: one C call instead of a Python loop over the tensors)."""
    if type(tensors) is range and tensors.step == 1 and 0 <= tensors.start and tensors.stop <= len(regions):
        return regions[tensors.start:tensors.stop]
    return [regions[i] for i in tensors]


def _timed_out(sync_wait_ms: int) -> str:
    """Why a transfer got LLM_TIMEOUT from its peer (the link is broken from now on: rule 8)."""
    if sync_wait_ms <= 0:
        return ("llm.SyncKvCacheWaitTime is 0: a transfer with another process times out at once "
                "(SEMANTICS.md §10 rule 9); unlink and link again")
    return (f"the peer did not answer within {sync_wait_ms} ms (llm.SyncKvCacheWaitTime); "
            "unlink and link again")


def run(entity: Entity, local: CacheEntry, rc: RemoteCache, pull: bool, sync_wait_ms: int,
        local_tensors: Sequence[int], remote_tensors: Sequence[int],
        local_off: np.ndarray, remote_off: np.ndarray, length: np.ndarray) -> int:
    """Move the bytes (caller holds entity.lock): leases on both caches, then one copy."""
    if entity.broken:
        reject(TIMEOUT, "the link timed out earlier; unlink and link again (kvdd rule 8)")
    if not local.acquire():
        reject(NOT_EXIST, f"local cache {local.cache_id} was unregistered")
    try:
        status, lease = entity.peer.acquire(rc, sync_wait_ms)
        if status != S_OK:
            if status == TIMEOUT:
                entity.broken = True
            reject(status, f"remote cache {rc.cache_id} is gone" if status == NOT_EXIST
                   else _timed_out(sync_wait_ms))
        try:
            regions = _select(local.regions, local_tensors)
            if pull:
                status = entity.peer.read(lease, remote_tensors, remote_off, regions, local_off,
                                          length, sync_wait_ms)
            else:
                status = entity.peer.write(lease, remote_tensors, regions, local_off, remote_off,
                                           length, sync_wait_ms)
            if status == TIMEOUT:
                entity.broken = True
            if status != S_OK:
                reject(status, "the transfer failed")
            return S_OK
        finally:
            entity.peer.release(lease)
    finally:
        local.release()
