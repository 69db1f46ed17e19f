"""The same-host path's mapped copies (kvdd.sim.fabric.samehost_shm): an owner whose caches live in
kvdd.empty memory is copied through a mapping of that memory in the reader.  Every call must do
exactly what it does through the owner's /proc/<pid>/mem: the same outcome and every byte of both
processes equal, the compiled path (kvdd._native._xproc.SameHostMover) on and off."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdd import Cache, CacheDesc, CacheIndex, KvCacheExtParam
from kvdd._native import _xproc
from kvdd.sim import _fastpath
from kvdd.sim.fabric import samehost

from fastpath_support import outcome
from test_fastpath import GEOMETRIES, U8, block_pair, layer_ext
from test_fastpath_samehost import OWNER, World, owner_world

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    yield from owner_world("shm")


def _maps(w: World) -> _xproc.PeerMaps | None:
    maps = w.me.dd.backend.entities[OWNER].peer._path._reader.maps  # type: ignore[attr-defined]
    assert maps is None or isinstance(maps, _xproc.PeerMaps)
    return maps


def _four_ways(w: World, call: Callable[[], None], seed: int) -> int:
    """``call`` mapped and through /proc/<pid>/mem, compiled path on and off, from the same
    bytes: equal outcomes and bytes; returns how many of the mapped runs used the mappings."""
    maps = _maps(w)
    assert maps is not None
    results = []
    used = 0
    for mapped in (True, False):
        for on in (True, False):
            w.me.fill(seed)
            w.owner.fill(seed + 1)
            maps.enabled = mapped
            before = maps.uses
            prev = _fastpath.set_enabled(on)
            try:
                out = outcome(call)
            finally:
                _fastpath.set_enabled(prev)
                maps.enabled = True
            used += maps.uses - before
            if not mapped:
                assert maps.uses == before
            results.append((out, w.me.arena.copy(), w.owner.memory()))
    first = results[0]
    for other in results[1:]:
        assert other[0] == first[0]
        np.testing.assert_array_equal(other[1], first[1])
        np.testing.assert_array_equal(other[2], first[2])
    return used


def test_the_owner_memory_is_mapped(world: World) -> None:
    maps = _maps(world)
    assert maps is not None and len(maps) == 1
    assert maps.mapped_bytes >= world.owner.size


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mapped_calls_equal_proc_mem_calls(world: World, data: st.DataObject) -> None:
    """Valid calls of every kind (rows, sizes, layer ranges, blocks) and some out of range."""
    me, owner = world.me, world.owner
    g = data.draw(st.integers(0, len(GEOMETRIES) - 1))
    n, (B, S) = GEOMETRIES[g]
    kind = data.draw(st.sampled_from(["pull_kv_cache", "push_kv_cache", "pull_kv_blocks",
                                      "push_kv_blocks"]))
    ext = data.draw(layer_ext(n))
    seed = data.draw(st.integers(0, 2**16))
    desc = CacheDesc(n, U8, (B, S))
    call: Callable[[], None]
    if kind == "pull_kv_cache":
        idx = CacheIndex(OWNER, owner.ids[g], data.draw(st.integers(0, B)))
        row = data.draw(st.integers(0, B - 1))
        size = data.draw(st.sampled_from([-1, 1, S // 2, S, S + 1]))
        call = lambda: me.dd.pull_kv_cache(idx, Cache(me.ids[g]), row, size, ext)  # noqa: E731
    elif kind == "push_kv_cache":
        idx = CacheIndex(OWNER, owner.ids[g], data.draw(st.integers(0, B)))
        row = data.draw(st.integers(0, B - 1))
        call = lambda: me.dd.push_kv_cache(Cache(me.ids[g], (), desc), idx, row, -1, ext)  # noqa: E731
    else:
        src, dst = data.draw(block_pair())
        idx = CacheIndex(OWNER, owner.ids[g], 0)
        if kind == "pull_kv_blocks":
            call = lambda: me.dd.pull_kv_blocks(idx, Cache(me.ids[g]), src, dst, ext)  # noqa: E731
        else:
            call = lambda: me.dd.push_kv_blocks(Cache(me.ids[g], (), desc), idx, src, dst, ext)  # noqa: E731
    _four_ways(world, call, seed)


def test_common_calls_use_the_mapping(world: World) -> None:
    me, owner = world.me, world.owner
    idx = CacheIndex(OWNER, owner.ids[1], 1)
    blk = CacheIndex(OWNER, owner.ids[1], 0)
    layers = KvCacheExtParam((1, 2), (0, 1), 2)
    calls: list[Callable[[], None]] = [
        lambda: me.dd.pull_kv_cache(idx, Cache(me.ids[1])),
        lambda: me.dd.pull_kv_cache(idx, Cache(me.ids[1]), 2, -1, layers),
        lambda: me.dd.pull_kv_blocks(blk, Cache(me.ids[1]), [3, 4, 0], [5, 6, 7]),
        lambda: me.dd.push_kv_blocks(Cache(me.ids[1], (), me.descs[1]), blk, [0, 1], [6, 7]),
        lambda: me.dd.push_kv_cache(Cache(me.ids[1], (), me.descs[1]),
                                    CacheIndex(OWNER, owner.ids[1], 4), 1),
    ]
    for i, call in enumerate(calls):
        assert _four_ways(world, call, i) == 2, f"call {i} did not use the mapping both ways"
