"""A tiny, independent reference model of SEMANTICS.md's byte formulas.

Pure numpy byte slicing of the formulas of SEMANTICS.md §2.1, §2.5, §3.10-§3.13 (and the request
size limit of §3.11 step 8).  Nothing here is imported from kvdd's implementation: the element
sizes are restated from SEMANTICS.md §5, the run grouping from §3.11 step 7 and the push layer plan
from §3.12 step 6.  Tensors are 1-D ``uint8`` numpy views of exactly ``T`` bytes; every function
writes into the destination views in place, reading only from the source views (pass views of a
*before* snapshot as sources so that sequential semantics never read what they just wrote).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]

#: element size in bits per ``ge::DataType`` value (SEMANTICS.md §5); only the values the suite uses
#: plus a few neighbours.  Invalid values (5, 28 = DT_UNDEFINED, >= 43) are deliberately absent.
ITEMSIZE_BITS: dict[int, int] = {
    0: 32,  # DT_FLOAT
    1: 16,  # DT_FLOAT16
    2: 8,  # DT_INT8
    3: 32,  # DT_INT32
    4: 8,  # DT_UINT8
    9: 64,  # DT_INT64
    27: 16,  # DT_BF16
    29: 4,  # DT_INT4
    30: 1,  # DT_UINT1
    31: 2,  # DT_INT2
    38: 6,  # DT_FLOAT6_E3M2
}

#: SEMANTICS.md §3.11 step 8: ``120 + 16*(K + 2*G) <= 2 MiB - 8``.
REQUEST_LIMIT = 2 * 1024 * 1024 - 8

#: SEMANTICS.md §3.7 step 10: the published cache table may not exceed 1 MiB.
CACHE_TABLE_LIMIT = 1024 * 1024


@dataclass(frozen=True)
class Geom:
    """The derived quantities of SEMANTICS.md §2.1 for one registered cache."""

    n: int  # number of tensors
    T: int  # bytes per tensor
    B: int  # batch size = number of blocks = shape[0]
    S: int  # stride = bytes per batch row = bytes per block = floor(T / B)

    @property
    def ragged(self) -> bool:
        """kvdd rule 10 (§10.10): T not a multiple of S, or S == 0."""
        return self.S == 0 or self.T % self.S != 0


def tensor_nbytes(dtype: int, shape: Sequence[int]) -> int:
    """T: product of dims x element size; sub-byte types ``ceil(elements*bits/8)`` (§2.1, §5)."""
    elements = math.prod(shape)
    bits = ITEMSIZE_BITS[int(dtype)]
    return (elements * bits + 7) // 8


def geom(num_tensors: int, dtype: int, shape: Sequence[int]) -> Geom:
    t = tensor_nbytes(dtype, shape)
    b = int(shape[0])
    return Geom(n=num_tensors, T=t, B=b, S=t // b)


def cache_table_bytes(tensor_counts: Sequence[int]) -> int:
    """Serialized cache-table size of §3.7 step 10: 24 + sum(64 + 8*n)."""
    return 24 + sum(64 + 8 * n for n in tensor_counts)


# -- layer ranges (§2.5, §3.10 step 4) ----------------------------------------------------------


def pull_tensor_span(n_local: int, src_range: tuple[int, int], dst_range: tuple[int, int],
                     t: int) -> tuple[int, int, int]:
    """(first src tensor, first dst tensor, K) of a pull: ranges apply only if both firsts >= 0."""
    if src_range[0] >= 0 and dst_range[0] >= 0:
        k = (dst_range[1] - dst_range[0] + 1) * t
        return src_range[0] * t, dst_range[0] * t, k
    return 0, 0, n_local


def push_layer_plan(src_range: tuple[int, int], dst_range: tuple[int, int], t: int,
                    num_tensors_in_struct: int) -> list[tuple[int, int]]:
    """The (src layer, dst layer) plan of §3.12 step 6, ``u`` read from the caller's struct."""
    if src_range[0] >= 0 and src_range[0] == src_range[1]:
        return [(src_range[0], dst_range[0])]
    if src_range[0] == -1:
        u = num_tensors_in_struct
        if u < t:
            m = 0
        elif u % t == 0:
            m = u // t - 1
        else:
            m = u // t
        return [(layer, layer) for layer in range(m + 1)]
    return [(layer, dst_range[0] + (layer - src_range[0]))
            for layer in range(src_range[0], src_range[1] + 1)]


# -- block runs (§3.11 step 7) ------------------------------------------------------------------


def groups(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(src0, dst0, length)`` in list order where both indices step by exactly +1."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((s, d, 1))
    return out


def request_bytes(k: int, g: int) -> int:
    """Size of a block request with K tensors and G groups (§3.11 step 8)."""
    return 120 + 16 * (k + 2 * g)


def max_groups(k: int) -> int:
    """Largest G with request_bytes(K, G) <= REQUEST_LIMIT."""
    return (REQUEST_LIMIT - 120 - 16 * k) // 32


# -- transfers ----------------------------------------------------------------------------------


def _copy(dst: Bytes, dst_off: int, src: Bytes, src_off: int, n: int) -> None:
    assert 0 <= dst_off and dst_off + n <= dst.size, "reference: destination outside tensor"
    assert 0 <= src_off and src_off + n <= src.size, "reference: source outside tensor"
    dst[dst_off:dst_off + n] = src[src_off:src_off + n]


def pull_cache(local: Sequence[Bytes], remote: Sequence[Bytes], L: Geom, *, size: int = -1,
               src_batch: int = 0, dst_batch: int = 0, ss: int = 0, ds: int = 0,
               k: int | None = None) -> None:
    """§3.10: ``local[ds+k][bd*L.S : +nbytes] <- remote[ss+k][bs*L.S : +nbytes]`` (local stride!)."""
    nbytes = size if size > 0 else L.S
    count = L.n if k is None else k
    for i in range(count):
        _copy(local[ds + i], dst_batch * L.S, remote[ss + i], src_batch * L.S, nbytes)


def pull_blocks(local: Sequence[Bytes], remote: Sequence[Bytes], L: Geom, remote_nbytes: int,
                src_blocks: Sequence[int], dst_blocks: Sequence[int], *, ss: int = 0,
                ds: int = 0, k: int | None = None) -> None:
    """§3.11: block size is the local stride on both sides; groups apply in list order.  Quirk:
    when ``R.T % L.S != 0`` the *last* group (in list order) copies only ``R.T % L.S`` bytes."""
    count = L.n if k is None else k
    runs = groups(src_blocks, dst_blocks)
    tail = remote_nbytes % L.S
    for i in range(count):
        for j, (s0, d0, n) in enumerate(runs):
            length = tail if tail and j == len(runs) - 1 else n * L.S
            _copy(local[ds + i], d0 * L.S, remote[ss + i], s0 * L.S, length)


def push_cache_layer(remote: Sequence[Bytes], local: Sequence[Bytes], L: Geom, R: Geom, t: int,
                     ls: int, ld: int, *, src_batch: int = 0, dst_batch: int = 0) -> None:
    """§3.12 per layer: ``remote[ld*t+k][bd*R.S : +L.S] <- local[ls*t+k][bs*L.S : +L.S]``."""
    for i in range(t):
        _copy(remote[ld * t + i], dst_batch * R.S, local[ls * t + i], src_batch * L.S, L.S)


def push_blocks_layer(remote: Sequence[Bytes], local: Sequence[Bytes], L: Geom, t: int, ls: int,
                      ld: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
    """§3.13 per layer: block size = local stride, also for the remote offset."""
    for i in range(t):
        for s0, d0, n in groups(src_blocks, dst_blocks):
            _copy(remote[ld * t + i], d0 * L.S, local[ls * t + i], s0 * L.S, n * L.S)
