"""The tables ``kvdd bench`` prints for people (``--json`` prints the document instead)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

from .harness import fmt, print_table
from .xproc import print_cross_process

__all__ = ["OVERHEAD_COLUMNS", "TRANSFER_COLUMNS", "print_report"]

TRANSFER_COLUMNS = ("geometry", "kind", "tensors", "calls", "run_bytes", "bytes", "min_ms", "median_ms",
                    "gbps", "memcpy_1t_gbps", "memcpy_2t_gbps", "ratio", "ratio_median", "verified")
OVERHEAD_COLUMNS = ("case", "path", "min_us", "median_us", "calls")


def print_report(doc: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The tables for people."""
    out = file if file is not None else sys.stdout
    env, cfg = doc["environment"], doc["config"]
    print(f"# {env.get('cpu', env['machine'])}, {env['cpus']} CPUs, Python {env['python']}; copy kernel "
          f"isa={cfg['isa']}, streaming >= {fmt(cfg['streaming_threshold'])}B, "
          f"auto 2 threads >= {fmt(cfg['threads_threshold'])}B", file=out)
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

