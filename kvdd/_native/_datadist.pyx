# cython: auto_pickle=False
# cython: language_level=3
# distutils: language = c++
"""The native backend: :class:`NativeBackend` drives the C++ ``llm_datadist::LlmDataDist``.

Built only when meson finds a CANN root (option ``native``; see VENDOR.md).  Each method converts
kvdd's value types (:mod:`kvdd.types`) field by field into the C++ structs of
``llm_datadist/llm_datadist.h`` (declared in ``_cdatadist.pxd``), calls the C++ member of the
same name with the GIL released and returns the raw status (an ``int``, never raised).  A C++
exception thrown by the library becomes the status ``LLM_FAILED``, and its message the call's
:meth:`NativeBackend.last_error_detail`, so the facade's ``raise_for_status`` turns it into
``kvdd.LLMError`` like any other status (API.md).  The constructor and ``Finalize`` have no
status to return: a C++ exception there is raised through ``raise_for_status`` directly.  Addresses registered from a :class:`kvdd.TensorAddrs` keep its ``owners``
alive until the cache is unregistered or the instance finalized.

Concurrency: calls may come from several threads at once (as upstream allows); ``finalize`` waits
for the calls in flight and holds new ones back while it runs, because upstream's ``Finalize``
must not run concurrently with other calls (VENDOR.md).
"""

import os
import threading
from collections.abc import Mapping

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libcpp cimport bool as cpp_bool
from libcpp.map cimport map as cpp_map
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from kvdd._native._cdatadist cimport (
    AscendString,
    Cache,
    CacheDesc,
    CacheIndex,
    CachePlacement,
    ClusterInfo,
    DataType,
    DT_UNDEFINED,
    IpInfo,
    KvCacheExtParam,
    LLM_FAILED,
    LLM_SUCCESS,
    LlmDataDist,
    LlmRole,
    OPTION_BUF_POOL_CFG,
    OPTION_DEVICE_ID,
    OPTION_ENABLE_SET_ROLE,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LISTEN_IP_INFO,
    OPTION_LOCAL_COMM_RES,
    OPTION_SYNC_CACHE_WAIT_TIME,
    OPTION_TRANSFER_BACKEND,
    RegisterCfg,
    Status,
)

from kvdd.types import check_int

__all__ = ["NativeBackend", "build_info", "header_constants"]


include "_datadist_library.pxi"
include "_datadist_convert.pxi"
include "_datadist_instance.pxi"


cdef class NativeBackend(_Instance):
    """kvdd's Backend protocol (API.md) over the C++ ``llm_datadist::LlmDataDist``.

    Parameters
    ----------
    cluster_id : int
        uint64, this instance's cluster id (``LlmDataDist(cluster_id, role)``).
    role : int
        int32 role (``LlmRole``); out-of-enum values are passed through and rejected by
        ``Initialize`` with PARAM_INVALID (SEMANTICS.md §3.2).

    Every method returns the raw C++ status as an ``int``.  A C++ exception returns LLM_FAILED
    (with empty ``rets``, cache id -1 or no cache where the call has outputs) and keeps the C++
    message for :meth:`last_error_detail`; only the constructor and ``finalize`` raise
    ``kvdd.LLMError`` (LLM_FAILED) for one.  A wrong Python type raises TypeError and a value
    outside the C++ width ValueError, before anything is called.
    """

    # ---- links ------------------------------------------------------------------------------

    def link_llm_clusters(self, clusters, timeout_ms):
        """``LinkLlmClusters(clusters, rets, timeout_in_millis)`` -> ``(status, rets)``."""
        cdef LlmDataDist* dd = self._get()
        cdef vector[ClusterInfo] infos
        cdef vector[Status] rets
        cdef int32_t timeout = _i32(timeout_ms, "timeout_ms")
        cdef Status st
        _fill_clusters(infos, clusters)
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.LinkLlmClusters(infos, rets, timeout)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            return self._cxx_failed("LinkLlmClusters", exc), []
        return st, [r for r in rets]

    def unlink_llm_clusters(self, clusters, timeout_ms, force):
        """``UnlinkLlmClusters(clusters, rets, timeout_in_millis, force_flag)`` ->
        ``(status, rets)``."""
        cdef LlmDataDist* dd = self._get()
        cdef vector[ClusterInfo] infos
        cdef vector[Status] rets
        cdef int32_t timeout = _i32(timeout_ms, "timeout_ms")
        cdef cpp_bool force_flag = bool(force)
        cdef Status st
        _fill_clusters(infos, clusters)
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.UnlinkLlmClusters(infos, rets, timeout, force_flag)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            return self._cxx_failed("UnlinkLlmClusters", exc), []
        return st, [r for r in rets]

    # ---- registration -----------------------------------------------------------------------

    def register_kv_cache(self, cache_desc, addrs, cfg):
        """``RegisterKvCache(cache_desc, addrs, cfg, cache_id)`` -> ``(status, cache_id)``.

        ``cache_id`` is -1 unless the status is success.  When ``addrs`` is a
        :class:`kvdd.TensorAddrs`, its ``owners`` stay referenced until the cache is
        unregistered or the instance finalized.
        """
        cdef LlmDataDist* dd = self._get()
        cdef CacheDesc desc = CacheDesc()
        cdef vector[uint64_t] addr_vec
        cdef RegisterCfg reg_cfg = RegisterCfg()   # reserved bytes only (cfg has no fields)
        cdef int64_t cache_id = -1
        cdef Status st
        _fill_cache_desc(desc, cache_desc, "cache_desc")
        _fill_u64_vector(addr_vec, addrs, "addrs")
        owners = getattr(addrs, "owners", None)
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.RegisterKvCache(desc, addr_vec, reg_cfg, cache_id)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            if owners:
                self._orphans.append(owners)   # the library's state is unknown
            return self._cxx_failed("RegisterKvCache", exc), -1
        if st == LLM_SUCCESS:
            if owners:
                self._owners[cache_id] = owners
            return st, cache_id
        if owners and st != LLM_FAILED:
            # Upstream keeps the entry of a registration whose cache table overflowed although it
            # returns PARAM_INVALID (SEMANTICS.md §3.7 step 10), and no id tells us which: keep
            # the memory alive until finalize rather than risk a use after free.
            self._orphans.append(owners)
        return st, -1

    def unregister_kv_cache(self, cache_id):
        """``UnregisterKvCache(cache_id)``; on success the kept owners are released."""
        cdef LlmDataDist* dd = self._get()
        cdef int64_t cid = _i64(cache_id, "cache_id")
        cdef Status st
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.UnregisterKvCache(cid)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("UnregisterKvCache", exc)
        if st == LLM_SUCCESS:
            self._owners.pop(cid, None)
        return st

    def allocate_cache(self, cache_desc):
        """``AllocateCache(cache_desc, cache)`` -> ``(status, Cache | None)`` (upstream:
        FEATURE_NOT_ENABLED, SEMANTICS.md §3.9)."""
        cdef LlmDataDist* dd = self._get()
        cdef CacheDesc desc = CacheDesc()
        cdef Cache out = Cache()
        cdef Status st
        _fill_cache_desc(desc, cache_desc, "cache_desc")
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.AllocateCache(desc, out)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            return self._cxx_failed("AllocateCache", exc), None
        if st != LLM_SUCCESS:
            return st, None
        return st, _cache_to_py(out)

    def deallocate_cache(self, cache_id):
        """``DeallocateCache(cache_id)`` (upstream: FEATURE_NOT_ENABLED)."""
        cdef LlmDataDist* dd = self._get()
        cdef int64_t cid = _i64(cache_id, "cache_id")
        cdef Status st
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.DeallocateCache(cid)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("DeallocateCache", exc)
        return st

    # ---- transfers --------------------------------------------------------------------------

    def pull_kv_cache(self, src_cache_index, dst_cache, batch_index, size, ext_param):
        """``PullKvCache(src_cache_index, dst_cache, batch_index, size, ext_param)``
        (SEMANTICS.md §3.10); ``ext_param=None`` is ``KvCacheExtParam{}``."""
        cdef LlmDataDist* dd = self._get()
        cdef CacheIndex index = CacheIndex()
        cdef Cache cache = Cache()
        cdef uint32_t batch = _u32(batch_index, "batch_index")
        cdef int64_t nbytes = _i64(size, "size")
        cdef KvCacheExtParam ext = KvCacheExtParam()
        cdef Status st
        _fill_cache_index(index, src_cache_index, "src_cache_index")
        _fill_cache(cache, dst_cache, "dst_cache")
        _fill_ext_param(ext, ext_param)
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.PullKvCache(index, cache, batch, nbytes, ext)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("PullKvCache", exc)
        return st

    def pull_kv_blocks(self, src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param):
        """``PullKvBlocks(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)``
        (SEMANTICS.md §3.11)."""
        cdef LlmDataDist* dd = self._get()
        cdef CacheIndex index = CacheIndex()
        cdef Cache cache = Cache()
        cdef vector[uint64_t] src
        cdef vector[uint64_t] dst
        cdef KvCacheExtParam ext = KvCacheExtParam()
        cdef Status st
        _fill_cache_index(index, src_cache_index, "src_cache_index")
        _fill_cache(cache, dst_cache, "dst_cache")
        _fill_u64_vector(src, src_blocks, "src_blocks")
        _fill_u64_vector(dst, dst_blocks, "dst_blocks")
        _fill_ext_param(ext, ext_param)
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.PullKvBlocks(index, cache, src, dst, ext)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("PullKvBlocks", exc)
        return st

    def push_kv_cache(self, src_cache, dst_cache_index, src_batch_index, size, ext_param):
        """``PushKvCache(src_cache, dst_cache_index, src_batch_index, size, ext_param)``
        (SEMANTICS.md §3.12)."""
        cdef LlmDataDist* dd = self._get()
        cdef Cache cache = Cache()
        cdef CacheIndex index = CacheIndex()
        cdef uint32_t batch = _u32(src_batch_index, "src_batch_index")
        cdef int64_t nbytes = _i64(size, "size")
        cdef KvCacheExtParam ext = KvCacheExtParam()
        cdef Status st
        _fill_cache(cache, src_cache, "src_cache")
        _fill_cache_index(index, dst_cache_index, "dst_cache_index")
        _fill_ext_param(ext, ext_param)
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.PushKvCache(cache, index, batch, nbytes, ext)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("PushKvCache", exc)
        return st

    def push_kv_blocks(self, src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param):
        """``PushKvBlocks(src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param)``
        (SEMANTICS.md §3.13)."""
        cdef LlmDataDist* dd = self._get()
        cdef Cache cache = Cache()
        cdef CacheIndex index = CacheIndex()
        cdef vector[uint64_t] src
        cdef vector[uint64_t] dst
        cdef KvCacheExtParam ext = KvCacheExtParam()
        cdef Status st
        _fill_cache(cache, src_cache, "src_cache")
        _fill_cache_index(index, dst_cache_index, "dst_cache_index")
        _fill_u64_vector(src, src_blocks, "src_blocks")
        _fill_u64_vector(dst, dst_blocks, "dst_blocks")
        _fill_ext_param(ext, ext_param)
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.PushKvBlocks(cache, index, src, dst, ext)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("PushKvBlocks", exc)
        return st

    def copy_kv_cache(self, src_cache, dst_cache, src_batch_index, dst_batch_index, offset,
                      size):
        """``CopyKvCache(src_cache, dst_cache, src_batch_index, dst_batch_index, offset, size)``
        (upstream: FEATURE_NOT_ENABLED, SEMANTICS.md §3.9)."""
        cdef LlmDataDist* dd = self._get()
        cdef Cache src = Cache()
        cdef Cache dst = Cache()
        cdef uint32_t src_batch = _u32(src_batch_index, "src_batch_index")
        cdef uint32_t dst_batch = _u32(dst_batch_index, "dst_batch_index")
        cdef uint64_t off = _u64(offset, "offset")
        cdef int64_t nbytes = _i64(size, "size")
        cdef Status st
        _fill_cache(src, src_cache, "src_cache")
        _fill_cache(dst, dst_cache, "dst_cache")
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.CopyKvCache(src, dst, src_batch, dst_batch, off, nbytes)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("CopyKvCache", exc)
        return st

    def copy_kv_blocks(self, src_cache, dst_cache, src_blocks, dst_blocks_list):
        """``CopyKvBlocks(src_cache, dst_cache, src_blocks, dst_blocks_list)`` (upstream:
        FEATURE_NOT_ENABLED, SEMANTICS.md §3.9)."""
        cdef LlmDataDist* dd = self._get()
        cdef Cache src = Cache()
        cdef Cache dst = Cache()
        cdef vector[uint64_t] src_vec
        cdef vector[vector[uint64_t]] dst_list
        cdef Status st
        _fill_cache(src, src_cache, "src_cache")
        _fill_cache(dst, dst_cache, "dst_cache")
        _fill_u64_vector(src_vec, src_blocks, "src_blocks")
        for i, blocks in enumerate(dst_blocks_list):
            dst_list.push_back(vector[uint64_t]())
            _fill_u64_vector(dst_list.back(), blocks, f"dst_blocks_list[{i}]")
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.CopyKvBlocks(src, dst, src_vec, dst_list)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("CopyKvBlocks", exc)
        return st
