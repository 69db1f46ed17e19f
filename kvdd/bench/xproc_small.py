"""Small-call latency and CPU cost for the cross-process section of ``kvdd bench``.

* :func:`latency` times single calls of several functions interleaved in short batches (so load
  from other processes hits all of them alike) and reports median and p99 per function;
* :class:`CpuMeter` measures the CPU seconds of this process and of a peer process (all threads:
  ``CLOCK_PROCESS_CPUTIME_ID`` here, ``/proc/<pid>/task/*/schedstat`` there, ns resolution) spent
  while a function runs, per GB moved.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["latency", "CpuMeter", "task_cpu_s", "pvm_ctypes", "small_block_rows", "SMALL_BLOCK_COUNTS"]

#: Block counts of the small block-list latency rows (64 KiB blocks, pulled from the peer process).
SMALL_BLOCK_COUNTS = (1, 4, 16)


def latency(fns: Mapping[str, Callable[[], object]], calls: int, batch: int = 50,
            warmup: int = 20) -> dict[str, dict[str, float]]:
    """``{name: {"median_us", "p99_us", "calls"}}`` over ``calls`` timed calls of each function,
    run interleaved in batches of ``batch`` calls (after ``warmup`` untimed calls each).

    Each batch starts with one untimed call: on a virtual or shared machine the first call after
    another function ran (or after a pause) pays the CPU's wake-up and cold caches — a bare
    ``getpid`` through ctypes 6 µs after a 5 ms gap, a bare 64 B ``process_vm_readv`` a p99 of
    36 µs when those first calls are timed — so the p99 is that of a call in a stream of calls,
    for every function alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[int]] = {name: [] for name in fns}
    clock = time.perf_counter_ns
    done = 0
    while done < calls:
        n = min(batch, calls - done)
        for name, fn in fns.items():
            out = samples[name]
            fn()  # untimed: the batch's first call after another function ran
            for _ in range(n):
                t0 = clock()
                fn()
                out.append(clock() - t0)
        done += n
    result: dict[str, dict[str, float]] = {}
    for name, ns in samples.items():
        a = np.asarray(ns, dtype=np.float64) / 1e3
        result[name] = {"median_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99)),
                        "calls": float(len(a))}
    return result


def pvm_ctypes(pid: int, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> Callable[[], object]:
    """A bare ``process_vm_readv`` of these iovecs (addresses and byte lengths, local run i <-
    remote run i) called from Python through ctypes: what any Python caller of the system call
    pays, the reference of the small-call targets.  Raises OSError when a call moves fewer bytes."""
    import ctypes

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                   ctypes.c_ulong]
    n = len(lengths)
    liov = (IoVec * n)(*(IoVec(a, ln) for a, ln in zip(local, lengths)))
    riov = (IoVec * n)(*(IoVec(a, ln) for a, ln in zip(remote, lengths)))
    args = (pid, ctypes.addressof(liov), n, ctypes.addressof(riov), n, 0)
    if fn(*args) != sum(lengths):
        raise OSError(ctypes.get_errno(), "process_vm_readv of the reference iovecs failed")
    return _Bound(fn, args, (liov, riov))


class _Bound:
    """A ctypes call with fixed arguments that keeps the memory they point to alive."""

    def __init__(self, fn: Callable[..., object], args: tuple[object, ...], keep: object) -> None:
        self.fn, self.args, self.keep = fn, args, keep

    def __call__(self) -> object:
        return self.fn(*self.args)


def small_block_rows(path: str, data_path: str, pull: Callable[[int], Callable[[], object]],
                     reference: Callable[[int], Callable[[], object]], verify: Callable[[int], bool],
                     block_bytes: int, calls: int, most: int) -> list[dict[str, Any]]:
    """Latency rows of small block lists: for each count in :data:`SMALL_BLOCK_COUNTS`,
    ``pull(count)`` (a ``pull_kv_blocks`` of that many blocks) against ``reference(count)`` (the
    bare ``process_vm_readv`` of the same iovecs), interleaved as :func:`latency` does;
    ``verify(count)`` says whether the pull landed the peer's bytes.  Counts above ``most`` (the
    blocks the run has) are left out."""
    rows: list[dict[str, Any]] = []
    for count in (c for c in SMALL_BLOCK_COUNTS if c <= most):
        fn = pull(count)
        fn()
        ok = verify(count)
        res = latency({"transfer": fn, "pvm_ctypes": reference(count)}, calls)
        tr, ref = res["transfer"], res["pvm_ctypes"]
        rows.append({"path": path, "data_path": data_path, "kind": f"pull_blocks_{count}x{block_bytes >> 10}KiB",
                     "bytes": count * block_bytes, "median_us": tr["median_us"], "p99_us": tr["p99_us"],
                     "pvm_ctypes_median_us": ref["median_us"], "pvm_ctypes_p99_us": ref["p99_us"],
                     "vs_pvm_ctypes_median": tr["median_us"] / ref["median_us"], "calls": int(tr["calls"]),
                     "verified": ok})
    return rows


def task_cpu_s(pid: int) -> float | None:
    """CPU seconds of every thread of process ``pid`` so far (None when unreadable)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total / 1e9


class CpuMeter:
    """CPU seconds of this process and of ``peer_pid`` per GB moved by a function."""

    def __init__(self, peer_pid: int) -> None:
        self.peer_pid = peer_pid

    def per_gb(self, fn: Callable[[], object], nbytes: int, repeats: int) -> dict[str, Any]:
        """Run ``fn`` ``repeats`` times; ``{"cpu_s_per_gb", "own_cpu_s_per_gb",
        "peer_cpu_s_per_gb"}`` (None for the peer when its counters cannot be read)."""
        peer0 = task_cpu_s(self.peer_pid)
        own0 = time.process_time()
        for _ in range(repeats):
            fn()
        own = time.process_time() - own0
        peer1 = task_cpu_s(self.peer_pid)
        peer = None if peer0 is None or peer1 is None else max(peer1 - peer0, 0.0)
        gb = nbytes * repeats / 1e9
        return {"cpu_s_per_gb": (own + (peer or 0.0)) / gb, "own_cpu_s_per_gb": own / gb,
                "peer_cpu_s_per_gb": None if peer is None else peer / gb}


#: The small-call table's columns.  The bare mechanisms' p99 is shown beside their median, measured
#: the same way (:func:`latency`: interleaved batches, each batch's first call untimed).
LAT_COLUMNS = ("path", "kind", "median_us", "p99_us", "in_process_median_us", "vs_in_process_median",
               "in_process_python_median_us", "in_process_python_p99_us", "vs_in_process_python_median",
               "vs_in_process_python_p99", "socket_rr_median_us", "socket_rr_p99_us", "vs_socket_rr_median",
               "pvm_ctypes_median_us", "pvm_ctypes_p99_us", "vs_pvm_ctypes_median", "calls", "verified")

#: The cross-process targets: (path, table, kind, key, at least / at most, bound, what). The same-host
#: latency targets compare a call with the in-process pull through the engine's Python checks, and
#: with a bare ``process_vm_readv`` from Python; the comparison with the compiled in-process pull
#: (the same compiled call path, an instance of this process at the other end) is printed beside
#: them (vs_in_process_median).
_TARGETS: tuple[tuple[str, str, str, str, str, float, str], ...] = (
    ("process_vm", "latency", "pull_64B", "vs_in_process_python_median", "max", 2.5,
     "same-host 64 B pull median <= 2.5x the in-process pull (both through the engine's Python checks)"),
    ("process_vm", "latency", "pull_64B", "vs_in_process_python_p99", "max", 10.0,
     "same-host 64 B pull p99 <= 10x the in-process pull (both through the engine's Python checks)"),
    ("process_vm", "latency", "pull_64B", "vs_pvm_ctypes_median", "max", 1.2,
     "same-host 64 B pull median <= 1.2x a bare 64 B process_vm_readv from Python (ctypes)"),
    ("process_vm", "latency", "pull_64B", "p99_us", "max", 10.0,
     "same-host 64 B pull p99 <= 10 us"),
    *(("process_vm", "latency", f"pull_blocks_{n}x64KiB", "vs_pvm_ctypes_median", "max", 1.2,
       f"same-host pull of {n} x 64 KiB blocks: median <= 1.2x a bare process_vm_readv of the same "
       "iovecs from Python (ctypes)") for n in SMALL_BLOCK_COUNTS),
    ("process_vm", "rows", "pull_blocks", "vs_pvm_iov", "min", 0.95,
     "same-host block pull >= 0.95x bare process_vm_readv of the same iovecs"),
    ("process_vm", "rows", "pull_row", "vs_pvm", "min", 0.95,
     "same-host row pull >= 0.95x bare process_vm_readv"),
    ("process_vm", "rows", "push_blocks", "vs_pvm_iov", "min", 0.95,
     "same-host block push >= 0.95x bare process_vm_writev of the same iovecs"),
    ("tcp", "rows", "pull_blocks", "vs_socket", "min", 0.9,
     "TCP block pull >= 0.9x a raw loopback socket (the faster of two receivers)"),
    ("tcp", "rows", "pull_row", "vs_socket", "min", 0.9,
     "TCP row pull >= 0.9x a raw loopback socket (the faster of two receivers)"),
    ("tcp", "latency", "pull_64B", "vs_socket_rr_median", "max", 3.0,
     "TCP 64 B pull median <= 3x a raw blocking 64 B request/response"),
)


def xp_targets(rows: list[dict[str, Any]], lat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cross-process targets against what this run measured (as a ratio, whether met; for a
    bound in µs the ratio is measured / bound and the text gives the measured value)."""
    out: list[dict[str, Any]] = []
    for path, table, kind, key, sense, bound, what in _TARGETS:
        for r in (rows if table == "rows" else lat):
            if r["path"] == path and r["kind"] == kind and r.get(key) is not None:
                v = float(r[key])
                if key.endswith("_us"):  # an absolute bound: the ratio is measured / bound
                    out.append({"target": f"{what} (measured {v:.1f} us)", "ratio": v / bound,
                                "met": v <= bound})
                    continue
                out.append({"target": what, "ratio": v, "met": v >= bound if sense == "min" else v <= bound})
    return out
