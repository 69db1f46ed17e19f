"""Local copies and pool calls in the engine of CANN's Python package (docs/spec/PYPKG.md §4.11,
§4.3)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np

import pytest

from engine_support import (FEATURE_NOT_ENABLED, NO, NOT_EXIST, NOT_YET_LINK, PARAM_INVALID, S_OK,
                            Mem, blocks_key, cache_key, engine, expect_blocks, id_key, link, pull,
                            pull_param, register, status_of)
from kvdd.sim.pypkg import copies, pools
from kvdd.sim.pypkg.lifecycle import Engine


@pytest.fixture
def one() -> Iterator[Engine]:
    e = engine(1)
    yield e
    e.instance.finalize()


def test_copy_cache(one: Engine) -> None:
    src = Mem(2, 4, 16, seed=1)
    dst = Mem(2, 3, 32)
    sid, did = register(one, src, blocks=False), register(one, dst, blocks=False)
    before = dst.copy()
    assert status_of(copies.copy_cache, one, (sid, did, 2, 1, 4, 8, NO)) == S_OK
    want = [b.copy() for b in before]
    for w, s in zip(want, src.tensors):
        w[36:44] = s[36:44]  # dst row 1 (stride 32) + 4 <- src row 2 (stride 16) + 4
    assert all((g == w).all() for g, w in zip(dst.tensors, want))
    # size -1: S_src - offset = 12 bytes
    before = dst.copy()
    assert status_of(copies.copy_cache, one, (sid, did, 0, 0, 4, -1, NO)) == S_OK
    want = [b.copy() for b in before]
    for w, s in zip(want, src.tensors):
        w[4:16] = s[4:16]
    assert all((g == w).all() for g, w in zip(dst.tensors, want))


@pytest.mark.parametrize("param, status", [
    ((9, 2, 0, 0, 0, -1, NO), NOT_EXIST),
    ((1, 9, 0, 0, 0, -1, NO), NOT_EXIST),
    ((1, 3, 0, 0, 0, -1, NO), PARAM_INVALID),  # tensor counts differ
    ((1, 2, 4, 0, 0, -1, NO), PARAM_INVALID),  # src batch
    ((1, 2, 0, 3, 0, -1, NO), PARAM_INVALID),  # dst batch
    ((1, 2, 0, 0, 16, -1, NO), PARAM_INVALID),  # offset >= src stride
    ((1, 2, 0, 0, 0, 17, NO), PARAM_INVALID),  # size > src stride
])
def test_copy_cache_checks(one: Engine, param: tuple[int, ...], status: int) -> None:
    register(one, Mem(2, 4, 16, seed=1), blocks=False)
    dst = Mem(2, 3, 32)
    register(one, dst, blocks=False)
    register(one, Mem(3, 3, 32), blocks=False)
    assert status_of(copies.copy_cache, one, param) == status
    assert all((t == 0).all() for t in dst.tensors)


def test_copy_cache_size_must_fit_the_destination(one: Engine) -> None:
    src = Mem(1, 2, 32, seed=1)
    dst = Mem(1, 4, 16)
    sid, did = register(one, src, blocks=False), register(one, dst, blocks=False)
    assert status_of(copies.copy_cache, one, (sid, did, 0, 0, 0, -1, NO)) == PARAM_INVALID
    assert status_of(copies.copy_cache, one, (sid, did, 0, 0, 0, 16, NO)) == S_OK


def test_copy_blocks(one: Engine) -> None:
    mem = Mem(2, 6, 16, seed=2)
    cid = register(one, mem)
    before = mem.copy()
    assert status_of(copies.copy_blocks, one, cid, [(0, 3), (0, 4), (5, 1)]) == S_OK
    expect_blocks(mem.tensors, before, before, [(0, 3), (0, 4), (5, 1)], 16)
    assert status_of(copies.copy_blocks, one, cid, [(0, 1), (6, 2)]) == PARAM_INVALID
    assert status_of(copies.copy_blocks, one, cid, [(0, 6)]) == PARAM_INVALID
    expect_blocks(mem.tensors, before, before, [(0, 3), (0, 4), (5, 1)], 16)
    assert status_of(copies.copy_blocks, one, 42, [(0, 1)]) == NOT_EXIST


def test_swap_blocks_address_only(one: Engine) -> None:
    host = Mem(2, 4, 16, seed=3)
    dev = Mem(2, 8, 16)
    before = dev.copy()
    assert status_of(copies.swap_blocks, one, (-1, [host.addrs]), (-1, [dev.addrs]), 16, 0,
                     [(0, 5), (1, 6), (3, 0)]) == S_OK
    expect_blocks(dev.tensors, before, host.tensors, [(0, 5), (1, 6), (3, 0)], 16)


def test_swap_blocks_checks(one: Engine) -> None:
    host = Mem(2, 4, 16, seed=3)
    dev = Mem(2, 8, 16)
    did = register(one, dev)
    before = dev.copy()
    assert status_of(copies.swap_blocks, one, (-1, [host.addrs]), (did, [dev.addrs]), 16, 0,
                     [(0, 1)]) == PARAM_INVALID  # registered and address-only mixed
    hid = register(one, host)
    assert status_of(copies.swap_blocks, one, (hid, [host.addrs]), (did, [dev.addrs]), 16, 0,
                     [(0, 8)]) == PARAM_INVALID  # dst index >= N
    assert status_of(copies.swap_blocks, one, (hid, [host.addrs]), (did, [dev.addrs[:1]]), 16, 0,
                     [(0, 1)]) == PARAM_INVALID  # address counts
    assert status_of(copies.swap_blocks, one, (hid, [host.addrs]), (did, [dev.addrs]), 0, 0,
                     [(0, 1)]) == PARAM_INVALID  # block size
    assert status_of(copies.swap_blocks, one, (hid, [host.addrs]), (did, [dev.addrs]), 32, 0,
                     [(0, 7)]) == PARAM_INVALID  # past the registered tensor (kvdd)
    assert status_of(copies.swap_blocks, one, (-1, [[4096, 8192]]), (-1, [dev.addrs]), 16, 0,
                     [(0, 1)]) == PARAM_INVALID  # unmapped memory (kvdd)
    assert status_of(copies.swap_blocks, one, (99, [host.addrs]), (did, [dev.addrs]), 16, 0,
                     [(0, 1)]) == NOT_EXIST
    expect_blocks(dev.tensors, before, before, [], 16)
    assert status_of(copies.swap_blocks, one, (hid, [host.addrs]), (did, [dev.addrs]), 16, 0,
                     [(3, 7)]) == S_OK
    expect_blocks(dev.tensors, before, host.tensors, [(3, 7)], 16)


def test_remap(one: Engine) -> None:
    assert status_of(copies.remap_registered_memory, one, []) == PARAM_INVALID
    assert status_of(copies.remap_registered_memory, one, [(0, 4096, 64)]) == NOT_YET_LINK
    other = engine(2)
    try:
        link(one, other)
        assert status_of(copies.remap_registered_memory, one, [(0, 4096, 64)]) == S_OK
    finally:
        other.instance.finalize()


def test_no_pool(one: Engine) -> None:
    assert status_of(pools.deallocate, one, 1) == FEATURE_NOT_ENABLED
    assert status_of(pools.remove_cache_key, one, cache_key(0, 1)) == FEATURE_NOT_ENABLED
    assert status_of(copies.check_capacity, one, 1) == FEATURE_NOT_ENABLED
    assert status_of(pools.allocate, one, (1, 4, -1, [4], 1, False), []) == FEATURE_NOT_ENABLED


def desc(n: int, rows: int, row_bytes: int, blocks: bool = False,
         placement: int = 1) -> tuple[int, int, int, list[int], int, bool]:
    return (n, 4, -1, [rows, row_bytes], placement, blocks)


def test_pool_allocation_keys_and_references(one: Engine) -> None:
    """§4.3: ids consumed by failed allocations, CheckCacheKeys, OUT_OF_MEMORY, an owned cache
    freed with its last reference (id and keys), registered caches untouched."""
    one.mem_pool_config = '{"memory_size": 65536, "page_shift": 12}'
    k0, k1 = cache_key(0, 100), cache_key(0, 101)
    cid, addrs = pools.allocate(one, desc(2, 4, 1024), [k0, k1])
    assert cid == 1 and len(addrs) == 2 and all(a % 4096 == 0 for a in addrs)
    entry = one.instance.caches[cid]
    assert (entry.B, entry.S, entry.remote_accessible) == (4, 1024, True)
    assert one.instance.cache_table.req_keys == {(100, 0): (1, 0), (101, 0): (1, 1)}
    for bad_keys in ([k0], [cache_key(0, NO, 3), cache_key(0, NO, 3)], [cache_key(0, 5 + i) for i in range(5)]):
        assert status_of(pools.allocate, one, desc(1, 4, 1024), bad_keys) == PARAM_INVALID
    assert status_of(pools.allocate, one, desc(1, 4, 1024, placement=0), []) == PARAM_INVALID  # no host pool
    assert status_of(pools.allocate, one, desc(16, 4, 1024), []) == 0x5010B01C  # 16 x 4 KiB > 56 KiB
    cid2, addrs2 = pools.allocate(one, desc(14, 1, 4096, blocks=True), [blocks_key(0, 3)])
    assert cid2 == 6  # ids 2-5 consumed by the key and memory failures (placement: before the id)
    pools.deallocate(one, cid)
    assert cid in one.instance.caches  # two keys still hold it
    pools.remove_cache_key(one, k0)
    pools.remove_cache_key(one, k0)  # unknown now: success
    assert cid in one.instance.caches
    pools.remove_cache_key(one, k1)
    assert cid not in one.instance.caches and one.instance.cache_table.req_keys == {(NO, 3): (6, 0)}
    # its pages are free again: the same two tensors fit where they were
    assert pools.allocate(one, desc(2, 4, 1024), [])[1] == addrs
    reg = register(one, Mem(1, 4, 16))
    pools.deallocate(one, reg)
    assert reg in one.instance.caches
    pools.deallocate(one, cid2)  # its BlocksCacheKey still holds it
    pools.remove_cache_key(one, blocks_key(0, 3))
    assert cid2 not in one.instance.caches


def test_pulled_from_an_allocated_cache(one: Engine) -> None:
    """An allocated cache is remote-accessible: a peer pulls its rows by id."""
    one.mem_pool_config = '{"memory_size": 65536}'
    cid, addrs = pools.allocate(one, desc(1, 4, 64), [])
    src = np.ctypeslib.as_array((ctypes.c_uint8 * 256).from_address(addrs[0]))
    src[:] = np.arange(256, dtype=np.uint8)
    d = engine(2)
    try:
        dst = Mem(1, 2, 64)
        did = register(d, dst, blocks=False)
        link(d, one)
        assert pull(d, did, id_key(1, cid, batch=3), pull_param(batch=1)) == S_OK
        want = np.zeros(128, np.uint8)
        want[64:128] = np.arange(192, 256, dtype=np.uint8)
        assert (dst.tensors[0] == want).all()
    finally:
        d.instance.finalize()
