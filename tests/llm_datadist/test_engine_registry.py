"""Registration in the engine of CANN's Python package: entry types, ids, keys, flags, the table
peers see (docs/spec/PYPKG.md §4.1, §4.2, §4.4; checklist §7.5 items 13, 14)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from engine_support import (FAILED, NO, NOT_EXIST, PARAM_INVALID, S_OK, UINT8, Mem, blocks_key,
                            cache_key, engine, expect_blocks, id_key, link, pull, pull_param,
                            register, status_of)
from kvdd.sim.checks import Rejected
from kvdd.sim.fabric import KIND_BLOCKS, KIND_CACHE
from kvdd.sim.pypkg import pulls, registry
from kvdd.sim.pypkg.lifecycle import Engine


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    p, d = engine(1), engine(2)
    yield p, d
    d.instance.finalize()
    p.instance.finalize()


def reg_status(e: Engine, desc: object, addrs: list[int], keys: list[object] = [],
               ra: bool = True) -> int:
    return status_of(registry.register, e, desc, addrs, keys, ra)


def test_ids_from_one_consumed_by_a_failed_size(pair: tuple[Engine, Engine]) -> None:
    """§7.5-13: the first id is 1; a non-positive dim fails after the id is consumed; a shape
    with 0 or 32 dims and a count mismatch fail before it."""
    p, _ = pair
    mem = Mem(2, 4, 16)
    assert reg_status(p, (2, UINT8, -1, [], 1, True), mem.addrs) == PARAM_INVALID
    assert reg_status(p, (2, UINT8, -1, [1] * 32, 1, True), mem.addrs) == PARAM_INVALID
    assert reg_status(p, (3, UINT8, -1, [4, 16], 1, True), mem.addrs) == PARAM_INVALID  # native count
    assert register(p, mem) == 1
    assert reg_status(p, (2, UINT8, -1, [4, 0], 1, True), mem.addrs) == PARAM_INVALID  # id 2 burnt
    assert reg_status(p, (2, 200, -1, [4, 16], 1, True), mem.addrs) == PARAM_INVALID  # id 3 burnt
    assert register(p, mem, blocks=False) == 4
    assert reg_status(p, (2, UINT8, -1, [1] * 31, 1, True), mem.addrs[:1] * 2) == 5  # 31 dims


def test_entry_types_from_the_first_dim(pair: tuple[Engine, Engine]) -> None:
    """§4.1 step 6: BLOCKS B=1, N=shape[0], S=T/N; CACHE B=shape[0], N=0, S=T/B."""
    p, _ = pair
    mem = Mem(2, 8, 32)
    b = p.instance.caches[register(p, mem, blocks=True)]
    c = p.instance.caches[register(p, mem, blocks=False)]
    assert (b.kind, b.B, b.N, b.S, b.T) == (KIND_BLOCKS, 1, 8, 32, 256)
    assert (c.kind, c.B, c.N, c.S, c.T) == (KIND_CACHE, 8, 0, 32, 256)


def test_calc_tensor_size() -> None:
    assert registry.calc_tensor_size([4, 16], UINT8) == 64
    assert registry.calc_tensor_size([2, 3], 27) == 12  # BF16
    assert registry.calc_tensor_size([2, 3], 13) == 96  # STRING: 16 bytes
    assert registry.calc_tensor_size([2, 0], UINT8) == -1
    assert registry.calc_tensor_size([2, 3], 28) == -1
    assert registry.calc_tensor_size([2**62, 4], 0) == -1  # int64 overflow


def test_null_and_foreign_memory_refused(pair: tuple[Engine, Engine]) -> None:
    """kvdd's rule for every cache (also one that is not remote-accessible, which upstream would
    register as given): a null address is PARAM_INVALID, unmapped memory FAILED."""
    p, _ = pair
    mem = Mem(2, 4, 16)
    assert reg_status(p, mem.desc(True), [mem.addrs[0], 0], ra=False) == PARAM_INVALID
    assert reg_status(p, mem.desc(True), [mem.addrs[0], 4096], ra=False) == FAILED
    assert p.instance.caches == {}


def test_blocks_keys_last_wins_and_unregister(pair: tuple[Engine, Engine]) -> None:
    """§7.5-14: two blocks caches with BlocksCacheKey(x, 0): a peer pulling that key reads the
    second; unregistering the first keeps the key on the second."""
    p, d = pair
    first, second = Mem(2, 4, 16, seed=1), Mem(2, 4, 16, seed=2)
    id1 = register(p, first, keys=[blocks_key(99, 0)])
    id2 = register(p, second, keys=[blocks_key(7, 0)])  # the key's cluster id is ignored
    registry.unregister(p, id1)
    assert p.instance.cache_table.req_keys == {(NO, 0): (id2, 0)}
    dst = Mem(2, 4, 16)
    did = register(d, dst)
    link(d, p)
    before = dst.copy()
    assert pull(d, did, blocks_key(1, 0), pull_param([0, 3], [1, 2])) == S_OK
    expect_blocks(dst.tensors, before, second.tensors, [(0, 1), (3, 2)], 16)


def test_blocks_key_of_an_unregistered_cache_is_gone(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    id1 = register(p, Mem(2, 4, 16, seed=1), keys=[blocks_key(1, 5)])
    registry.unregister(p, id1)
    registry.unregister(p, id1)  # repeated: success
    registry.unregister(p, -3)  # negative: success
    registry.unregister(p, 1234)  # unknown: success
    assert p.instance.cache_table.req_keys == {}
    did = register(d, Mem(2, 4, 16))
    link(d, p)
    assert pull(d, did, blocks_key(1, 5), pull_param([0], [0])) == NOT_EXIST


def test_cache_keys_first_wins_padding_and_prefix(pair: tuple[Engine, Engine]) -> None:
    """§4.1: non-blocks keys first-wins with their batch position; padding keys take a
    position but no identity; prefix keys go to the unpublished prefix map."""
    p, _ = pair
    a = register(p, Mem(1, 4, 8), blocks=False,
                 keys=[cache_key(0, NO, 3), cache_key(0, 11, 3), cache_key(0, NO, 0, prefix=5)])
    b = register(p, Mem(1, 4, 8), blocks=False, keys=[cache_key(0, 11, 3), cache_key(0, 12, 3)])
    table = p.instance.cache_table
    assert table.req_keys == {(11, 3): (a, 1), (12, 3): (b, 1)}
    assert table.prefix_keys == {(5, 0): (a, 2)}
    views = p.instance.snapshot_for_link()[0]
    assert views[a].keys == ((11, 3, 1),) and views[b].keys == ((12, 3, 1),)
    registry.unregister(p, a)
    assert table.req_keys == {(12, 3): (b, 1)} and table.prefix_keys == {}


def test_blocks_overwrite_moves_the_published_key(pair: tuple[Engine, Engine]) -> None:
    p, _ = pair
    a = register(p, Mem(1, 4, 8), keys=[blocks_key(0, 1)])
    assert p.instance.snapshot_for_link()[0][a].keys == ((NO, 1, 0),)  # (a link before b)
    b = register(p, Mem(1, 4, 8), keys=[blocks_key(0, 1), blocks_key(0, 2)])
    views = p.instance.snapshot_for_link()[0]
    assert views[a].keys == () and views[b].keys == ((NO, 1, 0), (NO, 2, 1))
    registry.unregister(p, b)
    assert p.instance.cache_table.req_keys == {}  # a lost the key for good


def test_not_remote_accessible_listed_never_served(pair: tuple[Engine, Engine]) -> None:
    """§4.1 step 5, §4.4: a cache registered with remote_accessible=False is in the table peers
    see (so their pull fails PARAM_INVALID, remote checked after local) but not served."""
    p, d = pair
    hidden = register(p, Mem(2, 4, 16, seed=3), ra=False, keys=[blocks_key(0, 4)])
    views, served = p.instance.snapshot_for_link()
    assert not views[hidden].remote_accessible and hidden not in served
    dst = Mem(2, 4, 16)
    did = register(d, dst)
    link(d, p)
    before = dst.copy()
    assert pull(d, did, blocks_key(1, 4), pull_param([0], [0])) == PARAM_INVALID
    assert pull(d, did, id_key(1, hidden), pull_param((), [0])) == PARAM_INVALID
    # the C++ face's view of the same table: no lease on it (its pull gets KV_CACHE_NOT_EXIST)
    entity = d.instance.entities[1]
    rc = entity.peer.snapshot()[hidden]
    assert entity.peer.acquire(rc, 1000)[0] == NOT_EXIST
    expect_blocks(dst.tensors, before, before, [], 16)


def test_local_not_remote_accessible_refused_before_remote(pair: tuple[Engine, Engine]) -> None:
    """§7.5-11 (engine part): pulling into a cache registered without remote access fails
    PARAM_INVALID in remote-accessible mode (the local flag is checked before the remote one)."""
    p, d = pair
    register(p, Mem(2, 4, 16, seed=1), ra=False, keys=[blocks_key(0, 0)])
    dst = Mem(2, 4, 16)
    did = register(d, dst, ra=False)
    link(d, p)
    with pytest.raises(Rejected, match="local cache"):
        pulls.pull_cache_v2(d, did, blocks_key(1, 0), pull_param([0], [0]))
    assert all((t == 0).all() for t in dst.tensors)


def test_table_over_one_mib_keeps_the_entry(pair: tuple[Engine, Engine]) -> None:
    """§4.1 step 7: a table over 1 MiB -> PARAM_INVALID with the entry left in place; peers read
    the last table that fit."""
    p, _ = pair
    one = np.zeros(64, np.uint8)
    many = Mem(1, 4, 16)
    many.tensors = [one] * 70000  # 70000 tensors x 8 bytes of addresses in the table
    many.n = 70000
    assert reg_status(p, (70000, UINT8, -1, [4, 16], 1, True), many.addrs) == 1  # 0.56 MB
    assert reg_status(p, (70000, UINT8, -1, [4, 16], 1, True), many.addrs) == PARAM_INVALID
    assert set(p.instance.caches) == {1, 2}
    assert set(p.instance.snapshot_for_link()[0]) == {1}
