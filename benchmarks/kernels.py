"""Kernel-level benchmark of ``kvdd._native._copy.copy_runs`` against the machine's own limit.

For each total size (1 MiB .. 256 MiB) and run size (16/64/128/256 KiB) it copies ``total / run``
runs at random, non-contiguous block offsets (like PullKvBlocks with random block ids, one tensor) and
compares with the limit of the same number of bytes, contiguous, measured interleaved in the same run:
the best of ``numpy.copyto`` on 1 and 2 threads and glibc ``memcpy`` forced to streaming stores on 1
and 2 threads (:class:`kvdd.bench.baselines.Limits`). Also reports the per-call overhead of a 64-byte
copy.

    python -m benchmarks.kernels            # full table (about 1-2 minutes on 2 cores)
    python -m benchmarks.kernels --quick    # under 30 s
    python -m benchmarks.kernels --json     # machine-readable
    python -m benchmarks.kernels --modes auto,regular,stream --threads 1,2   # threshold tuning

Columns: ``ratio`` = limit time / copy_runs time (min over repeats; >1 is faster than the limit;
``limit`` names the fastest), ``ratio_median`` the same from medians, ``ratio_stream`` against one
contiguous streaming copy of kvdd's own kernel (``stream_bench``), ``path`` = what copy_runs planned (``S`` streaming / ``R`` regular stores, then
the thread count; with threads=0 the plan is taken once, automatic mode may change it per call).
The header line reports how busy the machine was with other work while measuring: on a shared
2-core machine only runs with ~0% other load are comparable.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

from kvdd._native import _copy
from kvdd.bench.baselines import Limits, limit_columns

from .harness import (LoadMonitor, compare, dump_json, environment, interleaved, per_call_overhead, print_table,
                      repeats_for)

__all__ = ["main", "measure_overhead", "measure_runs", "tuning"]

KiB = 1 << 10
MiB = 1 << 20
TOTALS = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
RUNS = (16 * KiB, 64 * KiB, 128 * KiB, 256 * KiB)
QUICK_TOTALS = (1 * MiB, 16 * MiB, 256 * MiB)
QUICK_RUNS = (16 * KiB, 128 * KiB)

#: streaming threshold per mode: auto = the module default (None), regular = never, stream = always
MODES: dict[str, int | None] = {"auto": None, "regular": 1 << 62, "stream": 0}

COLUMNS = ("case", "total", "run", "runs", "threads", "mode", "path", "min_ms", "median_ms", "gbps", "limit",
           "limit_gbps", "ratio", "ratio_median", "ratio_stream")


@contextmanager
def tuning(*, streaming_threshold: int | None = None, threads_threshold: int | None = None,
           isa: str | None = None) -> Iterator[None]:
    """Temporarily change the kernel module's thresholds / streaming ISA."""
    prev_s = _copy.set_streaming_threshold(streaming_threshold) if streaming_threshold is not None else None
    prev_t = _copy.set_threads_threshold(threads_threshold) if threads_threshold is not None else None
    prev_i = _copy.set_isa(isa) if isa is not None else None
    try:
        yield
    finally:
        if prev_s is not None:
            _copy.set_streaming_threshold(prev_s)
        if prev_t is not None:
            _copy.set_threads_threshold(prev_t)
        if prev_i is not None:
            _copy.set_isa(prev_i)


def _buffer(nbytes: int, fill: int) -> tuple[npt.NDArray[np.uint8], _copy.Region]:
    a = np.empty(nbytes, dtype=np.uint8)
    a.fill(fill)  # fault every page in before timing
    return a, _copy.Region(a.ctypes.data, a.nbytes, a)


def _with_mode(fn: Callable[[], object], threshold: int | None) -> Callable[[], object]:
    if threshold is None:
        return fn

    def run() -> object:
        prev = _copy.set_streaming_threshold(threshold)
        try:
            return fn()
        finally:
            _copy.set_streaming_threshold(prev)

    return run


def measure_runs(totals: Sequence[int] = TOTALS, run_sizes: Sequence[int] = RUNS,
                 threads: Sequence[int] = (1, 2), modes: Sequence[str] = ("auto",),
                 repeats: int | None = None, seed: int = 0, budget_s: float = 0.2) -> list[dict[str, Any]]:
    """Random-offset block runs vs. contiguous memcpy of the same bytes, one row per
    (total, run size, threads, mode). `repeats` None: chosen per size from `budget_s`."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    with Limits(max(totals)) as limits:
        for total in totals:
            rows += _measure_total(total, run_sizes, threads, modes, repeats, rng, budget_s, limits)
    return rows


def _measure_total(total: int, run_sizes: Sequence[int], threads: Sequence[int], modes: Sequence[str],
                   repeats: int | None, rng: np.random.Generator, budget_s: float,
                   limits: Limits) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cap = 2 * total  # blocks are drawn from twice as many as copied: gaps between runs
    _src, rs = _buffer(cap, 0x5A)
    _dst, rd = _buffer(cap, 0xA5)
    for run in run_sizes:
        n = max(1, total // run)
        nbytes = n * run
        blocks = cap // run
        so = rng.choice(blocks, n, replace=False).astype(np.int64) * run
        do = rng.choice(blocks, n, replace=False).astype(np.int64) * run
        ln = np.full(n, run, dtype=np.int64)
        fns: dict[str, Callable[[], object]] = {"stream": functools.partial(_copy.stream_bench, rd, rs, nbytes)}
        fns.update(limits.fns(_dst, _src, nbytes))
        paths: dict[str, str] = {}
        for mode in modes:
            thr = MODES[mode]
            for t in threads:
                key = f"{mode}/{t}"
                call = functools.partial(_copy.copy_runs, [rs], [rd], so, do, ln, threads=t)
                fns[key] = _with_mode(call, thr)
                with tuning(streaming_threshold=thr):
                    p = _copy.plan_runs([rs], [rd], so, do, ln, threads=t)
                paths[key] = ("S" if p.streaming else "R") + str(p.threads)
        reps = repeats if repeats is not None else repeats_for(nbytes, budget_s)
        res = interleaved(fns, reps)
        best = str(limit_columns(res, nbytes, candidate="stream")["limit"])
        for key, path in paths.items():
            mode, nthreads = key.split("/")
            row = compare("random runs", nbytes, res[key], res[best], total=total, run=run, runs=n,
                          threads=int(nthreads), mode=mode, path=path)
            row["limit"] = best
            row["ratio_stream"] = res["stream"]["min_s"] / res[key]["min_s"]
            row["stream_gbps"] = nbytes / res["stream"]["min_s"] / 1e9
            rows.append(row)
    del _src, _dst, rs, rd
    return rows


def measure_overhead(nbytes: int = 64, calls: int = 20000, batches: int = 15) -> dict[str, Any]:
    """Per-call time of ``copy_runs`` for one tensor and one run of `nbytes` (and of an empty
    ``memcpy_bench`` for reference: the cost of any call into the extension)."""
    a, ra = _buffer(4096, 1)
    b, rb = _buffer(4096, 2)
    z = np.zeros(1, dtype=np.int64)
    ln = np.array([nbytes], dtype=np.int64)
    src, dst = [ra], [rb]
    row: dict[str, Any] = {"case": f"per-call {nbytes} B", "bytes": nbytes}
    row.update(per_call_overhead(functools.partial(_copy.copy_runs, src, dst, z, z, ln), calls, batches))
    ref = per_call_overhead(functools.partial(_copy.memcpy_bench, rb, ra, nbytes), calls, batches)
    row["memcpy_bench_median_us"] = ref["median_us"]
    del a, b
    return row


def _sizes(text: str, unit: int) -> list[int]:
    return [int(float(x) * unit) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats (under 30 s)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--totals", help="total sizes in MiB, comma separated (default 1,4,16,64,256)")
    ap.add_argument("--runs", help="run sizes in KiB, comma separated (default 16,64,128,256)")
    ap.add_argument("--threads", default="1,2",
                    help="threads= values to measure: 1, 2, and 0 = automatic (default 1,2)")
    ap.add_argument("--modes", default="auto", help=f"streaming modes among {','.join(MODES)} (default auto)")
    ap.add_argument("--repeats", type=int, help="repeats per measurement (default: by size)")
    ap.add_argument("--isa", help=f"streaming implementation (default best of {_copy.available_isas()})")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    totals = _sizes(args.totals, MiB) if args.totals else list(QUICK_TOTALS if args.quick else TOTALS)
    runs = _sizes(args.runs, KiB) if args.runs else list(QUICK_RUNS if args.quick else RUNS)
    threads = [int(t) for t in args.threads.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    budget = 0.08 if args.quick else 0.2

    with tuning(isa=args.isa):
        config = {
            "isa": _copy.get_isa(),
            "streaming_threshold": _copy.get_streaming_threshold(),
            "threads_threshold": _copy.get_threads_threshold(),
            "chunk_size": _copy.get_chunk_size(),
            "cpu_features": _copy.cpu_features(),
        }
        stats0 = _copy.thread_stats()
        with LoadMonitor() as load:
            overhead = measure_overhead(batches=7 if args.quick else 15)
            rows = measure_runs(totals, runs, threads, modes, args.repeats, args.seed, budget)
        stats1 = _copy.thread_stats()
    env = environment()
    env.update(load.result())
    two = {k: stats1[k] - stats0[k] for k in stats1}

    if args.json:
        dump_json({"environment": env, "config": config, "overhead": overhead, "runs": rows,
                   "two_thread_stats": two})
    else:
        busy = env.get("other_busy")
        print(f"# {env.get('cpu', env['machine'])}, {env['cpus']} CPUs, Python {env['python']}; "
              f"isa={config['isa']} streaming>={config['streaming_threshold']} B "
              f"auto-2-threads>={config['threads_threshold'] if config['threads_threshold'] is not None else 'measured'}"
              f" ({_copy.threads_model()})")
        if busy is not None:
            print(f"# other load while measuring: {busy:.0%} of all CPUs"
                  + ("  (numbers not representative: machine busy)" if busy > 0.1 else ""))
        if two["calls"]:
            print(f"# 2-thread calls: {two['calls']}, helper did {two['helper_chunks']}/{two['chunks']} "
                  f"work items, stalls {two['stalls']}")
        print_table([overhead], ["case", "min_us", "median_us", "memcpy_bench_median_us", "calls"])
        print()
        print_table(rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
