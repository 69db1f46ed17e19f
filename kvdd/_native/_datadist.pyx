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


cdef extern from "<shared_mutex>" namespace "std" nogil:
    cdef cppclass shared_mutex:
        shared_mutex() except +
        void lock()
        void unlock()
        void lock_shared()
        void unlock_shared()


cdef extern from "<string>" namespace "std":
    cdef cppclass string_t "std::string":
        const char* c_str()
        size_t size()


cdef extern from *:
    """
    #include <dlfcn.h>
    #include <link.h>
    #include <string>
    #ifndef KVDD_TEST_DOUBLE
    #define KVDD_TEST_DOUBLE 0
    #endif
    /* The loaded libllm_datadist.so (already mapped as a dependency of this module). */
    static void *kvdd_library_handle(void) {
        return dlopen("libllm_datadist.so", RTLD_LAZY | RTLD_NOLOAD);
    }
    static void *kvdd_test_double_symbol(const char *name) {
    #if KVDD_TEST_DOUBLE
        void *sym = NULL;
        void *handle = kvdd_library_handle();
        if (handle != NULL) {
            sym = dlsym(handle, name);
            dlclose(handle);
        }
        if (sym == NULL) {
            sym = dlsym(RTLD_DEFAULT, name);
        }
        return sym;
    #else
        (void)name;
        return NULL;
    #endif
    }
    /* Test double only: the port the simulator bound; -1 not listening, <= -2 unknown. */
    static int kvdd_td_listen_port(void *dd) {
        typedef int (*fn_t)(void *);
        fn_t fn = (fn_t)kvdd_test_double_symbol("kvdd_testdouble_listen_port");
        return fn == NULL ? -3 : fn(dd);
    }
    /* The library's explanation of the calling thread's last failed call, NULL when it has none:
       the simulated root's kvdd_testdouble_last_error, else ACL's aclGetRecentErrMsg (CANN's
       libascendcl.so, where the runtime records its errors) when it is loaded. */
    static const char *kvdd_library_message(void) {
        typedef const char *(*fn_t)(void);
        fn_t fn = (fn_t)kvdd_test_double_symbol("kvdd_testdouble_last_error");
        if (fn == NULL) {
            fn = (fn_t)dlsym(RTLD_DEFAULT, "aclGetRecentErrMsg");
        }
        return fn == NULL ? NULL : fn();
    }
    /* Test double only: its _GLIBCXX_USE_CXX11_ABI; -1 when unknown. */
    static int kvdd_td_cxx11_abi(void) {
        typedef int (*fn_t)(void);
        fn_t fn = (fn_t)kvdd_test_double_symbol("kvdd_testdouble_cxx11_abi");
        return fn == NULL ? -1 : fn();
    }
    static int kvdd_cxx11_abi(void) { return _GLIBCXX_USE_CXX11_ABI; }
    static int kvdd_built_against_test_double(void) { return KVDD_TEST_DOUBLE; }
    /* Path of the loaded libllm_datadist.so, "" when unknown. */
    static std::string kvdd_library_path(void) {
        std::string path;
        void *handle = kvdd_library_handle();
        if (handle != NULL) {
            struct link_map *map = NULL;
            if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != NULL && map->l_name != NULL) {
                path = map->l_name;
            }
            dlclose(handle);
        }
        return path;
    }
    """
    int kvdd_td_listen_port(void* dd) nogil
    int kvdd_td_cxx11_abi() nogil
    const char* kvdd_library_message() nogil
    int kvdd_cxx11_abi() nogil
    int kvdd_built_against_test_double() nogil
    string_t kvdd_library_path "kvdd_library_path"() except +


# ---- conversions (Python value types -> C++) --------------------------------------------------

_U8 = 0xFF
_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)


cdef object _as_int(object value, str name, object lo, object hi, str ctype):
    """``value`` as a Python int within [lo, hi]: TypeError for non-integers and bool,
    ValueError outside the C++ width (API.md "Value types").  The one width check is
    :func:`kvdd.types.check_int`, which also names ``ctype`` in its message."""
    return check_int(name, value, (lo, hi))


cdef inline uint64_t _u64(object value, str name) except? 0:
    return _as_int(value, name, 0, _U64, "uint64")


cdef inline uint32_t _u32(object value, str name) except? 0:
    return _as_int(value, name, 0, _U32, "uint32")


cdef inline uint16_t _u16(object value, str name) except? 0:
    return _as_int(value, name, 0, _U16, "uint16")


cdef inline uint8_t _u8(object value, str name) except? 0:
    return _as_int(value, name, 0, _U8, "uint8")


cdef inline int32_t _i32(object value, str name) except? -1:
    return _as_int(value, name, _I32[0], _I32[1], "int32")


cdef inline int64_t _i64(object value, str name) except? -1:
    return _as_int(value, name, _I64[0], _I64[1], "int64")


cdef AscendString _ascend_string(object text, str name) except *:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be str, not {type(text).__name__}")
    cdef bytes data = (<str>text).encode("utf-8")
    return AscendString(PyBytes_AS_STRING(data), <size_t>PyBytes_GET_SIZE(data))


cdef int _fill_options(cpp_map[AscendString, AscendString]& out, object options,
                       str name) except -1:
    if options is None:
        return 0
    if not isinstance(options, Mapping):
        raise TypeError(f"{name} must be a mapping of str to str, not {type(options).__name__}")
    for key, value in options.items():
        out.insert(pair[AscendString, AscendString](
            _ascend_string(key, f"{name} key"), _ascend_string(value, f"{name}[{key!r}]")))
    return 0


cdef int _fill_ip_infos(vector[IpInfo]& out, object infos, str name) except -1:
    cdef IpInfo info = IpInfo()
    for i, item in enumerate(infos):
        info = IpInfo()
        info.ip = _ascend_string(item.ip, f"{name}[{i}].ip")
        info.port = _u16(item.port, f"{name}[{i}].port")
        out.push_back(info)
    return 0


cdef int _fill_clusters(vector[ClusterInfo]& out, object clusters) except -1:
    cdef ClusterInfo* info
    for i, cluster in enumerate(clusters):
        out.push_back(ClusterInfo())
        info = &out.back()
        info.remote_cluster_id = _u64(cluster.remote_cluster_id,
                                      f"clusters[{i}].remote_cluster_id")
        info.remote_role_type = _i32(cluster.remote_role_type, f"clusters[{i}].remote_role_type")
        _fill_ip_infos(info.local_ip_infos, cluster.local_ip_infos,
                       f"clusters[{i}].local_ip_infos")
        _fill_ip_infos(info.remote_ip_infos, cluster.remote_ip_infos,
                       f"clusters[{i}].remote_ip_infos")
    return 0


cdef int _fill_u64_vector(vector[uint64_t]& out, object values, str name) except -1:
    out.reserve(len(values))
    for i, value in enumerate(values):
        out.push_back(_u64(value, f"{name}[{i}]"))
    return 0


cdef int _fill_cache_desc(CacheDesc& out, object desc, str name) except -1:
    # Out-of-enum values (API.md: placement any uint32, data_type any int32) go through the
    # enums' integer types unchanged.
    out.placement = <CachePlacement>_u32(desc.placement, f"{name}.placement")
    out.num_tensors = _u32(desc.num_tensors, f"{name}.num_tensors")
    out.data_type = <DataType>_i32(desc.data_type, f"{name}.data_type")
    for i, dim in enumerate(desc.shape):
        out.shape.push_back(_i64(dim, f"{name}.shape[{i}]"))
    return 0


cdef int _fill_cache(Cache& out, object cache, str name) except -1:
    out.cache_id = _i64(cache.cache_id, f"{name}.cache_id")
    for i, addr in enumerate(cache.tensor_addrs):
        out.tensor_addrs.push_back(<uintptr_t>_u64(addr, f"{name}.tensor_addrs[{i}]"))
    _fill_cache_desc(out.cache_desc, cache.cache_desc, f"{name}.cache_desc")
    return 0


cdef int _fill_cache_index(CacheIndex& out, object index, str name) except -1:
    out.cluster_id = _u64(index.cluster_id, f"{name}.cluster_id")
    out.cache_id = _i64(index.cache_id, f"{name}.cache_id")
    out.batch_index = _u32(index.batch_index, f"{name}.batch_index")
    return 0


cdef int _fill_ext_param(KvCacheExtParam& out, object param) except -1:
    # None keeps the C++ default ({-1, -1}, {-1, -1}, 2).  Ranges are inclusive (first, last)
    # pairs in both kvdd and C++: copied as they are.
    if param is None:
        return 0
    src_first, src_last = param.src_layer_range
    dst_first, dst_last = param.dst_layer_range
    out.src_layer_range.first = _i32(src_first, "ext_param.src_layer_range[0]")
    out.src_layer_range.second = _i32(src_last, "ext_param.src_layer_range[1]")
    out.dst_layer_range.first = _i32(dst_first, "ext_param.dst_layer_range[0]")
    out.dst_layer_range.second = _i32(dst_last, "ext_param.dst_layer_range[1]")
    out.tensor_num_per_layer = _u8(param.tensor_num_per_layer, "ext_param.tensor_num_per_layer")
    return 0


# ---- C++ -> Python ----------------------------------------------------------------------------

cdef object _cache_to_py(const Cache& cache):
    from kvdd import types

    desc = types.CacheDesc(
        num_tensors=cache.cache_desc.num_tensors,
        data_type=<int32_t>cache.cache_desc.data_type,
        shape=tuple(cache.cache_desc.shape),
        placement=<uint32_t>cache.cache_desc.placement,
    )
    return types.Cache(
        cache_id=cache.cache_id,
        tensor_addrs=tuple(<uint64_t>a for a in cache.tensor_addrs),
        cache_desc=desc,
    )


cdef str _cxx_message(str call, object exc):
    """The explanation of a C++ exception that ``except +`` turned into ``exc``."""
    message = str(exc) or type(exc).__name__
    return f"llm_datadist::LlmDataDist::{call} threw a C++ exception: {message}"


cdef object _raise_cxx(str call, object exc):
    """For the two members without a status to return (constructor, Finalize): raise through
    kvdd.status.raise_for_status, the one status -> exception function."""
    from kvdd.status import Status as PyStatus, raise_for_status

    raise_for_status(PyStatus.LLM_FAILED, f"llm_datadist::LlmDataDist::{call}",
                     None, _cxx_message(call, exc))


cdef object _listen_port_of(object value):
    """The TCP port an accepted ``llm.ListenIpInfo`` value listens on (low 16 bits, as the
    socket layer truncates it; SEMANTICS.md §3.2 step 4)."""
    try:
        from kvdd.options import parse_listen_ip_info

        return parse_listen_ip_info(value)[1] & 0xFFFF
    except Exception:  # the library accepted it; be lenient about our own parse
        text = value.rsplit(":", 1)[-1]
        return int(text) & 0xFFFF if text.strip().lstrip("+").isdigit() else 0


cdef str _c_text(const char* text):
    return text.decode("utf-8")


def header_constants():
    """Option keys and statuses as ``llm_datadist/llm_datadist.h`` defines them.

    Returns ``{name: value}`` for the eight ``OPTION_*`` keys and ``LLM_SUCCESS``/``LLM_FAILED``
    (compiled in from the header this module was built against), so tests and ``kvdd doctor``
    can compare them with :mod:`kvdd.options` and :class:`kvdd.Status`.
    """
    return {
        "OPTION_LISTEN_IP_INFO": _c_text(OPTION_LISTEN_IP_INFO),
        "OPTION_DEVICE_ID": _c_text(OPTION_DEVICE_ID),
        "OPTION_SYNC_CACHE_WAIT_TIME": _c_text(OPTION_SYNC_CACHE_WAIT_TIME),
        "OPTION_BUF_POOL_CFG": _c_text(OPTION_BUF_POOL_CFG),
        "OPTION_ENABLE_SET_ROLE": _c_text(OPTION_ENABLE_SET_ROLE),
        "OPTION_LOCAL_COMM_RES": _c_text(OPTION_LOCAL_COMM_RES),
        "OPTION_TRANSFER_BACKEND": _c_text(OPTION_TRANSFER_BACKEND),
        "OPTION_GLOBAL_RESOURCE_CONFIG": _c_text(OPTION_GLOBAL_RESOURCE_CONFIG),
        "LLM_SUCCESS": <uint32_t>LLM_SUCCESS,
        "LLM_FAILED": <uint32_t>LLM_FAILED,
    }


def build_info():
    """How this module was built and what it loaded.

    Keys: ``cxx11_abi`` (the ``_GLIBCXX_USE_CXX11_ABI`` it was compiled with), ``test_double``
    (built against kvdd's CI test double), ``test_double_cxx11_abi`` (the double's setting, None
    when not the double), ``library`` (path of the loaded ``libllm_datadist.so``, '' if unknown).
    """
    cdef string_t path = kvdd_library_path()
    double_abi = kvdd_td_cxx11_abi()
    return {
        "cxx11_abi": kvdd_cxx11_abi(),
        "test_double": bool(kvdd_built_against_test_double()),
        "test_double_cxx11_abi": None if double_abi < 0 else double_abi,
        "library": path.c_str()[:path.size()].decode("utf-8", "surrogateescape"),
    }


cdef class NativeBackend:
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

    cdef LlmDataDist* _dd
    cdef shared_mutex* _mutex
    cdef dict _owners        # cache id -> TensorAddrs.owners kept alive while registered
    cdef list _orphans       # owners of registrations whose entry may remain (see register)
    cdef bint _initialized
    cdef bint _hixl
    cdef int _listen         # port parsed from llm.ListenIpInfo, -1 when not listening
    cdef object _local       # threading.local: .detail = this thread's last failure explanation

    def __cinit__(self, *args, **kwargs):
        self._dd = NULL
        self._mutex = new shared_mutex()
        self._owners = {}
        self._orphans = []
        self._initialized = False
        self._hixl = False
        self._listen = -1
        self._local = threading.local()

    def __init__(self, cluster_id, role):
        cdef uint64_t cid = _u64(cluster_id, "cluster_id")
        cdef int32_t r = _i32(role, "role")
        if self._dd != NULL:
            raise RuntimeError("NativeBackend is already constructed")
        try:
            with nogil:
                self._dd = new LlmDataDist(cid, <LlmRole>r)
        except Exception as exc:
            _raise_cxx("LlmDataDist", exc)

    def __dealloc__(self):
        # Upstream's destructor tears a still-initialized instance down; owners are released by
        # Cython after this returns, i.e. after the library has forgotten the memory.
        if self._dd != NULL:
            with nogil:
                del self._dd
            self._dd = NULL
        if self._mutex != NULL:
            del self._mutex
            self._mutex = NULL

    def __repr__(self):
        return f"<NativeBackend initialized={bool(self._initialized)} listen_port={self.listen_port}>"

    cdef LlmDataDist* _get(self) except NULL:
        if self._dd == NULL:
            raise RuntimeError("NativeBackend.__init__ was not called")
        self._local.detail = None   # a new call: forget the previous explanation
        self._local.fresh = True
        return self._dd

    cdef Status _cxx_failed(self, str call, object exc):
        """A C++ exception from ``call``: LLM_FAILED, with the C++ message kept as this thread's
        ``last_error_detail()``."""
        self._local.detail = _cxx_message(call, exc)
        return LLM_FAILED

    def last_error_detail(self):
        """The explanation of this thread's last non-success status, or None (API.md, Backend
        protocol).

        The message of a C++ exception the library threw (the call returned LLM_FAILED); else the
        library's own explanation of the failed call when it offers one (the simulated CANN root
        always does; on CANN, ACL's ``aclGetRecentErrMsg``), else None.  Meaningful right after
        the failed call, on its thread; reading it clears it.
        """
        cdef const char* text
        if not getattr(self._local, "fresh", False):
            return None
        self._local.fresh = False
        detail = self._local.detail
        self._local.detail = None
        if detail is None:
            text = kvdd_library_message()
            if text != NULL and text[0] != 0:
                detail = text.decode("utf-8", "replace")
        return detail

    # ---- lifecycle --------------------------------------------------------------------------

    def initialize(self, options):
        """``Initialize(options)``: option keys and values are str (SEMANTICS.md §3.2)."""
        cdef LlmDataDist* dd = self._get()
        cdef cpp_map[AscendString, AscendString] opts
        cdef Status st
        _fill_options(opts, options, "options")
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.Initialize(opts)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("Initialize", exc)
        if st == LLM_SUCCESS and not self._initialized:
            # An already initialized instance ignores new options (SEMANTICS.md §3.2 step 1).
            self._initialized = True
            backend = options.get(_c_text(OPTION_TRANSFER_BACKEND))
            self._hixl = backend == "hixl"
            listen = options.get(_c_text(OPTION_LISTEN_IP_INFO))
            self._listen = -1 if listen is None else _listen_port_of(listen)
        return st

    def finalize(self):
        """``Finalize()``: waits for calls in flight, then drops the owners kept so far."""
        cdef LlmDataDist* dd = self._get()
        # Swap the owner tables before the call: a registration that completes after Finalize
        # (in another thread) lands in the new table and stays alive; one in flight during it is
        # kept too (until the next unregister/finalize), which is safe.
        owners, orphans = self._owners, self._orphans
        self._owners, self._orphans = {}, []
        try:
            with nogil:
                self._mutex.lock()
                try:
                    dd.Finalize()
                    # Still exclusive: no call can observe the old state after Finalize.
                    self._initialized = False
                    self._hixl = False
                    self._listen = -1
                finally:
                    self._mutex.unlock()
        except Exception as exc:
            # State unknown: keep every owner (memory safety first).
            owners.update(self._owners)
            orphans.extend(self._orphans)
            self._owners, self._orphans = owners, orphans
            _raise_cxx("Finalize", exc)
        del owners, orphans   # released here, after the library forgot the memory

    def set_role(self, role, options):
        """``SetRole(role, options)``: role any int32; options may be empty (SEMANTICS.md §3.4)."""
        cdef LlmDataDist* dd = self._get()
        cdef int32_t r = _i32(role, "role")
        cdef cpp_map[AscendString, AscendString] opts
        cdef Status st
        _fill_options(opts, options, "options")
        try:
            with nogil:
                self._mutex.lock_shared()
                try:
                    st = dd.SetRole(<LlmRole>r, opts)
                finally:
                    self._mutex.unlock_shared()
        except Exception as exc:
            st = self._cxx_failed("SetRole", exc)
        if st == LLM_SUCCESS and not self._hixl:
            # comm backend: listen info (re)starts listening, its absence stops it.  The HIXL
            # backend never changes its listener (SEMANTICS.md §3.4 step 5).
            listen = None if options is None else options.get(_c_text(OPTION_LISTEN_IP_INFO))
            self._listen = -1 if listen is None else _listen_port_of(listen)
        return st

    @property
    def listen_port(self):
        """The TCP port this instance listens on, None when not listening.

        The real library has no call for it: the port comes from the ``llm.ListenIpInfo``
        accepted by ``Initialize``/``SetRole`` (low 16 bits); on a real CANN install the binding
        cannot learn which port 0 bound and reports 0 (choose a fixed port there).  A build
        against kvdd's simulated CANN root asks the root instead, which knows exactly (also for
        the internal listen keys and SetRole's normalized compares); ``KVDD_TESTDOUBLE_PORT_HOOK=0``
        turns that off so the build behaves like a real install (the conformance run "as on an
        Atlas node" sets it, so nothing in it relies on the hook).
        """
        if (self._dd != NULL and kvdd_built_against_test_double()
                and os.environ.get("KVDD_TESTDOUBLE_PORT_HOOK", "1") != "0"):
            port = kvdd_td_listen_port(<void*>self._dd)
            if port >= 0:
                return port
            if port == -1:
                return None
        if self._listen < 0:
            return None
        return self._listen

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
