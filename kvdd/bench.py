"""``kvdd bench``: simulator transfer speed on real model KV-cache geometries, measured against the
machine's own memcpy in the same run.

Two in-process simulator instances (``LlmDataDist(..., backend="sim")``, prefill cluster 1 and
decode cluster 2, both listening on 127.0.0.1 port 0 and linked) move a model's KV cache through the
public API, as a serving engine would:

``pull_row``     PullKvCache of one full batch row of every tensor (contiguous ``[batch, seq, ...]``
                 layout; one row = the request's tokens);
``pull_size``    PullKvCache with ``size``: the first half of the row's tokens of every tensor;
``pull_layers``  PullKvCache of the row one layer at a time (``KvCacheExtParam`` layer ranges
                 ``(l, l)``, prebuilt), all layers: the bytes of ``pull_row`` in ``layers`` calls;
``push_row``     PushKvCache of one full row of every tensor, prefill -> decode (all layers, one call);
``pull_blocks``  PullKvBlocks of the request's blocks from random, distinct, unordered block ids of a
                 paged cache twice as large, into random ids (so nearly every block is its own run);
``push_blocks``  PushKvBlocks of the same shape, prefill -> decode.

Geometries (MODELS.md; 128-token blocks, bf16): Qwen2.5-7B (56 tensors, 128 KiB per block and
tensor), Llama-3.1-8B (64, 256 KiB), DeepSeek-V3 latent (61, 128 KiB) and rope (61, 16 KiB) caches,
GLM-5 DSA indexer keys (78, 32 KiB), and the synthetic single-tensor 1024 x 64 KiB and
4096 x 16 KiB block cases.

Every row reports bytes moved, min/median time over interleaved repeats, GB/s (decimal), the
best plain ``memcpy`` of the same number of bytes between the same two buffers with 1 thread and
with 2 threads (two halves at once) measured interleaved with the transfer, and ``ratio`` = best
memcpy time / transfer time (min over repeats; ``ratio_median`` from medians; > 1 is faster than
memcpy, possible because large copies use streaming stores). Every transfer kind is checked once
against the source bytes before timing (``verified``).

The per-call overhead of a 64-byte single-tensor pull is measured through ``LlmDataDist.pull_kv_cache``
with prebuilt ``CacheIndex``/``Cache`` objects (with ``ext_param`` left out, and prebuilt), through
the backend object directly, with many caches registered and peers linked, and for the bare copy
kernel call.

Benchmarks are not tests: they report, they do not assert (DESIGN.md). ``--quick`` takes well under
a minute on 2 cores; ``--json`` prints one JSON document instead of tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from . import (
    OPTION_DEVICE_ID,
    OPTION_LISTEN_IP_INFO,
    OPTION_SYNC_CACHE_WAIT_TIME,
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmDataDist,
    LlmRole,
    tensor_addrs,
)
from ._native import _copy

__all__ = [
    "GEOMETRIES",
    "KINDS",
    "SCHEMA",
    "BenchGeometry",
    "add_bench_arguments",
    "main",
    "measure_cross_process",
    "measure_overhead",
    "measure_transfers",
    "run_from_args",
]

#: Identifies the JSON document ``kvdd bench --json`` prints.
SCHEMA = "kvdd.bench/1"

KiB = 1 << 10
MiB = 1 << 20
BLOCK_TOKENS = 128
LOCALHOST = "127.0.0.1"
PREFILL_ID, DECODE_ID = 1, 2

#: Transfer kinds, in the order they are measured.
KINDS = ("pull_row", "pull_size", "pull_layers", "push_row", "pull_blocks", "push_blocks")

Row = dict[str, Any]
Timing = dict[str, Any]


# ---- geometries ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchGeometry:
    """One cache family of a model: ``tensors`` tensors of ``token_shape`` bf16 elements per token,
    ``per_layer`` tensors per layer (2: K and V; 1: MLA). ``blocks`` fixes the request's block
    count (synthetic cases); otherwise it follows ``--tokens``."""

    name: str
    model: str
    tensors: int
    per_layer: int
    token_shape: tuple[int, ...]
    blocks: int | None = None

    @property
    def token_bytes(self) -> int:
        n = 2  # bf16
        for d in self.token_shape:
            n *= d
        return n

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * BLOCK_TOKENS

    @property
    def layers(self) -> int:
        return self.tensors // self.per_layer

    def request_blocks(self, tokens: int, synthetic_blocks: int | None) -> int:
        if self.blocks is not None:
            return synthetic_blocks if synthetic_blocks is not None else self.blocks
        return max(1, tokens // BLOCK_TOKENS)


GEOMETRIES: dict[str, BenchGeometry] = {g.name: g for g in (
    BenchGeometry("qwen2.5-7b", "Qwen2.5-7B K/V", 56, 2, (4, 128)),
    BenchGeometry("llama-3.1-8b", "Llama-3.1-8B K/V", 64, 2, (8, 128)),
    BenchGeometry("deepseek-v3-latent", "DeepSeek-V3 MLA latent", 61, 1, (512,)),
    BenchGeometry("deepseek-v3-rope", "DeepSeek-V3 MLA rope", 61, 1, (64,)),
    BenchGeometry("glm-5-indexer", "GLM-5 DSA indexer keys", 78, 1, (128,)),
    BenchGeometry("synthetic-1024x64k", "1 tensor, 1024 x 64 KiB blocks", 1, 1, (256,), blocks=1024),
    BenchGeometry("synthetic-4096x16k", "1 tensor, 4096 x 16 KiB blocks", 1, 1, (64,), blocks=4096),
)}


# ---- measuring (the helpers of benchmarks/harness.py, inside the installed package) ----------------


def _timing(samples: Sequence[float]) -> Timing:
    return {"min_s": min(samples), "median_s": statistics.median(samples), "samples": len(samples)}


def interleaved(fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, Timing]:
    """Time several operations in turn (a, b, c, a, b, c, ...) so that each sees the same machine
    state; one ``{"min_s", "median_s", "samples"}`` per name."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.perf_counter
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return {name: _timing(s) for name, s in samples.items()}


def repeats_for(nbytes: int, budget_s: float = 0.25, bandwidth: float = 10e9, lo: int = 5, hi: int = 200) -> int:
    """A repeat count that spends about `budget_s` per operation at `bandwidth` bytes/s."""
    est = nbytes / bandwidth
    return max(lo, min(hi, int(budget_s / max(est, 1e-9))))


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def time_repeats(fn: Callable[[], object], repeats: int, warmup: int = 1) -> Timing:
    """Time `repeats` calls of `fn` (after `warmup` untimed calls): ``{"min_s", "median_s", "samples"}``."""
    for _ in range(warmup):
        fn()
    samples = []
    clock = time.perf_counter
    for _ in range(repeats):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return _timing(samples)


def compare(case: str, nbytes: int, candidate: Timing, limit: Timing, **extra: Any) -> dict[str, Any]:
    """One result row: bytes, candidate and limit times (min and median), GB/s, and the ratio
    candidate-bandwidth / limit-bandwidth (``ratio`` from min times, ``ratio_median`` from medians)."""
    row: dict[str, Any] = {"case": case}
    row.update(extra)
    row.update({
        "bytes": nbytes,
        "min_ms": candidate["min_s"] * 1e3,
        "median_ms": candidate["median_s"] * 1e3,
        "gbps": gbps(nbytes, candidate["min_s"]),
        "limit_gbps": gbps(nbytes, limit["min_s"]),
        "ratio": limit["min_s"] / candidate["min_s"],
        "ratio_median": limit["median_s"] / candidate["median_s"],
        "samples": candidate["samples"],
    })
    return row


def dump_json(payload: Any, file: IO[str] | None = None) -> None:
    """Write `payload` as indented JSON (to stdout by default)."""
    out = file if file is not None else sys.stdout
    json.dump(payload, out, indent=2, sort_keys=False)
    out.write("\n")
    out.flush()


def per_call_overhead(fn: Callable[[], object], calls: int = 20000, batches: int = 15) -> dict[str, Any]:
    """Per-call time of a tiny operation: `batches` timed loops of `calls` calls each (an empty loop's
    time subtracted); ``{"min_us", "median_us", "calls"}``."""
    clock = time.perf_counter
    rng = range(calls)
    per: list[float] = []
    for _ in range(batches):
        t0 = clock()
        for _ in rng:
            pass
        empty = clock() - t0
        t0 = clock()
        for _ in rng:
            fn()
        per.append((clock() - t0 - empty) / calls)
    return {"min_us": min(per) * 1e6, "median_us": statistics.median(per) * 1e6, "calls": calls * batches}


def _proc_stat_cpu() -> tuple[float, float] | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = float(os.sysconf("SC_CLK_TCK"))
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    total = sum(fields[:8])
    return (total - idle) / hz, total / hz


class LoadMonitor:
    """How busy the machine was with other work while measuring (fraction of all CPUs)."""

    def __init__(self) -> None:
        self._start: tuple[float, float] | None = None
        self._end: tuple[float, float] | None = None
        self._own = 0.0

    def __enter__(self) -> LoadMonitor:
        self._start = _proc_stat_cpu()
        t = os.times()
        self._own = -(t.user + t.system)
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = _proc_stat_cpu()
        t = os.times()
        self._own += t.user + t.system

    def add_own(self, cpu_s: float) -> None:
        """Count `cpu_s` of CPU time of this run's own helper processes (peers) as not "other"."""
        self._own += cpu_s

    def result(self) -> dict[str, float]:
        if self._start is None or self._end is None:
            return {}
        total = self._end[1] - self._start[1]
        if total <= 0:
            return {}
        busy = self._end[0] - self._start[0]
        return {"other_busy": max(0.0, (busy - self._own) / total), "cpu_s": total}


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"
    if isinstance(v, int) and v >= MiB and v % 1024 == 0:
        return f"{v / MiB:g}Mi" if v % (MiB // 4) == 0 else f"{v // 1024}Ki"
    if isinstance(v, int) and v >= 1024 and v % 1024 == 0:
        return f"{v // 1024}Ki"
    return str(v)


def print_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None,
                file: IO[str] | None = None, title: str | None = None) -> None:
    """Print result rows as an aligned text table (columns: the given ones, or every key in order of
    first appearance)."""
    rows = list(rows)
    out = file if file is not None else sys.stdout
    if title:
        print(title, file=out)
    if not rows:
        print("(no results)", file=out)
        return
    if columns is None:
        seen: dict[str, None] = {}
        for r in rows:
            for k in r:
                seen.setdefault(k, None)
        columns = list(seen)
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)), file=out)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=out)
    out.flush()


# ---- memory and the limit --------------------------------------------------------------------------


def _arena(nbytes: int) -> npt.NDArray[np.uint8]:
    """`nbytes` of page-aligned, faulted-in memory (tensors of real allocators are aligned)."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + nbytes]


def _fill_pattern(a: npt.NDArray[np.uint8]) -> None:
    """Every 8-byte word gets its own index: any misplaced byte shows."""
    words = a.view(np.uint64)
    step = 2 * MiB
    for i in range(0, words.size, step):
        j = min(words.size, i + step)
        words[i:j] = np.arange(i, j, dtype=np.uint64)


class _TwoThreadMemcpy:
    """The 2-thread limit: a persistent helper copies the second half while the caller copies the
    first (``memcpy_bench`` releases the GIL)."""

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._done = threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job: Callable[[], object] | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvdd-bench-memcpy", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            if self._stop:
                return
            job = self._job
            assert job is not None
            try:
                job()
            finally:
                self._done.release()

    def run(self, first: Callable[[], object], second: Callable[[], object]) -> None:
        self._job = second
        self._go.release()
        try:
            first()
        finally:
            self._done.acquire()

    def close(self) -> None:
        self._stop = True
        self._go.release()
        self._thread.join()


def _memcpy_limits(dst: _copy.Region, src: _copy.Region, nbytes: int,
                   pair: _TwoThreadMemcpy) -> dict[str, Callable[[], object]]:
    half = (nbytes // 2) & ~63
    d2 = _copy.Region(dst.addr + half, nbytes - half, dst)
    s2 = _copy.Region(src.addr + half, nbytes - half, src)
    one = functools.partial(_copy.memcpy_bench, dst, src, nbytes)
    return {
        "memcpy_1t": one,
        "memcpy_2t": functools.partial(pair.run, functools.partial(_copy.memcpy_bench, dst, src, half),
                                       functools.partial(_copy.memcpy_bench, d2, s2, nbytes - half)),
    }


# ---- the two instances ----------------------------------------------------------------------------


def _instance(cluster_id: int, role: int, device: int) -> LlmDataDist:
    dd = LlmDataDist(cluster_id, role, backend="sim")
    dd.initialize({OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", OPTION_DEVICE_ID: str(device)})
    return dd


def _link(local: LlmDataDist, remote: LlmDataDist) -> None:
    port = remote.listen_port
    assert port is not None
    local.link_llm_clusters([ClusterInfo(remote_cluster_id=remote.cluster_id,
                                         remote_ip_infos=(IpInfo(LOCALHOST, port),))])


@contextmanager
def _pair() -> Iterator[tuple[LlmDataDist, LlmDataDist]]:
    """Prefill (cluster 1) and decode (cluster 2), initialized, not yet linked."""
    with ExitStack() as stack:
        p = stack.enter_context(_instance(PREFILL_ID, LlmRole.PROMPT, 0))
        d = stack.enter_context(_instance(DECODE_ID, LlmRole.DECODER, 1))
        yield p, d


@dataclass
class _Side:
    arena: npt.NDArray[np.uint8]
    tensors: list[npt.NDArray[np.uint8]]
    region: _copy.Region
    rows: Cache
    paged: Cache


def _side(dd: LlmDataDist, geom: BenchGeometry, blocks: int, pattern: bool) -> _Side:
    """One instance's memory (``tensors`` tensors of 2 x the request each, in one arena) registered
    twice: as a contiguous ``[2, tokens, ...]`` cache (rows) and a paged ``[2 x blocks, 128, ...]``
    cache (blocks) over the same bytes."""
    request = blocks * geom.block_bytes
    T = 2 * request
    arena = _arena(geom.tensors * T)
    if pattern:
        _fill_pattern(arena)
    else:
        arena.fill(0)
    tensors = [arena[k * T:(k + 1) * T] for k in range(geom.tensors)]
    bf16 = DataType.DT_BF16
    rows_desc = CacheDesc(geom.tensors, bf16, (2, blocks * BLOCK_TOKENS, *geom.token_shape))
    paged_desc = CacheDesc(geom.tensors, bf16, (2 * blocks, BLOCK_TOKENS, *geom.token_shape))
    addrs = tensor_addrs(tensors)
    rows = Cache(dd.register_kv_cache(rows_desc, addrs), addrs, rows_desc)
    paged = Cache(dd.register_kv_cache(paged_desc, addrs), addrs, paged_desc)
    return _Side(arena, tensors, _copy.Region(arena.ctypes.data, arena.nbytes, arena), rows, paged)


@dataclass
class _Case:
    kind: str
    nbytes: int
    calls: int
    unit: int  # bytes per tensor per copied run (row, prefix or block)
    run: Callable[[], object]
    expect: Callable[[], bool]  # after one run: the destination holds the source bytes


def _cases(geom: BenchGeometry, blocks: int, p: LlmDataDist, d: LlmDataDist, ps: _Side, ds: _Side,
           rng: np.random.Generator) -> list[_Case]:
    n, t = geom.tensors, geom.per_layer
    S_row = blocks * geom.block_bytes
    S_blk = geom.block_bytes
    row_idx = CacheIndex(PREFILL_ID, ps.rows.cache_id, 1)  # remote row 1 -> local row 0
    blk_idx = CacheIndex(PREFILL_ID, ps.paged.cache_id, 0)
    push_idx = CacheIndex(DECODE_ID, ds.paged.cache_id, 0)
    push_row_idx = CacheIndex(DECODE_ID, ds.rows.cache_id, 0)  # local row 1 -> remote row 0
    ext_all = KvCacheExtParam(tensor_num_per_layer=t)
    src_ids = [int(x) for x in rng.permutation(2 * blocks)[:blocks]]
    dst_ids = [int(x) for x in rng.permutation(2 * blocks)[:blocks]]
    layer_ext = [KvCacheExtParam((lay, lay), (lay, lay), t) for lay in range(geom.layers)]
    check = sorted({0, n - 1})

    def rows_equal(size: int) -> bool:
        return all(np.array_equal(ds.tensors[k][:size], ps.tensors[k][S_row:S_row + size]) for k in check)

    def blocks_equal(src: _Side, dst: _Side) -> bool:
        ok = True
        for k in check:
            for s, dd_ in zip(src_ids, dst_ids):
                a = src.tensors[k][s * S_blk:(s + 1) * S_blk]
                b = dst.tensors[k][dd_ * S_blk:(dd_ + 1) * S_blk]
                ok = ok and bool(np.array_equal(a, b))
        return ok

    def pull_layers() -> None:
        for ext in layer_ext:
            d.pull_kv_cache(row_idx, ds.rows, 0, -1, ext)

    half = (S_row // 2) or S_row
    cases = [
        _Case("pull_row", n * S_row, 1, S_row,
              functools.partial(d.pull_kv_cache, row_idx, ds.rows, 0, -1, ext_all),
              functools.partial(rows_equal, S_row)),
        _Case("pull_size", n * half, 1, half,
              functools.partial(d.pull_kv_cache, row_idx, ds.rows, 0, half, ext_all),
              functools.partial(rows_equal, half)),
    ]
    if geom.layers > 1:
        cases.append(_Case("pull_layers", n * S_row, geom.layers, S_row, pull_layers,
                           functools.partial(rows_equal, S_row)))
    cases += [
        _Case("push_row", n * S_row, 1, S_row,
              functools.partial(p.push_kv_cache, ps.rows, push_row_idx, 1, -1, ext_all),
              functools.partial(rows_equal, S_row)),
        _Case("pull_blocks", n * blocks * S_blk, 1, S_blk,
              functools.partial(d.pull_kv_blocks, blk_idx, ds.paged, src_ids, dst_ids, ext_all),
              functools.partial(blocks_equal, ps, ds)),
        _Case("push_blocks", n * blocks * S_blk, 1, S_blk,
              functools.partial(p.push_kv_blocks, ps.paged, push_idx, src_ids, dst_ids, ext_all),
              functools.partial(blocks_equal, ps, ds)),
    ]
    return cases


def measure_transfers(names: Sequence[str], tokens: int, synthetic_blocks: int | None, budget_s: float,
                      repeats: int | None, seed: int, kinds: Sequence[str] = KINDS,
                      progress: Callable[[str], None] | None = None) -> list[Row]:
    """One row per (geometry, transfer kind): see the module docstring."""
    rows: list[Row] = []
    rng = np.random.default_rng(seed)
    pair = _TwoThreadMemcpy()
    try:
        for name in names:
            geom = GEOMETRIES[name]
            blocks = geom.request_blocks(tokens, synthetic_blocks)
            if progress is not None:
                progress(f"{name}: {geom.tensors} tensors x {blocks} blocks of {geom.block_bytes // KiB} KiB")
            with _pair() as (p, d):
                ps = _side(p, geom, blocks, pattern=True)
                ds = _side(d, geom, blocks, pattern=False)
                _link(d, p)  # after registering: a link sees the caches registered before it
                for case in _cases(geom, blocks, p, d, ps, ds, rng):
                    if case.kind not in kinds:
                        continue
                    for k in {0, geom.tensors - 1}:  # what the check reads: nothing left from before
                        ds.tensors[k][:] = 0
                    case.run()
                    verified = case.expect()
                    fns: dict[str, Callable[[], object]] = {"transfer": case.run}
                    fns.update(_memcpy_limits(ds.region, ps.region, case.nbytes, pair))
                    reps = repeats if repeats is not None else repeats_for(case.nbytes, budget_s)
                    res = interleaved(fns, reps)
                    rows.append(_row(geom, blocks, case, res, verified))
                del ps, ds
    finally:
        pair.close()
    return rows


def _row(geom: BenchGeometry, blocks: int, case: _Case, res: dict[str, Timing], verified: bool) -> Row:
    tr, m1, m2 = res["transfer"], res["memcpy_1t"], res["memcpy_2t"]
    best_min = min(m1["min_s"], m2["min_s"])
    best_med = min(m1["median_s"], m2["median_s"])
    return {
        "geometry": geom.name,
        "kind": case.kind,
        "tensors": geom.tensors,
        "blocks": blocks,
        "run_bytes": case.unit,
        "calls": case.calls,
        "bytes": case.nbytes,
        "min_ms": tr["min_s"] * 1e3,
        "median_ms": tr["median_s"] * 1e3,
        "gbps": gbps(case.nbytes, tr["min_s"]),
        "memcpy_1t_gbps": gbps(case.nbytes, m1["min_s"]),
        "memcpy_2t_gbps": gbps(case.nbytes, m2["min_s"]),
        "ratio": best_min / tr["min_s"],
        "ratio_median": best_med / tr["median_s"],
        "ratio_1t": m1["min_s"] / tr["min_s"],
        "samples": tr["samples"],
        "verified": verified,
    }


# ---- per-call overhead -----------------------------------------------------------------------------


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
        p, d = stack.enter_context(_pair())
        desc = CacheDesc(1, DataType.DT_UINT8, (4, 64))
        a = _arena(256)
        _fill_pattern(a)
        b = _arena(256)
        b.fill(0)
        pid = p.register_kv_cache(desc, tensor_addrs([a]))
        did = d.register_kv_cache(desc, tensor_addrs([b]))
        _link(d, p)
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
                m = _arena(256)
                m.fill(0)
                keep.append(m)
                dd.register_kv_cache(desc, tensor_addrs([m]))
        for i in range(extra_peers):
            q = stack.enter_context(_instance(100 + i, LlmRole.PROMPT, 2 + i))
            _link(d, q)
        add(f"pull 64 B, +{extra_caches} caches, +{extra_peers} links",
            "LlmDataDist.pull_kv_cache(idx, cache)", functools.partial(d.pull_kv_cache, idx, cache))

        ra = _copy.Region(a.ctypes.data, a.nbytes, a)
        rb = _copy.Region(b.ctypes.data, b.nbytes, b)
        z = np.zeros(1, dtype=np.int64)
        ln = np.array([64], dtype=np.int64)
        add("copy 64 B", "kernel copy_runs (floor)", functools.partial(_copy.copy_runs, [ra], [rb], z, z, ln))
    return out


# ---- cross-process ---------------------------------------------------------------------------------
#
# A peer *process* (multiprocessing spawn) hosts a simulator instance with one registered tensor of
# `row_bytes` (a pattern), registered twice: as a ``[1, row_bytes]`` cache (the row) and as a paged
# ``[row_bytes / 64 KiB, 64 KiB]`` cache (the block pool).  It also serves a raw loopback socket
# that sends the first N bytes of the same buffer on request (sendall).  This process links to it
# and times, interleaved with the raw mechanisms of the same bytes: process_vm_readv/writev
# (``_xproc.pvm_bench``: one iovec each side, one thread), a local memcpy (1 and 2 threads) and,
# on the TCP path, the raw socket transfer (recv_into a preallocated buffer).

XP_BLOCK_BYTES = 64 * KiB
XP_ROW_BYTES, XP_BLOCKS = 256 * MiB, 1024  # the targets of issue 6
XP_QUICK_ROW_BYTES, XP_QUICK_BLOCKS = 64 * MiB, 256
XP_LOCAL_ID = 20
XP_PEER_IDS = {"process_vm": 21, "tcp": 22}
XP_PATHS = ("process_vm", "tcp")
XP_WAIT_MS = 60_000  # llm.SyncKvCacheWaitTime of both sides: no slow transfer times out
XP_START_TIMEOUT_S = 120.0  # the peer must be ready within this (spawn, import, fill, listen)
XP_ENV = "KVDD_SIM_XPROC"  # kvdd.sim.fabric.ENV_XPROC: "tcp" disables process_vm on a link
XP_TARGET = 0.8
_XP_STOP = b"\0" * 8


def _xp_options(device: int) -> dict[str, str]:
    return {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", OPTION_DEVICE_ID: str(device),
            OPTION_SYNC_CACHE_WAIT_TIME: str(XP_WAIT_MS)}


def _xp_serve_raw(server: socket.socket, buf: memoryview) -> None:
    """The raw loopback limit, peer side: for every 8-byte request N > 0, sendall N bytes of `buf`."""
    try:
        conn, _ = server.accept()
    except OSError:
        return
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = bytearray(8)
        while True:
            got = 0
            try:
                while got < 8:
                    n = conn.recv_into(memoryview(req)[got:])
                    if n == 0:
                        return
                    got += n
                want = int.from_bytes(req, "little")
                if want == 0 or want > len(buf):
                    return
                conn.sendall(buf[:want])
            except OSError:
                return


def _xp_peer_main(conn: Any, row_bytes: int, cluster_id: int, tcp: bool) -> None:
    """Entry point of the spawned peer: register the pattern, report where it is, wait for `stop`
    (or the parent's death), finalize."""
    if tcp:
        os.environ[XP_ENV] = "tcp"
    parent = os.getppid()
    try:
        arena = _arena(row_bytes)
        _fill_pattern(arena)
        server = socket.create_server((LOCALHOST, 0))
        with server, LlmDataDist(cluster_id, LlmRole.PROMPT, backend="sim") as dd:
            dd.initialize(_xp_options(0))
            addrs = tensor_addrs([arena])
            row_id = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, row_bytes)), addrs)
            paged_id = dd.register_kv_cache(
                CacheDesc(1, DataType.DT_UINT8, (row_bytes // XP_BLOCK_BYTES, XP_BLOCK_BYTES)), addrs)
            raw = threading.Thread(target=_xp_serve_raw, args=(server, arena.data.cast("B")),
                                   name="kvdd-bench-raw", daemon=True)
            raw.start()
            conn.send(("ready", {"pid": os.getpid(), "port": dd.listen_port, "raw_port": server.getsockname()[1],
                                 "row_cache": row_id, "paged_cache": paged_id, "addr": int(arena.ctypes.data)}))
            while not conn.poll(0.5):
                if os.getppid() != parent:  # the bench died: do not linger
                    return
            conn.recv()
        t = os.times()
        conn.send(("cpu", t.user + t.system))
    except BaseException as exc:  # reported to the bench
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        conn.close()


@dataclass
class _XPeer:
    path: str
    pid: int
    cluster_id: int
    port: int
    raw_port: int
    row_cache: int
    paged_cache: int
    addr: int


@contextmanager
def _xp_peer(path: str, row_bytes: int, cpu_out: list[float]) -> Iterator[_XPeer]:
    """A spawned peer process (with ``KVDD_SIM_XPROC=tcp`` on the TCP path); stopped, or killed,
    on the way out, whatever happens.  Its CPU time is appended to `cpu_out` when it stops."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    cluster_id = XP_PEER_IDS[path]
    proc = ctx.Process(target=_xp_peer_main, args=(there, row_bytes, cluster_id, path == "tcp"),
                       name=f"kvdd-bench-peer-{path}", daemon=True)
    proc.start()
    there.close()
    try:
        deadline = time.monotonic() + XP_START_TIMEOUT_S
        while not here.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"the {path} peer process exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {path} peer process was not ready within {XP_START_TIMEOUT_S:.0f} s")
        try:
            kind, info = here.recv()
        except EOFError:
            raise RuntimeError(f"the {path} peer process exited without a word") from None
        if kind != "ready":
            raise RuntimeError(f"the {path} peer process failed: {info}")
        peer = _XPeer(path, int(info["pid"]), cluster_id, int(info["port"]), int(info["raw_port"]),
                      int(info["row_cache"]), int(info["paged_cache"]), int(info["addr"]))
        yield peer
    finally:
        try:
            here.send("stop")
            if here.poll(10):
                kind, value = here.recv()
                if kind == "cpu":
                    cpu_out.append(float(value))
        except (OSError, EOFError, ValueError, TypeError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        here.close()


@contextmanager
def _xp_env(path: str) -> Iterator[None]:
    """``KVDD_SIM_XPROC=tcp`` in this process too while the TCP link is made (the fabric chooses a
    link's data path when linking)."""
    old = os.environ.get(XP_ENV)
    if path == "tcp":
        os.environ[XP_ENV] = "tcp"
    try:
        yield
    finally:
        if path == "tcp":
            if old is None:
                os.environ.pop(XP_ENV, None)
            else:
                os.environ[XP_ENV] = old


def _xp_data_path(dd: LlmDataDist, peer_cluster_id: int) -> str:
    """The data path the fabric chose for the link (``process_vm``, ``tcp``)."""
    try:
        entity = dd.backend.entities[peer_cluster_id]  # type: ignore[attr-defined]
        return str(getattr(entity.peer, "data_path", "in_process"))
    except (AttributeError, KeyError, TypeError):
        return "unknown"


class _RawSocket:
    """The raw loopback limit, bench side: ask for N bytes, recv_into a preallocated buffer."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((LOCALHOST, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def pull(self, buf: memoryview, nbytes: int) -> None:
        self.sock.sendall(nbytes.to_bytes(8, "little"))
        recv_into = self.sock.recv_into
        got = 0
        while got < nbytes:
            n = recv_into(buf[got:nbytes])
            if n == 0:
                raise RuntimeError("the raw socket peer closed the connection")
            got += n

    def close(self) -> None:
        try:
            self.sock.sendall(_XP_STOP)
        except OSError:
            pass
        self.sock.close()


def _xp_row(path: str, kind: str, nbytes: int, run_bytes: int, res: dict[str, Timing], verified: bool,
            limit: str, data_path: str) -> Row:
    tr = res["transfer"]

    def ratio(name: str, key: str) -> float | None:
        t = res.get(name)
        return None if t is None else t[key] / tr[key]

    def rate(name: str) -> float | None:
        t = res.get(name)
        return None if t is None else gbps(nbytes, t["min_s"])

    row: Row = {
        "path": path,
        "data_path": data_path,
        "kind": kind,
        "run_bytes": run_bytes,
        "bytes": nbytes,
        "min_ms": tr["min_s"] * 1e3,
        "median_ms": tr["median_s"] * 1e3,
        "gbps": gbps(nbytes, tr["min_s"]),
        "pvm_gbps": rate("pvm"),
        "memcpy_1t_gbps": rate("memcpy_1t"),
        "memcpy_2t_gbps": rate("memcpy_2t"),
        "socket_gbps": rate("socket"),
        "vs_pvm": ratio("pvm", "min_s"),
        "vs_memcpy": ratio("memcpy_1t", "min_s"),
        "vs_memcpy_2t": ratio("memcpy_2t", "min_s"),
        "vs_socket": ratio("socket", "min_s"),
        "limit": limit,
        "ratio": ratio(limit, "min_s"),
        "ratio_median": ratio(limit, "median_s"),
        "samples": tr["samples"],
        "verified": verified,
    }
    return row


def measure_cross_process(row_bytes: int, blocks: int, budget_s: float, repeats: int | None, seed: int,
                          paths: Sequence[str] = XP_PATHS,
                          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The cross-process section of ``kvdd bench``: see the comment above :data:`XP_BLOCK_BYTES`."""
    if row_bytes < XP_BLOCK_BYTES or row_bytes % XP_BLOCK_BYTES:
        raise ValueError(f"the cross-process size must be a positive multiple of {XP_BLOCK_BYTES // KiB} KiB")
    pool = row_bytes // XP_BLOCK_BYTES
    if not 1 <= blocks <= pool:
        raise ValueError(f"the cross-process block count must lie in [1, {pool}] (the size / 64 KiB)")
    try:
        from ._native import _xproc
    except ImportError as exc:  # not Linux: no process_vm_readv
        raise RuntimeError(f"no process_vm_readv here ({exc})") from None
    rng = np.random.default_rng(seed)
    src_ids = [int(x) for x in rng.permutation(pool)[:blocks]]
    dst_ids = [int(x) for x in rng.permutation(pool)[:blocks]]
    blk_bytes = blocks * XP_BLOCK_BYTES
    B = XP_BLOCK_BYTES

    # this side: `src` holds the peer's pattern (memcpy source, push source, expected bytes), `dst`
    # receives (pulls, raw limits); both registered as paged caches, `dst` also as the row
    src = _arena(row_bytes)
    _fill_pattern(src)
    dst = _arena(row_bytes)
    dst.fill(0)
    src_r = _copy.Region(src.ctypes.data, src.nbytes, src)
    dst_r = _copy.Region(dst.ctypes.data, dst.nbytes, dst)
    dst_mv = dst.data.cast("B")
    row_desc = CacheDesc(1, DataType.DT_UINT8, (1, row_bytes))
    paged_desc = CacheDesc(1, DataType.DT_UINT8, (pool, B))

    def blocks_equal() -> bool:
        return all(np.array_equal(dst[d * B:(d + 1) * B], src[s * B:(s + 1) * B]) for s, d in zip(src_ids, dst_ids))

    rows: list[Row] = []
    peers: list[dict[str, Any]] = []
    peer_cpu: list[float] = []
    pair = _TwoThreadMemcpy()
    try:
        for path in paths:
            if progress is not None:
                progress(f"cross-process over {path}: {row_bytes // MiB if row_bytes >= MiB else row_bytes} "
                         f"{'MiB' if row_bytes >= MiB else 'B'} row, {blocks} x 64 KiB blocks (peer process)")
            with ExitStack() as stack:
                peer = stack.enter_context(_xp_peer(path, row_bytes, peer_cpu))
                dd = stack.enter_context(LlmDataDist(XP_LOCAL_ID, LlmRole.DECODER, backend="sim"))
                dd.initialize(_xp_options(1))
                rows_cache = Cache(dd.register_kv_cache(row_desc, tensor_addrs([dst])), (dst.ctypes.data,), row_desc)
                dst_paged = Cache(dd.register_kv_cache(paged_desc, tensor_addrs([dst])), (dst.ctypes.data,),
                                  paged_desc)
                src_paged = Cache(dd.register_kv_cache(paged_desc, tensor_addrs([src])), (src.ctypes.data,),
                                  paged_desc)
                with _xp_env(path):
                    dd.link_llm_clusters([ClusterInfo(remote_cluster_id=peer.cluster_id,
                                                      remote_ip_infos=(IpInfo(LOCALHOST, peer.port),))], 10_000)
                data_path = _xp_data_path(dd, peer.cluster_id)
                peers.append({"path": path, "pid": peer.pid, "data_path": data_path})
                row_idx = CacheIndex(peer.cluster_id, peer.row_cache, 0)
                blk_idx = CacheIndex(peer.cluster_id, peer.paged_cache, 0)
                ext = KvCacheExtParam(tensor_num_per_layer=1)  # one tensor, one layer
                pull_row = functools.partial(dd.pull_kv_cache, row_idx, rows_cache, 0, -1, ext)
                pull_blocks = functools.partial(dd.pull_kv_blocks, blk_idx, dst_paged, src_ids, dst_ids, ext)
                push_blocks = functools.partial(dd.push_kv_blocks, src_paged, blk_idx, src_ids, dst_ids, ext)
                raw: _RawSocket | None = None
                if path == "tcp":
                    raw = _RawSocket(peer.raw_port)
                    stack.callback(raw.close)

                def limits(nbytes: int, write: bool) -> dict[str, Callable[[], object]]:
                    fns: dict[str, Callable[[], object]] = {}
                    fns["pvm"] = functools.partial(_xproc.pvm_bench, peer.pid, src_r if write else dst_r,
                                                   peer.addr, nbytes, write)
                    fns.update(_memcpy_limits(dst_r, src_r, nbytes, pair))
                    if raw is not None and not write:
                        fns["socket"] = functools.partial(raw.pull, dst_mv, nbytes)
                    return fns

                def measure(kind: str, fn: Callable[[], object], nbytes: int, run_bytes: int, write: bool,
                            verify: Callable[[], bool]) -> None:
                    dst.fill(0)
                    fn()
                    verified = verify()
                    fns: dict[str, Callable[[], object]] = {"transfer": fn}
                    fns.update(limits(nbytes, write))
                    if raw is not None and not write:  # the raw socket moves the same bytes
                        dst.fill(0)
                        fns["socket"]()
                        verified = verified and bool(np.array_equal(dst[:nbytes], src[:nbytes]))
                    reps = repeats if repeats is not None else repeats_for(nbytes, 2 * budget_s, 5e9, lo=5, hi=50)
                    res = interleaved(fns, reps)
                    limit = "socket" if raw is not None else ("pvm" if path == "process_vm" else "memcpy_1t")
                    rows.append(_xp_row(path, kind, nbytes, run_bytes, res, verified, limit, data_path))

                measure("pull_row", pull_row, row_bytes, row_bytes, False,
                        lambda: bool(np.array_equal(dst, src)))
                measure("pull_blocks", pull_blocks, blk_bytes, B, False, blocks_equal)
                if path == "process_vm":
                    def pushed() -> bool:  # read the peer's blocks back (pull verified above)
                        dst.fill(0)
                        dd.pull_kv_blocks(blk_idx, dst_paged, dst_ids, dst_ids, ext)
                        return all(np.array_equal(dst[d * B:(d + 1) * B], src[s * B:(s + 1) * B])
                                   for s, d in zip(src_ids, dst_ids))
                    measure("push_blocks", push_blocks, blk_bytes, B, True, pushed)
    finally:
        pair.close()
    return {"config": {"row_bytes": row_bytes, "blocks": blocks, "block_bytes": XP_BLOCK_BYTES,
                       "sync_wait_ms": XP_WAIT_MS},
            "peers": peers, "peer_cpu_s": sum(peer_cpu), "rows": rows, "targets": _xp_targets(rows)}


def _xp_targets(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The targets of issue 6 (the pull of the row) against what this run measured."""
    out: list[dict[str, Any]] = []
    for path, key, what in (("process_vm", "vs_pvm", "same-host pull >= 0.8x plain process_vm_readv"),
                            ("process_vm", "vs_memcpy", "same-host pull >= 0.8x plain memcpy (1 thread)"),
                            ("tcp", "vs_socket", "TCP pull >= 0.8x raw loopback socket")):
        for r in rows:
            if r["path"] == path and r["kind"] == "pull_row" and r.get(key) is not None:
                out.append({"target": what, "ratio": r[key], "met": r[key] >= XP_TARGET})
    return out


# ---- command line ---------------------------------------------------------------------------------

TRANSFER_COLUMNS = ("geometry", "kind", "tensors", "calls", "run_bytes", "bytes", "min_ms", "median_ms",
                    "gbps", "memcpy_1t_gbps", "memcpy_2t_gbps", "ratio", "ratio_median", "verified")
OVERHEAD_COLUMNS = ("case", "path", "min_us", "median_us", "calls")
XP_COLUMNS = ("path", "kind", "run_bytes", "bytes", "min_ms", "median_ms", "gbps", "pvm_gbps", "memcpy_1t_gbps",
              "memcpy_2t_gbps", "socket_gbps", "vs_pvm", "vs_memcpy", "vs_socket", "ratio_median", "verified")


def add_bench_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``kvdd bench`` (also used by ``benchmarks/transfers.py``)."""
    ap.add_argument("--quick", action="store_true",
                    help="1024-token requests, short time budget (well under a minute on 2 cores)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    ap.add_argument("--geometries", default=",".join(GEOMETRIES),
                    help=f"comma-separated subset of: {', '.join(GEOMETRIES)} (default all)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of: {', '.join(KINDS)}")
    ap.add_argument("--tokens", type=int,
                    help="tokens per request of the model geometries (default 2048, --quick 1024; "
                         "rounded down to 128-token blocks)")
    ap.add_argument("--blocks", type=int, help="override the block count of the synthetic cases")
    ap.add_argument("--repeats", type=int, help="timed repeats per measurement (default: by size)")
    ap.add_argument("--budget", type=float, help="seconds per measured operation (default 0.25, --quick 0.05)")
    ap.add_argument("--overhead-calls", type=int,
                    help="calls per timed loop of the overhead measurement (default 20000, --quick 5000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random block ids")
    xp = ap.add_mutually_exclusive_group()
    xp.add_argument("--cross-process", action="store_true",
                    help="measure only the cross-process section (a spawned peer process; process_vm and TCP "
                         "paths against process_vm_readv, memcpy and a raw loopback socket); a plain run "
                         "includes it")
    xp.add_argument("--no-cross-process", action="store_true", help="leave the cross-process section out")
    ap.add_argument("--cross-process-bytes", type=int,
                    help=f"bytes of the cross-process row, a multiple of 64 KiB (default {XP_ROW_BYTES // MiB} MiB, "
                         f"--quick {XP_QUICK_ROW_BYTES // MiB} MiB)")
    ap.add_argument("--cross-process-blocks", type=int,
                    help=f"64 KiB blocks of the cross-process block transfers (default {XP_BLOCKS}, "
                         f"--quick {XP_QUICK_BLOCKS})")


def _names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise ValueError(f"unknown {what} {', '.join(bad) or '(none given)'}; choose from {', '.join(allowed)}")
    return names


def _command(args: argparse.Namespace) -> str:
    parts = ["kvdd bench"]
    for opt in ("quick", "json", "cross_process", "no_cross_process"):
        if getattr(args, opt):
            parts.append(f"--{opt.replace('_', '-')}")
    defaults = {"geometries": ",".join(GEOMETRIES), "kinds": ",".join(KINDS), "seed": 0}
    for opt in ("geometries", "kinds", "tokens", "blocks", "repeats", "budget", "overhead_calls", "seed",
                "cross_process_bytes", "cross_process_blocks"):
        value = getattr(args, opt)
        if value is not None and value != defaults.get(opt):
            parts.append(f"--{opt.replace('_', '-')} {value}")
    return " ".join(parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure what `args` asks for; the JSON document (see :data:`SCHEMA`)."""
    names = _names(args.geometries, list(GEOMETRIES), "geometry")
    kinds = _names(args.kinds, KINDS, "transfer kind")
    tokens = args.tokens if args.tokens is not None else (1024 if args.quick else 2048)
    if tokens < BLOCK_TOKENS:
        raise ValueError(f"--tokens must be at least {BLOCK_TOKENS} (one block)")
    if args.blocks is not None and args.blocks < 1:
        raise ValueError("--blocks must be at least 1")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 0.25)
    calls = args.overhead_calls if args.overhead_calls is not None else (5000 if args.quick else 20000)
    if calls < 1:
        raise ValueError("--overhead-calls must be at least 1")
    only_xp = bool(getattr(args, "cross_process", False))
    with_xp = only_xp or not getattr(args, "no_cross_process", False)
    xp_bytes = getattr(args, "cross_process_bytes", None)
    xp_bytes = xp_bytes if xp_bytes is not None else (XP_QUICK_ROW_BYTES if args.quick else XP_ROW_BYTES)
    xp_blocks = getattr(args, "cross_process_blocks", None)
    xp_blocks = xp_blocks if xp_blocks is not None else min(XP_QUICK_BLOCKS if args.quick else XP_BLOCKS,
                                                            max(1, xp_bytes // XP_BLOCK_BYTES))
    if with_xp:
        if xp_bytes < XP_BLOCK_BYTES or xp_bytes % XP_BLOCK_BYTES:
            raise ValueError("--cross-process-bytes must be a positive multiple of 65536 (64 KiB)")
        if not 1 <= xp_blocks <= xp_bytes // XP_BLOCK_BYTES:
            raise ValueError("--cross-process-blocks must lie in [1, --cross-process-bytes / 64 KiB]")
    progress = None if args.json else (lambda msg: print(f"# measuring {msg}", file=sys.stderr, flush=True))

    t0 = time.perf_counter()
    stats0 = _copy.thread_stats()
    overhead: list[Row] = []
    transfers: list[Row] = []
    cross: dict[str, Any] | None = None
    with LoadMonitor() as load:
        if not only_xp:
            overhead = measure_overhead(calls, 7 if args.quick else 15)
            transfers = measure_transfers(names, tokens, args.blocks, budget, args.repeats, args.seed, kinds,
                                          progress)
        if with_xp:
            try:
                cross = measure_cross_process(xp_bytes, xp_blocks, budget, args.repeats, args.seed,
                                              progress=progress)
            except Exception as exc:  # reported in the document (and the exit status of --cross-process)
                cross = {"config": {"row_bytes": xp_bytes, "blocks": xp_blocks, "block_bytes": XP_BLOCK_BYTES},
                         "error": f"{type(exc).__name__}: {exc}", "peers": [], "peer_cpu_s": 0.0, "rows": [],
                         "targets": []}
            load.add_own(float(cross["peer_cpu_s"]))  # the peers are this run, not other load
    stats1 = _copy.thread_stats()
    env = environment()
    env.update(load.result())
    return {
        "schema": SCHEMA,
        "command": _command(args),
        "quick": bool(args.quick),
        "environment": env,
        "config": {
            "tokens": tokens,
            "block_tokens": BLOCK_TOKENS,
            "budget_s": budget,
            "repeats": args.repeats,
            "seed": args.seed,
            "isa": _copy.get_isa(),
            "streaming_threshold": _copy.get_streaming_threshold(),
            "threads_threshold": _copy.get_threads_threshold(),
            "cpu_features": _copy.cpu_features(),
        },
        "overhead": overhead,
        "transfers": transfers,
        "cross_process": cross,
        "two_thread_kernel_calls": {k: stats1[k] - stats0[k] for k in stats1},
        "elapsed_s": time.perf_counter() - t0,
    }


def print_report(doc: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The tables for people."""
    out = file if file is not None else sys.stdout
    env, cfg = doc["environment"], doc["config"]
    print(f"# {env.get('cpu', env['machine'])}, {env['cpus']} CPUs, Python {env['python']}; copy kernel "
          f"isa={cfg['isa']}, streaming >= {_fmt(cfg['streaming_threshold'])}B, "
          f"auto 2 threads >= {_fmt(cfg['threads_threshold'])}B", file=out)
    busy = env.get("other_busy")
    if busy is not None:
        print(f"# other load while measuring: {busy:.0%} of all CPUs"
              + ("  (numbers not representative: machine busy)" if busy > 0.1 else ""), file=out)
    print(f"# {doc['command']}: {cfg['tokens']}-token requests, {doc['elapsed_s']:.1f} s", file=out)
    if doc["overhead"] or doc["transfers"]:
        print(file=out)
        print("Per-call overhead (64-byte single-tensor pull between two in-process simulator instances):",
              file=out)
        print_table(doc["overhead"], OVERHEAD_COLUMNS, out)
        print(file=out)
        print("Transfers (ratio = best plain memcpy of the same bytes, 1 or 2 threads, same run / transfer "
              "time; > 1 is faster than memcpy):", file=out)
        print_table(doc["transfers"], TRANSFER_COLUMNS, out)
    cross = doc.get("cross_process")
    if cross is not None:
        print_cross_process(cross, out)
    out.flush()


def print_cross_process(cross: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The cross-process table and the targets of issue 6."""
    out = file if file is not None else sys.stdout
    cfg = cross["config"]
    print(file=out)
    print(f"Cross-process (a spawned peer process, {_fmt(cfg['row_bytes'])}B row, {cfg['blocks']} x 64 KiB "
          "blocks; vs_X = transfer speed / X's speed on the same bytes, same run: pvm = plain "
          "process_vm_readv/writev, memcpy = 1-thread local memcpy, socket = raw loopback TCP):", file=out)
    if cross.get("error"):
        print(f"(not measured: {cross['error']})", file=out)
        return
    rows = [{k: v for k, v in r.items() if v is not None} for r in cross["rows"]]
    print_table(rows, XP_COLUMNS, out)
    for p in cross["peers"]:
        if p["data_path"] != p["path"]:
            print(f"# note: the {p['path']} link used the {p['data_path']} data path", file=out)
    for t in cross["targets"]:
        print(f"# target: {t['target']}: {t['ratio']:.2f}x, {'met' if t['met'] else 'NOT met'}", file=out)


def run_from_args(args: argparse.Namespace) -> int:
    """``kvdd bench``: exit status 0, 2 for unusable arguments, 1 when ``--cross-process`` failed."""
    try:
        doc = run(args)
    except ValueError as exc:
        print(f"kvdd bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    else:
        print_report(doc)
    cross = doc.get("cross_process")
    if getattr(args, "cross_process", False) and cross is not None and cross.get("error"):
        print(f"kvdd bench: cross-process: {cross['error']}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "kvdd bench") -> int:
    """The ``kvdd bench`` command on its own (``benchmarks/transfers.py`` runs this)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_bench_arguments(ap)
    return run_from_args(ap.parse_args(argv))
