"""Deterministic cache contents: every word is recomputable from its position alone."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["K_GUARD", "K_INIT_CONTIG", "K_INIT_PAGED", "K_PAD", "K_TOKEN", "Pattern", "SIDE_DECODE",
           "SIDE_PREFILL", "stream_base", "word_dtype"]


_M1 = np.uint64(0x9E3779B97F4A7C15)
_S32 = np.uint64(32)
_U64 = (1 << 64) - 1

# Stream kinds: each (side, family, kind, tensor) is its own stream of words.
K_TOKEN = 0  # prefill: a request's tokens (shared by the paged and contiguous layouts)
K_PAD = 1  # prefill: paged-block slots past the end of a request
K_INIT_PAGED = 2  # a side's own initial data in its paged cache (decode)
K_INIT_CONTIG = 3
K_GUARD = 4  # guard bytes around a cache's memory
SIDE_PREFILL = 0
SIDE_DECODE = 1


def stream_base(side: int, fam_index: int, kind: int, tensor: int) -> int:
    """First input of a stream; positions inside a stream are < 2**40 words."""
    return ((((side * 8 + fam_index) * 8 + kind) << 16) + tensor) << 40


def _mix_int(x: int) -> int:
    x = (x * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _U64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _U64
    return x ^ (x >> 32)


class Pattern:
    """Word ``k`` of a stream starting at ``start`` is ``mix(start + k + key)``: a bijection of 64-bit
    inputs (an odd multiply and an xorshift; ``key`` derives from the seed), truncated to the word
    size.  So two different positions never hold the same 64-bit word, and any byte is recomputable
    from its position alone.  Vectorized in L2-sized chunks (GB/s); not thread-safe (scratch)."""

    CHUNK = 1 << 15

    def __init__(self, seed: int) -> None:
        self.key = _mix_int(seed)
        self._ar = np.arange(self.CHUNK, dtype=np.uint64)
        self._x = np.empty(self.CHUNK, np.uint64)
        self._t = np.empty(self.CHUNK, np.uint64)
        self._ne = np.empty(self.CHUNK, np.bool_)
        self._w: dict[np.dtype[Any], NDArray[Any]] = {}

    def _gen(self, start: int, m: int, out: NDArray[np.uint64] | None = None) -> NDArray[np.uint64]:
        # word(p) = h ^ (h >> 32) with h = (p + key) * M (mod 2**64): each step is a bijection.
        x = self._x[:m] if out is None else out
        t = self._t[:m]
        np.add(self._ar[:m], np.uint64((start + self.key) & _U64), out=x)
        np.multiply(x, _M1, out=x)
        np.right_shift(x, _S32, out=t)
        np.bitwise_xor(x, t, out=x)
        return x

    def _gen_as(self, start: int, m: int, dtype: np.dtype[Any]) -> NDArray[Any]:
        x = self._gen(start, m)
        if dtype == np.uint64:
            return x
        w = self._w.get(dtype)
        if w is None:
            w = self._w[dtype] = np.empty(self.CHUNK, dtype)
        np.copyto(w[:m], x, casting="unsafe")  # keep the low bytes
        return w[:m]

    def fill(self, out: NDArray[Any], start: int) -> None:
        """``out[k] = word(start + k)`` (``out``: a 1-D contiguous view of unsigned words)."""
        direct = out.dtype == np.uint64
        for s in range(0, out.size, self.CHUNK):
            m = min(self.CHUNK, out.size - s)
            if direct:
                self._gen(start + s, m, out[s:s + m])
            else:
                np.copyto(out[s:s + m], self._gen_as(start + s, m, out.dtype), casting="unsafe")

    def expected(self, start: int, count: int, dtype: np.dtype[Any]) -> NDArray[Any]:
        out = np.empty(count, dtype)
        self.fill(out, start)
        return out

    def first_mismatch(self, view: NDArray[Any], start: int) -> int | None:
        """Index of the first word of ``view`` that is not ``word(start + k)``, or None."""
        for s in range(0, view.size, self.CHUNK):
            m = min(self.CHUNK, view.size - s)
            ne = np.not_equal(view[s:s + m], self._gen_as(start + s, m, view.dtype), out=self._ne[:m])
            if ne.any():
                return s + int(np.argmax(ne))
        return None


def word_dtype(token_bytes: int) -> np.dtype[Any]:
    for size, name in ((8, "uint64"), (4, "uint32"), (2, "uint16")):
        if token_bytes % size == 0:
            return np.dtype(name)
    return np.dtype("uint8")
