"""The seam between CANN's ``llm_datadist`` Python layer and the engine behind it.

Upstream's package talks to exactly one native module (``llm_datadist_wrapper``) whose functions
take and return plain ints and tuples (PYPKG.md §1.4).  kvdd keeps that seam: the Python layer of
:mod:`kvdd.llm_datadist` validates arguments in upstream's order (PYPKG.md §1-§5) and then calls a
:class:`Wrapper`; the simulator implements it (:mod:`kvdd.sim.pypkg`) with the internal engine's
checks and statuses (PYPKG.md §2.3, §3, §4 "native" steps).  Neither side imports the other's
private names.

Every method returns statuses as ints (0 = success) and never raises for an LLM status; a method
that has no engine (before ``initialize_v2`` or after ``finalize_v2``) returns the status PYPKG.md
§1.4 lists for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

__all__ = [
    "CacheDescTuple",
    "CacheKeyTuple",
    "PullParamTuple",
    "TransferCfgTuple",
    "BlockCfgTuple",
    "ClusterTuple",
    "CopyParamTuple",
    "MemInfoTuple",
    "Wrapper",
]

#: (num_tensors, data_type value, seq_len_dim_index, shape, placement value, is_blocks)
CacheDescTuple = tuple[int, int, int, Sequence[int], int, bool]
#: (cluster_id, cache_id, batch_index, req_id, prefix_id, model_id, is_blocks_key); PYPKG.md §1.4:
#: CacheKey -> (c, -1, 0, req, prefix, model, False); CacheKeyByIdAndIndex -> (c, id, b, 2**64-1,
#: 2**64-1, 0, False); BlocksCacheKey -> (c, -1, 0, 2**64-1, 2**64-1, model, True)
CacheKeyTuple = tuple[int, int, int, int, int, int, bool]
#: (size, batch_index, src_blocks, dst_blocks, src_tensor_indices, dst_tensor_indices,
#:  src_offset=-1, dst_offset=-1, tensor_num_per_layer)
PullParamTuple = tuple[int, int, Sequence[int], Sequence[int], Sequence[int], Sequence[int], int, int, int]
#: (src_cache_id, src_batch_index, src_layer, dst_addrs, dst_cluster_id, model_id_or_cache_id,
#:  dst_batch_index, push_type (0 raw addresses, 1 blocks key, 2 cache id), dst_layer,
#:  tensor_num_per_layer)
TransferCfgTuple = tuple[int, int, int, Sequence[int], int, int, int, int, int, int]
#: (dst_block_memory_size, src_blocks, dst_blocks)
BlockCfgTuple = tuple[int, Sequence[int], Sequence[int]]
#: (remote_cluster_id, remote_role, [(ip as little-endian u32, port)] local, [(ip, port)] remote)
ClusterTuple = tuple[int, int, Sequence[tuple[int, int]], Sequence[tuple[int, int]]]
#: (src_cache_id, dst_cache_id, src_batch_index, dst_batch_index, offset, size, req_id)
CopyParamTuple = tuple[int, int, int, int, int, int, int]
#: (mem_type value, addr, size)
MemInfoTuple = tuple[int, int, int]


class Wrapper(Protocol):
    """The engine calls of CANN's ``llm_datadist_wrapper`` (PYPKG.md §1.4), one process-wide engine.

    Statuses are ``ge`` status ints (PYPKG.md §1.2); the Python layer maps unknown ones to
    ``LLM_FAILED`` (``code_2_status``).  :meth:`last_error_detail` explains the calling thread's
    last non-success status (which check failed), for exception messages and logs.
    """

    def last_error_detail(self) -> str | None: ...

    def calc_tensor_size(self, shape: Sequence[int], data_type: int) -> int:
        """Bytes of one tensor, or -1 (a dim <= 0, overflow, unsupported data type)."""
        ...

    def initialize_v2(self, cluster_id: int, options: Mapping[str, str]) -> int:
        """Create the process's engine; LLM_FAILED when one exists (PYPKG.md §2.3, §3.1 step 6)."""
        ...

    def finalize_v2(self) -> None:
        """Tear the engine down (links, registrations); a no-op without one (§3.2)."""
        ...

    def link(self, comm_name: str, cluster_rank_info: Sequence[tuple[int, int]],
             rank_table: str) -> tuple[int, int]:
        """Rank-table link: ``(status, comm_id)``; the comm id starts PREPARING (§3.3, §9.2-3)."""
        ...

    def unlink(self, comm_id: int) -> int: ...

    def query_register_mem_status(self, comm_id: int) -> tuple[int, int]:
        """``(status, 0 OK | 1 PREPARING | 2 FAILED)`` (§3.3)."""
        ...

    def link_clusters_v2(self, clusters: Sequence[ClusterTuple],
                         timeout_ms: int) -> tuple[int, list[int]]: ...

    def unlink_clusters_v2(self, clusters: Sequence[ClusterTuple], timeout_ms: int,
                           force: bool) -> tuple[int, list[int]]: ...

    def switch_role_v2(self, role: str, options: Mapping[str, str]) -> int: ...

    def register_cache(self, cache_desc: CacheDescTuple, addrs: Sequence[int],
                       cache_keys: Sequence[CacheKeyTuple],
                       remote_accessible: bool) -> tuple[int, tuple[int, list[list[int]]]]:
        """``(status, (cache_id, [addrs]))``; the id is consumed as §4.1 step 3 says."""
        ...

    def unregister_cache(self, cache_id: int) -> int: ...

    def allocate_cache_v2(self, cache_desc: CacheDescTuple,
                          cache_keys: Sequence[CacheKeyTuple]) -> tuple[int, tuple[int, list[list[int]]]]: ...

    def deallocate_cache_v2(self, cache_id: int) -> int: ...

    def remove_cache_key_v2(self, cache_key: CacheKeyTuple) -> int: ...

    def pull_cache_v2(self, dst_cache_id: int, cache_key: CacheKeyTuple,
                      param: PullParamTuple) -> int:
        """Both ``pull_cache`` and ``pull_blocks`` (block lists in ``param``), §4.5-4.7."""
        ...

    def transfer_cache_v2(self, task_id: int, cfg: TransferCfgTuple,
                          block_cfg: BlockCfgTuple) -> int:
        """One layer of a push or of ``transfer_cache_async`` (§4.8, §4.10)."""
        ...

    def copy_cache_v2(self, param: CopyParamTuple) -> int: ...

    def copy_blocks_v2(self, cache_id: int, copy_block_info: Sequence[tuple[int, int]]) -> int: ...

    def swap_blocks_v2(self, src: tuple[int, Sequence[Sequence[int]]],
                       dst: tuple[int, Sequence[Sequence[int]]], block_size: int,
                       swap_type: int, block_mapping: Sequence[tuple[int, int]]) -> int: ...

    def check_capacity_v2(self, size: int) -> int: ...

    def remap_registered_memory(self, mem_infos: Sequence[MemInfoTuple]) -> int: ...
