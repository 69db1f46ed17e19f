"""The simulator's implementation of the seam (:class:`kvdd.llm_datadist._seam.Wrapper`).

One object per process (:func:`process_wrapper`) standing in for CANN's native module
``llm_datadist_wrapper`` (PYPKG.md §1.4): the lifecycle and link calls go to
:mod:`.lifecycle` / :mod:`.links`, registration to :mod:`.registry`, transfers to :mod:`.pulls`
and :mod:`.pushes`, local copies to :mod:`.copies`.  Every method returns statuses as ints and
never raises for an LLM status; without an engine (before ``initialize_v2``, after
``finalize_v2``) it returns what PYPKG.md §1.4 lists: LLM_FAILED for link, unlink,
query_register_mem_status, register_cache, unregister_cache, allocate_cache_v2,
link_clusters_v2 / unlink_clusters_v2 (with an empty list); LLM_PARAM_INVALID for the others.

No method holds the GIL while it waits: waits are on locks, events and sockets (pulls serialize
per link, pushes engine-wide, PYPKG.md §9.11).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from ...status import FAILED, PARAM_INVALID, S_OK
from ..checks import Rejected
from . import copies, lifecycle, links, pools, pulls, pushes, registry

if TYPE_CHECKING:
    from ...llm_datadist._seam import (BlockCfgTuple, CacheDescTuple, CacheKeyTuple, ClusterTuple,
                                       CopyParamTuple, MemInfoTuple, PullParamTuple,
                                       TransferCfgTuple)
    from .protocols import PkgEngine

__all__ = ["SimWrapper", "process_wrapper"]

_T = TypeVar("_T")

NO_ENGINE = "no engine: LLMDataDist is not initialized (or was finalized)"


class SimWrapper:
    """CANN's ``llm_datadist_wrapper`` functions over kvdd's simulator (implements
    :class:`kvdd.llm_datadist._seam.Wrapper`)."""

    def __init__(self) -> None:
        self._local = threading.local()

    # -- details --------------------------------------------------------------------------------
    def _fail(self, status: int, detail: str) -> int:
        self._local.detail = detail
        return status

    def last_error_detail(self) -> str | None:
        """Why this thread's last failing call failed (then forgotten)."""
        detail: str | None = getattr(self._local, "detail", None)
        self._local.detail = None
        if detail is None:
            detail = lifecycle.last_error_detail()
        return detail

    def _run(self, no_engine: int, fn: Callable[[PkgEngine], int]) -> int:
        """``fn(engine)`` with a rejection turned into its status (and detail)."""
        engine = lifecycle.current()
        if engine is None:
            return self._fail(no_engine, NO_ENGINE)
        try:
            return fn(engine)
        except Rejected as exc:
            return self._fail(exc.status, exc.detail)

    # -- stateless ------------------------------------------------------------------------------
    def calc_tensor_size(self, shape: Sequence[int], data_type: int) -> int:
        return registry.calc_tensor_size(shape, data_type)

    @staticmethod
    def dict_to_vector(d: Mapping[int, int]) -> list[tuple[int, int]]:
        """The pairs of ``d`` in insertion order (PYPKG.md §1.4)."""
        return list(d.items())

    # -- lifecycle and links ---------------------------------------------------------------------
    def initialize_v2(self, cluster_id: int, options: Mapping[str, str]) -> int:
        return lifecycle.initialize_v2(cluster_id, options)

    def finalize_v2(self) -> None:
        lifecycle.finalize_v2()

    def switch_role_v2(self, role: str, options: Mapping[str, str]) -> int:
        return lifecycle.switch_role_v2(role, options)

    def link(self, comm_name: str, cluster_rank_info: Sequence[tuple[int, int]],
             rank_table: str) -> tuple[int, int]:
        return links.link(comm_name, cluster_rank_info, rank_table)

    def unlink(self, comm_id: int) -> int:
        return links.unlink(comm_id)

    def query_register_mem_status(self, comm_id: int) -> tuple[int, int]:
        return links.query_register_mem_status(comm_id)

    def link_clusters_v2(self, clusters: Sequence[ClusterTuple],
                         timeout_ms: int) -> tuple[int, list[int]]:
        return links.link_clusters_v2(clusters, timeout_ms)

    def unlink_clusters_v2(self, clusters: Sequence[ClusterTuple], timeout_ms: int,
                           force: bool) -> tuple[int, list[int]]:
        return links.unlink_clusters_v2(clusters, timeout_ms, force)

    # -- registration ----------------------------------------------------------------------------
    def register_cache(self, cache_desc: CacheDescTuple, addrs: Sequence[int],
                       cache_keys: Sequence[CacheKeyTuple],
                       remote_accessible: bool) -> tuple[int, tuple[int, list[list[int]]]]:
        engine = lifecycle.current()
        if engine is None:
            return self._fail(FAILED, NO_ENGINE), (-1, [])
        try:
            cache_id = registry.register(engine, cache_desc, addrs, cache_keys, remote_accessible)
        except Rejected as exc:
            return self._fail(exc.status, exc.detail), (-1, [])
        return S_OK, (cache_id, [list(addrs)])

    def unregister_cache(self, cache_id: int) -> int:
        def go(engine: PkgEngine) -> int:
            registry.unregister(engine, cache_id)
            return S_OK
        return self._run(FAILED, go)

    def allocate_cache_v2(self, cache_desc: CacheDescTuple, cache_keys: Sequence[CacheKeyTuple]
                          ) -> tuple[int, tuple[int, list[list[int]]]]:
        engine = lifecycle.current()
        if engine is None:
            return self._fail(FAILED, NO_ENGINE), (-1, [])
        try:
            cache_id, addrs = pools.allocate(engine, cache_desc, cache_keys)
        except Rejected as exc:
            return self._fail(exc.status, exc.detail), (-1, [])
        return S_OK, (cache_id, [addrs])

    def deallocate_cache_v2(self, cache_id: int) -> int:
        return self._run(PARAM_INVALID, lambda e: pools.deallocate(e, cache_id))

    def remove_cache_key_v2(self, cache_key: CacheKeyTuple) -> int:
        return self._run(PARAM_INVALID, lambda e: pools.remove_cache_key(e, cache_key))

    def check_capacity_v2(self, size: int) -> int:
        return self._run(PARAM_INVALID, lambda e: copies.check_capacity(e, size))

    # -- transfers -------------------------------------------------------------------------------
    def pull_cache_v2(self, dst_cache_id: int, cache_key: CacheKeyTuple,
                      param: PullParamTuple) -> int:
        return self._run(PARAM_INVALID,
                         lambda e: pulls.pull_cache_v2(e, dst_cache_id, cache_key, param))

    def transfer_cache_v2(self, task_id: int, cfg: TransferCfgTuple,
                          block_cfg: BlockCfgTuple = (0, [], [])) -> int:
        return self._run(PARAM_INVALID,
                         lambda e: pushes.transfer_cache_v2(e, task_id, cfg, block_cfg))

    # -- local copies ----------------------------------------------------------------------------
    def copy_cache_v2(self, param: CopyParamTuple) -> int:
        return self._run(PARAM_INVALID, lambda e: copies.copy_cache(e, param))

    def copy_blocks_v2(self, cache_id: int, copy_block_info: Sequence[tuple[int, int]]) -> int:
        return self._run(PARAM_INVALID, lambda e: copies.copy_blocks(e, cache_id, copy_block_info))

    def swap_blocks_v2(self, src: tuple[int, Sequence[Sequence[int]]],
                       dst: tuple[int, Sequence[Sequence[int]]], block_size: int,
                       swap_type: int, block_mapping: Sequence[tuple[int, int]]) -> int:
        return self._run(PARAM_INVALID, lambda e: copies.swap_blocks(
            e, src, dst, block_size, swap_type, block_mapping))

    def remap_registered_memory(self, mem_infos: Sequence[MemInfoTuple]) -> int:
        return self._run(PARAM_INVALID, lambda e: copies.remap_registered_memory(e, mem_infos))


_wrapper: SimWrapper | None = None
_wrapper_lock = threading.Lock()


def process_wrapper() -> SimWrapper:
    """The process-wide :class:`SimWrapper` (the engine inside exists between ``initialize_v2``
    and ``finalize_v2``)."""
    global _wrapper
    with _wrapper_lock:
        if _wrapper is None:
            _wrapper = SimWrapper()
        return _wrapper
