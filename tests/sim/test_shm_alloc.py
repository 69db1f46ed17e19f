"""kvdd.empty (kvdd/shm.py): shareable cache memory and its registry."""

from __future__ import annotations

import fcntl
import gc
import os

import ml_dtypes
import numpy as np
import pytest

import kvdd
from kvdd import (OPTION_DEVICE_ID, OPTION_LISTEN_IP_INFO, Cache, CacheDesc, CacheIndex,
                  ClusterInfo, DataType, IpInfo, KvCacheExtParam, LlmDataDist, LlmRole,
                  tensor_addrs)
from kvdd import shm
from kvdd.sim.fabric import samehost
from shared_support import in_a_forked_child, owner_pattern, shm_owner


@pytest.mark.parametrize("shape, dtype", [((3, 5), np.float32), (7, np.uint8), ((2, 3, 4), np.int64),
                                          ((4, 4), ml_dtypes.bfloat16), ((0,), np.float16),
                                          ((), np.float64)])
def test_shape_dtype_alignment_and_the_registry(shape: tuple[int, ...], dtype: type) -> None:
    gc.collect()  # allocations earlier tests left to the collector go first, not during the count
    before = shm.live_allocations()
    a = kvdd.empty(shape, dtype)
    want: np.ndarray = np.empty(shape, dtype)
    assert a.shape == want.shape and a.dtype == want.dtype
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % shm.PAGE == 0
    assert not a.any()  # tmpfs pages start as zeros
    found = shm.lookup(a.ctypes.data, a.nbytes)
    assert found is not None
    alloc, off = found
    assert off == 0 and alloc.size == max(shm.PAGE, -(-a.nbytes // shm.PAGE) * shm.PAGE)
    assert os.fstat(alloc.fd).st_size == alloc.size and os.fstat(alloc.fd).st_ino == alloc.ino
    seals = fcntl.fcntl(alloc.fd, fcntl.F_GET_SEALS)
    assert seals == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    assert shm.live_allocations() == before + 1
    fd, ino = alloc.fd, alloc.ino
    del a, found, alloc
    gc.collect()
    assert shm.live_allocations() == before  # freed with the array
    try:
        assert os.fstat(fd).st_ino != ino  # its fd closed (the number may be reused since)
    except OSError:
        pass


def test_a_view_keeps_the_allocation_and_lookup_bounds() -> None:
    a = kvdd.empty(3 * shm.PAGE, np.uint8)
    base = int(a.ctypes.data)
    v = a[shm.PAGE:]
    del a
    gc.collect()
    found = shm.lookup(base + shm.PAGE + 10, 100)
    assert found is not None and found[1] == shm.PAGE + 10
    assert shm.lookup(base, 3 * shm.PAGE) is not None
    assert shm.lookup(base, 3 * shm.PAGE + 1) is None  # one byte past its end
    below = shm.lookup(base - 1, 1)
    assert below is None or below[0].addr != base
    v[:] = 9
    del v
    gc.collect()
    assert shm.lookup(base, 1) is None


def test_an_address_reused_before_the_finalizer_ran() -> None:
    """The mapping is unmapped before its finalizer runs: a new allocation at that address
    replaces the entry, and the late finalizer leaves it alone."""
    addr = 0x7E0000000000  # (no live allocation there: only the registry is exercised)
    old = shm.Allocation(addr, shm.PAGE, os.open(os.devnull, os.O_RDONLY), 1)
    new = shm.Allocation(addr, 2 * shm.PAGE, os.open(os.devnull, os.O_RDONLY), 2)
    shm._register(old)
    shm._register(new)
    shm._forget(old)
    found = shm.lookup(addr + shm.PAGE, 10)
    assert found is not None and found[0] is new
    shm._forget(new)
    assert shm.lookup(addr + shm.PAGE, 10) is None and addr not in shm._starts


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        kvdd.empty((2, -1), np.uint8)
    with pytest.raises(ValueError):
        kvdd.empty(3, object)


def test_a_forked_child_shares_the_pages() -> None:
    a = kvdd.empty(16, np.uint8)
    in_a_forked_child(lambda: a.fill(42))
    assert (a == 42).all()


@pytest.mark.skipif(not samehost.availability()[0], reason=samehost.availability()[1])
def test_two_links_to_one_owner_map_the_same_bytes() -> None:
    n = 1 << 16
    readers = []
    with shm_owner(n) as (_p, port, cid):
        try:
            for k in (2, 3):
                dd = LlmDataDist(k, LlmRole.DECODER, backend="sim")
                readers.append(dd)
                dd.initialize({OPTION_DEVICE_ID: str(k), OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
                dd.link_llm_clusters([ClusterInfo(remote_cluster_id=1,
                                                  remote_ip_infos=(IpInfo("127.0.0.1", port),))])
                assert dd.backend.link_data_path(1) == "process_vm"  # type: ignore[attr-defined]
            one = KvCacheExtParam(tensor_num_per_layer=1)
            desc = CacheDesc(1, DataType.DT_UINT8, (1, n))
            bufs = [kvdd.empty(n, np.uint8) for _ in readers]
            ids = [dd.register_kv_cache(desc, tensor_addrs([b])) for dd, b in zip(readers, bufs)]
            idx = CacheIndex(1, cid, 0)
            readers[0].pull_kv_cache(idx, Cache(ids[0]), 0, -1, one)
            np.testing.assert_array_equal(bufs[0], owner_pattern(n))
            bufs[0][:] = 7  # pushed by the first link, pulled by the second
            readers[0].push_kv_cache(Cache(ids[0], (), desc), idx, 0, -1, one)
            readers[1].pull_kv_cache(idx, Cache(ids[1]), 0, -1, one)
            assert (bufs[1] == 7).all()
            for dd in readers:
                mover = dd.backend.entities[1].peer.one_sided()  # type: ignore[attr-defined]
                assert mover.maps is not None and mover.maps.uses >= 1
        finally:
            for dd in readers:
                dd.finalize()


def test_the_python_package_pools_are_shareable() -> None:
    """allocate_cache's pools (kvdd.sim.pypkg.pools) live in kvdd.empty memory: a tensor carved
    from one is announced to a same-host reader (one record: its pool's memfd and offset)."""
    from kvdd.sim.fabric.samehost_shm import records_of
    from kvdd.sim.pypkg.pools import Pool
    pool = Pool(1 << 20, 16)
    addr = pool.alloc(3 << 16)
    assert addr is not None
    found = shm.lookup(addr, 3 << 16)
    assert found is not None and found[0].addr <= pool.base

    class Entry:
        addrs, T = (addr,), 3 << 16

    rows = records_of([Entry()])  # type: ignore[list-item]
    assert rows.tolist() == [[0, 0, found[0].fd, found[1], found[0].ino]]
