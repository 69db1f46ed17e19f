"""Engine validation: the rejection that carries a status, and the checks shared by several calls.

A check that fails raises :class:`Rejected` with the LLM status the C++ call would return and a
detail for the exception message; each Backend method of :class:`kvdd.sim.engine.SimBackend`
turns it into its returned status once.  Rejections never leave the simulator package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from ..options import is_ipv4_literal
from ..status import PARAM_INVALID, Status
from ..types import ClusterInfo, KvCacheExtParam

if TYPE_CHECKING:
    from .entries import CacheEntry, Entity
    from .fabric import RemoteCache

__all__ = [
    "CACHE_TABLE_LIMIT", "REQUEST_LIMIT", "HARDWARE_UNCHECKED", "Rejected", "reject", "ext_valid",
    "require_ext", "require_initialized", "require_local_cache", "require_link",
    "require_not_ragged", "require_remote_tensors", "require_tensor_count", "require_layer_multiple",
    "require_inside_remote", "require_clusters",
]


#: §3.7 step 10: the serialized cache table must fit 1 MiB.
CACHE_TABLE_LIMIT = 1 << 20
#: §3.11 step 8: a transfer request (120 + 16*(K + 2*G) bytes) must fit 2 MiB - 8.
REQUEST_LIMIT = (2 << 20) - 8
HARDWARE_UNCHECKED = "unchecked on hardware (undefined there); the simulator refuses it"


class Rejected(Exception):
    """A call refused by a check: ``status`` is what the C++ call returns, ``detail`` says why."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def reject(status: int, detail: str) -> NoReturn:
    """Refuse the current call with ``status``."""
    raise Rejected(status, detail)


def require_initialized(initialized: bool) -> None:
    """Step 1 of every call after Initialize: ``LLM_FAILED`` before it."""
    if not initialized:
        reject(Status.LLM_FAILED, "not initialized")


def require_clusters(initialized: bool, clusters: Sequence[ClusterInfo], timeout_ms: int) -> None:
    """Link/UnlinkLlmClusters steps 1-4 (§3.5, §3.6): initialized, timeout > 0, every IP an IPv4
    literal (remote_ip_infos then local_ip_infos, cluster by cluster), clusters non-empty."""
    require_initialized(initialized)
    if timeout_ms <= 0:
        reject(PARAM_INVALID, f"timeout {timeout_ms} ms must be > 0")
    for i, cluster in enumerate(clusters):
        for info in (*cluster.remote_ip_infos, *cluster.local_ip_infos):
            if info.ip == "" or not is_ipv4_literal(info.ip):
                reject(PARAM_INVALID, f"clusters[{i}]: IP {info.ip!r} is not an IPv4 literal")
    if not clusters:
        reject(PARAM_INVALID, "clusters is empty")


def ext_valid(ext: KvCacheExtParam, equal_len: bool) -> bool:
    """CheckKvCacheExtParam (§2.5)."""
    s0, s1 = ext.src_layer_range
    d0, d1 = ext.dst_layer_range
    if not (s0 >= -1 and s1 >= -1 and s0 <= s1):
        return False
    if not (d0 >= -1 and d1 >= -1 and d0 <= d1):
        return False
    if ext.tensor_num_per_layer <= 0:
        return False
    if equal_len and s1 - s0 != d1 - d0:
        return False
    return True


def require_ext(ext: KvCacheExtParam, equal_len: bool) -> None:
    """CheckKvCacheExtParam (§2.5) failing with ``LLM_PARAM_INVALID``."""
    if not ext_valid(ext, equal_len):
        reject(PARAM_INVALID, f"invalid ext_param {ext}")


def require_local_cache(caches: dict[int, CacheEntry], cache_id: int) -> CacheEntry:
    """The local cache ``cache_id``, else ``LLM_KV_CACHE_NOT_EXIST``."""
    local = caches.get(cache_id)
    if local is None:
        reject(Status.LLM_KV_CACHE_NOT_EXIST, f"local cache {cache_id} is not registered")
    return local


def require_link(entities: dict[int, Entity], cluster_id: int) -> Entity:
    """The link entity for ``cluster_id``, else ``LLM_NOT_YET_LINK``."""
    entity = entities.get(cluster_id)
    if entity is None:
        reject(Status.LLM_NOT_YET_LINK, f"no link to cluster {cluster_id}")
    return entity


def require_layer_multiple(local: CacheEntry, t: int) -> None:
    """The local tensor count must be a multiple of ``tensor_num_per_layer``."""
    if local.n % t != 0:
        reject(PARAM_INVALID, f"local tensor count {local.n} is not a multiple of {t}")


def require_tensor_count(src_list: Sequence[int] | None, rc: RemoteCache, local: CacheEntry) -> None:
    """Without layer ranges the remote cache must have the local tensor count (§3.10 step 14)."""
    if src_list is None and rc.num_tensors != local.n:
        reject(PARAM_INVALID, f"remote cache has {rc.num_tensors} tensors, local {local.n}")


def require_not_ragged(local: CacheEntry, rc: RemoteCache) -> None:
    """kvdd rule 10: a cache whose tensor size is not a multiple of its stride (ragged sub-byte
    cache) cannot be transferred."""
    if local.ragged or rc.ragged:
        reject(PARAM_INVALID, "a cache whose tensor size is not a multiple of its stride "
               "(ragged sub-byte cache) cannot be transferred (kvdd rule 10)")


def require_remote_tensors(remote_tensors: Sequence[int], rc: RemoteCache) -> None:
    """kvdd rule 1 (§7.8): the source layer range must stay inside the remote tensors."""
    if remote_tensors[-1] >= rc.num_tensors:
        reject(PARAM_INVALID, f"src layer range reaches tensor {remote_tensors[-1]} "
               f"of a {rc.num_tensors}-tensor remote cache; {HARDWARE_UNCHECKED}")


def require_inside_remote(beyond: bool, what: str) -> None:
    """kvdd rule 1: ``beyond`` means ``what`` would touch bytes past the remote tensor."""
    if beyond:
        reject(PARAM_INVALID, f"{what} past the remote tensor; {HARDWARE_UNCHECKED}")


