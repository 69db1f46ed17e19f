# cython: language_level=3
# Declarations of the LLM-DataDist C++ API (``llm_datadist/llm_datadist.h``) for Cython.
#
# Restated by kvdd from the type and signature tables of VENDOR.md (the vendor header is not copied).
# Names are the vendor's exactly, and only names the real header has are declared (Cython emits
# code for a declaration only when it is used, so a wrong one would break only the first real
# build that uses it, while CI against a permissive double stays green).  The reserved byte
# arrays that end every struct are not declared: user code does not touch them and the C++
# compiler sees the real layout.  They have no default initializer upstream
# (except RegisterCfg's): the binding value-initializes every struct it fills (``T()``), which
# zeroes them; tests/native/test_native_hardening.py checks that.
#
# Every ``LlmDataDist`` member is ``except +`` (none is ``noexcept`` upstream) and ``nogil``: kvdd
# calls them with the GIL released; a C++ exception becomes the status ``LLM_FAILED`` with the C++
# message as the call's ``last_error_detail()``.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libcpp cimport bool as cpp_bool
from libcpp.map cimport map as cpp_map
from libcpp.utility cimport pair
from libcpp.vector cimport vector


# ---- ge:: (graph/ascend_string.h, graph/types.h, external/ge_common/api_error_codes.h, all
# ---- included by llm_datadist.h) --------------------------------------------------------------
cdef extern from "llm_datadist/llm_datadist.h" namespace "ge" nogil:
    ctypedef uint32_t Status

    cdef cppclass AscendString:
        AscendString()
        AscendString(const char* name)
        AscendString(const char* name, size_t length)
        const char* GetString()
        size_t GetLength()
        cpp_bool operator<(const AscendString& other)

    # Plain enum without a fixed underlying type (SEMANTICS.md §5); kvdd stores any int32 in it.
    enum DataType:
        DT_FLOAT
        DT_FLOAT16
        DT_INT8
        DT_INT32
        DT_UINT8
        DT_INT16
        DT_UINT16
        DT_UINT32
        DT_INT64
        DT_UINT64
        DT_DOUBLE
        DT_BOOL
        DT_STRING
        DT_DUAL_SUB_INT8
        DT_DUAL_SUB_UINT8
        DT_COMPLEX64
        DT_COMPLEX128
        DT_QINT8
        DT_QINT16
        DT_QINT32
        DT_QUINT8
        DT_QUINT16
        DT_RESOURCE
        DT_STRING_REF
        DT_DUAL
        DT_VARIANT
        DT_BF16
        DT_UNDEFINED
        DT_INT4
        DT_UINT1
        DT_INT2
        DT_UINT2
        DT_COMPLEX32
        DT_HIFLOAT8
        DT_FLOAT8_E5M2
        DT_FLOAT8_E4M3FN
        DT_FLOAT8_E8M0
        DT_FLOAT6_E3M2
        DT_FLOAT6_E2M3
        DT_FLOAT4_E2M1
        DT_FLOAT4_E1M2


# ---- llm_datadist:: -----------------------------------------------------------------------------
cdef extern from "llm_datadist/llm_datadist.h" namespace "llm_datadist" nogil:
    # Option keys (constexpr const char[]).
    const char OPTION_LISTEN_IP_INFO[]
    const char OPTION_DEVICE_ID[]
    const char OPTION_SYNC_CACHE_WAIT_TIME[]
    const char OPTION_BUF_POOL_CFG[]
    const char OPTION_ENABLE_SET_ROLE[]
    const char OPTION_LOCAL_COMM_RES[]
    const char OPTION_TRANSFER_BACKEND[]
    const char OPTION_GLOBAL_RESOURCE_CONFIG[]

    # Statuses (constexpr Status): the 18 codes llm_datadist.h defines (VENDOR.md).  The other
    # twelve codes of kvdd.Status live only as ge::LLM_* in ge/llm_error_codes.h, which
    # llm_datadist.h does not include: declaring them here would break a real build on first use.
    const Status LLM_SUCCESS
    const Status LLM_FAILED
    const Status LLM_WAIT_PROC_TIMEOUT
    const Status LLM_KV_CACHE_NOT_EXIST
    const Status LLM_PARAM_INVALID
    const Status LLM_NOT_YET_LINK
    const Status LLM_ALREADY_LINK
    const Status LLM_LINK_FAILED
    const Status LLM_UNLINK_FAILED
    const Status LLM_NOTIFY_PROMPT_UNLINK_FAILED
    const Status LLM_CLUSTER_NUM_EXCEED_LIMIT
    const Status LLM_PROCESSING_LINK
    const Status LLM_DEVICE_OUT_OF_MEMORY
    const Status LLM_EXIST_LINK
    const Status LLM_FEATURE_NOT_ENABLED
    const Status LLM_TIMEOUT
    const Status LLM_LINK_BUSY
    const Status LLM_OUT_OF_MEMORY

    enum class LlmRole(int32_t):
        kPrompt
        kDecoder
        kMix
        kEnd

    enum class CachePlacement(uint32_t):
        kHost
        kDevice

    cdef cppclass IpInfo:
        IpInfo()    # implicit default constructor
        AscendString ip
        uint16_t port

    cdef cppclass ClusterInfo:
        ClusterInfo()    # implicit default constructor
        uint64_t remote_cluster_id
        int32_t remote_role_type
        vector[IpInfo] local_ip_infos
        vector[IpInfo] remote_ip_infos

    # No default member initializers upstream: value-initialize (CacheIndex()) before use.
    cdef cppclass CacheIndex:
        CacheIndex()    # implicit default constructor
        uint64_t cluster_id
        int64_t cache_id
        uint32_t batch_index

    cdef cppclass CacheDesc:
        CacheDesc()    # implicit default constructor
        CachePlacement placement
        uint32_t num_tensors
        DataType data_type
        vector[int64_t] shape

    cdef cppclass Cache:
        Cache()    # implicit default constructor
        int64_t cache_id
        vector[uintptr_t] tensor_addrs
        CacheDesc cache_desc

    cdef cppclass KvCacheExtParam:
        KvCacheExtParam()    # implicit default constructor
        pair[int32_t, int32_t] src_layer_range     # inclusive (first, last)
        pair[int32_t, int32_t] dst_layer_range     # inclusive (first, last)
        uint8_t tensor_num_per_layer

    cdef cppclass RegisterCfg:
        RegisterCfg()    # implicit default constructor (reserved bytes zeroed)

    cdef cppclass LlmDataDist:
        LlmDataDist(uint64_t cluster_id, LlmRole role) except +
        Status Initialize(const cpp_map[AscendString, AscendString]& options) except +
        void Finalize() except +
        Status SetRole(LlmRole role, const cpp_map[AscendString, AscendString]& options) except +
        Status LinkLlmClusters(const vector[ClusterInfo]& clusters, vector[Status]& rets,
                               int32_t timeout_in_millis) except +
        Status UnlinkLlmClusters(const vector[ClusterInfo]& clusters, vector[Status]& rets,
                                 int32_t timeout_in_millis, cpp_bool force_flag) except +
        Status AllocateCache(const CacheDesc& cache_desc, Cache& cache) except +
        Status DeallocateCache(int64_t cache_id) except +
        Status PullKvCache(const CacheIndex& src_cache_index, const Cache& dst_cache,
                           uint32_t batch_index, int64_t size,
                           const KvCacheExtParam& ext_param) except +
        Status PullKvBlocks(const CacheIndex& src_cache_index, const Cache& dst_cache,
                            const vector[uint64_t]& src_blocks, const vector[uint64_t]& dst_blocks,
                            const KvCacheExtParam& ext_param) except +
        Status CopyKvCache(const Cache& src_cache, const Cache& dst_cache,
                           uint32_t src_batch_index, uint32_t dst_batch_index, uint64_t offset,
                           int64_t size) except +
        Status CopyKvBlocks(const Cache& src_cache, const Cache& dst_cache,
                            const vector[uint64_t]& src_blocks,
                            const vector[vector[uint64_t]]& dst_blocks_list) except +
        Status PushKvCache(const Cache& src_cache, const CacheIndex& dst_cache_index,
                           uint32_t src_batch_index, int64_t size,
                           const KvCacheExtParam& ext_param) except +
        Status PushKvBlocks(const Cache& src_cache, const CacheIndex& dst_cache_index,
                            const vector[uint64_t]& src_blocks, const vector[uint64_t]& dst_blocks,
                            const KvCacheExtParam& ext_param) except +
        Status RegisterKvCache(const CacheDesc& cache_desc, const vector[uint64_t]& addrs,
                               const RegisterCfg& cfg, int64_t& cache_id) except +
        Status UnregisterKvCache(int64_t cache_id) except +
