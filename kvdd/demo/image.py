"""One side's cache memory and what every block and row of it must hold (the verifier)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .. import Cache, CacheDesc, CachePlacement, LlmDataDist, tensor_addrs
from ..shm import empty
from .errors import VerificationError
from .geometry import Geometry
from .pattern import (
    K_GUARD,
    K_INIT_CONTIG,
    K_INIT_PAGED,
    K_PAD,
    K_TOKEN,
    SIDE_DECODE,
    SIDE_PREFILL,
    Pattern,
    stream_base,
    word_dtype,
)
from .text import Progress, mib

__all__ = ["CacheImage", "Run", "UnitExpect", "allocate", "fill_and_register", "owner_map",
           "placement_for", "prefill_block_expect", "prefill_row_expect"]


Run = tuple[int, int, int]  # (word offset in the unit, words, stream input of the first word)


@dataclass
class UnitExpect:
    """What one block (paged) or row (contiguous) of one tensor must hold, and where it came from."""

    runs: list[Run]
    source: str


class CacheImage:
    """One registered cache of one side: its memory (``GUARD`` bytes, ``n`` tensors back to back,
    ``GUARD`` bytes, in one :func:`kvdd.empty` allocation, which a simulator peer process on this
    host maps) and the expected content of every block or row of every tensor.  ``units`` are
    blocks (``layout == "paged"``) or batch rows (``"contiguous"``)."""

    GUARD = 4096

    def __init__(self, side: str, geom: Geometry, fam_index: int, layout: str, units: int,
                 placement: int = CachePlacement.DEVICE) -> None:
        self.side = side
        self.side_code = SIDE_PREFILL if side == "prefill" else SIDE_DECODE
        self.geom = geom
        self.fam_index = fam_index
        self.fam = fam = geom.families[fam_index]
        self.layout = layout
        self.name = f"{fam.name}/{layout}"
        self.units = units
        self.unit_tokens = geom.block_size if layout == "paged" else geom.tokens
        self.n = geom.num_tensors(fam)
        self.token_bytes = geom.token_bytes(fam)
        self.unit_bytes = self.unit_tokens * self.token_bytes
        self.tensor_bytes = units * self.unit_bytes
        self.word = word_dtype(self.token_bytes)
        self.token_words = self.token_bytes // self.word.itemsize
        self.unit_words = self.unit_bytes // self.word.itemsize
        g = self.GUARD
        self.buf = empty(2 * g + self.n * self.tensor_bytes, np.uint8)
        body = self.buf[g:g + self.n * self.tensor_bytes]
        shape = (units, self.unit_tokens, *fam.token_shape)
        self.array = body.view(geom.np_dtype).reshape((self.n, *shape))
        self.words = body.view(self.word).reshape(self.n, units, self.unit_words)
        self.guards = (self.buf[:g], self.buf[g + self.n * self.tensor_bytes:])
        self.desc = CacheDesc(num_tensors=self.n, data_type=geom.data_type, shape=shape, placement=placement)
        self.cache_id = -1
        self.cache = Cache()
        init_kind = K_INIT_PAGED if layout == "paged" else K_INIT_CONTIG
        self.expect: list[list[UnitExpect]] = [
            [UnitExpect([(0, self.unit_words, stream_base(self.side_code, fam_index, init_kind, i)
                          + u * self.unit_words)], f"{side}'s own initial data")
             for u in range(units)]
            for i in range(self.n)]

    @property
    def nbytes(self) -> int:
        return self.n * self.tensor_bytes

    def tensors(self) -> list[NDArray[Any]]:
        return [self.array[i] for i in range(self.n)]

    def _guard_start(self, which: int) -> int:
        return stream_base(self.side_code, self.fam_index, K_GUARD, 2 * (self.layout == "paged") + which)

    def tensor_runs(self, i: int) -> Iterator[tuple[int, int, int, int]]:
        """``(unit, word offset in the tensor, words, stream input)`` of tensor ``i``, adjacent runs of
        one stream merged (so decode's own data and prefill rows are one run per tensor)."""
        cur: list[int] | None = None  # [unit, offset, count, start]
        uw = self.unit_words
        for u, ue in enumerate(self.expect[i]):
            for off, cnt, start in ue.runs:
                pos = u * uw + off
                if cur is not None and cur[1] + cur[2] == pos and cur[3] + cur[2] == start:
                    cur[2] += cnt
                    continue
                if cur is not None:
                    yield cur[0], cur[1], cur[2], cur[3]
                cur = [u, pos, cnt, start]
        if cur is not None:
            yield cur[0], cur[1], cur[2], cur[3]

    def fill(self, pattern: Pattern) -> None:
        for which, guard in enumerate(self.guards):
            pattern.fill(guard, self._guard_start(which))
        flat = self.words.reshape(self.n, -1)
        for i in range(self.n):
            for _u, pos, cnt, start in self.tensor_runs(i):
                pattern.fill(flat[i, pos:pos + cnt], start)

    def registered(self, cache_id: int, addrs: Sequence[int]) -> None:
        self.cache_id = cache_id
        self.cache = Cache(cache_id=cache_id, tensor_addrs=tuple(addrs), cache_desc=self.desc)

    def tensor_label(self, i: int) -> str:
        t = self.fam.tensors_per_layer
        return f"tensor {i} (layer {i // t} {self.fam.parts[i % t]})"

    def unit_label(self, u: int) -> str:
        return f"block {u}" if self.layout == "paged" else f"row {u}"

    def verify(self, pattern: Pattern, targets: set[tuple[str, int, int]], step: str) -> int:
        """Compare all memory (guards included) with the expectation; raise on the first mismatch.

        ``targets``: ``(cache name, tensor, unit)`` the step wrote (for the message).  Returns bytes
        checked.
        """
        for which, guard in enumerate(self.guards):
            k = pattern.first_mismatch(guard, self._guard_start(which))
            if k is not None:
                got = bytes(guard[k:k + 8])
                exp = bytes(pattern.expected(self._guard_start(which) + k, 8, np.dtype(np.uint8)))
                where = "before" if which == 0 else "after"
                raise VerificationError(
                    f"{step}: {self.side} cache '{self.name}' (id {self.cache_id}): guard byte {k} "
                    f"{where} the cache memory changed (expected {exp.hex()}, got {got.hex()}): "
                    "something wrote outside the registered tensors",
                    transfer=step, location={"side": self.side, "cache": self.name, "cache_id": self.cache_id,
                                             "guard": where, "byte": k, "expected": exp.hex(), "got": got.hex()})
        flat = self.words.reshape(self.n, -1)
        uw = self.unit_words
        for i in range(self.n):
            for _u, pos, cnt, start in self.tensor_runs(i):
                k = pattern.first_mismatch(flat[i, pos:pos + cnt], start)
                if k is not None:
                    # locate the unit run holding word pos + k and report from there
                    word = pos + k
                    u = word // uw
                    for off, rcnt, rstart in self.expect[i][u].runs:
                        if off <= word - u * uw < off + rcnt:
                            self._raise_mismatch(pattern, i, u, off, rcnt, rstart, word - u * uw - off,
                                                 targets, step)
                    raise AssertionError("unreachable: mismatch outside every run")
        return self.nbytes + 2 * self.GUARD

    def _raise_mismatch(self, pattern: Pattern, i: int, u: int, off: int, cnt: int, start: int,
                        k: int, targets: set[tuple[str, int, int]], step: str) -> None:
        view = self.words[i, u]
        exp_run = pattern.expected(start, cnt, self.word)
        got_run = view[off:off + cnt]
        differing = int(np.count_nonzero(exp_run.view(np.uint8) != got_run.view(np.uint8)))
        w = self.word.itemsize
        first = int(np.argmax(exp_run[k:k + 1].view(np.uint8) != got_run[k:k + 1].view(np.uint8)))
        byte_in_unit = (off + k) * w + first  # the first differing byte
        token = byte_in_unit // self.token_bytes
        elem = (byte_in_unit % self.token_bytes) // self.geom.itemsize
        exp_b = exp_run.view(np.uint8)[k * w + first:k * w + first + 8].tobytes()
        got_b = got_run.view(np.uint8)[k * w + first:k * w + first + 8].tobytes()
        in_target = (self.name, i, u) in targets
        src = self.expect[i][u].source
        if in_target:
            what = f"a target of this step, should hold {src}"
        else:
            what = f"outside this step's targets, should still hold {src}"
        loc = {"side": self.side, "cache": self.name, "cache_id": self.cache_id, "tensor": i,
               "layer": i // self.fam.tensors_per_layer, "part": self.fam.parts[i % self.fam.tensors_per_layer],
               "block" if self.layout == "paged" else "row": u, "token": token, "element": elem,
               "byte_in_tensor": u * self.unit_bytes + byte_in_unit, "expected": exp_b.hex(),
               "got": got_b.hex(), "differing_bytes_in_unit": differing, "in_target": in_target,
               "should_hold": src}
        raise VerificationError(
            f"{step}: {self.side} cache '{self.name}' (id {self.cache_id}) {self.tensor_label(i)} "
            f"{self.unit_label(u)}, token {token} element {elem} (byte {u * self.unit_bytes + byte_in_unit} "
            f"of the tensor): expected {exp_b.hex()} got {got_b.hex()}; {differing} of {self.unit_bytes} "
            f"bytes of this {'block' if self.layout == 'paged' else 'row'} differ; it is {what}",
            transfer=step, location=loc)


def prefill_block_expect(geom: Geometry, fam_index: int, i: int, p: int,
                          owner: Mapping[int, tuple[int, int]], token_words: int) -> UnitExpect:
    r, j = owner[p]
    bs = geom.block_size
    valid = min(bs, geom.tokens - j * bs)
    runs: list[Run] = [(0, valid * token_words,
                        stream_base(SIDE_PREFILL, fam_index, K_TOKEN, i) + (r * geom.tokens + j * bs) * token_words)]
    if valid < bs:
        runs.append((valid * token_words, (bs - valid) * token_words,
                     stream_base(SIDE_PREFILL, fam_index, K_PAD, i) + (p * bs + valid) * token_words))
    return UnitExpect(runs, f"prefill block {p} (request {r} tokens {j * bs}-{j * bs + valid - 1})")


def prefill_row_expect(geom: Geometry, fam_index: int, i: int, r: int, token_words: int,
                        tokens: int | None = None) -> list[Run]:
    n = geom.tokens if tokens is None else tokens
    return [(0, n * token_words, stream_base(SIDE_PREFILL, fam_index, K_TOKEN, i) + r * geom.tokens * token_words)]


def owner_map(block_tables: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    return {int(p): (r, j) for r, table in enumerate(block_tables) for j, p in enumerate(table)}


def placement_for(dd: LlmDataDist) -> int:
    # The simulator keeps caches in host memory whatever the placement says.  On a real node the
    # demo's numpy arrays are host memory, so it registers them as HOST there.
    return CachePlacement.HOST if dd.backend_name == "native" else CachePlacement.DEVICE


def allocate(side: str, dd: LlmDataDist, geom: Geometry) -> tuple[list[CacheImage], list[CacheImage]]:
    """Allocate, fill and register one side's paged and contiguous caches (all before any link:
    a cache registered after a link is not visible over it, SEMANTICS.md §2.4)."""
    placement = placement_for(dd)
    blocks, rows = ((geom.prefill_blocks, geom.requests) if side == "prefill"
                    else (geom.decode_blocks, geom.decode_rows))
    paged = [CacheImage(side, geom, f, "paged", blocks, placement) for f in range(len(geom.families))]
    contig = [CacheImage(side, geom, f, "contiguous", rows, placement) for f in range(len(geom.families))]
    return paged, contig


def fill_and_register(dd: LlmDataDist, images: Sequence[CacheImage], pattern: Pattern, log: Progress) -> None:
    total = sum(img.nbytes for img in images)
    with log.step(f"filling {len(images)} caches, {mib(total)}"):
        for img in images:
            img.fill(pattern)
    for img in images:
        addrs = tensor_addrs(img.tensors())
        img.registered(dd.register_kv_cache(img.desc, addrs), addrs)
    log(f"registered {', '.join(f'{img.name}=id {img.cache_id}' for img in images)}")
