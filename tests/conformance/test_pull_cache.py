"""PullKvCache: SEMANTICS.md §3.10 (checks in order, bytes), §2.5, §6 scenarios 43-57, §7.3, §7.8,
§7.10, kvdd rule §10.1."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvdd import Cache, CacheIndex, DataType, KvCacheExtParam

from . import reference as ref
from .checked import (
    pull_cache_checked,
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

I32 = DataType.DT_INT32


def test_s43_default_pull(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_cache_checked(world, d, ph, dh)


@pytest.mark.parametrize("src_batch,dst_batch", [(0, 3), (3, 0), (2, 1), (1, 1)])
def test_pull_rows(world: World, transfer: str, src_batch: int, dst_batch: int) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_cache_checked(world, d, ph, dh, src_batch=src_batch, batch_index=dst_batch)


@pytest.mark.parametrize("size", [0, -2, -64, -(2**63)])
def test_s44_bad_size(world: World, size: int) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), 0, size)


def test_s45_size_above_local_stride(world: World) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), 0, 65)


@pytest.mark.parametrize("size", [64, 1, 10, 63])
def test_s45_size_is_bytes_per_tensor_from_row_start(world: World, transfer: str,
                                                     size: int) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_cache_checked(world, d, ph, dh, size=size, src_batch=1, batch_index=2)


@pytest.mark.parametrize("batch_index", [4, 5, 2**32 - 1])
def test_s46_dst_batch_out_of_range(world: World, batch_index: int) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), batch_index)


def test_s47_pull_from_own_cluster(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(CacheIndex(d.cluster_id, dh.cache_id), dh.cache())


@pytest.mark.parametrize("cache_id", [99, 0, -1])
def test_s48_unknown_local_cache_even_unlinked(world: World, cache_id: int) -> None:
    d, p = pair(world)
    ph = p.register()
    d.register()
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), Cache(cache_id=cache_id))


def test_s49_not_linked(world: World, transfer: str) -> None:
    d, p = pair(world, transfer)
    ph, dh = p.register(), d.register()
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(NOT_YET_LINK):  # a cluster id nobody linked
        d.pull_kv_cache(ph.index(cluster_id=77), dh.cache())


@pytest.mark.parametrize("remote_id", [99, 2, 0, -1, -(2**63), 2**63 - 1])
def test_s50_unknown_remote_cache(world: World, transfer: str, remote_id: int) -> None:
    d, p, dh, ph = linked(world, transfer)
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(cache_id=remote_id), dh.cache())


@pytest.mark.parametrize("remote_n", [8, 12])
def test_s51_tensor_count_mismatch(world: World, remote_n: int) -> None:
    d, p, dh, ph = linked(world, pspec=Spec(n=remote_n))
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache())


def test_s52_local_stride_larger_than_remote(world: World, transfer: str) -> None:
    # local {2,128} int32 (S=512), remote {4,64} (S=256).
    d, p, dh, ph = linked(world, transfer, dspec=Spec(shape=(2, 128)), pspec=Spec(shape=(4, 64)))
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache())  # nbytes = L.S = 512 > R.S
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), 0, 257)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), 2, 256)  # dst batch 2 >= L.B
    pull_cache_checked(world, d, ph, dh, size=256)
    # §7.3: the remote offset is bs * L.S = 512, i.e. remote row 2 (not row 1).
    pull_cache_checked(world, d, ph, dh, size=256, src_batch=1, batch_index=1)


def test_quirk_remote_offset_uses_local_stride(world: World, transfer: str) -> None:
    # local {4,16} (S=64), remote {2,64} (S=256, B=2, T=512): row bs is read at bs*64, and bs is not
    # checked against R.B.
    d, p, dh, ph = linked(world, transfer, pspec=Spec(shape=(2, 64)))
    pull_cache_checked(world, d, ph, dh, src_batch=3, batch_index=0)
    pull_cache_checked(world, d, ph, dh, src_batch=7, batch_index=1)  # the last 64 bytes of R
    pull_cache_checked(world, d, ph, dh, src_batch=6, batch_index=2, size=30)


@pytest.mark.parametrize("src_batch,size", [(8, -1), (8, 1), (9, 10),
                                            (2**32 - 1, -1)])
def test_rule1_pull_past_remote_tensor(world: World, transfer: str, src_batch: int,
                                       size: int) -> None:
    # kvdd rule 1: bs*L.S + nbytes > R.T -> PARAM_INVALID, no byte moved (remote {2,64}: T=512).
    d, p, dh, ph = linked(world, transfer, pspec=Spec(shape=(2, 64)))
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(src_batch), dh.cache(), 0, size)


@pytest.mark.parametrize("src_batch,size", [(4, -1), (4, 1), (3, -1)])
def test_rule1_pull_same_shapes(world: World, src_batch: int, size: int) -> None:
    d, p, dh, ph = linked(world)
    if src_batch == 3:
        pull_cache_checked(world, d, ph, dh, src_batch=3)  # the last row is fine
        return
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(src_batch), dh.cache(), 0, size)


# -- layer ranges (§2.5, §3.10 step 4 and 10, §7.8, §7.10) ------------------------------------------


@pytest.mark.parametrize("e", [
    ext((0, 1), (0, 1), 2), ext((0, 1), (0, 1), 1),  # scenario 53
    ext((3, 4), (0, 1), 2), ext((0, 0), (4, 4), 2), ext((1, 1), (2, 2), 1),
    ext((0, 4), (0, 4), 2), ext((0, 1), (0, 1), 5), ext((0, 9), (0, 9), 1), ext((1, 1), (1, 1), 5),
], ids=str)
def test_s53_layer_ranges(world: World, transfer: str, e: KvCacheExtParam) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_cache_checked(world, d, ph, dh, ext_param=e, src_batch=1, batch_index=2)


@pytest.mark.parametrize("e", [
    ext((-1, -1), (3, 4), 2),  # scenario 57: dst range ignored
    ext((0, 0), (-1, -1), 2), ext((2, 3), (-1, 7), 2), ext((-1, 5), (-1, 5), 2),  # §7.8, §7.10
    ext((-1, -1), (5, 9), 2),  # an out-of-range dst range is ignored too
    ext((-1, 3), (8, 20), 1),
], ids=str)
def test_s57_ranges_ignored_unless_both_firsts_non_negative(world: World, transfer: str,
                                                            e: KvCacheExtParam) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_cache_checked(world, d, ph, dh, ext_param=e)


@pytest.mark.parametrize("t", [3, 7, 17, 4])
def test_s54_tensors_per_layer_not_dividing(world: World, t: int) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), ext_param=ext((0, 1), (0, 1), t))


@pytest.mark.parametrize("e", [
    ext((0, 1), (0, 2), 2), ext((-2, 1), (0, 1), 2),  # scenario 55
    ext((0, 1), (-2, 1), 2), ext((0, 0), (0, 0), 0), ext((-1, -1), (-1, -1), 0),  # scenario 56
    ext((1, 0), (0, 1), 2), ext((0, 1), (1, 0), 2), ext((0, -1), (0, 0), 2), ext((-1, -2), (0, 0), 2),
    ext((-2, -1), (0, 0), 2), ext((-1, -1), (1, 0), 2), ext((-1, -1), (-3, 0), 2),
    ext((0, 0), (5, 5), 2), ext((0, 5), (0, 5), 2), ext((0, 0), (9, 9), 2),  # dst past L.n
], ids=str)
def test_s55_s56_bad_ranges(world: World, transfer: str, e: KvCacheExtParam) -> None:
    d, p, dh, ph = linked(world, transfer)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), ext_param=e)


@pytest.mark.parametrize("e", [ext((5, 5), (0, 0), 2), ext((4, 5), (0, 1), 2), ext((10, 10), (0, 0), 1)],
                         ids=str)
def test_rule1_src_range_past_remote_tensor_count(world: World, e: KvCacheExtParam) -> None:
    # §7.8: the src range is not checked against R.n upstream; kvdd rule 1 rejects it.
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), ext_param=e)


def test_ranges_skip_tensor_count_rule(world: World) -> None:
    # §3.10 step 14: with index lists the counts need not match (remote 12 tensors, local 10).
    d, p, dh, ph = linked(world, pspec=Spec(n=12))
    pull_cache_checked(world, d, ph, dh, ext_param=ext((5, 5), (0, 0), 2))
    pull_cache_checked(world, d, ph, dh, ext_param=ext((1, 5), (0, 4), 2))


# -- order of the checks (§3.10): two faults, the earlier check's status wins -------------------------

PullArgs = tuple[CacheIndex, Cache, int, int, KvCacheExtParam | None]
Case = Callable[[CacheHandle, CacheHandle], PullArgs]
UNLINKED = 77  # a cluster id nobody linked

ORDER_CASES: dict[str, tuple[Case, Err]] = {
    "size(2)<local(7)": (lambda ph, dh: (ph.index(), Cache(99), 0, 0, None), PARAM_INVALID),
    "ext(3)<local(7)": (lambda ph, dh: (ph.index(), Cache(99), 0, -1, ext((1, 0))), PARAM_INVALID),
    "t=0(3)<local(7)": (lambda ph, dh: (ph.index(), Cache(99), 0, -1, ext(t=0)), PARAM_INVALID),
    "own(6)<local(7)": (lambda ph, dh: (CacheIndex(2, 1), Cache(99), 0, -1, None), PARAM_INVALID),
    "local(7)<link(11)": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), Cache(99), 0, -1, None),
                          KV_CACHE_NOT_EXIST),
    "batch(8)<link(11)": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), 4, -1, None),
                          PARAM_INVALID),
    "size(9)<link(11)": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), 0, 65, None),
                         PARAM_INVALID),
    "n%t(10)<link(11)": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), 0, -1,
                                          ext((0, 0), (0, 0), 3)), PARAM_INVALID),
    "dst idx(10)<link(11)": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), 0, -1,
                                              ext((0, 0), (5, 5))), PARAM_INVALID),
    "lens(10)<link(11)": (lambda ph, dh: (ph.index(cluster_id=UNLINKED), dh.cache(), 0, -1,
                                           ext((0, 1), (0, 0))), PARAM_INVALID),
    "link(11)<remote(13)": (lambda ph, dh: (CacheIndex(UNLINKED, 99), dh.cache(), 0, -1, None),
                            NOT_YET_LINK),
    "remote(13)<rule1": (lambda ph, dh: (ph.index(100, cache_id=99), dh.cache(), 0, -1, None),
                         KV_CACHE_NOT_EXIST),
    "remote(13)<src range": (lambda ph, dh: (ph.index(cache_id=99), dh.cache(), 0, -1,
                                              ext((7, 7), (0, 0))), KV_CACHE_NOT_EXIST),
}


@pytest.mark.parametrize("case", sorted(ORDER_CASES))
def test_pull_check_order(world: World, transfer: str, case: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    make, err = ORDER_CASES[case]
    src, dst, batch_index, size, e = make(ph, dh)
    with world.rejects(err):
        d.pull_kv_cache(src, dst, batch_index, size, e)


def test_pull_ignores_dst_cache_struct_fields(world: World) -> None:
    # §3.10: only dst_cache.cache_id is read (desc and addresses are ignored).
    d, p, dh, ph = linked(world)
    before = world.snapshot()
    d.pull_kv_cache(ph.index(), Cache(cache_id=dh.cache_id, tensor_addrs=(8, 16)))
    expected = before.copy()
    ref.pull_cache(expected.tensors(dh), before.tensors(ph), dh.geom)
    world.assert_memory(expected)


def test_pull_between_different_dtypes_same_bytes(world: World) -> None:
    # §3.10: data types are never compared; only byte counts matter.
    d, p, dh, ph = linked(world, dspec=Spec(dtype=DataType.DT_INT8, shape=(4, 64)),
                          pspec=Spec(dtype=DataType.DT_BF16, shape=(4, 32)))
    pull_cache_checked(world, d, ph, dh, src_batch=3, batch_index=1)
