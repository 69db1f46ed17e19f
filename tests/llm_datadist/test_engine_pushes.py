"""transfer_cache_v2 in the engine of CANN's Python package: push_cache (type 2), push_blocks
(type 1), the C2B and raw-address variants (docs/spec/PYPKG.md §4.8, §4.10; §7.5 item 23)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from engine_support import (NOT_EXIST, NOT_YET_LINK, PARAM_INVALID, S_OK,
                            Mem, blocks_key, cache_key, engine, expect_blocks, link, push, register)
from kvdd.sim.pypkg import pushes
from kvdd.sim.pypkg.lifecycle import Engine


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    p, d = engine(1), engine(2)
    yield p, d
    d.instance.finalize()
    p.instance.finalize()


def blocks_cfg(src_id: int, ls: int, ld: int, model: int = 0, cluster: int = 2,
               t: int = 2) -> tuple[int, int, int, list[int], int, int, int, int, int, int]:
    return (src_id, 0, ls, [], cluster, model, 0, 1, ld, t)


def cache_cfg(src_id: int, ls: int, ld: int, dst_id: int, src_batch: int = 0, dst_batch: int = 0,
              cluster: int = 2, t: int = 2) -> tuple[int, int, int, list[int], int, int, int, int, int, int]:
    return (src_id, src_batch, ls, [], cluster, dst_id, dst_batch, 2, ld, t)


def test_push_blocks_bytes_per_layer(pair: tuple[Engine, Engine]) -> None:
    """P pushes layer 1 of its blocks into layer 0 of D's (t = 2): runs of L.S bytes."""
    p, d = pair
    src = Mem(4, 8, 32, seed=3)
    sid = register(p, src)
    dst = Mem(4, 8, 32)
    register(d, dst, keys=[blocks_key(0, 5)])
    link(p, d)
    before = dst.copy()
    pairs = [(0, 7), (1, 0), (2, 1), (6, 4)]
    st = push(p, blocks_cfg(sid, 1, 0, model=5), (0, [s for s, _ in pairs], [b for _, b in pairs]))
    assert st == S_OK
    expect_blocks(dst.tensors, before, src.tensors, pairs, 32, tensors=[(0, 2), (1, 3)])


def test_push_blocks_checks_in_order(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    sid = register(p, Mem(4, 8, 32, seed=3))
    dst = Mem(4, 8, 32)
    register(d, dst, keys=[blocks_key(0, 5)])
    assert push(p, blocks_cfg(sid, 0, 0, model=5), (0, [0], [0])) == NOT_YET_LINK
    link(p, d)
    assert push(p, blocks_cfg(sid, 0, 0, model=5, t=0), (0, [0], [0])) == PARAM_INVALID
    assert push(p, blocks_cfg(99, 0, 0, model=5), (0, [0], [0])) == NOT_EXIST  # local
    assert push(p, blocks_cfg(sid, 0, 0, model=6), (0, [0], [0])) == NOT_EXIST  # remote key
    assert push(p, blocks_cfg(sid, 0, 2, model=5), (0, [0], [0])) == PARAM_INVALID  # ld >= R.n/t
    assert push(p, blocks_cfg(sid, 0, 0, model=5), (0, [0], [8])) == PARAM_INVALID  # dst >= R.N
    assert push(p, blocks_cfg(sid, 2, 0, model=5), (0, [0], [0])) == PARAM_INVALID  # ls >= L.n/t
    assert push(p, blocks_cfg(sid, 0, 0, model=5, t=3), (0, [0], [0])) == PARAM_INVALID  # n % t
    assert push(p, blocks_cfg(sid, 0, 0, model=5), (0, [0, 1], [0])) == PARAM_INVALID  # lengths
    assert push(p, blocks_cfg(sid, 0, 0, model=5), (0, [8], [0])) == PARAM_INVALID  # src >= L.N
    # §7.5-23: empty src_blocks selects C2B, which needs a block size push_blocks never passes
    assert push(p, blocks_cfg(sid, 0, 0, model=5), (0, [], [0])) == PARAM_INVALID
    assert all((t == 0).all() for t in dst.tensors)


def test_push_cache_rows(pair: tuple[Engine, Engine]) -> None:
    """C2C: L.S bytes of source row bs into remote row bd (at bd * R.S)."""
    p, d = pair
    src = Mem(2, 4, 16, seed=2)
    sid = register(p, src, blocks=False)
    dst = Mem(2, 3, 32)  # R.S = 32 > L.S = 16: only the first 16 bytes of the row
    did = register(d, dst, blocks=False)
    link(p, d)
    before = dst.copy()
    assert push(p, cache_cfg(sid, 0, 0, did, src_batch=3, dst_batch=2, t=1)) == S_OK
    want = [b.copy() for b in before]
    want[0][64:80] = src.tensors[0][48:64]
    assert all((g == w).all() for g, w in zip(dst.tensors, want))
    assert push(p, cache_cfg(sid, 0, 0, did, dst_batch=3, t=1)) == PARAM_INVALID  # bd >= R.B
    assert push(p, cache_cfg(sid, 0, 0, did, src_batch=4, t=1)) == PARAM_INVALID  # bs >= L.B
    assert push(p, cache_cfg(sid, 0, 0, 0, t=1)) == NOT_EXIST  # no CacheKey(req 0, model 0)


def test_push_cache_id_zero_resolves_the_key_req0_model0(pair: tuple[Engine, Engine]) -> None:
    """Upstream's request defaults: a cache id <= 0 looks up the identity (0, 0)."""
    p, d = pair
    src = Mem(1, 2, 16, seed=2)
    sid = register(p, src, blocks=False)
    dst = Mem(1, 2, 16)
    register(d, dst, blocks=False, keys=[cache_key(0, 0, 0)])
    link(p, d)
    assert push(p, cache_cfg(sid, 0, 0, -5, src_batch=1, dst_batch=0, t=1)) == S_OK
    assert (dst.tensors[0][:16] == src.tensors[0][16:]).all() and (dst.tensors[0][16:] == 0).all()


def test_push_cache_row_past_the_remote_is_refused(pair: tuple[Engine, Engine]) -> None:
    """No L.S <= R.S check upstream: a row that would run past the remote tensor is refused
    (PYPKG.md §9.8)."""
    p, d = pair
    sid = register(p, Mem(1, 2, 64, seed=2), blocks=False)
    dst = Mem(1, 4, 16)
    did = register(d, dst, blocks=False)
    link(p, d)
    assert push(p, cache_cfg(sid, 0, 0, did, dst_batch=3, t=1)) == PARAM_INVALID
    assert push(p, cache_cfg(sid, 0, 0, did, dst_batch=2, t=1)) == PARAM_INVALID
    assert (dst.tensors[0] == 0).all()


def test_c2b_push_with_a_block_memory_size(pair: tuple[Engine, Engine]) -> None:
    """transfer_cache_async's C2B: the source row in bms-byte chunks into dst blocks (bms must
    equal the remote stride in remote-accessible mode)."""
    p, d = pair
    src = Mem(2, 1, 96, seed=7)  # one row of 96 bytes
    sid = register(p, src, blocks=False)
    dst = Mem(2, 6, 32)
    register(d, dst, keys=[blocks_key(0, 1)])
    link(p, d)
    before = dst.copy()
    assert push(p, blocks_cfg(sid, 0, 0, model=1), (32, [], [4, 0, 2])) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, [(0, 4), (1, 0), (2, 2)], 32)
    assert push(p, blocks_cfg(sid, 0, 0, model=1), (16, [], [0])) == PARAM_INVALID  # != R.S
    assert push(p, blocks_cfg(sid, 0, 0, model=1), (32, [], [0, 1, 2, 3])) == PARAM_INVALID


def test_remote_or_local_not_remote_accessible(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    sid = register(p, Mem(2, 4, 16, seed=1))
    hid = register(p, Mem(2, 4, 16, seed=1), ra=False)
    register(d, Mem(2, 4, 16), keys=[blocks_key(0, 0)], ra=False)
    link(p, d)
    assert push(p, blocks_cfg(hid, 0, 0), (0, [0], [0])) == PARAM_INVALID
    assert push(p, blocks_cfg(sid, 0, 0), (0, [0], [0])) == PARAM_INVALID


def test_two_sided_raw_addresses() -> None:
    """transfer_cache_async with TransferConfig on a two-sided engine: each tensor of the layer to
    its raw destination address, which must lie inside a tensor the peer serves over the link
    (upstream writes anywhere; the simulator refuses what it cannot map, PYPKG.md §9.8)."""
    p, d = engine(1, ra=False), engine(2, ra=False)
    try:
        src = Mem(4, 4, 16, seed=1)
        sid = register(p, src, blocks=False)
        dst = Mem(2, 4, 16)
        register(d, dst, blocks=False)
        link(p, d)
        before = dst.copy()
        raw = (sid, 3, 1, [dst.addrs[1] + 16, dst.addrs[0] + 48], 2, 0, 0, 0, 0, 2)
        assert push(p, raw) == S_OK  # layer 1 = tensors 2, 3; source row 3
        want = [b.copy() for b in before]
        want[1][16:32] = src.tensors[2][48:64]
        want[0][48:64] = src.tensors[3][48:64]
        assert all((g == w).all() for g, w in zip(dst.tensors, want))
        before = dst.copy()
        # C2B: the source row in 8-byte chunks to blocks 5 and 1 of an 8-byte-block view
        assert push(p, (sid, 0, 0, [dst.addrs[0], dst.addrs[1]], 2, 0, 0, 0, 0, 2),
                    (8, [], [5, 1])) == S_OK
        want = [b.copy() for b in before]
        for k in range(2):
            want[k][40:48] = src.tensors[k][0:8]
            want[k][8:16] = src.tensors[k][8:16]
        assert all((g == w).all() for g, w in zip(dst.tensors, want))
        before = dst.copy()
        for bad in ([4096, 8192], [dst.addrs[0] + 56, dst.addrs[1]]):  # unmapped; past the end
            assert push(p, (sid, 0, 0, bad, 2, 0, 0, 0, 0, 2)) == PARAM_INVALID
        assert push(p, (sid, 0, 0, [dst.addrs[0]], 2, 0, 0, 0, 0, 2)) == PARAM_INVALID  # 1 for t=2
        assert push(p, (sid, 0, 2, dst.addrs, 2, 0, 0, 0, 0, 2)) == PARAM_INVALID  # ls
        assert push(p, cache_cfg(sid, 0, 0, 1)) == PARAM_INVALID  # a key config: no addresses
        assert push(p, (sid, 0, 0, dst.addrs, 2, 0, 0, 0, 0, 2), (8, [], list(range(9)))) == PARAM_INVALID
        # row 3 + 3 chunks runs past the source tensor (unchecked upstream): refused
        assert push(p, (sid, 3, 0, dst.addrs, 2, 0, 0, 0, 0, 2), (8, [], [0, 1, 2])) == PARAM_INVALID
        assert all((g == w).all() for g, w in zip(dst.tensors, before))
    finally:
        d.instance.finalize()
        p.instance.finalize()


def test_pushes_serialized_engine_wide(pair: tuple[Engine, Engine],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads pushing over different links of one engine never overlap (§9.11)."""
    p, d = pair
    e = engine(3)
    try:
        src = Mem(2, 4, 16, seed=1)
        sid = register(p, src)
        register(d, Mem(2, 4, 16), keys=[blocks_key(0, 0)])
        register(e, Mem(2, 4, 16), keys=[blocks_key(0, 0)])
        link(p, d)
        link(p, e)
        inside = [0]
        peak = [0]
        real = getattr(pushes, "run")

        def slow_run(*args: object) -> int:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            time.sleep(0.05)
            inside[0] -= 1
            return int(real(*args))

        monkeypatch.setattr(pushes, "run", slow_run)
        results: list[int] = []
        threads = [threading.Thread(target=lambda c=c: results.append(
            push(p, blocks_cfg(sid, 0, 0, cluster=c), (0, [0], [1])))) for c in (2, 3, 2, 3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert results == [S_OK] * 4 and peak[0] == 1
    finally:
        e.instance.finalize()
