"""The per-call overhead section of ``kvdd bench``: a 64-byte single-tensor pull through the facade,
through the backend object, with many caches and links around, and the bare copy-kernel call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import ExitStack

import numpy as np
import numpy.typing as npt

from .. import Cache, CacheDesc, CacheIndex, DataType, KvCacheExtParam, LlmRole, tensor_addrs
from .._native import _copy
from .baselines import arena, fill_pattern
from .harness import Row, per_call_overhead
from .transfers import PREFILL_ID, instance, instance_pair, link

__all__ = ["measure_overhead"]


def measure_overhead(calls: int, batches: int, extra_caches: int = 256, extra_peers: int = 4) -> list[Row]:
    """Per-call time of a 64-byte single-tensor pull (one 64-byte row of a ``[4, 64]`` uint8 cache)
    through the facade and through the backend object, then again with `extra_caches` more caches
    registered on both sides and `extra_peers` more linked instances; and the bare kernel call."""
    out: list[Row] = []

    def add(case: str, path: str, fn: Callable[[], object]) -> None:
        row: Row = {"case": case, "path": path, "bytes": 64}
        row.update(per_call_overhead(fn, calls, batches))
        out.append(row)

    with ExitStack() as stack:
        p, d = stack.enter_context(instance_pair())
        desc = CacheDesc(1, DataType.DT_UINT8, (4, 64))
        a = arena(256)
        fill_pattern(a)
        b = arena(256)
        b.fill(0)
        pid = p.register_kv_cache(desc, tensor_addrs([a]))
        did = d.register_kv_cache(desc, tensor_addrs([b]))
        link(d, p)
        idx = CacheIndex(PREFILL_ID, pid, 1)
        cache = Cache(did, (), desc)
        ext = KvCacheExtParam()
        d.pull_kv_cache(idx, cache)
        if not np.array_equal(b[:64], a[64:128]):
            raise RuntimeError("the 64-byte pull moved the wrong bytes")
        backend = d.backend
        add("pull 64 B", "LlmDataDist.pull_kv_cache(idx, cache)", functools.partial(d.pull_kv_cache, idx, cache))
        add("pull 64 B", "LlmDataDist.pull_kv_cache(idx, cache, 0, -1, ext)",
            functools.partial(d.pull_kv_cache, idx, cache, 0, -1, ext))
        add("pull 64 B", "backend.pull_kv_cache(idx, cache, 0, -1, ext)",
            functools.partial(backend.pull_kv_cache, idx, cache, 0, -1, ext))

        # the same pull with many caches and links around (a fresh link sees the new caches)
        keep: list[npt.NDArray[np.uint8]] = []
        for dd in (p, d):
            for _ in range(extra_caches):
                m = arena(256)
                m.fill(0)
                keep.append(m)
                dd.register_kv_cache(desc, tensor_addrs([m]))
        for i in range(extra_peers):
            q = stack.enter_context(instance(100 + i, LlmRole.PROMPT, 2 + i))
            link(d, q)
        add(f"pull 64 B, +{extra_caches} caches, +{extra_peers} links",
            "LlmDataDist.pull_kv_cache(idx, cache)", functools.partial(d.pull_kv_cache, idx, cache))

        ra = _copy.Region(a.ctypes.data, a.nbytes, a)
        rb = _copy.Region(b.ctypes.data, b.nbytes, b)
        z = np.zeros(1, dtype=np.int64)
        ln = np.array([64], dtype=np.int64)
        add("copy 64 B", "kernel copy_runs (floor)", functools.partial(_copy.copy_runs, [ra], [rb], z, z, ln))
    return out

