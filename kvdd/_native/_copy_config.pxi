# Included by _copy.pyx (one module): the process-wide configuration of the copy kernels and its
# diagnostics (ISA, thresholds, the thread model, counters).

# ---- configuration ---------------------------------------------------------------------------------

def cpu_features():
    """CPU features checked at run time (``{"avx2": True, ...}``), for ``kvdd doctor``."""
    return {kvdd_cpu_feature_name(i).decode(): bool(kvdd_cpu_feature_value(i))
            for i in range(kvdd_cpu_feature_count())}


def cache_sizes():
    """The cache sizes the thresholds are derived from: ``{"l2": bytes per core, "llc": bytes}``
    (0: unknown), from Linux sysfs, else sysconf."""
    return {"l2": kvdd_l2_bytes(), "llc": kvdd_llc_bytes()}


def thread_stats():
    """Counters since import: of the 2-thread path ``calls``, ``chunks`` (work items),
    ``helper_chunks`` (those done by the second thread; the rest ran on the calling thread) and
    ``stalls``, ``post_ns`` and ``wait_ns`` (the caller's time posting the work and waiting at the end
    for the helper's last items), ``moves`` (the helper moved off the caller's CPU after the caller
    changed CPU) and ``wakes`` (the helper woken from sleep); ``jobs`` (copies that moved bytes) and
    ``job_ns`` (time spent copying them)."""
    cdef uint64_t out[KVDD_STATS]
    kvdd_thread_stats(out)
    return {"calls": out[0], "chunks": out[1], "helper_chunks": out[2], "stalls": out[3],
            "jobs": out[4], "job_ns": out[5], "post_ns": out[6], "wait_ns": out[7], "moves": out[8],
            "wakes": out[9]}


def job_ns():
    """``thread_stats()["job_ns"]`` alone (no dict: what the benchmarks read around a timed call)."""
    cdef uint64_t out[KVDD_STATS]
    kvdd_thread_stats(out)
    return out[5]


def available_isas():
    """Streaming implementations usable on this CPU, best last (``"memcpy"`` = regular stores)."""
    cdef unsigned m = kvdd_isa_mask()
    return [name for i, name in enumerate(_ISA_NAMES) if m & (1u << i)]


def get_isa():
    """The streaming implementation used for calls at or above the streaming threshold."""
    return _ISA_NAMES[_isa]


def set_isa(name):
    """Select the streaming implementation (``"avx512"``, ``"avx2"``, ``"sse2"``, ``"neon"``,
    ``"memcpy"`` or ``"best"``); returns the previous one. Raises ValueError for one this CPU cannot
    run."""
    global _isa
    prev = _ISA_NAMES[_isa]
    if name == "best":
        _isa = kvdd_isa_best()
        return prev
    if name not in _ISA_NAMES:
        raise ValueError(f"set_isa: unknown implementation {name!r}; choose from {_ISA_NAMES + ('best',)}")
    cdef int i = _ISA_NAMES.index(name)
    if not (kvdd_isa_mask() & (1u << i)):
        raise ValueError(f"set_isa: this CPU cannot run {name!r}; available: {available_isas()}")
    _isa = i
    return prev


cdef uint64_t _threshold_arg(object nbytes, str what) except? 0:
    n = PyNumber_Index(nbytes)
    if n < 0:
        raise ValueError(f"{what}: threshold must be >= 0 bytes, not {n}")
    return min(n, 1 << 62)


def get_streaming_threshold():
    """Bytes per call from which :func:`copy_runs` uses streaming stores."""
    return _streaming_threshold


def set_streaming_threshold(nbytes):
    """Set the streaming threshold in bytes (0: always stream); returns the previous value."""
    global _streaming_threshold
    prev = _streaming_threshold
    _streaming_threshold = _threshold_arg(nbytes, "set_streaming_threshold")
    return prev


def get_threads_threshold():
    """Bytes per call from which ``threads=0`` uses two threads, or None: decided by measured cost
    (see :func:`threads_model`)."""
    return None if _threads_threshold < 0 else _threads_threshold


def set_threads_threshold(nbytes):
    """Fix the automatic 2-thread threshold in bytes (0: always), or None: decide by measured cost;
    returns the previous setting."""
    global _threads_threshold
    prev = get_threads_threshold()
    _threads_threshold = -1 if nbytes is None else <int64_t>_threshold_arg(nbytes, "set_threads_threshold")
    return prev


def threads_model():
    """The measured costs behind the automatic thread choice: ``extra_us`` (what a 2-thread call
    costs its caller beyond its own share: posting the work, waiting for the helper's last item),
    ``one_thread_gbps`` (one thread's copy speed, from this process's calls of at
    least 256 KiB) and ``min_bytes`` (calls from this size use two threads when the threshold is
    None)."""
    cdef int64_t out[2]
    kvdd_threads_model(out)
    return {"extra_us": out[0] / 1e3, "one_thread_gbps": 1e3 / out[1] if out[1] > 0 else float("inf"),
            "min_bytes": kvdd_threads_min_bytes()}


def get_chunk_size():
    """Bytes per work item of the 2-thread path (0: automatic)."""
    return _chunk_size


def set_chunk_size(nbytes):
    """Set the bytes per work item of the 2-thread path (0: automatic); returns the previous value."""
    global _chunk_size
    prev = _chunk_size
    _chunk_size = _threshold_arg(nbytes, "set_chunk_size")
    return prev
