"""The compiled path (kvdd.sim._fastpath) over a same-host link: the owner is an instance in
another process, the link uses the one-sided path (``/proc/<pid>/mem``), and the compiled path
reaches it through ``kvdd._native._xproc.SameHostMover``.  It must never change what a call does.

Every call runs twice from the same bytes, with the compiled path on and off: the outcome
(success, or the exception's type and message) and every byte of both processes' cache memory
(the owner's read and written through its ``/proc/<pid>/mem`` by the test) must be equal.  Random
and near-valid calls as in test_fastpath.py; the common calls must be taken."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvdd
from kvdd import Cache, CacheIndex, ClusterInfo, IpInfo, KvCacheExtParam
from kvdd.sim import _fastpath
from kvdd.sim.fabric import samehost

from fastpath_support import fast, outcome
from test_fastpath import GEOMETRIES, LOCALHOST, Side, _side, any_call, near_valid_call

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

OWNER = 1

# The owner: cluster 1 with the caches of test_fastpath.GEOMETRIES in one arena; prints its port,
# the arena's address and size and the cache ids; finalizes on a line from stdin.
_OWNER = r"""
import sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
G, ALLOC = eval(sys.argv[1]), sys.argv[2]
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
sizes = [n * int(np.prod(shape)) for n, shape in G]
arena = kvdd.empty(sum(sizes), np.uint8) if ALLOC == "shm" else np.zeros(sum(sizes), np.uint8)
ids, at = [], 0
for (n, shape), size in zip(G, sizes):
    T = size // n
    ids.append(dd.register_kv_cache(CacheDesc(n, DataType.DT_UINT8, shape),
                                    tensor_addrs([arena[at + k * T: at + (k + 1) * T]
                                                  for k in range(n)])))
    at += size
print(dd.listening_port, int(arena.ctypes.data), arena.size, *ids, flush=True)
sys.stdin.readline()
dd.finalize()
"""


@dataclass
class Owner:
    """The owner process, its cache memory reached through its /proc/<pid>/mem."""

    proc: subprocess.Popen[str]
    port: int
    addr: int
    size: int
    ids: list[int]
    mem: int

    def fill(self, seed: int) -> None:
        data = np.random.default_rng(seed).integers(0, 256, self.size, dtype=np.uint8)
        assert os.pwrite(self.mem, data.tobytes(), self.addr) == self.size

    def memory(self) -> np.ndarray:
        return np.frombuffer(os.pread(self.mem, self.size, self.addr), np.uint8)


@dataclass
class World:
    me: Side
    owner: Owner


def owner_world(memory: str) -> Iterator[World]:
    """A linked owner process whose cache memory comes from numpy (``"numpy"``: copies through
    its /proc/<pid>/mem) or from kvdd.empty (``"shm"``: copies through its memory mapped here);
    skips when the link does not use the same-host path."""
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, repr(GEOMETRIES), memory],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    port, addr, size, *ids = (int(x) for x in proc.stdout.readline().split())
    mem = os.open(f"/proc/{proc.pid}/mem", os.O_RDWR)
    me = _side(2, kvdd.LlmRole.DECODER)
    try:
        me.dd.link_llm_clusters([ClusterInfo(remote_cluster_id=OWNER,
                                             remote_ip_infos=(IpInfo(LOCALHOST, port),))])
        path = me.dd.backend.link_data_path(OWNER)  # type: ignore[attr-defined]
        if path != "process_vm":
            pytest.skip(f"the link uses {path}, not the same-host path")
        reader = me.dd.backend.entities[OWNER].peer._path._reader  # type: ignore[attr-defined]
        assert (reader.maps is not None) == (memory == "shm")
        yield World(me, Owner(proc, port, addr, size, ids, mem))
    finally:
        me.dd.finalize()
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(30)
        os.close(mem)


@pytest.fixture(scope="module", params=["numpy", "shm"])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    yield from owner_world(request.param)


def _both_ways(w: World, call: Callable[[], None], seed: int) -> bool:
    """``call`` with the compiled path on, then off, from the same bytes: equal outcomes, equal
    bytes on both sides; whether the compiled path took it."""
    results = []
    taken = 0
    for on in (True, False):
        w.me.fill(seed)
        w.owner.fill(seed + 1)
        before = fast(w.me).taken
        prev = _fastpath.set_enabled(on)
        try:
            out = outcome(call)
        finally:
            _fastpath.set_enabled(prev)
        if on:
            taken = fast(w.me).taken - before
        results.append((out, w.me.arena.copy(), w.owner.memory()))
    (out_on, mine_on, theirs_on), (out_off, mine_off, theirs_off) = results
    assert out_on == out_off
    np.testing.assert_array_equal(mine_on, mine_off)
    np.testing.assert_array_equal(theirs_on, theirs_off)
    assert taken in (0, 1) and (taken == 0 or out_on[0] == "ok")
    return taken == 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_compiled_path_never_changes_a_same_host_call(world: World, data: st.DataObject) -> None:
    me, owner = world.me, world.owner
    kind, call, seed = any_call(data, me.dd, me.ids, owner.ids, OWNER)
    event(f"{kind}: {'compiled' if _both_ways(world, call, seed) else 'Python path'}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_near_valid_same_host_calls(world: World, data: st.DataObject) -> None:
    """Valid calls, and valid calls with one value just past its bound."""
    me, owner = world.me, world.owner
    kind, call, seed = near_valid_call(data, me.dd, me.ids, owner.ids, OWNER)
    event(f"{kind}: {'compiled' if _both_ways(world, call, seed) else 'Python path'}")


def test_common_same_host_calls_take_the_compiled_path(world: World) -> None:
    me, owner = world.me, world.owner
    idx = CacheIndex(OWNER, owner.ids[1], 1)  # 6 tensors of 8 x 32 bytes
    blk = CacheIndex(OWNER, owner.ids[1], 0)
    layers = KvCacheExtParam((1, 2), (0, 1), 2)
    calls: list[Callable[[], None]] = [
        lambda: me.dd.pull_kv_cache(idx, Cache(me.ids[1])),
        lambda: me.dd.pull_kv_cache(idx, Cache(me.ids[1]), 3, 16),
        lambda: me.dd.pull_kv_cache(idx, Cache(me.ids[1]), 2, -1, layers),
        lambda: me.dd.pull_kv_blocks(blk, Cache(me.ids[1]), [3, 4, 0], [5, 6, 7]),
        lambda: me.dd.pull_kv_blocks(blk, Cache(me.ids[1]), (1,), (0,), KvCacheExtParam((2, 2), (0, 0), 2)),
        lambda: me.dd.push_kv_blocks(Cache(me.ids[1], (), me.descs[1]), blk, [0, 1], [6, 7]),
        lambda: me.dd.push_kv_blocks(Cache(me.ids[1], (), me.descs[1]), blk, [2], [3], layers),
        lambda: me.dd.push_kv_cache(Cache(me.ids[1], (), me.descs[1]), CacheIndex(OWNER, owner.ids[1], 4), 1),
        lambda: me.dd.push_kv_cache(Cache(me.ids[1], (), me.descs[1]), CacheIndex(OWNER, owner.ids[1], 7), 0,
                                    -1, layers),
    ]
    for i, call in enumerate(calls):
        assert _both_ways(world, call, i), f"call {i} was not taken"
