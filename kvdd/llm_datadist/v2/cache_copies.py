"""Local copies of ``CacheManager``: ``copy_cache``, ``copy_blocks``, ``swap_blocks``,
``remap_registered_memory`` (PYPKG.md §4.11).  Python checks first, then the engine."""

from __future__ import annotations

from .._seam import Wrapper
from ..status import raise_if_false
from ..utils.utils import check_dict, check_int64, check_isinstance, check_uint32, check_uint64
from .llm_keys import INVALID_ID
from .llm_types import Cache, MemInfo, Memtype, Placement

__all__ = ["LocalCopies"]

_SWAP_IN, _SWAP_OUT = 0, 1  # swap_blocks_v2 swap_type: host -> device, device -> host
_ADDRESS_ONLY = -1  # swap_blocks_v2 cache id of an address-only view (the package never sends a real id)


class LocalCopies:
    """The local-copy methods of :class:`~kvdd.llm_datadist.v2.cache_manager.CacheManager`."""

    _llm_datadist: Wrapper

    def _check(self, status: int, func: str, info: object) -> None:
        raise NotImplementedError

    def copy_cache(self, dst: Cache, src: Cache, dst_batch_index: int = 0, src_batch_index: int = 0,
                   offset: int = 0, size: int = -1, req_id: int | None = None) -> None:
        """Copy rows between two local non-blocks caches (CANN ``copy_cache``, PYPKG.md §4.11):
        ``dst[i][dst_batch*S+offset, +m) <- src[i][src_batch*S+offset, +m)``, ``m`` = ``size``
        bytes or the rest of the row. LLM_PARAM_INVALID for a blocks cache or ``size`` not -1/>0.
        """
        check_isinstance("dst", dst, Cache, allow_none=False)
        check_isinstance("src", src, Cache, allow_none=False)
        check_uint32("dst_batch_index", dst_batch_index)
        check_uint32("src_batch_index", src_batch_index)
        check_uint64("offset", offset)
        check_int64("size", size)
        raise_if_false(not dst.is_blocks_cache and not src.is_blocks_cache,
                       "copy_cache does not take blocks caches.")
        raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, but got {size}.")
        check_uint64("req_id", req_id, allow_none=True)
        param = (src.cache_id, dst.cache_id, src_batch_index, dst_batch_index, offset, size,
                 INVALID_ID if req_id is None else req_id)
        self._check(self._llm_datadist.copy_cache_v2(param), "copy_cache",
                    f"src={src.cache_id}, dst={dst.cache_id}")

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Copy block ``s`` to each block of ``copy_block_info[s]`` in every tensor of a blocks
        cache (CANN ``copy_blocks``, PYPKG.md §4.11)."""
        check_isinstance("cache", cache, Cache, allow_none=False)
        # the mapping's types (values are lists of int) before the cache kind, as upstream
        check_dict("copy_block_info", copy_block_info, int, list, inner_types=int, allow_none=False)
        raise_if_false(cache.is_blocks_cache, "copy_blocks needs a blocks cache.")
        pairs: list[tuple[int, int]] = []
        for src_block, dst_list in copy_block_info.items():
            pairs.extend((src_block, d) for d in dst_list)
        self._check(self._llm_datadist.copy_blocks_v2(cache.cache_id, pairs), "copy_blocks",
                    f"cache_id={cache.cache_id}")

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Copy blocks between a HOST and a DEVICE blocks cache (CANN ``swap_blocks``,
        PYPKG.md §4.11); the HOST side is usually ``Cache.create_cpu_cache``."""
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        raise_if_false(src_cache.is_blocks_cache and dst_cache.is_blocks_cache,
                       "swap_blocks needs two blocks caches.")
        # after the kinds, as upstream, and the keys only: a bad value fails the range rule below
        check_isinstance("src_to_dst", src_to_dst, dict, allow_none=False, inner_class=int)
        sd, dd = src_cache.cache_desc, dst_cache.cache_desc
        block_size = sd.size // sd.batch_size
        raise_if_false(block_size == dd.size // dd.batch_size and sd.num_tensors == dd.num_tensors,
                       "swap_blocks needs equal block sizes and tensor counts.")
        for s, d in src_to_dst.items():
            raise_if_false(0 <= s < sd.batch_size and 0 <= d < dd.batch_size,
                           f"block pair ({s}, {d}) out of range.")
        placements = {sd.placement, dd.placement}
        raise_if_false(placements == {Placement.HOST, Placement.DEVICE},
                       "swap_blocks needs one HOST and one DEVICE cache.")
        swap_type = _SWAP_IN if sd.placement == Placement.HOST else _SWAP_OUT
        # Both sides go to the engine as address-only views (cache id -1), registered or not:
        # the engine refuses a registered cache paired with a view such as create_cpu_cache's.
        status = self._llm_datadist.swap_blocks_v2(
            (_ADDRESS_ONLY, [src_cache.tensor_addrs]), (_ADDRESS_ONLY, [dst_cache.tensor_addrs]),
            block_size, swap_type, list(src_to_dst.items()))
        self._check(status, "swap_blocks", f"src={src_cache.cache_id}, dst={dst_cache.cache_id}")

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        """Re-bind registered device memory (reserved upstream, PYPKG.md §4.11)."""
        infos = [mem_infos] if isinstance(mem_infos, MemInfo) else mem_infos
        raise_if_false(isinstance(infos, list) and all(isinstance(m, MemInfo) for m in infos),
                       "mem_infos must be a MemInfo or a list of MemInfo.")
        for info in infos:
            raise_if_false(info.mem_type == Memtype.MEM_TYPE_DEVICE, "mem_type must be MEM_TYPE_DEVICE.")
            raise_if_false(info.addr != 0, "addr must not be 0.")
            raise_if_false(info.size > 0, "size must be > 0.")
        status = self._llm_datadist.remap_registered_memory([(i.mem_type.value, i.addr, i.size) for i in infos])
        self._check(status, "remap_registered_memory", f"{len(infos)} ranges")
