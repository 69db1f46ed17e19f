"""pull_cache_v2 in the engine of CANN's Python package: check order, statuses, runs and bytes
(docs/spec/PYPKG.md §4.4-§4.7; checklist §7.5 items 16-22), in one process."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from engine_support import (FEATURE_NOT_ENABLED, NO, NOT_EXIST, NOT_YET_LINK, PARAM_INVALID,
                            S_OK, Mem, blocks_key, cache_key, engine, expect_blocks, id_key, link,
                            pull, pull_param, register, unlink)
from kvdd.sim.fabric import RemoteCache
from kvdd.sim.pypkg import keys, registry
from kvdd.sim.pypkg.lifecycle import Engine
from kvdd.sim.runs import Runs


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    p, d = engine(1), engine(2)
    yield p, d
    d.instance.finalize()
    p.instance.finalize()


def setup_blocks(p: Engine, d: Engine, n: int = 4, nb: int = 12, S: int = 32,
                 linked: bool = True) -> tuple[Mem, Mem, int]:
    src, dst = Mem(n, nb, S, seed=5), Mem(n, nb, S)
    register(p, src, keys=[blocks_key(1, 0)])
    did = register(d, dst)
    if linked:
        link(d, p)
    return src, dst, did


def test_item16_link_check_precedes_the_length_check(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    src, dst, did = setup_blocks(p, d, linked=False)
    assert pull(d, did, blocks_key(1), pull_param([0, 1], [0])) == NOT_YET_LINK
    link(d, p)
    assert pull(d, did, blocks_key(1), pull_param([0, 1], [0])) == PARAM_INVALID
    assert all((t == 0).all() for t in dst.tensors)


def test_item16_host_blocks_check_lengths_locally() -> None:
    """A HOST blocks destination checks its block bounds and list lengths in CheckParam, before
    the link (PYPKG.md §4.6, data_cache_engine.cc CheckParam)."""
    d = engine(2)
    try:
        dst = Mem(2, 4, 16)
        desc = (2, 4, -1, [4, 16], 0, True)  # HOST
        did = registry.register(d, desc, dst.addrs, [], True)
        assert pull(d, did, blocks_key(1), pull_param([0, 1], [0])) == PARAM_INVALID
        assert pull(d, did, blocks_key(1), pull_param([0], [4])) == PARAM_INVALID
        assert pull(d, did, blocks_key(1), pull_param([0], [3])) == NOT_YET_LINK
    finally:
        d.instance.finalize()


def test_item17_statuses_in_order(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    src, dst, did = setup_blocks(p, d)
    assert pull(d, did, blocks_key(2), pull_param([0], [0])) == PARAM_INVALID  # own cluster
    assert pull(d, 77, blocks_key(2), pull_param([0], [0])) == PARAM_INVALID  # own cluster first
    assert pull(d, 77, blocks_key(1), pull_param([0], [0])) == NOT_EXIST  # unknown local
    assert pull(d, did, blocks_key(1, 9), pull_param([0], [0])) == NOT_EXIST  # unknown model
    assert pull(d, did, blocks_key(1), pull_param([0], [12])) == PARAM_INVALID  # dst >= shape[0]
    assert pull(d, did, blocks_key(1), pull_param([12], [0])) == PARAM_INVALID  # src >= R.N
    assert pull(d, did, blocks_key(1), pull_param([0], [0], t=0)) == PARAM_INVALID
    assert pull(d, did, blocks_key(3), pull_param([0], [0])) == NOT_YET_LINK
    assert all((t == 0).all() for t in dst.tensors)
    # a not-linked cluster with a bad dst block: the dst bound is checked after the link
    assert pull(d, did, blocks_key(3), pull_param([0], [99])) == NOT_YET_LINK


def test_item18_runs_and_bytes(pair: tuple[Engine, Engine]) -> None:
    """[0,1,4,5,6] -> [1,2,4,6,9]: runs (0,1,2), (4,4,1), (5,6,1), (6,9,1); len * L.S bytes each,
    every destination byte checked."""
    runs = Runs([0, 1, 4, 5, 6], [1, 2, 4, 6, 9])
    assert list(zip(runs.s0, runs.d0, runs.ln)) == [(0, 1, 2), (4, 4, 1), (5, 6, 1), (6, 9, 1)]
    p, d = pair
    src, dst, did = setup_blocks(p, d)
    before = dst.copy()
    pairs = list(zip([0, 1, 4, 5, 6], [1, 2, 4, 6, 9]))
    assert pull(d, did, blocks_key(1), pull_param([s for s, _ in pairs], [b for _, b in pairs])) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, pairs, 32)


def test_block_size_is_the_local_stride(pair: tuple[Engine, Engine]) -> None:
    """§4.6: blocks of L.S bytes on both sides, also when the peer's stride differs."""
    p, d = pair
    src = Mem(2, 4, 64, seed=9)  # R.S = 64, R.T = 256
    register(p, src, keys=[blocks_key(1, 0)])
    dst = Mem(2, 6, 32)  # L.S = 32
    did = register(d, dst)
    link(d, p)
    before = dst.copy()
    assert pull(d, did, blocks_key(1), pull_param([1, 2, 7], [0, 1, 5])) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, [(1, 0), (2, 1), (7, 5)], 32)
    # src block 8 = ceil(256 / 32) is out of range
    assert pull(d, did, blocks_key(1), pull_param([8], [0])) == PARAM_INVALID


def test_c2b_from_a_cache_entry(pair: tuple[Engine, Engine]) -> None:
    """§4.6 C2B: CacheKeyByIdAndIndex / CacheKey with empty src_blocks: group (i, dst[i])."""
    p, d = pair
    src = Mem(2, 4, 32, seed=4)  # CACHE: B=4, S=32
    sid = register(p, src, blocks=False, keys=[cache_key(0, 21, 2)])
    dst = Mem(2, 8, 32)
    did = register(d, dst)
    link(d, p)
    before = dst.copy()
    assert pull(d, did, id_key(1, sid, batch=3), pull_param((), [5, 2, 7])) == S_OK  # batch ignored
    expect_blocks(dst.tensors, before, src.tensors, [(0, 5), (1, 2), (2, 7)], 32)
    before = dst.copy()
    assert pull(d, did, cache_key(1, 21, 2), pull_param((), [0])) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, [(0, 0)], 32)
    # group 4: i = 4 >= ceil(R.T / L.S) = 4
    assert pull(d, did, id_key(1, sid), pull_param((), [0, 1, 2, 3, 4])) == PARAM_INVALID


def test_c2b_larger_local_block_than_the_remote_stride(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    sid = register(p, Mem(2, 4, 16, seed=4), blocks=False)
    did = register(d, Mem(2, 4, 32))
    link(d, p)
    assert pull(d, did, id_key(1, sid), pull_param((), [0])) == PARAM_INVALID  # L.S 32 > R.S 16


def test_item19_mla_default_t(pair: tuple[Engine, Engine]) -> None:
    """A 3-tensor cache (1 per layer), default t=2, no ranges: succeeds, all 3 tensors; with
    src_layer_range=range(1) and an odd count: PARAM_INVALID."""
    p, d = pair
    src, dst, did = setup_blocks(p, d, n=3)
    before = dst.copy()
    assert pull(d, did, blocks_key(1), pull_param([3, 4], [0, 1])) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, [(3, 0), (4, 1)], 32)
    assert pull(d, did, blocks_key(1), pull_param([0], [0], src=range(1))) == PARAM_INVALID


def test_item20_layer_ranges(pair: tuple[Engine, Engine]) -> None:
    """src range(1,3), dst range(0,2), t=2: tensors 2..5 of R into 0..3 of L."""
    p, d = pair
    src, dst, did = setup_blocks(p, d, n=6)
    before = dst.copy()
    assert pull(d, did, blocks_key(1), pull_param([1], [2], src=range(1, 3), dst=range(0, 2))) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, [(1, 2)], 32,
                  tensors=[(0, 2), (1, 3), (2, 4), (3, 5)])
    # only dst: the peer's tensor count must equal the dst tensors
    assert pull(d, did, blocks_key(1), pull_param([1], [2], dst=range(0, 2))) == PARAM_INVALID
    # only src: its length must equal the local count
    assert pull(d, did, blocks_key(1), pull_param([1], [2], src=range(0, 2))) == PARAM_INVALID
    before = dst.copy()
    assert pull(d, did, blocks_key(1), pull_param([4], [4], src=range(0, 3))) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, [(4, 4)], 32)
    # unequal lengths; dst beyond the local tensors; an index list that is not one run
    assert pull(d, did, blocks_key(1), pull_param([1], [2], src=range(0, 2), dst=range(0, 1))) \
        == PARAM_INVALID
    assert pull(d, did, blocks_key(1), pull_param([1], [2], src=range(1, 3), dst=range(2, 4))) \
        == PARAM_INVALID
    assert pull(d, did, blocks_key(1), (-1, 0, [1], [2], [0, 2], [0, 1], -1, -1, 2)) == PARAM_INVALID


def test_source_range_past_the_peer_is_refused(pair: tuple[Engine, Engine]) -> None:
    """Undefined upstream (a source tensor range past the peer's tensors): the memory-safe
    refusal (PYPKG.md §4.7 last rule, §9.8)."""
    p, d = pair
    src = Mem(4, 4, 32, seed=1)
    register(p, src, keys=[blocks_key(1, 0)])
    dst = Mem(4, 4, 32)
    did = register(d, dst)
    link(d, p)
    assert pull(d, did, blocks_key(1), pull_param([0], [0], src=range(1, 3), dst=range(0, 2))) \
        == PARAM_INVALID
    assert all((t == 0).all() for t in dst.tensors)


def test_item21_snapshot_at_link(pair: tuple[Engine, Engine]) -> None:
    """A cache the peer registers after the link is invisible until relink."""
    p, d = pair
    src, dst, did = setup_blocks(p, d)
    assert pull(d, did, blocks_key(1), pull_param([0], [0])) == S_OK
    late = Mem(4, 12, 32, seed=8)
    register(p, late, keys=[blocks_key(1, 3)])
    assert pull(d, did, blocks_key(1, 3), pull_param([0], [0])) == NOT_EXIST
    unlink(d, p)
    link(d, p)
    before = dst.copy()
    assert pull(d, did, blocks_key(1, 3), pull_param([2], [1])) == S_OK
    expect_blocks(dst.tensors, before, late.tensors, [(2, 1)], 32)


def test_item22_pull_cache_by_id(pair: tuple[Engine, Engine]) -> None:
    """Row b of every remote tensor (offset b * L.S) into row batch_index; size L.S + 1 fails."""
    p, d = pair
    src = Mem(2, 4, 16, seed=6)
    sid = register(p, src, blocks=False)
    dst = Mem(2, 3, 16)
    did = register(d, dst, blocks=False)
    link(d, p)
    before = dst.copy()
    assert pull(d, did, id_key(1, sid, batch=3), pull_param(batch=2)) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, [(3, 2)], 16)
    before = dst.copy()
    assert pull(d, did, id_key(1, sid, batch=1), pull_param(batch=0, size=5)) == S_OK
    want = [b.copy() for b in before]
    for w, s in zip(want, src.tensors):
        w[0:5] = s[16:21]
    assert all((g == w).all() for g, w in zip(dst.tensors, want))
    assert pull(d, did, id_key(1, sid), pull_param(size=17)) == PARAM_INVALID
    assert pull(d, did, id_key(1, sid), pull_param(batch=3)) == PARAM_INVALID  # batch >= L.B
    # the remote row is unchecked upstream; past the remote tensor kvdd refuses
    assert pull(d, did, id_key(1, sid, batch=4), pull_param()) == PARAM_INVALID
    # into a blocks cache; from a blocks source into a cache entry is allowed by id
    bid = register(d, Mem(2, 4, 16))
    assert pull(d, bid, id_key(1, sid), pull_param()) == PARAM_INVALID


def test_pull_cache_stride_rules(pair: tuple[Engine, Engine]) -> None:
    """m = L.S must fit the remote stride; the remote offset uses the local stride."""
    p, d = pair
    src = Mem(1, 4, 32, seed=6)  # R.S = 32
    sid = register(p, src, blocks=False)
    small = Mem(1, 4, 16)  # L.S = 16: row 3 of the remote at offset 3 * 16
    did = register(d, small, blocks=False)
    big = Mem(1, 2, 64)
    bigid = register(d, big, blocks=False)
    link(d, p)
    before = small.copy()
    assert pull(d, did, id_key(1, sid, batch=3), pull_param(batch=1)) == S_OK
    want = before[0].copy()
    want[16:32] = src.tensors[0][48:64]
    assert (small.tensors[0] == want).all()
    assert pull(d, bigid, id_key(1, sid), pull_param()) == PARAM_INVALID  # 64 > R.S


def test_quirks_of_the_one_sided_lookup() -> None:
    """§4.4: id <= 0 resolves (2**64-1, 0) = BlocksCacheKey(model 0); a prefix-only CacheKey
    resolves (2**64-1, model) — both name registered caches."""
    a = RemoteCache(1, 1, 64, 1, 64, False, 1, 2, 1, True, ((NO, 0, 0),))
    b = RemoteCache(2, 1, 64, 1, 64, False, 2, 2, 1, True, ((NO, 7, 0), (5, 7, 0)))
    snap = {1: a, 2: b}
    assert keys.find_remote(snap, id_key(9, 0)) is a
    assert keys.find_remote(snap, id_key(9, -4)) is a
    assert keys.find_remote(snap, id_key(9, 2)) is b
    assert keys.find_remote(snap, cache_key(9, NO, 7, prefix=3)) is b
    assert keys.find_remote(snap, cache_key(9, 5, 7)) is b
    assert keys.find_remote(snap, cache_key(9, 6, 7)) is None
    assert keys.find_remote(snap, id_key(9, 3)) is None


def test_link_pending_is_not_yet_link(pair: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    p, d = pair
    src, dst, did = setup_blocks(p, d)
    monkeypatch.setattr(d, "link_pending", lambda cid: cid == 1)
    assert pull(d, did, blocks_key(1), pull_param([0, 1], [0])) == NOT_YET_LINK
    monkeypatch.setattr(d, "link_pending", lambda cid: False)
    assert pull(d, did, blocks_key(1), pull_param([0], [0])) == S_OK


def test_two_sided_needs_the_peer_fsm() -> None:
    """§9.6: without remote-cache-accessible mode a pull returns FEATURE_NOT_ENABLED after the
    checks §4 defines (never a hang)."""
    p, d = engine(1, ra=False), engine(2, ra=False)
    try:
        src, dst, did = setup_blocks(p, d)
        assert pull(d, did, blocks_key(1), pull_param([0, 1], [0, 1])) == FEATURE_NOT_ENABLED
        assert pull(d, did, id_key(1, 1), pull_param((), [3])) == FEATURE_NOT_ENABLED
        # the request is built (and checked) before it would go to the peer
        assert pull(d, did, blocks_key(1), pull_param([0], [12])) == PARAM_INVALID
        assert pull(d, did, blocks_key(1), pull_param([0, 1], [0])) == PARAM_INVALID
        assert all((t == 0).all() for t in dst.tensors)
    finally:
        d.instance.finalize()
        p.instance.finalize()


def test_unregistered_remote_after_snapshot(pair: tuple[Engine, Engine]) -> None:
    """§4.9-1: an unregistration stays visible in the snapshot; the transfer finds the cache gone
    (KV_CACHE_NOT_EXIST) and moves nothing."""
    p, d = pair
    src, dst, did = setup_blocks(p, d)
    registry.unregister(p, 1)
    assert pull(d, did, blocks_key(1), pull_param([0], [0])) == NOT_EXIST
    assert all((t == 0).all() for t in dst.tensors)


def test_request_size_limit(pair: tuple[Engine, Engine]) -> None:
    """120 + 16 * (K + 2G) must fit 2 MiB - 8: 65,532 alternating groups of 2 tensors fail."""
    p, d = pair
    src = Mem(2, 140000, 1, seed=2)
    register(p, src, keys=[blocks_key(1, 0)])
    dst = Mem(2, 140000, 1)
    did = register(d, dst)
    link(d, p)
    n = 65535  # 120 + 16 * (2 + 2 * 65535) = 2,097,272 > 2,097,144
    src_b = list(range(0, 2 * n, 2))
    assert pull(d, did, blocks_key(1), pull_param(src_b, src_b)) == PARAM_INVALID
    n = 65530
    src_b = list(range(0, 2 * n, 2))
    assert pull(d, did, blocks_key(1), pull_param(src_b, src_b)) == S_OK
    got = np.flatnonzero(dst.tensors[1])
    want = np.flatnonzero(src.tensors[1][: 2 * n] * (np.arange(2 * n) % 2 == 0))
    assert np.array_equal(got, want)


def test_last_group_copies_the_remainder(pair: tuple[Engine, Engine]) -> None:
    """Upstream's quirk (§4.6): when R.T is not a multiple of the local block size, the last
    group copies only R.T mod L.S bytes (here 100 mod 32 = 4), whatever its length."""
    p, d = pair
    src = Mem(1, 4, 25, seed=3)  # R.T = 100
    register(p, src, keys=[blocks_key(1, 0)])
    dst = Mem(1, 6, 32)
    did = register(d, dst)
    link(d, p)
    assert pull(d, did, blocks_key(1), pull_param([0, 1, 3], [0, 1, 5])) == S_OK
    want = np.zeros(6 * 32, np.uint8)
    want[0:64] = src.tensors[0][0:64]  # the first group: 2 whole blocks
    want[160:164] = src.tensors[0][96:100]  # the last group: 4 bytes
    assert (dst.tensors[0] == want).all()
    dst.tensors[0][:] = 0
    assert pull(d, did, blocks_key(1), pull_param([0, 1], [2, 3])) == S_OK
    want = np.zeros(6 * 32, np.uint8)
    want[64:68] = src.tensors[0][0:4]  # the only group is the last one
    assert (dst.tensors[0] == want).all()
