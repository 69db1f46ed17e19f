# Included by _datadist.pyx (textually, sharing its cimports): kvdd's value types (kvdd.types)
# field by field into the C++ structs of llm_datadist.h, each integer checked against its C++
# width, and the few conversions back.

# ---- conversions (Python value types -> C++) --------------------------------------------------

_U8 = 0xFF
_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)
cdef enum:
    _DT_MAX = 43  # ge::DT_MAX, itself an enumerator


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


cdef inline bint _is_data_type_enumerator(int32_t value) noexcept:
    """An enumerator of ge::DataType: 0..4 and 6..DT_MAX (43) (SEMANTICS.md §5, VENDOR.md)."""
    return 0 <= value <= _DT_MAX and value != 5


cdef int _fill_cache_desc(CacheDesc& out, object desc, str name) except -1:
    # placement: an enum class over uint32_t, so any uint32 is a valid value (API.md).  data_type:
    # a plain enum, and converting an integer that is no enumerator into it is undefined (VENDOR.md):
    # such a value becomes DT_UNDEFINED, which the library refuses with LLM_PARAM_INVALID at the
    # very check that refuses the original (RegisterKvCache step 8, after the cache id is
    # consumed, SEMANTICS.md §3.7), so the check order and the status stay upstream's.
    out.placement = <CachePlacement>_u32(desc.placement, f"{name}.placement")
    out.num_tensors = _u32(desc.num_tensors, f"{name}.num_tensors")
    cdef int32_t data_type = _i32(desc.data_type, f"{name}.data_type")
    out.data_type = <DataType>data_type if _is_data_type_enumerator(data_type) else DT_UNDEFINED
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
