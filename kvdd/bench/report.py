"""The tables ``kvdd bench`` prints for people (``--json`` prints the document instead)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

from .harness import fmt, print_table
from .package import print_package
from .xproc import print_cross_process

__all__ = ["OVERHEAD_COLUMNS", "TARGET_COLUMNS", "TRANSFER_COLUMNS", "print_report", "print_targets"]

TRANSFER_COLUMNS = ("geometry", "kind", "tensors", "calls", "run_bytes", "bytes", "min_ms", "gbps",
                    "numpy_1t_gbps", "numpy_2t_gbps", "stream_1t_gbps", "stream_2t_gbps", "limit", "ratio",
                    "ratio_median", "two_threads", "compiled", "kernel_gbps", "outside_us", "verified")
TARGET_COLUMNS = ("geometry", "kind", "tensors", "calls", "run_bytes", "bytes", "gbps", "limit", "limit_gbps",
                  "ratio", "ratio_median", "two_threads", "compiled", "kernel_gbps", "outside_us", "goal", "met")
LIMITS_TEXT = ("limit = the fastest of numpy.copyto on 1 thread / 2 threads (halves) and glibc memcpy forced to "
               "streaming stores (child process, GLIBC_TUNABLES) on 1 / 2 threads, same bytes, interleaved; "
               "ratio = limit time / kvdd time (> 1: faster than the limit); two_threads = share of kvdd's "
               "copy calls that used two threads; compiled = share of kvdd's calls that took the simulator's "
               "compiled in-process path (kvdd.sim._fastpath); every operation is timed right after an untimed run of itself; "
               "kernel_gbps = the bytes over kvdd's median time in its copy kernels, outside_us = its median "
               "time outside them per call")
OVERHEAD_COLUMNS = ("case", "path", "min_us", "median_us", "calls")


def print_report(doc: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The tables for people."""
    out = file if file is not None else sys.stdout
    env, cfg = doc["environment"], doc["config"]
    model = cfg["threads_model"]
    threads = (f"{fmt(cfg['threads_threshold'])}B (fixed)" if cfg["threads_threshold"] is not None else
               f"{fmt(model['min_bytes'])}B (measured: 2-thread extra {model['extra_us']:.0f} us, one thread "
               f"{model['one_thread_gbps']:.1f} GB/s)")
    print(f"# {env.get('cpu', env['machine'])}, {env['cpus']} CPUs, Python {env['python']}; copy kernel "
          f"isa={cfg['isa']}, streaming >= {fmt(cfg['streaming_threshold'])}B, auto 2 threads >= {threads}",
          file=out)
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
        print(f"Transfers ({LIMITS_TEXT}):", file=out)
        print_table(doc["transfers"], TRANSFER_COLUMNS, out)
    if doc.get("targets") is not None:
        print_targets(doc["targets"], out)
    cross = doc.get("cross_process")
    if cross is not None:
        print_cross_process(cross, out)
    package = doc.get("package")
    if package is not None:
        print_package(package, out)
    out.flush()



def print_targets(section: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The targets table, one verdict line per target and what limits every row below its goal."""
    out = file if file is not None else sys.stdout
    print(file=out)
    print(f"Targets of issue 15 ({section['tokens']}-token requests for the model rows; {LIMITS_TEXT}):",
          file=out)
    rows = section["rows"]
    for name in dict.fromkeys(r["target"] for r in rows):
        print(file=out)
        print_table([r for r in rows if r["target"] == name], TARGET_COLUMNS, out,
                    title=f"{name}:" if name else "(measured alongside):")
    print(file=out)
    for t in section["summary"]:
        print(f"# target {t['target']}: >= {t['goal']}x: worst {t['worst_ratio']:.2f}x ({t['worst']}), "
              f"{'met' if t['met'] else 'NOT met'}", file=out)
    for r in rows:
        if r["met"] is False and r["limited_by"]:
            print(f"# {r['geometry']} {r['kind']} at {r['ratio']:.2f}x: limited by {r['limited_by']}", file=out)
