"""The limits kvdd's copies are measured against: plain copies of the same bytes, timed interleaved
with the candidate (:func:`kvdd.bench.harness.interleaved`), and the memory they run on.

The limit of a copy of N bytes is the best of (:class:`Limits`):

``numpy_1t``   ``numpy.copyto`` of the N bytes between the same two buffers (glibc ``memcpy``
               with its own choice of stores: regular below its non-temporal threshold);
``numpy_2t``   two ``numpy.copyto`` at once, each of one half (a persistent helper thread);
``stream_1t``  glibc ``memcpy`` forced to streaming (non-temporal) stores: a child process started
               with ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=<1 MiB>`` (tunables are
               read at process start) copies N bytes between its own buffers and reports the time;
``stream_2t``  the same on two threads, halves.

``memcpy_limits`` (plain ``memcpy`` of the same bytes, 1 and 2 threads) is the limit of the
cross-process section.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .._native import _copy
from .harness import MiB, Row, SelfTimed, Timing, gbps

__all__ = ["LIMIT_NAMES", "STREAM_THRESHOLD", "Limits", "StreamingMemcpy", "TwoThreadMemcpy", "arena", "fill_pattern",
           "limit_columns", "memcpy_limits", "stream_child_main"]

#: The limits of :class:`Limits`, in the order they are timed.
LIMIT_NAMES = ("numpy_1t", "numpy_2t", "stream_1t", "stream_2t")
#: glibc.cpu.x86_non_temporal_threshold of the streaming child: copies from 1 MiB use streaming stores
#: (glibc ignores values below 0x4040).
STREAM_THRESHOLD = 1 << 20


def arena(nbytes: int) -> npt.NDArray[np.uint8]:
    """`nbytes` of page-aligned, faulted-in memory (tensors of real allocators are aligned)."""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + nbytes]


def fill_pattern(a: npt.NDArray[np.uint8]) -> None:
    """Every 8-byte word gets its own index: any misplaced byte shows."""
    words = a.view(np.uint64)
    step = 2 * MiB
    for i in range(0, words.size, step):
        j = min(words.size, i + step)
        words[i:j] = np.arange(i, j, dtype=np.uint64)


class TwoThreadMemcpy:
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


def memcpy_limits(dst: _copy.Region, src: _copy.Region, nbytes: int,
                  pair: TwoThreadMemcpy) -> dict[str, Callable[[], object]]:
    """The ``memcpy_1t`` and ``memcpy_2t`` limits of copying `nbytes` from `src` to `dst` (callables)."""
    half = (nbytes // 2) & ~63
    d2 = _copy.Region(dst.addr + half, nbytes - half, dst)
    s2 = _copy.Region(src.addr + half, nbytes - half, src)
    one = functools.partial(_copy.memcpy_bench, dst, src, nbytes)
    return {
        "memcpy_1t": one,
        "memcpy_2t": functools.partial(pair.run, functools.partial(_copy.memcpy_bench, dst, src, half),
                                       functools.partial(_copy.memcpy_bench, d2, s2, nbytes - half)),
    }



def _halves(nbytes: int) -> tuple[int, int]:
    half = (nbytes // 2) & ~63
    return half, nbytes - half


def stream_child_main() -> None:
    """The streaming child (``kvdd.bench.baselines`` run in a process started by
    :class:`StreamingMemcpy`): two arenas of ``argv[1]`` bytes; for every line ``"nbytes threads"``
    on stdin, one timed ``memcpy`` (halves on two threads) and its time in seconds on stdout; at
    ``"stop"`` or end of input, ``"cpu <seconds> <verified 0/1>"``."""
    max_bytes = int(sys.argv[1])
    src, dst = arena(max_bytes), arena(max_bytes)
    fill_pattern(src)
    dst.fill(0)
    rs = _copy.Region(src.ctypes.data, src.nbytes, src)
    rd = _copy.Region(dst.ctypes.data, dst.nbytes, dst)
    pair = TwoThreadMemcpy()
    out = sys.stdout
    out.write(f"ready {os.environ.get('GLIBC_TUNABLES', '')}\n")
    out.flush()
    try:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "stop":
                break
            nbytes, threads = int(words[0]), int(words[1])
            if threads == 2:
                h, rest = _halves(nbytes)
                d2 = _copy.Region(rd.addr + h, rest, dst)
                s2 = _copy.Region(rs.addr + h, rest, src)
                first = functools.partial(_copy.memcpy_bench, rd, rs, h)
                second = functools.partial(_copy.memcpy_bench, d2, s2, rest)
                t0 = time.perf_counter()
                pair.run(first, second)
            else:
                t0 = time.perf_counter()
                _copy.memcpy_bench(rd, rs, nbytes)
            out.write(f"{time.perf_counter() - t0!r}\n")
            out.flush()
    finally:
        pair.close()
    ok = bool(np.array_equal(dst[:4096], src[:4096]))
    t = os.times()
    out.write(f"cpu {t.user + t.system!r} {int(ok)}\n")
    out.flush()


class StreamingMemcpy:
    """glibc ``memcpy`` forced to streaming stores, in a child process (see the module docstring).

    Parameters
    ----------
    max_bytes : int
        The largest copy that will be asked for (the child allocates two buffers of this size).
    threshold : int
        ``glibc.cpu.x86_non_temporal_threshold`` of the child, bytes.

    Use :meth:`timer` for a :class:`~kvdd.bench.harness.SelfTimed` operation; :meth:`close` stops
    the child and returns its CPU time (s).  Only on x86-64 Linux with glibc (``available``).

    Raises
    ------
    RuntimeError
        The child did not start (its stderr is in the message).
    """

    available = (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
                 and platform.libc_ver()[0] == "glibc")

    def __init__(self, max_bytes: int, threshold: int = STREAM_THRESHOLD) -> None:
        self.tunables = f"glibc.cpu.x86_non_temporal_threshold={threshold:#x}"
        # the kvdd this process runs, also in the child (a source checkout in its working directory
        # would shadow it otherwise)
        root = str(Path(_copy.__file__).resolve().parent.parent.parent)
        env = dict(os.environ, GLIBC_TUNABLES=self.tunables)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from kvdd.bench.baselines import stream_child_main; stream_child_main()",
             str(max_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
        self.max_bytes = max_bytes
        self.cpu_s = 0.0
        self.verified = False
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in, self._out = self._proc.stdin, self._proc.stdout
        line = self._out.readline().split(maxsplit=1)
        if line[:1] != ["ready"] or line[1:] != [self.tunables + "\n"]:
            self._proc.kill()
            _, err = self._proc.communicate()
            raise RuntimeError(f"the streaming-memcpy child did not start: {err.strip()[-500:]}")

    def _run(self, nbytes: int, threads: int) -> float:
        self._in.write(f"{nbytes} {threads}\n")
        self._in.flush()
        return float(self._out.readline())

    def timer(self, nbytes: int, threads: int) -> SelfTimed:
        """One copy of `nbytes` on `threads` (1 or 2) threads, timed by the child."""
        if not 0 < nbytes <= self.max_bytes:
            raise ValueError(f"StreamingMemcpy: {nbytes} bytes is not in (0, {self.max_bytes}]")
        return SelfTimed(functools.partial(self._run, nbytes, threads))

    def close(self) -> float:
        """Stop the child (kill it if it does not stop); its CPU time in seconds."""
        if self._proc.poll() is None:
            try:
                out, _ = self._proc.communicate("stop\n", timeout=30)
                words = out.split()
                if len(words) == 3 and words[0] == "cpu":
                    self.cpu_s, self.verified = float(words[1]), words[2] == "1"
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.communicate()
        return self.cpu_s


class Limits:
    """The limits of :data:`LIMIT_NAMES` for copies of up to `max_bytes` (the streaming child is
    left out where it cannot run, or when `streaming` is false).  Close it (or use ``with``)."""

    def __init__(self, max_bytes: int, streaming: bool = True) -> None:
        self.pair = TwoThreadMemcpy()
        self.stream: StreamingMemcpy | None = None
        try:
            if streaming and StreamingMemcpy.available:
                self.stream = StreamingMemcpy(max_bytes)
        except BaseException:
            self.pair.close()
            raise

    def __enter__(self) -> Limits:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.pair.close()
        if self.stream is not None:
            self.stream.close()

    @property
    def child_cpu_s(self) -> float:
        """CPU time of the streaming child (known once closed): this run's, not other load."""
        return self.stream.cpu_s if self.stream is not None else 0.0

    def fns(self, dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8],
            nbytes: int) -> dict[str, Callable[[], object]]:
        """The limits of copying `nbytes` from `src` to `dst` (arrays of at least `nbytes`)."""
        h, _ = _halves(nbytes)
        d, s = dst[:nbytes], src[:nbytes]
        out: dict[str, Callable[[], object]] = {
            "numpy_1t": functools.partial(np.copyto, d, s),
            "numpy_2t": functools.partial(self.pair.run, functools.partial(np.copyto, d[:h], s[:h]),
                                          functools.partial(np.copyto, d[h:], s[h:])),
        }
        if self.stream is not None and nbytes <= self.stream.max_bytes:
            out["stream_1t"] = self.stream.timer(nbytes, 1)
            out["stream_2t"] = self.stream.timer(nbytes, 2)
        return out


def limit_columns(res: Mapping[str, Timing], nbytes: int, candidate: str = "transfer") -> Row:
    """The limit columns of a result row: each limit's GB/s (None when not measured), ``limit`` (the
    fastest, by min time), ``limit_gbps``, ``ratio`` = limit time / candidate time (min times;
    ``ratio_median`` from medians: > 1 is faster than the limit), ``limit_median`` and
    ``limit_median_gbps`` (the fastest by median time: what kvdd's medians compare with)."""
    cand = res[candidate]
    out: Row = {f"{name}_gbps": (gbps(nbytes, res[name]["min_s"]) if name in res else None) for name in LIMIT_NAMES}
    measured = [name for name in LIMIT_NAMES if name in res]
    best = min(measured, key=lambda name: res[name]["min_s"])
    best_m = min(measured, key=lambda name: res[name]["median_s"])
    best_median = res[best_m]["median_s"]
    out.update({"limit": best, "limit_gbps": gbps(nbytes, res[best]["min_s"]),
                "ratio": res[best]["min_s"] / cand["min_s"], "ratio_median": best_median / cand["median_s"],
                "limit_median": best_m, "limit_median_gbps": gbps(nbytes, best_median)})
    return out
