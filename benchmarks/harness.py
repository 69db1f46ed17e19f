"""Measuring and reporting helpers shared by kvdd's benchmarks (kernel level here, model level in
``kvdd bench``).

Benchmarks are not tests: they measure and report ratios against a limit measured in the same run
(DESIGN.md). Every measurement is a plain ``dict`` (JSON-ready); :func:`print_table` renders a list of
them for people and :func:`dump_json` for machines.

Typical use::

    limit = time_repeats(lambda: memcpy_bench(dst, src, n), repeats=9)
    cand = time_repeats(lambda: copy_runs(...), repeats=9)
    row = compare("pull 1 MiB", n, cand, limit)
"""

from __future__ import annotations

# One implementation, inside the installed package (``kvdd bench`` cannot import this directory).
from kvdd.bench.harness import (
    LoadMonitor,
    Timing,
    compare,
    dump_json,
    environment,
    gbps,
    interleaved,
    per_call_overhead,
    print_table,
    repeats_for,
    time_repeats,
)

__all__ = [
    "LoadMonitor",
    "Timing",
    "compare",
    "dump_json",
    "environment",
    "gbps",
    "interleaved",
    "per_call_overhead",
    "print_table",
    "repeats_for",
    "time_repeats",
]
