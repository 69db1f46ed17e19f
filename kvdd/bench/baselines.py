"""The limits kvdd's copies are measured against: plain copies of the same bytes between the same
buffers, timed interleaved with the candidate (:func:`kvdd.bench.harness.interleaved`), and the
memory they run on.

``memcpy_1t``  one glibc ``memcpy`` of all the bytes (``kvdd._native._copy.memcpy_bench``, GIL released);
``memcpy_2t``  two ``memcpy`` at once, each of one half (a persistent helper thread takes the second).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from .._native import _copy
from .harness import MiB

__all__ = ["TwoThreadMemcpy", "arena", "fill_pattern", "memcpy_limits"]


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

