"""The four calls LLM-DataDist V2 does not support: AllocateCache, DeallocateCache, CopyKvCache
and CopyKvBlocks (docs/spec/SEMANTICS.md §3.9).

Each checks its argument types as the C++ signature would, then asks the backend, which returns
``LLM_FEATURE_NOT_ENABLED``; :class:`UnsupportedCalls` is a base of :class:`kvdd.LlmDataDist`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .backend import Backend
from .calls import check_type, raise_status
from .types import INT64, UINT32, UINT64, Cache, CacheDesc, check_int, check_int_seq

__all__ = ["UnsupportedCalls"]


class UnsupportedCalls:
    """The calls of C++ ``llm_datadist::LlmDataDist`` that V2 rejects (a base of :class:`kvdd.LlmDataDist`)."""

    @property
    def backend(self) -> Backend:
        """The backend the calls go to (:attr:`kvdd.LlmDataDist.backend`)."""
        raise NotImplementedError

    def allocate_cache(self, cache_desc: CacheDesc) -> Cache:
        """[AllocateCache, docs/spec/SEMANTICS.md §3.9] Not supported by LLM-DataDist V2.

        Parameters
        ----------
        cache_desc : CacheDesc
            Ignored.

        Returns
        -------
        Cache
            Never returns.

        Raises
        ------
        LLMFeatureNotEnabledError
            Always (after the argument types are checked).
        """
        check_type("cache_desc", cache_desc, CacheDesc)
        backend = self.backend
        status, cache = backend.allocate_cache(cache_desc)
        if status or cache is None:
            raise_status(backend, status, "AllocateCache")
        return cache

    def deallocate_cache(self, cache_id: int) -> None:
        """[DeallocateCache, docs/spec/SEMANTICS.md §3.9] Not supported by LLM-DataDist V2.

        Parameters
        ----------
        cache_id : int
            Ignored (int64).

        Raises
        ------
        LLMFeatureNotEnabledError
            Always.
        """
        cache_id = check_int("cache_id", cache_id, INT64)
        backend = self.backend
        status = backend.deallocate_cache(cache_id)
        if status:
            raise_status(backend, status, "DeallocateCache")

    def copy_kv_cache(self, src_cache: Cache, dst_cache: Cache, src_batch_index: int = 0,
                      dst_batch_index: int = 0, offset: int = 0, size: int = -1) -> None:
        """[CopyKvCache, docs/spec/SEMANTICS.md §3.9] Not supported by LLM-DataDist V2.

        Parameters
        ----------
        src_cache, dst_cache : Cache
            Checked for type only.
        src_batch_index, dst_batch_index : int
            uint32.
        offset : int
            uint64 bytes.
        size : int
            int64 bytes.

        Raises
        ------
        LLMFeatureNotEnabledError
            Always (after the argument types are checked).
        """
        check_type("src_cache", src_cache, Cache)
        check_type("dst_cache", dst_cache, Cache)
        src_batch_index = check_int("src_batch_index", src_batch_index, UINT32)
        dst_batch_index = check_int("dst_batch_index", dst_batch_index, UINT32)
        offset = check_int("offset", offset, UINT64)
        size = check_int("size", size, INT64)
        backend = self.backend
        status = backend.copy_kv_cache(src_cache, dst_cache, src_batch_index, dst_batch_index, offset, size)
        if status:
            raise_status(backend, status, "CopyKvCache")

    def copy_kv_blocks(self, src_cache: Cache, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks_list: Sequence[Sequence[int]]) -> None:
        """[CopyKvBlocks, docs/spec/SEMANTICS.md §3.9] Not supported by LLM-DataDist V2.

        Parameters
        ----------
        src_cache, dst_cache : Cache
            Checked for type only.
        src_blocks : Sequence[int]
            uint64 block indices.
        dst_blocks_list : Sequence[Sequence[int]]
            uint64 block indices per destination.

        Raises
        ------
        LLMFeatureNotEnabledError
            Always (after the argument types are checked).
        """
        check_type("src_cache", src_cache, Cache)
        check_type("dst_cache", dst_cache, Cache)
        src = check_int_seq("src_blocks", src_blocks, UINT64)
        if isinstance(dst_blocks_list, (str, bytes)) or not isinstance(dst_blocks_list, Sequence):
            raise TypeError("dst_blocks_list must be a sequence of sequences of block indices")
        dst = tuple(check_int_seq(f"dst_blocks_list[{i}]", d, UINT64) for i, d in enumerate(dst_blocks_list))
        backend = self.backend
        status = backend.copy_kv_blocks(src_cache, dst_cache, src, dst)
        if status:
            raise_status(backend, status, "CopyKvBlocks")
