"""A link hello's cache table (``wire.encode_snapshot`` / ``decode_snapshot``): a table of caches
of one shape is decoded in one numpy pass; it must give exactly what the per-cache decoding gives,
accept and refuse the same tables (zero or overflowing addresses, tensor sizes from 2**62,
duplicate ids, a differing tensor count, truncation) and leave the reader at the same place."""

from __future__ import annotations

import random
import struct

import pytest

from kvdd.sim.fabric import wire
from kvdd.sim.fabric.protocol import RemoteCache
from kvdd.sim.fabric.wire import RC, ProtocolError, Reader, Writer

M = (1 << 64) - 1
Record = tuple[int, int, int, int, int, int, int, list[int]]


def _encode(records: list[Record]) -> bytes:
    out = bytearray(struct.pack("<I", len(records)))
    for cid, n, t, b, s, ragged, placement, addrs in records:
        out += RC.pack(cid, n, t, b, s, ragged, placement) + struct.pack(f"<{len(addrs)}Q", *addrs)
    return bytes(out)


def _reference(data: bytes) -> object:
    """The per-cache decoding, written out (the behaviour the fast path must keep)."""
    r = Reader(data)
    count = r.u("I")
    snap: dict[int, RemoteCache] = {}
    addrs: dict[int, tuple[int, ...]] = {}
    try:
        for _ in range(count):
            cid, n, t, b, s, ragged, _p = RC.unpack(r.take(RC.size))
            if n == 0 or cid in snap:
                raise ProtocolError("malformed cache snapshot")
            vals = struct.unpack(f"<{n}Q", r.take(8 * n))
            if t >= 1 << 62 or 0 in vals or max(vals) > M - t:
                raise ProtocolError("malformed cache snapshot")
            snap[cid] = RemoteCache(cid, n, t, b, s, bool(ragged), cid)
            addrs[cid] = vals
    except ProtocolError:
        return "refused"
    return snap, addrs, r.pos


def _decoded(data: bytes) -> object:
    r = Reader(data)
    try:
        snap, addrs = wire.decode_snapshot(r)
    except ProtocolError:
        return "refused"
    return snap, addrs, r.pos


def _table(rng: random.Random, count: int, n: int) -> list[Record]:
    records: list[Record] = []
    for i in range(count):
        t = rng.choice([4096, 1 << 20, (1 << 62) - 1])
        addrs = [4096 * (8 * i + j + 1) for j in range(n)]
        records.append((i, n, t, 1, t, rng.randint(0, 1), rng.randint(0, 255), addrs))
    return records


@pytest.mark.parametrize("seed", range(40))
def test_tables_of_one_shape_decode_as_cache_by_cache(seed: int) -> None:
    rng = random.Random(seed)
    records = _table(rng, rng.choice([16, 17, 100]), rng.choice([1, 2, 3, 64]))
    i = rng.randrange(len(records))
    cid, n, t, b, s, ragged, placement, addrs = records[i]
    flaw = seed % 8
    if flaw == 1:
        addrs[rng.randrange(n)] = 0
    elif flaw == 2:
        addrs[rng.randrange(n)] = M - t + 1  # its end would pass 2**64
    elif flaw == 3:
        addrs[rng.randrange(n)] = M - t  # its end is exactly 2**64 - 1: allowed
    elif flaw == 4:
        t = 1 << 62
    elif flaw == 5:
        cid = records[(i + 1) % len(records)][0]  # a duplicate id
    elif flaw == 6:
        n, addrs = n + 1, addrs + [4096]  # another tensor count: not one shape
    records[i] = (cid, n, t, b, s, ragged, placement, addrs)
    data = _encode(records)
    if flaw == 7:
        data = data[:-rng.randint(1, 20)]
    want = _reference(data)
    assert _decoded(data) == want
    assert (want == "refused") == (flaw in (1, 2, 4, 5, 7))


def test_encoding_round_trips_a_served_table() -> None:
    class Entry:
        def __init__(self, cid: int, n: int) -> None:
            self.n, self.T, self.B, self.S, self.ragged, self.placement = n, 4096, 1, 4096, False, 0
            self.addrs = tuple(4096 * (cid * 100 + j + 1) for j in range(n))

    for n in (1, 64, 65):  # 65: numpy's encoding
        entries = {cid: Entry(cid, n) for cid in range(20)}
        w = Writer()
        wire.encode_snapshot(w, entries)  # type: ignore[arg-type]
        snap, addrs = wire.decode_snapshot(Reader(bytes(w.buf)))
        assert list(snap) == list(entries)
        assert all(addrs[c] == entries[c].addrs and snap[c].num_tensors == n for c in entries)


@pytest.mark.parametrize("n", [1, 64, 65])  # 65 tensors: the addresses checked with numpy
@pytest.mark.parametrize("count", [1, 15, 16])  # 16: with a second shape, cache by cache too
def test_a_zero_address_is_refused_cache_by_cache(count: int, n: int) -> None:
    records = _table(random.Random(count * 100 + n), count, n)
    if count == 16:
        cid, _n, t, b, s, ragged, placement, addrs = records[0]
        records[0] = (cid, n + 1, t, b, s, ragged, placement, addrs + [1 << 40])
    clean = _encode(records)
    assert _decoded(clean) == _reference(clean) != "refused"
    cid, n_last, t, b, s, ragged, placement, addrs = records[-1]
    records[-1] = (cid, n_last, t, b, s, ragged, placement, addrs[:-1] + [0])
    assert _decoded(_encode(records)) == "refused"


def test_a_table_holds_at_most_max_snapshot_caches() -> None:
    cap = wire.MAX_SNAPSHOT_CACHES
    records: list[Record] = [(i, 1, 4096, 1, 4096, 0, 0, [4096 * (i + 1)]) for i in range(cap + 1)]
    snap, _addrs = wire.decode_snapshot(Reader(_encode(records[:cap])))  # exactly at the cap
    assert len(snap) == cap
    with pytest.raises(ProtocolError, match="at most"):  # one past, the bytes all there
        wire.decode_snapshot(Reader(_encode(records)))
