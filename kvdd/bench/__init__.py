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

Benchmarks are not tests: they report, they do not assert. ``--quick`` takes well under
a minute on 2 cores; ``--json`` prints one JSON document instead of tables.
The package: :mod:`~kvdd.bench.harness` (the reusable measuring harness: timing, load, tables),
:mod:`~kvdd.bench.baselines` (the limits and the memory they run on), :mod:`~kvdd.bench.transfers`
(the model runs), :mod:`~kvdd.bench.overhead` (per-call overhead), :mod:`~kvdd.bench.xproc` (the
cross-process section), :mod:`~kvdd.bench.report` (the tables); this module holds the command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._native import _copy
from ..models import BLOCK_TOKENS
from .baselines import LIMIT_NAMES, STREAM_THRESHOLD, StreamingMemcpy
from .harness import LoadMonitor, Row, environment
from .overhead import measure_overhead
from .package import measure_package
from .report import print_footer, print_machine, print_section
from .targets import DEFAULT_SCALES, PER_LAYER_TOKENS, QUICK_SCALES, judge, measure_targets
from .transfers import DEFAULT_GEOMETRIES, GEOMETRIES, KINDS, BenchGeometry, measure_transfers
from .xproc import (
    XP_BLOCK_BYTES,
    XP_BLOCKS,
    XP_QUICK_BLOCKS,
    XP_QUICK_ROW_BYTES,
    XP_ROW_BYTES,
    measure_cross_process,
)

__all__ = [
    "GEOMETRIES",
    "KINDS",
    "SCHEMA",
    "BenchGeometry",
    "add_bench_arguments",
    "geometry_names",
    "main",
    "measure_cross_process",
    "measure_overhead",
    "measure_package",
    "measure_targets",
    "measure_transfers",
    "run",
    "run_from_args",
]

#: Identifies the JSON document ``kvdd bench --json`` prints.
SCHEMA = "kvdd.bench/1"

MiB = 1 << 20


def add_bench_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``kvdd bench`` (also used by ``benchmarks/transfers.py``)."""
    ap.add_argument("--quick", action="store_true",
                    help="1024-token requests, short time budget (1-2 minutes on 2 cores with every section)")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    ap.add_argument("--geometries", default=",".join(DEFAULT_GEOMETRIES),
                    help=f"comma-separated subset of: {', '.join(GEOMETRIES)}, or model names as the demo "
                         f"spells them (Qwen2.5-7B, DeepSeek-V3: both its caches; any case) (default: all but "
                         f"{', '.join(g for g in GEOMETRIES if g not in DEFAULT_GEOMETRIES)})")
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
    tg = ap.add_mutually_exclusive_group()
    tg.add_argument("--targets", action="store_true",
                    help="measure only the targets section (the copy kernels against the best of numpy.copyto "
                         "and glibc's streaming memcpy, 1 and 2 threads, on the workloads the kernel targets name); a plain "
                         "run includes it")
    tg.add_argument("--no-targets", action="store_true", help="leave the targets section out")
    ap.add_argument("--scales", help=f"MiB per call of the targets' single-tensor rows, comma-separated (default "
                                     f"{','.join(map(str, DEFAULT_SCALES))}, --quick {','.join(map(str, QUICK_SCALES))})")
    ap.add_argument("--target-tokens", type=int, default=PER_LAYER_TOKENS,
                    help=f"tokens per request of the targets' model rows (default {PER_LAYER_TOKENS})")
    xp = ap.add_mutually_exclusive_group()
    xp.add_argument("--cross-process", action="store_true",
                    help="measure only the cross-process section (a spawned peer process; process_vm and TCP "
                         "paths against process_vm_readv, memcpy and a raw loopback socket); a plain run "
                         "includes it")
    xp.add_argument("--no-cross-process", action="store_true", help="leave the cross-process section out")
    pk = ap.add_mutually_exclusive_group()
    pk.add_argument("--package", action="store_true",
                    help="measure only the package section (pull_blocks of a 1024-token Qwen2.5-7B request through "
                         "kvdd.llm_datadist, CANN's Python package on the simulator, against kvdd's own "
                         "LlmDataDist.pull_kv_blocks, same peer process); a plain run includes it")
    pk.add_argument("--no-package", action="store_true", help="leave the package section out")
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


def geometry_names(text: str) -> list[str]:
    """The geometries ``--geometries`` names: their own names (``qwen2.5-7b``) or the demo's model
    names (``Qwen2.5-7B``; ``DeepSeek-V3`` and ``GLM-5`` stand for each of their caches), any case.

    Raises
    ------
    ValueError
        A name that is neither, listing the choices.
    """
    out: list[str] = []
    bad: list[str] = []
    for name in (x.strip() for x in text.split(",")):
        if not name:
            continue
        key = name.lower()
        found = [key] if key in GEOMETRIES else [  # a model: each of its caches
            g for g, geom in GEOMETRIES.items() if geom.model.lower().startswith(key + " ")]
        if not found:
            bad.append(name)
        out += [g for g in found if g not in out]
    if bad or not out:
        raise ValueError(f"unknown geometry {', '.join(bad) or '(none given)'}; choose from "
                         f"{', '.join(GEOMETRIES)} (or a model: Qwen2.5-7B, Llama-3.1-8B, Llama-3.1-70B, "
                         "DeepSeek-V3, GLM-5)")
    return out


def _command(args: argparse.Namespace) -> str:
    parts = ["kvdd bench"]
    for opt in ("quick", "json", "targets", "no_targets", "cross_process", "no_cross_process", "package",
                "no_package"):
        if getattr(args, opt, False):
            parts.append(f"--{opt.replace('_', '-')}")
    defaults = {"geometries": ",".join(DEFAULT_GEOMETRIES), "kinds": ",".join(KINDS), "seed": 0,
                "target_tokens": PER_LAYER_TOKENS}
    for opt in ("geometries", "kinds", "tokens", "blocks", "repeats", "budget", "overhead_calls", "seed",
                "scales", "target_tokens", "cross_process_bytes", "cross_process_blocks"):
        value = getattr(args, opt, None)
        if value is not None and value != defaults.get(opt):
            parts.append(f"--{opt.replace('_', '-')} {value}")
    return " ".join(parts)


def run(args: argparse.Namespace,
        on_section: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Measure what `args` asks for; the JSON document (see :data:`SCHEMA`).

    ``on_section(name, doc)`` is called as each part is known, with the document so far:
    ``"machine"`` before measuring, then ``"main"`` (overhead and transfers), ``"targets"``,
    ``"cross_process"`` and ``"package"`` as each section finishes (so an interrupted run keeps what it measured).
    """
    def section(name: str, part: dict[str, Any]) -> None:
        if on_section is not None:
            on_section(name, part)

    names = geometry_names(args.geometries)
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
    only_tg = bool(getattr(args, "targets", False))
    only_pk = bool(getattr(args, "package", False))
    with_main = not (only_xp or only_tg or only_pk)
    with_tg = only_tg or (not (only_xp or only_pk) and not getattr(args, "no_targets", False))
    with_xp = only_xp or (not (only_tg or only_pk) and not getattr(args, "no_cross_process", False))
    with_pk = only_pk or (not (only_xp or only_tg) and not getattr(args, "no_package", False))
    scales_text = getattr(args, "scales", None)
    scales = list(QUICK_SCALES if args.quick else DEFAULT_SCALES)
    if scales_text is not None:
        try:
            scales = [int(x) for x in scales_text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--scales takes MiB as comma-separated integers, not {scales_text!r}") from None
        if not scales or min(scales) < 1:
            raise ValueError("--scales needs at least one size, each at least 1 (MiB)")
    target_tokens = getattr(args, "target_tokens", PER_LAYER_TOKENS)
    if target_tokens < BLOCK_TOKENS:
        raise ValueError(f"--target-tokens must be at least {BLOCK_TOKENS} (one block)")
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
    partial: dict[str, Any] = {"environment": environment(), "config": _kernel_config(),
                               "overhead": [], "transfers": [], "targets": None, "cross_process": None,
                               "package": None}
    section("machine", partial)

    t0 = time.perf_counter()
    stats0 = _copy.thread_stats()
    overhead: list[Row] = []
    transfers: list[Row] = []
    targets: dict[str, Any] | None = None
    cross: dict[str, Any] | None = None
    package: dict[str, Any] | None = None
    children: list[float] = []  # CPU time of the streaming-limit processes: this run, not other load
    with LoadMonitor() as load:
        if with_main:
            overhead = measure_overhead(calls, 7 if args.quick else 15)
            transfers = measure_transfers(names, tokens, args.blocks, budget, args.repeats, args.seed, kinds,
                                          progress, child_cpu=children)
            partial.update(overhead=overhead, transfers=transfers)
            section("main", partial)
        if with_tg:
            mine: list[float] = []
            with LoadMonitor() as tg_load:
                targets = measure_targets(scales, target_tokens, budget, args.repeats, args.seed, progress, mine)
                tg_load.add_own(sum(mine))
            judge(targets, tg_load.result().get("other_busy"))
            children += mine
            partial["targets"] = targets
            section("targets", partial)
        load.add_own(sum(children))
        if with_xp:
            try:
                cross = measure_cross_process(xp_bytes, xp_blocks, budget, args.repeats, args.seed,
                                              progress=progress)
            except Exception as exc:  # reported in the document (and the exit status of --cross-process)
                cross = {"config": {"row_bytes": xp_bytes, "blocks": xp_blocks, "block_bytes": XP_BLOCK_BYTES},
                         "error": f"{type(exc).__name__}: {exc}", "peers": [], "peer_cpu_s": 0.0, "rows": [],
                         "targets": []}
            load.add_own(float(cross["peer_cpu_s"]))  # the peers are this run, not other load
            partial["cross_process"] = cross
            section("cross_process", partial)
        if with_pk:
            package = measure_package(args.tokens, args.repeats, args.seed, bool(args.quick), progress)
            partial["package"] = package
            section("package", partial)
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
            **_kernel_config(),
            "limits": list(LIMIT_NAMES),
            "stream_limit_tunables": f"glibc.cpu.x86_non_temporal_threshold={STREAM_THRESHOLD:#x}"
                                     if StreamingMemcpy.available else None,
        },
        "overhead": overhead,
        "transfers": transfers,
        "targets": targets,
        "cross_process": cross,
        "package": package,
        "two_thread_kernel_calls": {k: stats1[k] - stats0[k] for k in stats1},
        "elapsed_s": time.perf_counter() - t0,
    }

def _kernel_config() -> dict[str, Any]:
    """The copy kernels' configuration (the 2-thread model is learned from this run's calls)."""
    return {"isa": _copy.get_isa(), "streaming_threshold": _copy.get_streaming_threshold(),
            "threads_threshold": _copy.get_threads_threshold(), "threads_model": _copy.threads_model(),
            "cache_sizes": _copy.cache_sizes(), "cpu_features": _copy.cpu_features()}


def _print_section(name: str, doc: dict[str, Any]) -> None:
    if name == "machine":
        print_machine(doc["environment"], doc["config"])
    else:
        print_section(doc, name)


def run_from_args(args: argparse.Namespace) -> int:
    """``kvdd bench``: exit status 0, 2 for unusable arguments, 1 when ``--cross-process`` failed.

    Tables are printed as each section finishes (Ctrl-C keeps the finished ones); ``--json``
    prints the whole document at the end."""
    try:
        doc = run(args, None if args.json else _print_section)
    except ValueError as exc:
        print(f"kvdd bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    else:
        print_footer(doc)
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