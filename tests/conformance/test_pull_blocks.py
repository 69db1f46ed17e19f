"""PullKvBlocks: SEMANTICS.md §3.11 (checks in order, run grouping, request-size limit, bytes),
§6 scenarios 59-64, §7.4, kvdd rules §10.1 and §10.11."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from kvdd import Cache, CacheIndex, DataType, KvCacheExtParam

from . import reference as ref
from .checked import (
    pull_blocks_checked,
)
from .harness import (
    KV_CACHE_NOT_EXIST,
    NOT_YET_LINK,
    PARAM_INVALID,
    CacheHandle,
    Err,
    Spec,
    World,
    ext,
    linked,
    pair,
)

UNLINKED = 77


def test_s59_one_block(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_blocks_checked(world, d, ph, dh, [0], [0])


@pytest.mark.parametrize("src,dst", [
    ([0, 1], [0, 1]), ([3], [0]), ([0, 1, 2, 3], [0, 1, 2, 3]), ([3, 2, 1, 0], [0, 1, 2, 3]),
    ([1, 2], [2, 3]), ([0, 0], [1, 2]), ([2, 3, 0], [0, 1, 3]),
])
def test_pull_blocks_bytes(world: World, transfer: str, src: list[int], dst: list[int]) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_blocks_checked(world, d, ph, dh, src, dst)


def test_run_grouping_upstream_example(world: World, transfer: str) -> None:
    # §3.11 [T-int]: src {0,1,4,5,6} -> dst {1,2,4,6,9}; dst block 1 receives src block 0.
    assert ref.groups([0, 1, 4, 5, 6], [1, 2, 4, 6, 9]) == [(0, 1, 2), (4, 4, 1), (5, 6, 1),
                                                            (6, 9, 1)]
    spec = Spec(n=2, shape=(10, 16))
    d, p, dh, ph = linked(world, transfer, dspec=spec, pspec=spec)
    pull_blocks_checked(world, d, ph, dh, [0, 1, 4, 5, 6], [1, 2, 4, 6, 9])
    assert d.tensor_bytes(dh, 1)[64:128] == p.tensor_bytes(ph, 1)[0:64]


def test_rule11_duplicate_dst_block_last_wins(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_blocks_checked(world, d, ph, dh, [0, 1, 3], [2, 2, 2])
    assert d.tensor_bytes(dh, 0)[128:192] == p.tensor_bytes(ph, 0)[192:256]


def test_s60_src_batch_index_must_be_0(world: World) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(1), dh.cache(), [0], [0])


@pytest.mark.parametrize("src,dst", [([], []), ([], [0]), ([0, 1], [0]), ([0], []), ([0], [0, 1])])
def test_s61_block_list_shapes(world: World, src: list[int], dst: list[int]) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), src, dst)


@pytest.mark.parametrize("dst", [[4], [0, 4], [3, 4], [2**64 - 1], [1, 0, 5]])
def test_s62_dst_block_past_local_batch(world: World, dst: list[int]) -> None:
    d, p, dh, ph = linked(world)
    src = list(range(len(dst)))
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), src, dst)


def test_s63_blocks_with_layer_ranges(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_blocks_checked(world, d, ph, dh, [0, 1], [0, 1], ext_param=ext((0, 1), (0, 1), 2))
    pull_blocks_checked(world, d, ph, dh, [2, 3], [0, 2], ext_param=ext((3, 4), (1, 2), 2))
    pull_blocks_checked(world, d, ph, dh, [1], [3], ext_param=ext((9, 9), (0, 0), 1))
    pull_blocks_checked(world, d, ph, dh, [1], [3], ext_param=ext((-1, 2), (4, 4), 2))  # ignored


@pytest.mark.parametrize("e", [
    ext((1, 0), (0, 1)), ext((0, 0), (0, 0), 0), ext((-2, 0), (0, 0)), ext((0, 0), (0, 0), 3),
    ext((0, 1), (0, 0)), ext((0, 0), (5, 5)), ext((5, 5), (0, 0)),
], ids=str)
def test_pull_blocks_bad_ranges(world: World, e: KvCacheExtParam) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0], [0], e)


def test_pull_blocks_own_cluster_and_unknown_ids(world: World) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(CacheIndex(2, 1), dh.cache(), [0], [0])
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_blocks(ph.index(), Cache(99), [0], [0])
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_blocks(ph.index(cluster_id=UNLINKED), dh.cache(), [0], [0])
    for rid in (99, 0, -1):
        with world.rejects(KV_CACHE_NOT_EXIST):
            d.pull_kv_blocks(ph.index(cache_id=rid), dh.cache(), [0], [0])


def test_pull_blocks_tensor_count_mismatch(world: World) -> None:
    d, p, dh, ph = linked(world, pspec=Spec(n=8))
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0], [0])
    pull_blocks_checked(world, d, ph, dh, [1], [2], ext_param=ext((3, 3), (0, 0)))


def test_pull_blocks_remote_with_more_tensors_is_refused(world: World) -> None:
    """§3.11 step 10 (tensor-count rule of §3.10 step 14): without layer ranges a remote cache
    with more tensors than the local one is refused too, and nothing is written."""
    d, p, dh, ph = linked(world, pspec=Spec(n=12))
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0], [0])


def test_pull_blocks_dst_run_starting_at_the_last_uint64_index_is_refused(world: World) -> None:
    """§3.11 step 9: every group's first and last dst index must be < L.B.  Pairs (0, 2**64-1),
    (1, 0) form one run (both indices step by +1 modulo 2**64) whose last dst index 0 is in range
    but whose first is not: LLM_PARAM_INVALID, nothing written."""
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0, 1], [2**64 - 1, 0])


# -- block size = local stride (§3.11, §7.4) and the remote bounds (step 11, rule 1) -------------------


def test_quirk_block_size_is_local_stride(world: World, transfer: str) -> None:
    # local {4,16} (S=64), remote {2,64} (S=256, T=512): remote block k is bytes [64k, 64k+64).
    d, p, dh, ph = linked(world, transfer, pspec=Spec(shape=(2, 64)))
    pull_blocks_checked(world, d, ph, dh, [5, 7], [0, 3])
    pull_blocks_checked(world, d, ph, dh, [4, 5, 6, 7], [0, 1, 2, 3])


@pytest.mark.parametrize("src,dst", [([8], [0]), ([7, 8], [0, 1]), ([2**63], [0]),
                                     ([2**64 - 1], [0]), ([0, 2**64 - 1], [0, 1])])
def test_src_block_past_remote_tensor(world: World, src: list[int], dst: list[int]) -> None:
    # first src index >= ceil(R.T/L.S) = 8 (step 11); a run that starts in range but ends past R.T
    # (accepted upstream, kvdd rule 1).
    d, p, dh, ph = linked(world, pspec=Spec(shape=(2, 64)))
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), src, dst)


def test_group_longer_than_remote_tensor(world: World) -> None:
    # local {4,16} (S=64), remote {2,16} (T=128): a 3-block group is 192 bytes > R.T.
    d, p, dh, ph = linked(world, pspec=Spec(shape=(2, 16)))
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0, 1, 2], [0, 1, 2])
    pull_blocks_checked(world, d, ph, dh, [0, 1], [2, 3])


def test_quirk_last_group_copies_remote_tail(world: World, transfer: str) -> None:
    # §3.11: if R.T % L.S != 0 the last group copies only R.T % L.S bytes.  Remote int8 {2,50}
    # (T=100) with L.S=64: 2 remote blocks, tail 36 bytes.
    d, p, dh, ph = linked(world, transfer, pspec=Spec(dtype=DataType.DT_INT8, shape=(2, 50)))
    pull_blocks_checked(world, d, ph, dh, [1], [0])  # bytes [64,100) of R -> 36 bytes
    pull_blocks_checked(world, d, ph, dh, [0], [3])  # the last group is block 0: still 36 bytes
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [2], [0])  # 2 >= ceil(100/64) (step 11)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0, 1], [0, 1])  # 128 > R.T (step 11)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [1, 0], [0, 1])  # a full block past R.T (rule 1)


def test_quirk_tail_applies_to_last_group_only(world: World, transfer: str) -> None:
    # Remote int8 {2,100} (T=200), L.S=64: tail 8 bytes; earlier groups copy whole blocks.
    assert ref.groups([0, 2], [0, 1]) == [(0, 0, 1), (2, 1, 1)]
    d, p, dh, ph = linked(world, transfer, pspec=Spec(dtype=DataType.DT_INT8, shape=(2, 100)))
    pull_blocks_checked(world, d, ph, dh, [0, 2], [0, 1])
    pull_blocks_checked(world, d, ph, dh, [0, 1], [2, 3])  # one group of 2 blocks -> 8 bytes
    pull_blocks_checked(world, d, ph, dh, [1, 2, 3], [0, 1, 2])


# -- request-size limit (§3.11 step 8, scenario 64) ----------------------------------------------------


def _alternating(g: int) -> tuple[list[int], list[int]]:
    # (0->1), (1->0), (0->1), ...: every pair is its own group.
    src = [i % 2 for i in range(g)]
    dst = [1 - s for s in src]
    assert len(ref.groups(src, dst)) == g
    return src, dst


def test_s64_request_size_limit(world: World) -> None:
    g_max = ref.max_groups(1)
    assert ref.request_bytes(1, g_max) <= ref.REQUEST_LIMIT < ref.request_bytes(1, g_max + 1)
    spec = Spec(n=1, shape=(2, 16))
    d, p, dh, ph = linked(world, dspec=spec, pspec=spec)
    src, dst = _alternating(g_max + 1)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), src, dst)
    src, dst = _alternating(g_max)
    pull_blocks_checked(world, d, ph, dh, src, dst)


def test_s64_request_size_counts_tensors(world: World) -> None:
    # 16 bytes per tensor: with K=3 tensors the K=1 maximum no longer fits.
    g = ref.max_groups(1)
    assert ref.request_bytes(3, g) > ref.REQUEST_LIMIT
    spec = Spec(n=3, shape=(2, 16))
    d, p, dh, ph = linked(world, dspec=spec, pspec=spec)
    src, dst = _alternating(g)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), src, dst)


def test_s64_contiguous_runs_are_one_group(world: World) -> None:
    # Many pairs but few groups: a long contiguous run is a single group.
    spec = Spec(n=1, shape=(4096, 1))  # S = 4 bytes
    g = ref.max_groups(1) + 10
    d, p, dh, ph = linked(world, dspec=spec, pspec=spec)
    src = list(range(4096)) * (g // 4096 + 1)
    dst = list(range(4096)) * (g // 4096 + 1)
    assert len(src) > g and len(ref.groups(src, dst)) < 100
    pull_blocks_checked(world, d, ph, dh, src, dst)


# -- order of the checks (§3.11) ------------------------------------------------------------------

BlocksArgs = tuple[CacheIndex, Cache, Sequence[int], Sequence[int], KvCacheExtParam | None]
Case = Callable[[CacheHandle, CacheHandle], BlocksArgs]
_BIG_SRC, _BIG_DST = _alternating(ref.max_groups(10) + 1)

ORDER_CASES: dict[str, tuple[Case, Err]] = {
    "batch(2)<local": (lambda ph, dh: (ph.index(1), Cache(99), [0], [0], None), PARAM_INVALID),
    "ext(3)<local": (lambda ph, dh: (ph.index(), Cache(99), [0], [0], ext(t=0)), PARAM_INVALID),
    "empty(4)<local": (lambda ph, dh: (ph.index(), Cache(99), [], [], None), PARAM_INVALID),
    "lens(5)<link": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), [0, 1], [0], None),
                     PARAM_INVALID),
    "own<local": (lambda ph, dh: (CacheIndex(2, 1), Cache(99), [0], [0], None), PARAM_INVALID),
    "local<link": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), Cache(99), [0], [0], None),
                   KV_CACHE_NOT_EXIST),
    "idx<link": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), [0], [0],
                                 ext((0, 0), (0, 0), 3)), PARAM_INVALID),
    "link<dst block(9)": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), [0], [4],
                                          None), NOT_YET_LINK),
    "link<request size(8)": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), _BIG_SRC,
                                             _BIG_DST, None), NOT_YET_LINK),
    "request size(8)<remote(10)": (lambda ph, dh: (ph.index(cache_id=99), dh.cache(), _BIG_SRC,
                                                   _BIG_DST, None), PARAM_INVALID),
    "dst block(9)<remote(10)": (lambda ph, dh: (ph.index(cache_id=99), dh.cache(), [0], [4], None),
                                PARAM_INVALID),
    "remote(10)<src block(11)": (lambda ph, dh: (ph.index(cache_id=99), dh.cache(), [9], [0], None),
                                 KV_CACHE_NOT_EXIST),
}


@pytest.mark.parametrize("case", sorted(ORDER_CASES))
def test_pull_blocks_check_order(world: World, transfer: str, case: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    make, err = ORDER_CASES[case]
    src, dst, sb, db, e = make(ph, dh)
    with world.rejects(err):
        d.pull_kv_blocks(src, dst, sb, db, e)


def test_pull_blocks_unlinked_first_checks(world: World) -> None:
    d, p = pair(world)
    ph, dh = p.register(), d.register()
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0], [0])
