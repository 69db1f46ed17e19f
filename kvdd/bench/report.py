"""The tables ``kvdd bench`` prints for people (``--json`` prints the document instead)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

from .harness import fmt, print_table, say
from .package import print_package
from .xproc import print_cross_process

__all__ = ["OVERHEAD_COLUMNS", "TARGET_COLUMNS", "TRANSFER_COLUMNS", "print_footer", "print_machine", "print_report",
           "print_section", "print_targets"]

# The first columns (up to the verdict) fit one 120-column table; print_table puts the rest in a
# second one, each starting with geometry and kind.
TRANSFER_COLUMNS = ("geometry", "kind", "bytes", "min_ms", "gbps", "limit", "ratio", "ratio_median", "verified",
                    "tensors", "calls", "run_bytes", "numpy_1t_gbps", "numpy_2t_gbps", "stream_1t_gbps",
                    "stream_2t_gbps", "two_threads", "compiled", "kernel_gbps", "outside_us")
TARGET_COLUMNS = ("geometry", "kind", "bytes", "gbps", "limit", "limit_gbps", "ratio", "ratio_median", "goal",
                  "met", "tensors", "calls", "run_bytes", "two_threads", "compiled", "kernel_gbps", "outside_us")
LIMITS_TEXT = ("limit = the fastest of numpy.copyto on 1 thread / 2 threads (halves) and glibc memcpy forced to "
               "streaming stores (child process, GLIBC_TUNABLES) on 1 / 2 threads, same bytes, interleaved; "
               "ratio = limit time / kvdd time (> 1: faster than the limit); two_threads = share of kvdd's "
               "copy calls that used two threads; compiled = share of kvdd's calls that took the simulator's "
               "compiled in-process path (kvdd.sim._fastpath); every operation is timed right after an untimed run of itself; "
               "kernel_gbps = the bytes over kvdd's median time in its copy kernels, outside_us = its median "
               "time outside them per call")
OVERHEAD_COLUMNS = ("case", "path", "min_us", "median_us", "calls")


def print_report(doc: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The tables for people: the machine, each measured section, the run's load and time."""
    out = file if file is not None else sys.stdout
    print_machine(doc["environment"], doc["config"], out)
    print_section(doc, "main", out)
    print_section(doc, "targets", out)
    print_section(doc, "cross_process", out)
    print_section(doc, "package", out)
    print_footer(doc, out)


def print_machine(env: Mapping[str, Any], cfg: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The first line: the CPU, Python and the copy kernels' configuration."""
    out = file if file is not None else sys.stdout
    say(f"# {env.get('cpu', env['machine'])}, {env['cpus']} CPUs, Python {env['python']}; copy kernel "
        f"isa={cfg['isa']}, streaming >= {fmt(cfg['streaming_threshold'])}B", out)
    out.flush()


def print_section(doc: Mapping[str, Any], name: str, file: IO[str] | None = None) -> None:
    """One measured section of the document (``main``: overhead and transfers, ``targets``,
    ``cross_process``, ``package``); nothing when it was not measured."""
    out = file if file is not None else sys.stdout
    if name == "main" and (doc.get("overhead") or doc.get("transfers")):
        print(file=out)
        say("Per-call overhead (64-byte single-tensor pull between two in-process simulator instances):", out)
        print_table(doc["overhead"], OVERHEAD_COLUMNS, out)
        print(file=out)
        say(f"Transfers ({LIMITS_TEXT}):", out)
        print_table(doc["transfers"], TRANSFER_COLUMNS, out)
    elif name == "targets" and doc.get("targets") is not None:
        print_targets(doc["targets"], out)
    elif name == "cross_process" and doc.get("cross_process") is not None:
        print_cross_process(doc["cross_process"], out)
    elif name == "package" and doc.get("package") is not None:
        print_package(doc["package"], out)
    out.flush()


def print_footer(doc: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The last lines: other load while measuring, the command, the request size and the time."""
    out = file if file is not None else sys.stdout
    print(file=out)
    busy = doc["environment"].get("other_busy")
    if busy is not None:
        say(f"# other load while measuring: {busy:.0%} of all CPUs"
            + ("  (numbers not representative: machine busy)" if busy > 0.1 else ""), out)
    cfg = doc["config"]
    model = cfg["threads_model"]
    threads = (f"{fmt(cfg['threads_threshold'])}B (fixed)" if cfg["threads_threshold"] is not None else
               f"{fmt(model['min_bytes'])}B (measured: 2-thread extra {model['extra_us']:.0f} us, one thread "
               f"{model['one_thread_gbps']:.1f} GB/s)")
    say(f"# copy kernels: auto 2 threads >= {threads}", out)
    say(f"# {doc['command']}: {cfg['tokens']}-token requests, {doc['elapsed_s']:.1f} s", out)
    out.flush()



def print_targets(section: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The targets table, one verdict line per target and what limits every row below its goal."""
    out = file if file is not None else sys.stdout
    print(file=out)
    say(f"Kernel targets ({section['tokens']}-token requests for the model rows; {LIMITS_TEXT}):", out)
    rows = section["rows"]
    for name in dict.fromkeys(r["target"] for r in rows):
        print(file=out)
        print_table([r for r in rows if r["target"] == name], TARGET_COLUMNS, out,
                    title=f"{name}:" if name else "(measured alongside):")
    print(file=out)
    for t in section["summary"]:
        say(f"# target {t['target']}: >= {t['goal']}x: worst {t['worst_ratio']:.2f}x ({t['worst']}), "
            f"{'met' if t['met'] else 'NOT met'}", out)
    for r in rows:
        if r["met"] is False and r["limited_by"]:
            say(f"# {r['geometry']} {r['kind']} at {r['ratio']:.2f}x: limited by {r['limited_by']}", out)
