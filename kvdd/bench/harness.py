"""The reusable measuring harness of kvdd's benchmarks: timing, the machine's other load, the
environment, and result rows as JSON or aligned text tables.

Benchmarks are not tests: they measure and report ratios against a limit measured in the same run.
Every measurement is a plain ``dict`` (JSON-ready); :func:`print_table` renders a list of them for
people and :func:`dump_json` for machines.  Typical use (the limits are in :mod:`kvdd.bench.baselines`)::

    res = interleaved({"candidate": lambda: copy(...), "limit": lambda: memcpy(...)}, repeats=9)
    row = compare("pull 1 MiB", n, res["candidate"], res["limit"])
    print_table([row])

Nothing here imports the rest of kvdd: the harness works for any callable.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import IO, Any

__all__ = [
    "TABLE_WIDTH",
    "peer_reporting",
    "say",
    "KiB",
    "MiB",
    "LoadMonitor",
    "Row",
    "SelfTimed",
    "Timing",
    "compare",
    "dump_json",
    "environment",
    "fmt",
    "gbps",
    "interleaved",
    "per_call_overhead",
    "print_table",
    "repeats_for",
    "time_repeats",
    "timing",
]

KiB = 1 << 10
MiB = 1 << 20

#: One result row (JSON-ready).
Row = dict[str, Any]
#: ``{"min_s", "median_s", "samples"}`` of one timed operation.
Timing = dict[str, Any]


class SelfTimed:
    """An operation that times itself (e.g. in another process): calling it runs it once and
    returns its duration in seconds, which :func:`interleaved` records instead of the call's."""

    def __init__(self, fn: Callable[[], float]) -> None:
        self.fn = fn

    def __call__(self) -> float:
        return self.fn()


def timing(samples: Sequence[float]) -> Timing:
    """``{"min_s", "median_s", "samples"}`` of `samples` (seconds)."""
    return {"min_s": min(samples), "median_s": statistics.median(samples), "samples": len(samples)}


def interleaved(fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1,
                own_warm: bool = False) -> dict[str, Timing]:
    """Time several operations in turn (a, b, c, a, b, c, ...) so that each sees the same machine
    state; one ``{"min_s", "median_s", "samples"}`` per name.  A :class:`SelfTimed` operation
    reports its own time.

    With `own_warm`, every timed run comes right after an untimed run of the same operation, so each
    operation finds the caches as its own previous run left them (its bytes in the last-level cache
    when they fit), whatever ran before it in the turn: without it, an operation that follows one
    touching the same bytes (a 2-thread copy after the 1-thread copy of the same buffers) runs hot
    while the others run cold."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.perf_counter
    for _ in range(repeats):
        for name, fn in fns.items():
            if own_warm:
                fn()
            if isinstance(fn, SelfTimed):
                samples[name].append(fn())
                continue
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return {name: timing(s) for name, s in samples.items()}


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
    return timing(samples)


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


def fmt(v: Any) -> str:
    """A table cell: floats to 3 significant digits or so, byte counts as Ki/Mi, bools as yes/no."""
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


#: Widest table line ``kvdd bench`` prints (characters); wider tables are split into column groups.
TABLE_WIDTH = 120


def say(text: str, file: IO[str] | None = None) -> None:
    """Print ``text`` wrapped at :data:`TABLE_WIDTH` (a ``# `` comment line stays a comment)."""
    out = file if file is not None else sys.stdout
    indent = "#   " if text.startswith("# ") else "  "
    print(textwrap.fill(text, TABLE_WIDTH, subsequent_indent=indent, break_on_hyphens=False,
                        break_long_words=False), file=out)


def print_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None,
                file: IO[str] | None = None, title: str | None = None, width: int = TABLE_WIDTH,
                keys: int = 2) -> None:
    """Print result rows as an aligned text table (columns: the given ones, or every key in order of
    first appearance).  A table wider than ``width`` characters is printed as several tables of
    consecutive columns, each starting with the first ``keys`` columns (which name the row)."""
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
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    keys = min(keys, len(columns))
    groups: list[list[int]] = []
    used = sum(widths[:keys]) + 2 * keys
    for i in range(keys, len(columns)):
        if not groups or used + widths[i] > width and len(groups[-1]) > 0:
            groups.append([])
            used = sum(widths[:keys]) + 2 * keys
        groups[-1].append(i)
        used += widths[i] + 2
    for n, group in enumerate(groups or [[]]):
        idx = [*range(keys), *group]
        if n:
            print(file=out)
        print("  ".join(columns[i].rjust(widths[i]) for i in idx), file=out)
        for row in cells:
            print("  ".join(row[i].rjust(widths[i]) for i in idx), file=out)
    out.flush()



@contextmanager
def peer_reporting(conn: Any) -> Iterator[None]:
    """The body of a bench's spawned peer process: an exception is sent to the bench over ``conn``
    as ``("error", "Type: message")`` and the process exits with status 1; ``conn`` is closed at
    the end either way."""
    try:
        yield
    except BaseException as exc:  # reported to the bench
        with suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        conn.close()
