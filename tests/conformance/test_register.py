"""RegisterKvCache / UnregisterKvCache / the stubbed calls: SEMANTICS.md §2.1-§2.2, §3.7-§3.9,
§6 scenarios 17-26, §7.22-§7.24, kvdd rules §10.4, §10.10, §10.12."""

from __future__ import annotations

import pytest

import kvdd
from kvdd import CacheDesc, CachePlacement, DataType, Status

from . import reference as ref
from .checked import (
    pull_cache_checked,
)
from .harness import (
    FAILED,
    FEATURE_NOT_ENABLED,
    KV_CACHE_NOT_EXIST,
    PARAM_INVALID,
    World,
    link,
    pair,
    raises,
)

I32 = DataType.DT_INT32


def _desc(n: int = 10, dtype: int = I32, shape: tuple[int, ...] = (4, 16),
          placement: int = CachePlacement.DEVICE) -> CacheDesc:
    return CacheDesc(num_tensors=n, data_type=dtype, shape=shape, placement=placement)


def test_s17_first_id_is_1_and_ids_increase(world: World) -> None:
    d = world.dut()
    d.initialize()
    assert [d.register().cache_id for _ in range(3)] == [1, 2, 3]


@pytest.mark.parametrize("placement", [CachePlacement.HOST, CachePlacement.DEVICE, 7])
def test_register_any_placement(world: World, placement: int) -> None:
    # §3.7: host and device placements are both accepted (any uint32 reaches step 9 as HOST).
    d = world.dut()
    d.initialize()
    assert d.register(placement=placement).cache_id == 1


@pytest.mark.parametrize("n", [0, 10])
def test_s18_empty_addrs(world: World, n: int) -> None:
    d = world.dut()
    d.initialize()
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(n), [])
    assert d.register().cache_id == 1  # no id consumed (step 2 precedes step 7)


@pytest.mark.parametrize("n_addrs", [1, 9, 11])
def test_s19_addr_count_mismatch(world: World, n_addrs: int) -> None:
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, n_addrs)
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(10), addrs)
    assert d.register().cache_id == 1


@pytest.mark.parametrize("zero_at", [0, 5, 9])
def test_s20_zero_address(world: World, zero_at: int) -> None:
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, 10)
    addrs[zero_at] = 0
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(10), addrs)
    assert d.register().cache_id == 1


@pytest.mark.parametrize("shape", [(), (1,) * 32, (1,) * 40])
def test_s21_shape_rank_rejected_without_consuming_an_id(world: World,
                                                         shape: tuple[int, ...]) -> None:
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, 1)
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(1, shape=shape), addrs)
    assert d.register().cache_id == 1  # step 6 precedes the id allocation (step 7)


def test_s21_31_dims_ok(world: World) -> None:
    d = world.dut()
    d.initialize()
    h = d.register(num_tensors=2, shape=(1,) * 30 + (4,))
    assert h.cache_id == 1 and h.nbytes == 16


@pytest.mark.parametrize("shape", [(4, 0), (-1, 16), (0,), (4, 16, -3), (2**62, 2**62)])
def test_s22_bad_dim_consumes_an_id(world: World, shape: tuple[int, ...]) -> None:
    d = world.dut()
    d.initialize()
    assert d.register().cache_id == 1
    _, addrs = d.alloc(256, 1)
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(1, shape=shape), addrs)
    assert d.register().cache_id == 3  # id 2 was consumed by the failed registration (§2.2)


@pytest.mark.parametrize("dtype", [DataType.DT_UNDEFINED, 5, 43, 1000, -1])
def test_s23_invalid_dtype_consumes_an_id(world: World, dtype: int) -> None:
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, 1)
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(1, dtype=dtype), addrs)
    assert d.register().cache_id == 2


def test_s23_struct_default_dtype_is_undefined(world: World) -> None:
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, 1)
    with world.rejects(PARAM_INVALID):
        d.register_addrs(CacheDesc(num_tensors=1, shape=(4, 16)), addrs)


def test_s24_same_addresses_twice(world: World) -> None:
    d = world.dut()
    d.initialize()
    h1 = d.register()
    h2 = d.register_again(h1)
    assert (h1.cache_id, h2.cache_id) == (1, 2)


def test_no_address_count_limit(world: World) -> None:
    # §3.7 / §7.25: the docs' "<= 240 addresses" is not enforced.
    d = world.dut()
    d.initialize()
    assert d.register(num_tensors=241, shape=(2, 2)).cache_id == 1


@pytest.mark.parametrize("cache_id", [0, -1, 99, 2**63 - 1])
def test_s25_unregister_unknown_succeeds(world: World, cache_id: int) -> None:
    d = world.dut()
    d.initialize()
    h = d.register()
    with world.unchanged():
        d.unregister(cache_id)
    assert d.register().cache_id == h.cache_id + 1


def test_s25_unregister_twice_and_ids_never_reused(world: World) -> None:
    d = world.dut()
    d.initialize()
    h = d.register()
    d.unregister(h.cache_id)
    d.unregister(h.cache_id)
    assert d.register().cache_id == 2


def test_unregistered_local_cache_not_found(world: World) -> None:
    d, p = pair(world)
    ph = p.register()
    dh = d.register()
    link(d, p)
    d.unregister(dh.cache_id)
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())


def test_unregister_while_linked_is_allowed(world: World, transfer: str) -> None:
    # §3.8 / §4: no LLM_EXIST_LINK for unregistration.
    d, p = pair(world, transfer)
    p.register()
    dh = d.register()
    link(d, p)
    d.unregister(dh.cache_id)


@pytest.mark.parametrize("initialized", [False, True])
def test_s26_stubbed_calls_feature_not_enabled(world: World, initialized: bool) -> None:
    d = world.dut()
    if initialized:
        d.initialize()
    h = d.register() if initialized else None
    cache = h.cache() if h is not None else kvdd.Cache(cache_id=1)
    dd = d.dd
    with world.rejects(FEATURE_NOT_ENABLED):
        dd.allocate_cache(_desc())
    with world.rejects(FEATURE_NOT_ENABLED):
        dd.deallocate_cache(0)
    with world.rejects(FEATURE_NOT_ENABLED):
        dd.deallocate_cache(1)
    with world.rejects(FEATURE_NOT_ENABLED):
        dd.copy_kv_cache(cache, cache)
    with world.rejects(FEATURE_NOT_ENABLED):
        dd.copy_kv_cache(cache, cache, 0, 1, 0, 64)
    with world.rejects(FEATURE_NOT_ENABLED):
        dd.copy_kv_blocks(cache, cache, [0], [[1]])


# -- order of the registration checks (§3.7) -------------------------------------------------------


def test_register_order_uninitialized_first(world: World) -> None:
    d = world.dut()
    with world.rejects(FAILED):
        d.register_addrs(_desc(10), [])


def test_register_order_addr_checks_before_id(world: World) -> None:
    # addr 0 (step 4) together with a bad dim (step 8): PARAM_INVALID and no id consumed.
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, 2)
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(2, shape=(4, 0)), [addrs[0], 0])
    assert d.register().cache_id == 1


# -- kvdd rule 4: memory that is not readable and writable (§10.4) ---------------------------------


@pytest.mark.parametrize("bad", [8, 0x10, 4096, 2**63, 2**64 - 64, 2**64 - 1])
def test_rule4_unmapped_address_is_llm_failed_and_consumes_an_id(world: World, bad: int) -> None:
    d = world.dut()
    d.initialize()
    with world.rejects(FAILED):
        d.register_addrs(_desc(1), [bad])
    assert d.register().cache_id == 2


def test_rule4_one_bad_address_among_good_ones(world: World) -> None:
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, 3)
    with world.rejects(FAILED):
        d.register_addrs(_desc(3), [addrs[0], 0x10, addrs[2]])
    assert d.register().cache_id == 2


def test_rule4_order_shape_checks_before_memory_check(world: World) -> None:
    # Bad memory (step 9, FAILED) never hides an earlier PARAM_INVALID: shape rank (step 6, no id),
    # a bad dim or dtype (step 8, id consumed).
    d = world.dut()
    d.initialize()
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(1, shape=()), [8])
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(1, shape=(4, 0)), [8])  # id 1 consumed
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(1, dtype=DataType.DT_UNDEFINED), [8])  # id 2 consumed
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(2), [8])  # count mismatch: no id
    assert d.register().cache_id == 3


def test_rule4_instance_still_usable(world: World) -> None:
    d, p = pair(world)
    ph = p.register()
    with raises(FAILED):
        d.register_addrs(_desc(10), [8] * 10)
    dh = d.register()
    link(d, p)
    pull_cache_checked(world, d, ph, dh)


# -- §3.7 step 10 / §7.23: the cache table limit ------------------------------------------------------


def test_cache_table_limit_boundary(world: World) -> None:
    # One cache of n tensors publishes 24 + 64 + 8n bytes; exactly 1 MiB is accepted.
    n_ok = (ref.CACHE_TABLE_LIMIT - ref.cache_table_bytes([0])) // 8
    assert ref.cache_table_bytes([n_ok]) == ref.CACHE_TABLE_LIMIT
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, 1)
    cache_id = d.register_addrs(_desc(n_ok), addrs * n_ok)  # identical (addr, T): registered once
    assert cache_id == 1


def test_cache_table_overflow_keeps_the_entry(world: World) -> None:
    n_big = (ref.CACHE_TABLE_LIMIT - ref.cache_table_bytes([0])) // 8 + 1
    assert ref.cache_table_bytes([n_big]) > ref.CACHE_TABLE_LIMIT
    d = world.dut()
    d.initialize()
    _, addrs = d.alloc(256, 1)
    with world.rejects(PARAM_INVALID):
        d.register_addrs(_desc(n_big), addrs * n_big)
    # §7.23: the entry (id 1) stays inserted, so the table is still too large for any other cache...
    with world.rejects(PARAM_INVALID):
        d.register()
    # ...until it is unregistered (id 2 failed the same way and also stays inserted: remove both).
    d.unregister(1)
    d.unregister(2)
    assert d.register().cache_id == 3


# -- kvdd rule 10: ragged sub-byte caches register (§10.10) -----------------------------------------


@pytest.mark.parametrize("shape,t,s", [((2, 5), 5, 2), ((16, 1), 8, 0), ((3, 7), 11, 3)])
def test_rule10_ragged_sub_byte_registers(world: World, shape: tuple[int, int], t: int,
                                          s: int) -> None:
    g = ref.geom(2, DataType.DT_INT4, shape)
    assert (g.T, g.S, g.ragged) == (t, s, True)
    d = world.dut()
    d.initialize()
    assert d.register(num_tensors=2, dtype=DataType.DT_INT4, shape=shape).cache_id == 1


@pytest.mark.parametrize("dtype,shape,nbytes", [
    (DataType.DT_INT4, (1,), 1), (DataType.DT_INT4, (3,), 2), (DataType.DT_UINT1, (4, 4), 2),
    (DataType.DT_INT2, (4, 5), 5), (DataType.DT_FLOAT6_E3M2, (4, 4), 12), (DataType.DT_BF16, (4, 8), 64),
    (DataType.DT_INT64, (2, 3), 48),
])
def test_tensor_sizes(world: World, dtype: int, shape: tuple[int, ...], nbytes: int) -> None:
    # §2.1/§5 sizes: registering exactly nbytes of memory per tensor works.
    assert ref.tensor_nbytes(dtype, shape) == nbytes
    d = world.dut()
    d.initialize()
    assert d.register(num_tensors=1, dtype=dtype, shape=shape).cache_id == 1


def test_statuses_are_the_documented_numbers() -> None:
    # §1: a wrong number would make every status assertion above vacuous.
    assert int(Status.LLM_PARAM_INVALID) == 0x5010B005
    assert int(Status.LLM_FAILED) == 0xFFFFFFFF
    assert int(Status.LLM_KV_CACHE_NOT_EXIST) == 0x5010B002
    assert int(Status.LLM_NOT_YET_LINK) == 0x5010B007
    assert int(Status.LLM_ALREADY_LINK) == 0x5010B008
    assert int(Status.LLM_LINK_FAILED) == 0x5010B009
    assert int(Status.LLM_UNLINK_FAILED) == 0x5010B00A
    assert int(Status.LLM_EXIST_LINK) == 0x5010B018
    assert int(Status.LLM_FEATURE_NOT_ENABLED) == 0x5010B019
    assert int(Status.LLM_TIMEOUT) == 0x5010B01A
