"""The model runs of ``kvdd bench``: two in-process simulator instances move a real model's KV cache
through the public API (see :mod:`kvdd.bench` for the transfer kinds), each transfer timed
interleaved with the limits of :mod:`kvdd.bench.baselines` on the same bytes.

Geometries are cache families of :data:`kvdd.models.MODELS` (bf16, 128-token blocks) plus two
synthetic single-tensor block cases.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .. import (
    OPTION_DEVICE_ID,
    OPTION_LISTEN_IP_INFO,
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
from .._native import _copy
from ..models import BLOCK_TOKENS, MODELS
from .baselines import Limits, arena, fill_pattern, limit_columns
from .harness import KiB, Row, SelfTimed, Timing, gbps, interleaved, repeats_for

__all__ = ["DECODE_ID", "DEFAULT_GEOMETRIES", "GEOMETRIES", "KINDS", "LOCALHOST", "PREFILL_ID", "BenchGeometry", "instance",
           "instance_pair", "link", "measure_transfers"]

LOCALHOST = "127.0.0.1"
PREFILL_ID, DECODE_ID = 1, 2

#: Transfer kinds, in the order they are measured.
KINDS = ("pull_row", "pull_size", "pull_layers", "push_row", "pull_blocks", "push_blocks")


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
    tokens: int | None = None  # a fixed request size (tokens), whatever --tokens says

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
        if self.tokens is not None:
            tokens = min(tokens, self.tokens)
        return max(1, tokens // BLOCK_TOKENS)


def _model_cache(name: str, model: str, cache: str, label: str, tokens: int | None = None) -> BenchGeometry:
    fam = MODELS[model].cache(cache)
    return BenchGeometry(name, f"{model} {label}", fam.tensors, fam.tensors_per_layer, fam.token_shape,
                         tokens=tokens)


#: The bench's geometries by ``--geometries`` name: cache families of :data:`kvdd.models.MODELS`
#: and two synthetic single-tensor block cases.  The default run measures :data:`DEFAULT_GEOMETRIES`.
GEOMETRIES: dict[str, BenchGeometry] = {g.name: g for g in (
    _model_cache("qwen2.5-7b", "Qwen2.5-7B", "kv", "K/V"),
    _model_cache("llama-3.1-8b", "Llama-3.1-8B", "kv", "K/V"),
    _model_cache("deepseek-v3-latent", "DeepSeek-V3", "latent", "MLA latent"),
    _model_cache("deepseek-v3-rope", "DeepSeek-V3", "rope", "MLA rope"),
    _model_cache("glm-5-rope", "GLM-5", "rope", "MLA rope"),
    _model_cache("glm-5-indexer", "GLM-5", "indexer", "DSA indexer keys"),
    # 160 tensors: requests of at most 1024 tokens (640 MiB per instance)
    _model_cache("llama-3.1-70b", "Llama-3.1-70B", "kv", "K/V", tokens=1024),
    BenchGeometry("synthetic-1024x64k", "1 tensor, 1024 x 64 KiB blocks", 1, 1, (256,), blocks=1024),
    BenchGeometry("synthetic-4096x16k", "1 tensor, 4096 x 16 KiB blocks", 1, 1, (64,), blocks=4096),
)}
#: The geometries of a plain ``kvdd bench`` (the targets section measures Llama-3.1-70B and GLM-5 rope).
DEFAULT_GEOMETRIES = tuple(n for n in GEOMETRIES if n not in ("llama-3.1-70b", "glm-5-rope"))


# ---- the two instances ----------------------------------------------------------------------------


def instance(cluster_id: int, role: int, device: int) -> LlmDataDist:
    """An initialized simulator instance listening on 127.0.0.1 (an ephemeral port)."""
    dd = LlmDataDist(cluster_id, role, backend="sim")
    dd.initialize({OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", OPTION_DEVICE_ID: str(device)})
    return dd


def link(local: LlmDataDist, remote: LlmDataDist) -> None:
    """`local` links to `remote` (by its listening port)."""
    local.link_llm_clusters([ClusterInfo(remote_cluster_id=remote.cluster_id,
                                         remote_ip_infos=(IpInfo(LOCALHOST, remote.listening_port),))])


@contextmanager
def instance_pair() -> Iterator[tuple[LlmDataDist, LlmDataDist]]:
    """Prefill (cluster 1) and decode (cluster 2), initialized, not yet linked."""
    with ExitStack() as stack:
        p = stack.enter_context(instance(PREFILL_ID, LlmRole.PROMPT, 0))
        d = stack.enter_context(instance(DECODE_ID, LlmRole.DECODER, 1))
        yield p, d



# ---- the transfers ---------------------------------------------------------------------------------


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
    mem = arena(geom.tensors * T)
    if pattern:
        fill_pattern(mem)
    else:
        mem.fill(0)
    tensors = [mem[k * T:(k + 1) * T] for k in range(geom.tensors)]
    bf16 = DataType.DT_BF16
    rows_desc = CacheDesc(geom.tensors, bf16, (2, blocks * BLOCK_TOKENS, *geom.token_shape))
    paged_desc = CacheDesc(geom.tensors, bf16, (2 * blocks, BLOCK_TOKENS, *geom.token_shape))
    addrs = tensor_addrs(tensors)
    rows = Cache(dd.register_kv_cache(rows_desc, addrs), addrs, rows_desc)
    paged = Cache(dd.register_kv_cache(paged_desc, addrs), addrs, paged_desc)
    return _Side(mem, tensors, _copy.Region(mem.ctypes.data, mem.nbytes, mem), rows, paged)


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


def measure_transfers(names: Sequence[str | BenchGeometry], tokens: int, synthetic_blocks: int | None,
                      budget_s: float, repeats: int | None, seed: int, kinds: Sequence[str] = KINDS,
                      progress: Callable[[str], None] | None = None, streaming_limit: bool = True,
                      child_cpu: list[float] | None = None) -> list[Row]:
    """One row per (geometry, transfer kind): see :mod:`kvdd.bench`.  `names` are keys of
    :data:`GEOMETRIES` or geometries; the CPU time of the streaming-limit child processes is appended
    to `child_cpu` (it is this run's, not other load)."""
    rows: list[Row] = []
    rng = np.random.default_rng(seed)
    for name in names:
        geom = GEOMETRIES[name] if isinstance(name, str) else name
        blocks = geom.request_blocks(tokens, synthetic_blocks)
        if progress is not None:
            progress(f"{geom.name}: {geom.tensors} tensors x {blocks} blocks of {geom.block_bytes // KiB} KiB")
        with instance_pair() as (p, d):
            ps = _side(p, geom, blocks, pattern=True)
            ds = _side(d, geom, blocks, pattern=False)
            link(d, p)  # after registering: a link sees the caches registered before it
            cases = [c for c in _cases(geom, blocks, p, d, ps, ds, rng) if c.kind in kinds]
            limits = Limits(max((c.nbytes for c in cases), default=1), streaming=streaming_limit)
            try:
                for case in cases:
                    for k in {0, geom.tensors - 1}:  # what the check reads: nothing left from before
                        ds.tensors[k][:] = 0
                    case.run()
                    verified = case.expect()
                    split: list[tuple[int, int]] = []
                    fns: dict[str, Callable[[], object]] = {
                        "transfer": SelfTimed(functools.partial(_kernel_timed, case.run, split))}
                    fns.update(limits.fns(ds.arena, ps.arena, case.nbytes))
                    reps = repeats if repeats is not None else repeats_for(case.nbytes, budget_s)
                    before = _copy.thread_stats()
                    taken = _compiled_calls(p, d)
                    res = interleaved(fns, reps, own_warm=True)
                    after = _copy.thread_stats()
                    two = (after["calls"] - before["calls"]) / (case.calls * (2 * reps + 1))
                    row = _row(geom, blocks, case, res, verified, two, split)
                    row["compiled"] = (_compiled_calls(p, d) - taken) / (case.calls * (2 * reps + 1))
                    row["stalls"] = after["stalls"] - before["stalls"]
                    rows.append(row)
            finally:
                limits.close()
                if child_cpu is not None:
                    child_cpu.append(limits.child_cpu_s)
            del ps, ds
    return rows


def _compiled_calls(*dds: LlmDataDist) -> int:
    """Transfers of these instances that took the simulator's compiled in-process path."""
    n = 0
    for dd in dds:
        fast = getattr(dd.backend, "fast_transfers", None)
        n += int(getattr(fast, "taken", 0))
    return n


def _kernel_timed(run: Callable[[], object], split: list[tuple[int, int]]) -> float:
    """`run`, timed around the call alone (a :class:`SelfTimed` operation, like the streaming
    child's copies: the split's bookkeeping is not in the time); appends to `split` the nanoseconds
    it spent in the copy kernels (``_copy.job_ns``) and outside them; returns its seconds."""
    k0 = _copy.job_ns()
    t0 = time.perf_counter_ns()
    run()
    t1 = time.perf_counter_ns()
    kernel = _copy.job_ns() - k0
    split.append((kernel, t1 - t0 - kernel))
    return (t1 - t0) / 1e9


def _row(geom: BenchGeometry, blocks: int, case: _Case, res: dict[str, Timing], verified: bool,
         two_threads: float, split: Sequence[tuple[int, int]]) -> Row:
    tr = res["transfer"]
    # split: one warm-up call, then an untimed and a timed call per repeat (own_warm)
    kernel_s = statistics.median(k for k, _ in split[2::2]) / 1e9
    outside_s = statistics.median(o for _, o in split[2::2]) / 1e9
    row: Row = {
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
    }
    row.update(limit_columns(res, case.nbytes))
    # where the transfer's time goes (medians): in the copy kernels, and outside them per call
    # (Python: the facade, the engine's checks and copy plan; after large copies it runs cache-cold)
    row.update({"kernel_gbps": gbps(case.nbytes, kernel_s),
                "outside_us": outside_s * 1e6 / case.calls,
                "two_threads": two_threads, "samples": tr["samples"], "verified": verified})
    return row
