"""Which caches a peer can use: SEMANTICS.md §2.4 and kvdd rules §10.2 (gone owners), §10.3
(visibility), §10.10 (ragged sub-byte caches), §10.11 (overlapping memory), §10.12 (shared
regions), §7.2, §7.24."""

from __future__ import annotations

import pytest

from kvdd import Cache, CacheDesc, DataType, Status

from .checked import (
    pull_blocks_checked,
    pull_cache_checked,
    push_blocks_checked,
    push_cache_checked,
)
from .harness import (
    KV_CACHE_NOT_EXIST,
    PARAM_INVALID,
    Spec,
    World,
    ext,
    link,
    linked,
    pair,
    unlink,
)


def test_cache_registered_after_link_invisible_until_relink(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    pull_cache_checked(world, d, ph, dh)  # the first transfer (upstream's snapshot point)
    late = p.register()
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(late.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_blocks(late.index(), dh.cache(), [0], [0])
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_cache(dh.cache(), late.index())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_blocks(dh.cache(), late.index(), [0], [0])
    assert unlink(d, p) == [Status.LLM_SUCCESS]
    assert link(d, p) == [Status.LLM_SUCCESS]
    pull_cache_checked(world, d, late, dh, src_batch=1)
    push_cache_checked(world, d, dh, late, dst_batch=2)


def test_registered_after_link_before_first_transfer_is_invisible(world: World,
                                                                  transfer: str) -> None:
    # kvdd rule 3 (§10.3): the link, not the first transfer, is the cut-off.
    d, p, dh, ph = linked(world, transfer)
    late = p.register()
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(late.index(), dh.cache())
    pull_cache_checked(world, d, ph, dh)


def test_late_cache_on_the_initiator_invisible_to_acceptor(world: World) -> None:
    # Comm links are bidirectional; the same rule holds in the other direction.
    d, p, dh, ph = linked(world, "comm")
    late = d.register()
    with world.rejects(KV_CACHE_NOT_EXIST):
        p.pull_kv_cache(late.index(), ph.cache())
    pull_cache_checked(world, p, dh, ph)


def test_local_cache_registered_after_link_is_usable_locally(world: World, transfer: str) -> None:
    # The rule is about remote use: the caller's own cache may be registered at any time.
    d, p, dh, ph = linked(world, transfer)
    late = d.register()
    pull_cache_checked(world, d, ph, late)
    pull_blocks_checked(world, d, ph, late, [1], [2])
    push_cache_checked(world, d, late, ph, dst_batch=3)
    push_blocks_checked(world, d, late, ph, [0], [1])


@pytest.mark.parametrize("after_first_transfer", [False, True])
def test_rule2_unregistered_remote_cache_not_found(world: World, transfer: str,
                                                   after_first_transfer: bool) -> None:
    # kvdd rule 2: a stale entry is never used (upstream would touch deregistered memory).
    d, p, dh, ph = linked(world, transfer)
    if after_first_transfer:
        pull_cache_checked(world, d, ph, dh)
    p.unregister(ph.cache_id)
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0], [0])
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_cache(dh.cache(), ph.index())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [0])


def test_rule2_finalized_remote_owner(world: World, transfer: str) -> None:
    d, p, dh, ph = linked(world, transfer)
    p.finalize()
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_cache(dh.cache(), ph.index())


def test_rule12_shared_region_survives_unregistering_the_twin(world: World,
                                                              transfer: str) -> None:
    # §7.24: upstream de-registers the shared (addr, T) region; kvdd keeps the other cache working.
    d, p = pair(world, transfer)
    first = p.register()
    second = p.register_again(first)
    dh = d.register()
    dtwin = d.register_again(dh)
    link(d, p)
    p.unregister(first.cache_id)
    d.unregister(dh.cache_id)
    pull_cache_checked(world, d, second, dtwin, src_batch=2)
    push_cache_checked(world, d, dtwin, second, dst_batch=1)


# -- kvdd rule 10: ragged sub-byte caches -----------------------------------------------------------

RAGGED = [Spec(n=2, dtype=DataType.DT_INT4, shape=(2, 5)),  # T=5, S=2
          Spec(n=2, dtype=DataType.DT_INT4, shape=(16, 1))]  # T=8, S=0


@pytest.mark.parametrize("spec", RAGGED, ids=["T%S", "S=0"])
@pytest.mark.parametrize("side", ["local", "remote"])
def test_rule10_ragged_transfers_rejected(world: World, spec: Spec, side: str) -> None:
    ok = Spec(n=2, dtype=DataType.DT_INT8, shape=(2, 2))
    d, p, dh, ph = linked(world, dspec=spec if side == "local" else ok,
                          pspec=spec if side == "remote" else ok)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), 0, 1)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0], [0])
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index())
    with world.rejects(PARAM_INVALID):
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [0])


def test_sub_byte_cache_that_is_not_ragged_transfers(world: World, transfer: str) -> None:
    spec = Spec(n=4, dtype=DataType.DT_INT4, shape=(4, 16))  # T=32, S=8
    d, p, dh, ph = linked(world, transfer, dspec=spec, pspec=spec)
    pull_cache_checked(world, d, ph, dh, src_batch=3, batch_index=1)
    pull_blocks_checked(world, d, ph, dh, [0, 1, 3], [1, 2, 0])
    push_cache_checked(world, d, dh, ph, src_batch_index=2, dst_batch=0, ext_param=ext((1, 1), (0, 0)))
    push_blocks_checked(world, d, dh, ph, [2], [3])


# -- kvdd rule 11: overlapping memory behaves as memmove ----------------------------------------------


@pytest.mark.kvdd_sim_only(reason="two instances in one process registering the same memory")
def test_rule11_overlapping_source_and_destination(world: World, inproc_peers: None) -> None:
    d, p = pair(world)
    ph = p.register(num_tensors=1)
    # D registers memory that starts 32 bytes into P's tensor: D's row 0 = P's bytes [32, 96).
    addr = p.tensor_addr(ph, 0) + 32
    d_id = d.register_addrs(CacheDesc(num_tensors=1, data_type=DataType.DT_INT32, shape=(4, 16)),
                            [addr])
    link(d, p)
    before = world.snapshot()
    d.pull_kv_cache(ph.index(), Cache(cache_id=d_id))
    expected = before.copy()
    src = before.tensors(ph)[0]
    dst = expected.tensors(ph)[0]
    dst[32:96] = src[0:64]  # as memmove: the source is read as it was before the copy
    world.assert_memory(expected)
