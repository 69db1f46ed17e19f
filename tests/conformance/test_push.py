"""PushKvCache / PushKvBlocks: SEMANTICS.md §3.12-§3.13 (checks in order, layer plans, partial
progress, bytes), §6 scenarios 65-78, §7.5-§7.7, §7.9, kvdd rules §10.1 and §10.11."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from kvdd import Cache, CacheIndex, CachePlacement, KvCacheExtParam

from . import reference as ref
from .checked import (
    push_blocks_checked,
    push_cache_checked,
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


# -- PushKvCache ----------------------------------------------------------------------------------


def test_s65_push_with_only_cache_id_and_single_layer(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    push_cache_checked(world, d, dh, ph, cache=dh.cache(id_only=True),
                       ext_param=ext((0, 0), (0, 0), 2))


def test_s65_acceptor_pushes_to_initiator(world: World) -> None:
    # The upstream scenario: P (the sim peer, listening) pushes to D, which initiated the link.
    d, p, dh, ph = linked(world, "comm")
    push_cache_checked(world, p, ph, dh, cache=ph.cache(id_only=True),
                       ext_param=ext((0, 0), (0, 0), 2))


def test_s66_default_ext_with_zero_num_tensors(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(id_only=True), ph.index())
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(num_tensors=0), ph.index())


def test_s67_default_ext_all_layers(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    assert len(ref.push_layer_plan((-1, -1), (-1, -1), 2, 10)) == 5
    push_cache_checked(world, d, dh, ph)


@pytest.mark.parametrize("src_batch,dst_batch", [(0, 3), (3, 0), (1, 2), (2, 2)])
def test_push_rows(world: World, transfer: str, src_batch: int, dst_batch: int) -> None:
    d, p, dh, ph = linked(world, transfer)
    push_cache_checked(world, d, dh, ph, src_batch_index=src_batch, dst_batch=dst_batch)


@pytest.mark.parametrize("size", [64, 0, -2, 1])
def test_s68_size_must_be_minus_1(world: World, size: int) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(), 0, size)


@pytest.mark.parametrize("placement", [CachePlacement.HOST, 2])
def test_s69_struct_placement_must_be_device(world: World, placement: int) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(placement=placement), ph.index())
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(placement=placement), ph.index(), [0], [0])


def test_quirk_registered_host_cache_pushes_if_struct_says_device(world: World) -> None:
    # §7.7: the registered placement is not consulted.
    d, p, dh, ph = linked(world, dspec=Spec(placement=CachePlacement.HOST))
    push_cache_checked(world, d, dh, ph, cache=dh.cache(placement=CachePlacement.DEVICE))
    push_blocks_checked(world, d, dh, ph, [1], [2], cache=dh.cache(placement=CachePlacement.DEVICE))
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index())  # the struct copied from the registration: HOST


def test_s70_unequal_range_lengths_nothing_written(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(), ext_param=ext((0, 1), (0, 3), 2))


def test_s71_src_layer_past_local_after_one_layer(world: World, transfer: str) -> None:
    # {4,5} -> {0,1}: layer 4->0 is written, then src layer 5 >= 10/2 fails (§7.6).
    d, p, dh, ph = linked(world, transfer)
    push_cache_checked(world, d, dh, ph, ext_param=ext((4, 5), (0, 1), 2), error=PARAM_INVALID,
                       layers_ok=1)


def test_s72_dst_layer_past_remote_after_one_layer(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    push_cache_checked(world, d, dh, ph, ext_param=ext((0, 1), (4, 5), 2), error=PARAM_INVALID,
                       layers_ok=1)


@pytest.mark.parametrize("t", [3, 7, 17])
@pytest.mark.parametrize("ranges", [((0, 1), (0, 1)), ((-1, -1), (-1, -1)), ((0, 0), (0, 0))])
def test_s73_tensors_per_layer_not_dividing(world: World, t: int,
                                            ranges: tuple[tuple[int, int], tuple[int, int]]) -> None:
    # The first planned layer already fails (dst layer >= floor(10/t) for t=17, else 10 % t != 0).
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(), ext_param=ext(ranges[0], ranges[1], t))
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [0], ext(ranges[0], ranges[1], t))


def test_push_tensor_num_per_layer_5(world: World) -> None:
    d, p, dh, ph = linked(world)
    push_cache_checked(world, d, dh, ph, ext_param=ext((1, 1), (0, 0), 5), src_batch_index=2,
                       dst_batch=1)
    push_cache_checked(world, d, dh, ph, ext_param=ext(t=5))


@pytest.mark.parametrize("dst_batch,src_batch", [(4, 0), (0, 4), (2**32 - 1, 0), (0, 2**32 - 1)])
def test_s74_batch_indices(world: World, dst_batch: int, src_batch: int) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(dst_batch), src_batch)


def test_s77_push_not_linked(world: World, transfer: str) -> None:
    d, p = pair(world, transfer)
    ph, dh = p.register(), d.register()
    with world.rejects(NOT_YET_LINK):
        d.push_kv_cache(dh.cache(), ph.index())
    with world.rejects(NOT_YET_LINK):
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [0])


def test_push_to_own_cluster_is_not_yet_link(world: World) -> None:
    # §3.12 step 7b: no own-cluster check for push; there is simply no entity for our own id.
    d, p, dh, ph = linked(world)
    with world.rejects(NOT_YET_LINK):
        d.push_kv_cache(dh.cache(), CacheIndex(2, dh.cache_id))


@pytest.mark.parametrize("cache_id", [99, 0, -1])
def test_s78_unknown_local_cache(world: World, cache_id: int) -> None:
    d, p, dh, ph = linked(world)
    bad = Cache(cache_id=cache_id, cache_desc=dh.desc)
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_cache(bad, ph.index())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_blocks(bad, ph.index(), [0], [0])


@pytest.mark.parametrize("remote_id", [99, 2, 0, -1])
def test_push_unknown_remote_cache(world: World, transfer: str, remote_id: int) -> None:
    d, p, dh, ph = linked(world, transfer)
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_cache(dh.cache(), ph.index(cache_id=remote_id))
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_blocks(dh.cache(), ph.index(cache_id=remote_id), [0], [0])


# -- layer plans (§3.12 step 6, §7.7, §7.9) -------------------------------------------------------


@pytest.mark.parametrize("e", [
    ext((0, 1), (0, 1), 2), ext((0, 1), (0, 1), 1), ext((1, 3), (2, 4), 2), ext((4, 4), (0, 0), 2),
    ext((0, 0), (4, 4), 2), ext((9, 9), (0, 0), 1), ext((0, 4), (0, 4), 2), ext((3, 3), (3, 3), 2),
    ext((-1, -1), (2, 2), 2),  # §7.9: dst ignored for "all", lengths 0 == 0
    ext((-1, 2), (0, 3), 2), ext((-1, 5), (-1, 5), 2), ext((-1, -1), (-1, -1), 1),  # [-1,k] = all
], ids=str)
def test_push_layer_plans(world: World, transfer: str, e: KvCacheExtParam) -> None:
    d, p, dh, ph = linked(world, transfer)
    push_cache_checked(world, d, dh, ph, ext_param=e, src_batch_index=1, dst_batch=3)


@pytest.mark.parametrize("e", [
    ext((-1, -1), (0, 3), 2), ext((-1, 3), (0, 3), 2),  # §7.9: length equality still enforced
    ext((-2, 0), (0, 0), 2), ext((1, 0), (1, 0), 2), ext((0, 0), (0, 0), 0), ext((0, -1), (0, -1), 2),
    ext((0, 0), (-1, -1), 2),  # a single layer mapped to dst -1 -> huge unsigned layer (step 7d)
    ext((5, 5), (0, 0), 2), ext((0, 0), (5, 5), 2),
], ids=str)
def test_push_bad_ranges_nothing_written(world: World, e: KvCacheExtParam) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(), ext_param=e)
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [0], e)


@pytest.mark.parametrize("u,layers", [(4, 2), (1, 1), (3, 2), (2, 1)])
def test_quirk_num_tensors_from_struct_selects_layers(world: World, u: int, layers: int) -> None:
    # §7.7: with default ranges the layer loop covers the struct's num_tensors, not the registered.
    assert len(ref.push_layer_plan((-1, -1), (-1, -1), 2, u)) == layers
    d, p, dh, ph = linked(world)
    push_cache_checked(world, d, dh, ph, cache=dh.cache(num_tensors=u), src_batch_index=2)


@pytest.mark.parametrize("u", [11, 12])
def test_quirk_num_tensors_too_large_partial(world: World, u: int) -> None:
    # 6 planned layers: 0..4 are written, layer 5 >= floor(R.n/t) fails (§3.12 step 7d, §7.6).
    d, p, dh, ph = linked(world)
    push_cache_checked(world, d, dh, ph, cache=dh.cache(num_tensors=u), error=PARAM_INVALID,
                       layers_ok=5)
    push_blocks_checked(world, d, dh, ph, [0, 1], [2, 3], cache=dh.cache(num_tensors=u),
                        error=PARAM_INVALID, layers_ok=5)


def test_local_tensor_count_not_multiple_of_t(world: World) -> None:
    # Registered 9 tensors, t=2: the first layer fails step 7g; nothing written.
    d, p, dh, ph = linked(world, dspec=Spec(n=9))
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index())
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(), ext_param=ext((0, 0), (0, 0)))


def test_remote_with_more_tensors(world: World) -> None:
    d, p, dh, ph = linked(world, pspec=Spec(n=12))
    push_cache_checked(world, d, dh, ph, ext_param=ext((0, 1), (4, 5)))
    push_cache_checked(world, d, dh, ph)  # layers 0..4 -> 0..4


# -- strides (§3.12 data semantics, §7.5, rule 1) ------------------------------------------------------


def test_quirk_push_row_overruns_into_next_remote_row(world: World, transfer: str) -> None:
    # local {2,32} (S=128), remote {4,16} (S=64, T=256): L.S bytes land at bd*R.S.
    d, p, dh, ph = linked(world, transfer, dspec=Spec(shape=(2, 32)))
    push_cache_checked(world, d, dh, ph, dst_batch=1, src_batch_index=1)
    push_cache_checked(world, d, dh, ph, dst_batch=2, src_batch_index=0)


def test_rule1_push_row_past_remote_tensor(world: World) -> None:
    d, p, dh, ph = linked(world, dspec=Spec(shape=(2, 32)))
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(3))  # [192, 320) > 256
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(3), ext_param=ext((0, 0), (0, 0)))


def test_push_smaller_local_stride(world: World, transfer: str) -> None:
    # local {4,16} (S=64), remote {2,64} (S=256): row bd starts at bd*R.S, L.S bytes written.
    d, p, dh, ph = linked(world, transfer, pspec=Spec(shape=(2, 64)))
    push_cache_checked(world, d, dh, ph, dst_batch=1, src_batch_index=3)
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(2))  # >= R.B


# -- PushKvBlocks --------------------------------------------------------------------------------


@pytest.mark.parametrize("src,dst", [([0, 1], [0, 1]), ([0], [3]), ([3, 2, 1, 0], [0, 1, 2, 3]),
                                     ([1, 2, 0], [0, 1, 3]), ([0, 0], [1, 2])])
def test_s76_push_blocks(world: World, transfer: str, src: list[int], dst: list[int]) -> None:
    d, p, dh, ph = linked(world, transfer)
    push_blocks_checked(world, d, dh, ph, src, dst)


def test_push_blocks_upstream_layer_example(world: World) -> None:
    # [T-int] src layer 0 block 0 -> dst layer 1 block 1; dst block 0 untouched.
    d, p, dh, ph = linked(world)
    push_blocks_checked(world, d, dh, ph, [0], [1], ext_param=ext((0, 0), (1, 1), 2))


def test_push_blocks_layer_plans(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    push_blocks_checked(world, d, dh, ph, [2, 3], [0, 1], ext_param=ext((1, 3), (2, 4), 2))
    push_blocks_checked(world, d, dh, ph, [1], [1], cache=dh.cache(id_only=True),
                        ext_param=ext((4, 4), (0, 0), 2))
    push_blocks_checked(world, d, dh, ph, [0], [2], ext_param=ext((-1, -1), (3, 3), 2))


def test_rule11_push_blocks_duplicate_dst_last_wins(world: World) -> None:
    d, p, dh, ph = linked(world)
    push_blocks_checked(world, d, dh, ph, [0, 1, 3], [2, 2, 2])
    assert p.tensor_bytes(ph, 0)[128:192] == d.tensor_bytes(dh, 0)[192:256]


@pytest.mark.parametrize("src,dst", [([], []), ([], [0]), ([0, 1], [0]), ([0], [])])
def test_s75_push_blocks_list_shapes(world: World, src: list[int], dst: list[int]) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(), ph.index(), src, dst)


def test_s75_push_blocks_dst_batch_index_must_be_0(world: World) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(), ph.index(1), [0], [0])


@pytest.mark.parametrize("src,dst", [([0], [4]), ([0, 1], [3, 4]), ([4], [0]), ([3, 4], [0, 1]),
                                     ([0, 5], [0, 1]), ([2**64 - 1], [0]), ([0], [2**64 - 1])])
def test_s76_push_blocks_out_of_range(world: World, src: list[int], dst: list[int]) -> None:
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(), ph.index(), src, dst)


def test_push_blocks_src_run_starting_at_the_last_uint64_index_is_refused(world: World) -> None:
    """§3.13 step 8: for every group the first and last src index must be < L.B.  Pairs
    (2**64-1, 0), (0, 1) form one run (both indices step by +1 modulo 2**64) whose last src index
    0 is in range but whose first is not: LLM_PARAM_INVALID, nothing written."""
    d, p, dh, ph = linked(world)
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(), ph.index(), [2**64 - 1, 0], [0, 1])


def test_push_blocks_partial_multi_layer(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    push_blocks_checked(world, d, dh, ph, [0], [1], ext_param=ext((0, 1), (4, 5)),
                        error=PARAM_INVALID, layers_ok=1)
    push_blocks_checked(world, d, dh, ph, [2], [3], ext_param=ext((3, 5), (0, 2)),
                        error=PARAM_INVALID, layers_ok=2)


def test_push_blocks_block_size_is_local_stride(world: World, transfer: str) -> None:
    # local {2,32} (S=128), remote {4,16} (T=256): remote block k is bytes [128k, 128k+128).
    d, p, dh, ph = linked(world, transfer, dspec=Spec(shape=(2, 32)))
    push_blocks_checked(world, d, dh, ph, [0], [1])
    push_blocks_checked(world, d, dh, ph, [1, 0], [0, 1])
    with world.rejects(PARAM_INVALID):  # max(dst) < R.B passes upstream; rule 1: [256,384) > T
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [2])


def test_push_blocks_remote_block_count(world: World) -> None:
    # local {4,16} (S=64), remote {2,64} (B=2): max(dst_blocks) < R.B is the remote check.
    d, p, dh, ph = linked(world, pspec=Spec(shape=(2, 64)))
    push_blocks_checked(world, d, dh, ph, [3, 2], [1, 0])
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [2])


# -- order of the checks (§3.12, §3.13) ------------------------------------------------------------

PushArgs = tuple[Cache, CacheIndex, int, int, KvCacheExtParam | None]
PushCase = Callable[[CacheHandle, CacheHandle], PushArgs]


def _host(h: CacheHandle) -> Cache:
    return h.cache(placement=CachePlacement.HOST)


def _unknown(h: CacheHandle) -> Cache:
    return Cache(cache_id=99, cache_desc=h.desc)


PUSH_ORDER: dict[str, tuple[PushCase, Err]] = {
    "placement(2)<local": (lambda dh, ph: (Cache(99, (), _host(dh).cache_desc), ph.index(), 0, -1,
                                           None), PARAM_INVALID),
    "size(3)<local": (lambda dh, ph: (_unknown(dh), ph.index(), 0, 64, None), PARAM_INVALID),
    "ext(4)<local": (lambda dh, ph: (_unknown(dh), ph.index(), 0, -1, ext((0, 1), (0, 2))),
                     PARAM_INVALID),
    "num_tensors(5)<local": (lambda dh, ph: (Cache(99), ph.index(), 0, -1, None), PARAM_INVALID),
    "local(7a)<link(7b)": (lambda dh, ph: (_unknown(dh), ph.index(cluster_id=UNLINKED), 0, -1, None),
                           KV_CACHE_NOT_EXIST),
    "link(7b)<dst batch(7e)": (lambda dh, ph: (dh.cache(), CacheIndex(UNLINKED, 1, 4), 0, -1, None),
                               NOT_YET_LINK),
    "link(7b)<src batch(7h)": (lambda dh, ph: (dh.cache(), CacheIndex(UNLINKED, 1), 4, -1, None),
                               NOT_YET_LINK),
    "link(7b)<dst layer(7d)": (lambda dh, ph: (dh.cache(), CacheIndex(UNLINKED, 1), 0, -1,
                                               ext((0, 0), (7, 7))), NOT_YET_LINK),
    "remote(7c)<dst batch(7e)": (lambda dh, ph: (dh.cache(), ph.index(4, cache_id=99), 0, -1, None),
                                 KV_CACHE_NOT_EXIST),
    "remote(7c)<src layer(7f)": (lambda dh, ph: (dh.cache(), ph.index(cache_id=99), 0, -1,
                                                 ext((7, 7), (0, 0))), KV_CACHE_NOT_EXIST),
}


@pytest.mark.parametrize("case", sorted(PUSH_ORDER))
def test_push_cache_check_order(world: World, transfer: str, case: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    make, err = PUSH_ORDER[case]
    src, dst, sb, size, e = make(dh, ph)
    with world.rejects(err):
        d.push_kv_cache(src, dst, sb, size, e)


BlocksArgs = tuple[Cache, CacheIndex, Sequence[int], Sequence[int], KvCacheExtParam | None]
BlocksCase = Callable[[CacheHandle, CacheHandle], BlocksArgs]

BLOCKS_ORDER: dict[str, tuple[BlocksCase, Err]] = {
    "placement(2)<local": (lambda dh, ph: (Cache(99, (), _host(dh).cache_desc), ph.index(), [0], [0],
                                           None), PARAM_INVALID),
    "empty(3)<local": (lambda dh, ph: (_unknown(dh), ph.index(), [], [], None), PARAM_INVALID),
    "lens(4)<local": (lambda dh, ph: (_unknown(dh), ph.index(), [0], [0, 1], None), PARAM_INVALID),
    "dst batch(5)<link": (lambda dh, ph: (dh.cache(), CacheIndex(UNLINKED, 1, 1), [0], [0], None),
                          PARAM_INVALID),
    "ext(6)<local": (lambda dh, ph: (_unknown(dh), ph.index(), [0], [0], ext(t=0)), PARAM_INVALID),
    "num_tensors(7)<local": (lambda dh, ph: (Cache(99), ph.index(), [0], [0], None), PARAM_INVALID),
    "local<link": (lambda dh, ph: (_unknown(dh), ph.index(cluster_id=UNLINKED), [0], [0], None),
                   KV_CACHE_NOT_EXIST),
    "link<dst block": (lambda dh, ph: (dh.cache(), CacheIndex(UNLINKED, 1), [0], [4], None),
                       NOT_YET_LINK),
    "link<src block": (lambda dh, ph: (dh.cache(), CacheIndex(UNLINKED, 1), [4], [0], None),
                       NOT_YET_LINK),
    "remote<dst block": (lambda dh, ph: (dh.cache(), ph.index(cache_id=99), [0], [4], None),
                         KV_CACHE_NOT_EXIST),
}


@pytest.mark.parametrize("case", sorted(BLOCKS_ORDER))
def test_push_blocks_check_order(world: World, transfer: str, case: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    make, err = BLOCKS_ORDER[case]
    src, dst, sb, db, e = make(dh, ph)
    with world.rejects(err):
        d.push_kv_blocks(src, dst, sb, db, e)
