"""The block runs of PullKvBlocks and PushKvBlocks (SEMANTICS.md §3.11 step 7, §3.13): the
(source, destination) block pairs grouped into maximal runs, and the byte runs the copy kernels get.

A request of a few blocks (:data:`SMALL` pairs or fewer: a 1024-token request is 8 blocks of 128
tokens) is planned in C into Python int lists (:func:`kvdd._native._copy.group_small_runs`, and
its byte runs with their total and ends in one more call: :meth:`Runs.byte_plan`), a larger list or
tuple of plain ints in one pass in C (:func:`kvdd._native._runs.block_runs`), anything else with
numpy.  All give the same runs; the small path exists because every numpy call costs a few
microseconds, several times more right after a large copy has evicted the interpreter's and numpy's
code and data from the caches, which made the plan of an 8-block pull of a 78-tensor cache cost as
much as a third of its 10 MiB copy (docs/benchmarks.md, "How the kernels choose"); planned in
Python ints it still cost ~20 us per call, in C ~8.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Union

import numpy as np

from .._native._copy import group_small_runs, small_byte_plan
from .._native._runs import block_runs, byte_runs, sum_int64
from ..status import PARAM_INVALID
from .checks import reject

__all__ = ["SMALL", "BytePlan", "Runs", "row_run", "total"]

#: Requests of at most this many block pairs are planned without numpy.
SMALL = 64

_I64 = np.int64

#: One index per run: a list of Python ints (small requests) or a uint64 / int64 array.
Column = Union[list[int], np.ndarray]


#: The byte runs of a request and their bounds: ``(src_off, dst_off, length, total, src_end,
#: dst_end)``, three int64 arrays, ``sum(length)`` and the largest ``src_off + length`` and
#: ``dst_off + length``.
BytePlan = tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int]


class Runs:
    """§3.11 step 7: pairs grouped into maximal runs where both indices step by +1, in list order.

    Per run: first and last source and destination block (``s0``, ``s_last``, ``d0``, ``d_last``)
    and length in blocks (``ln``); ``d_max`` is the largest destination block of the request.
    Indices are uint64 as in C: the index after 2**64-1 wraps to 0 (and fails a bound later).
    """

    __slots__ = ("s0", "d0", "ln", "s_last", "d_last", "d_max", "_maxima")

    s0: Column
    d0: Column
    ln: Column
    s_last: Column
    d_last: Column

    def __init__(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._maxima: dict[int, int] = {}
        small = group_small_runs(src, dst, SMALL)  # up to SMALL plain ints: Python int lists, in C
        if small is not None:
            self.s0, self.d0, self.ln, self.s_last, self.d_last, self.d_max = small
            return
        grouped = block_runs(src, dst)  # a list or tuple of plain ints: one pass in C
        if grouped is not None:
            self.s0, self.d0, self.ln, self.s_last, self.d_last, self.d_max, maxima = grouped
            # each column's largest value, by the column's identity: the bound checks and
            # longest() pass without another numpy call when nothing is out of bounds
            self._maxima = {id(c): v for c, v in zip((self.s0, self.d0, self.ln, self.s_last, self.d_last),
                                                     maxima)}
            return
        sa = np.asarray(src, dtype=np.uint64)
        da = np.asarray(dst, dtype=np.uint64)
        with np.errstate(over="ignore"):
            cont = (sa[1:] == sa[:-1] + np.uint64(1)) & (da[1:] == da[:-1] + np.uint64(1))
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        ends = np.append(starts[1:], len(sa))
        self.s0 = sa[starts]
        self.d0 = da[starts]
        self.ln = (ends - starts).astype(_I64)
        self.s_last = sa[ends - 1]
        self.d_last = da[ends - 1]
        self.d_max = int(da.max())

    def __len__(self) -> int:
        return len(self.ln)

    def first_at_or_above(self, first: Column, last: Column, bound: int) -> int | None:
        """The first run whose first or last index is >= bound (its offending index), or None."""
        if isinstance(first, list) and isinstance(last, list):
            for f, la in zip(first, last):
                if f >= bound or la >= bound:
                    return f if f >= bound else la
            return None
        hi_first, hi_last = self._maxima.get(id(first)), self._maxima.get(id(last))
        if hi_first is not None and hi_last is not None and max(hi_first, hi_last) < bound:
            return None
        fa, la_ = np.asarray(first), np.asarray(last)
        bad = (fa >= np.uint64(bound)) | (la_ >= np.uint64(bound))
        if not bad.any():
            return None
        i = int(np.argmax(bad))
        return int(fa[i]) if fa[i] >= bound else int(la_[i])

    def require_below(self, first: Column, last: Column, bound: int, what: str, of: str) -> None:
        """Every run's first and last index below ``bound`` (the ``of`` count), else
        ``LLM_PARAM_INVALID`` naming the first offending ``what``."""
        bad = self.first_at_or_above(first, last, bound)
        if bad is not None:
            reject(PARAM_INVALID, f"{what} {bad} >= {of} {bound}")

    def longest(self) -> int:
        """The longest run, in blocks."""
        if isinstance(self.ln, list):
            return max(self.ln)
        known = self._maxima.get(id(self.ln))
        return known if known is not None else int(self.ln.max())

    def byte_plan(self, block: int, tail: int = 0) -> BytePlan:
        """The byte runs as int64 arrays: ``s0[i] * block``, ``d0[i] * block`` and ``ln[i] * block``
        (the last run `tail` bytes when `tail` > 0: the §3.11 quirk), with their total and ends
        (:data:`BytePlan`): one C call.  The total and the ends are exact, or ``2**64 - 1`` when
        they do not fit 64 bits (a bound check on them then refuses the request)."""
        if isinstance(self.ln, list) and isinstance(self.s0, list) and isinstance(self.d0, list):
            try:
                return small_byte_plan(self.s0, self.d0, self.ln, block, tail)
            except ValueError:  # indices >= 2**32 or a total past int64 (a remote announcing a huge
                pass            # tensor): byte_runs saturates, so the bound checks refuse it
        return byte_runs(np.asarray(self.s0, dtype=np.uint64), np.asarray(self.d0, dtype=np.uint64),
                         np.asarray(self.ln, dtype=_I64), block, tail)


def total(length: Column) -> int:
    """``sum(length)`` as an int."""
    if isinstance(length, list):
        return sum(length)
    return sum_int64(length) if length.dtype == _I64 else int(length.sum())


@functools.lru_cache(maxsize=256)
def row_run(local_off: int, remote_off: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The copy plan of a row transfer (PullKvCache, PushKvCache): one run, the local and remote
    byte offsets and the length, as three read-only 1-element int64 arrays.  Cached: the calls of a
    per-layer sequence repeat the same row, and three numpy array creations per call are a
    measurable part of a 2 MiB layer's pull (more so with the caches cold after the previous
    layer's copy)."""
    arrays = (np.array([local_off], _I64), np.array([remote_off], _I64), np.array([length], _I64))
    for a in arrays:
        a.flags.writeable = False
    return arrays
