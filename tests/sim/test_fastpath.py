"""kvdd.sim._fastpath: the compiled path of in-process transfers must never change what a call does.

Every call runs twice on the same starting bytes, with the compiled path on and off: the outcome
(success, or the exception's type and message) and every byte of both instances' memory must be
equal. The calls are random: valid and invalid ids, rows, sizes, layer ranges, block lists,
placements, so that both the accepted and the declined side of every check are exercised; the
deterministic tests below pin that the common calls are accepted (otherwise the comparison would
only ever test the Python path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvdd
from kvdd import (
    Cache,
    CacheDesc,
    CacheIndex,
    CachePlacement,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmDataDist,
    LlmRole,
    tensor_addrs,
)
from kvdd.sim import _fastpath, faults

from fastpath_support import both_ways, fast, outcome

#: tests of the compiled path force it on (they pass with KVDD_SIM_FAST_PATH=0 too)
pytestmark = pytest.mark.usefixtures("compiled_path_on")

LOCALHOST = "127.0.0.1"
U8 = DataType.DT_UINT8

#: (num_tensors, shape) of the caches each side registers: strides 64, 32, 100 and 48 bytes, tensor
#: counts that are and are not multiples of 2 and 3
GEOMETRIES = ((4, (4, 64)), (6, (8, 32)), (3, (2, 100)), (4, (5, 48)), (6, (6, 64)))


@dataclass
class Side:
    dd: LlmDataDist
    arena: np.ndarray
    ids: list[int]
    descs: list[CacheDesc]

    def fill(self, seed: int) -> None:
        self.arena[:] = np.random.default_rng(seed).integers(0, 256, self.arena.size, dtype=np.uint8)

    def memory(self) -> list[np.ndarray]:
        return [self.arena.copy()]


def _side(cluster_id: int, role: int) -> Side:
    dd = LlmDataDist(cluster_id, role, backend="sim")
    dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", kvdd.OPTION_DEVICE_ID: str(cluster_id)})
    sizes = [n * int(np.prod(shape)) for n, shape in GEOMETRIES]
    arena = np.zeros(sum(sizes), np.uint8)
    ids, descs, at = [], [], 0
    for (n, shape), size in zip(GEOMETRIES, sizes):
        T = size // n
        tensors = [arena[at + k * T: at + (k + 1) * T] for k in range(n)]
        desc = CacheDesc(n, U8, shape)
        ids.append(dd.register_kv_cache(desc, tensor_addrs(tensors)))
        descs.append(desc)
        at += size
    return Side(dd, arena, ids, descs)


def _link(a: Side, b: Side) -> None:
    a.dd.link_llm_clusters([ClusterInfo(remote_cluster_id=b.dd.cluster_id,
                                        remote_ip_infos=(IpInfo(LOCALHOST, b.dd.listening_port),))])


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Side, Side]]:
    """Prefill (cluster 1) and decode (cluster 2), linked (each has an entity for the other)."""
    p, d = _side(1, LlmRole.PROMPT), _side(2, LlmRole.DECODER)
    try:
        _link(d, p)
        yield p, d
    finally:
        d.dd.finalize()
        p.dd.finalize()


def _both_ways(pair: tuple[Side, Side], call: Callable[[], None], seed: int) -> bool:
    """fastpath_support.both_ways on the pair: whether the compiled path took the call."""
    return both_ways(pair, call, seed)[0]


# ---- random calls ---------------------------------------------------------------------------------

KINDS = ("pull_kv_cache", "pull_kv_blocks", "push_kv_cache", "push_kv_blocks")
small = st.integers(-1, 7)
ranges = st.sampled_from([(-1, -1), (0, 0), (0, 1), (1, 1), (1, 2), (2, 3), (-1, 2), (3, 3), (0, 2)])
exts = st.one_of(st.none(), st.none(), st.none(), st.builds(KvCacheExtParam, ranges, ranges, st.integers(1, 3)))
#: mostly inside the caches' 2-8 blocks, sometimes past them or near the uint64 wrap
block = st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(0, 9), st.sampled_from([2**32, 2**64 - 1]))
blocks = st.lists(block, min_size=0, max_size=6)


@st.composite
def block_pair(draw: st.DrawFn) -> tuple[Sequence[int], Sequence[int]]:
    """Mostly equal-length, non-empty lists (often consecutive runs), as lists or tuples."""
    n = draw(st.sampled_from([1, 2, 3, 4, 5, 6] * 3 + [0]))
    src = draw(st.lists(block, min_size=n, max_size=n))
    if draw(st.integers(0, 9)) == 0:
        dst = draw(st.lists(block, min_size=0, max_size=6))
    elif draw(st.booleans()):
        start = draw(st.integers(0, 6))
        dst = [start + i for i in range(n)]
    else:
        dst = draw(st.lists(block, min_size=n, max_size=n))
    return (tuple(src), tuple(dst)) if draw(st.booleans()) else (src, dst)


def _ids(ids: list[int]) -> st.SearchStrategy[int]:
    return st.sampled_from(ids * 3 + [0, -1, 999])


def any_call(data: st.DataObject, caller: LlmDataDist, caller_ids: list[int], owner_ids: list[int],
             owner_cluster: int) -> tuple[str, Callable[[], None], int]:
    """A call of ``caller`` on the owner's caches (``owner_ids``, one per geometry) with values
    around every bound (mostly the owner's cluster and the same geometry on both sides): its kind,
    the call, and a seed to fill memory with."""
    cluster = data.draw(st.sampled_from([owner_cluster] * 6 + [caller.cluster_id, 99]))
    kind = data.draw(st.sampled_from(KINDS))
    rows = [0, 1, 3, 7] if kind.endswith("cache") else [0] * 9 + [1]  # blocks: row 0 or refused
    g = data.draw(st.integers(0, len(GEOMETRIES) - 1))  # mostly the same geometry on both sides
    remote_id = owner_ids[g] if data.draw(st.integers(0, 3)) else data.draw(_ids(owner_ids))
    local_id = caller_ids[g] if data.draw(st.integers(0, 3)) else data.draw(_ids(caller_ids))
    idx = CacheIndex(cluster, remote_id, data.draw(st.sampled_from(rows)))
    n_local = dict(zip(caller_ids, (n for n, _ in GEOMETRIES))).get(local_id, 4)
    ext = data.draw(exts)
    seed = data.draw(st.integers(0, 2**16))
    call: Callable[[], None]
    shape = data.draw(st.sampled_from([g[1] for g in GEOMETRIES]))
    desc = CacheDesc(data.draw(st.sampled_from([n_local] * 3 + [0, 1, 5, 7])), U8, shape,
                     data.draw(st.sampled_from([CachePlacement.DEVICE] * 3 + [CachePlacement.HOST])))
    if kind == "pull_kv_cache":
        row = data.draw(small.filter(lambda x: x >= 0))
        size = data.draw(st.sampled_from([-1, -1, 0, 1, 16, 32, 48, 64, 65, 100, 200, -2]))
        call = lambda: caller.pull_kv_cache(idx, Cache(local_id), row, size, ext)  # noqa: E731
    elif kind == "push_kv_cache":
        row = data.draw(small.filter(lambda x: x >= 0))
        size = data.draw(st.sampled_from([-1] * 5 + [0, 32]))
        call = lambda: caller.push_kv_cache(Cache(local_id, (), desc), idx, row, size, ext)  # noqa: E731
    else:
        src, dst = data.draw(block_pair())
        if kind == "pull_kv_blocks":
            call = lambda: caller.pull_kv_blocks(idx, Cache(local_id), src, dst, ext)  # noqa: E731
        else:
            call = lambda: caller.push_kv_blocks(Cache(local_id, (), desc), idx, src, dst, ext)  # noqa: E731
    return kind, call, seed


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_compiled_path_never_changes_a_call(pair: tuple[Side, Side], data: st.DataObject) -> None:
    p, d = pair
    caller, owner = data.draw(st.sampled_from([(d, p), (p, d)]))
    kind, call, seed = any_call(data, caller.dd, caller.ids, owner.ids, owner.dd.cluster_id)
    took = _both_ways(pair, call, seed)
    event(f"{kind}: {'compiled' if took else 'Python path'}")


@st.composite
def layer_ext(draw: st.DrawFn, n: int) -> KvCacheExtParam | None:
    """None, all layers, or equal-length layer ranges inside an n-tensor cache."""
    t = draw(st.sampled_from([t for t in (1, 2, 3) if n % t == 0]))
    layers = n // t
    if draw(st.booleans()):
        return None if t == 2 and draw(st.booleans()) else KvCacheExtParam(tensor_num_per_layer=t)
    length = draw(st.integers(1, layers))
    s0, d0 = draw(st.integers(0, layers - length)), draw(st.integers(0, layers - length))
    return KvCacheExtParam((s0, s0 + length - 1), (d0, d0 + length - 1), t)


#: what a near-valid call changes, if anything: one value moved just past its bound
BREAKS = ("none", "none", "none", "row", "remote_row", "size", "block", "src_block", "geometry",
          "layer", "tensor_num", "num_tensors", "placement", "cluster", "empty", "length")


def near_valid_call(data: st.DataObject, caller: LlmDataDist, caller_ids: list[int], owner_ids: list[int],
                    owner_cluster: int) -> tuple[str, Callable[[], None], int]:
    """A valid call of ``caller`` on the owner's caches (``owner_ids``, one per geometry), or one with
    one value just past its bound (``BREAKS``): its kind, the call, and a seed to fill memory with."""
    g = data.draw(st.integers(0, len(GEOMETRIES) - 1))
    n, (B, S) = GEOMETRIES[g]
    kind = data.draw(st.sampled_from(KINDS))
    brk = data.draw(st.sampled_from(BREAKS))
    ext = data.draw(layer_ext(n))
    if brk == "layer" and ext is not None and ext.src_layer_range[0] >= 0:
        (s0, s1), (d0, d1) = ext.src_layer_range, ext.dst_layer_range
        ext = KvCacheExtParam((s0 + 1, s1 + 1), (d0 + 1, d1 + 1), ext.tensor_num_per_layer)
    if brk == "tensor_num":  # a tensor count per layer that does not divide the cache's
        t = data.draw(st.sampled_from([t for t in (2, 3, 4) if n % t]))
        ext = KvCacheExtParam((0, 0), (0, 0), t) if data.draw(st.booleans()) else KvCacheExtParam(tensor_num_per_layer=t)
    remote_id = owner_ids[(g + 1) % len(GEOMETRIES)] if brk == "geometry" else owner_ids[g]
    cluster = {"cluster": caller.cluster_id}.get(brk, owner_cluster)
    seed = data.draw(st.integers(0, 2**16))
    call: Callable[[], None]
    if kind == "pull_kv_cache":
        row = B if brk == "row" else data.draw(st.integers(0, B - 1))
        rrow = B if brk == "remote_row" else data.draw(st.integers(0, B - 1))
        size = S + 1 if brk == "size" else data.draw(st.sampled_from([-1, 1, S // 2, S]))
        idx = CacheIndex(cluster, remote_id, rrow)
        call = lambda: caller.pull_kv_cache(idx, Cache(caller_ids[g]), row, size, ext)  # noqa: E731
    elif kind == "push_kv_cache":
        row = B if brk == "row" else data.draw(st.integers(0, B - 1))
        idx = CacheIndex(cluster, remote_id, B if brk == "remote_row" else data.draw(st.integers(0, B - 1)))
        desc = CacheDesc(n + 1 if brk == "num_tensors" else n, U8, (B, S),
                         CachePlacement.HOST if brk == "placement" else CachePlacement.DEVICE)
        size = 0 if brk == "size" else -1
        call = lambda: caller.push_kv_cache(Cache(caller_ids[g], (), desc), idx, row, size, ext)  # noqa: E731
    else:
        k = 0 if brk == "empty" else data.draw(st.integers(1, min(B, 4)))
        runs = data.draw(st.booleans())  # consecutive pairs: one run of k blocks
        if runs:
            s0, d0 = data.draw(st.integers(0, B - k)), data.draw(st.integers(0, B - k))
            src, dst = [s0 + i for i in range(k)], [d0 + i for i in range(k)]
        else:
            src = data.draw(st.lists(st.integers(0, B - 1), min_size=k, max_size=k))
            dst = data.draw(st.lists(st.integers(0, B - 1), min_size=k, max_size=k))
        if k and brk in ("block", "src_block"):
            moved = src if brk == "src_block" else dst
            if runs:  # the run's last block is the first one past the end
                moved[:] = [B - k + 1 + i for i in range(k)]
            else:
                moved[data.draw(st.integers(0, k - 1))] = B
        if brk == "length":
            dst = dst + [0]
        idx = CacheIndex(cluster, remote_id, 0)
        if kind == "pull_kv_blocks":
            call = lambda: caller.pull_kv_blocks(idx, Cache(caller_ids[g]), src, dst, ext)  # noqa: E731
        else:
            num = n + 1 if brk == "num_tensors" else n
            placement = CachePlacement.HOST if brk == "placement" else CachePlacement.DEVICE
            desc = CacheDesc(num, U8, (B, S), placement)
            call = lambda: caller.push_kv_blocks(Cache(caller_ids[g], (), desc), idx, src, dst, ext)  # noqa: E731
    return kind, call, seed


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_near_valid_calls(pair: tuple[Side, Side], data: st.DataObject) -> None:
    """Valid calls, and valid calls with one value just past its bound: the compiled path's
    acceptance must stop exactly where the checks do."""
    p, d = pair
    caller, owner = data.draw(st.sampled_from([(d, p), (p, d)]))
    kind, call, seed = near_valid_call(data, caller.dd, caller.ids, owner.ids, owner.dd.cluster_id)
    event(f"{kind}: {'compiled' if _both_ways(pair, call, seed) else 'Python path'}")


# ---- the common calls are taken -------------------------------------------------------------------

def test_common_calls_take_the_compiled_path(pair: tuple[Side, Side]) -> None:
    p, d = pair
    idx = CacheIndex(1, p.ids[1], 1)  # 6 tensors of 8 x 32 bytes
    blk = CacheIndex(1, p.ids[1], 0)
    push = CacheIndex(2, d.ids[1], 0)
    layers = KvCacheExtParam((1, 2), (0, 1), 2)
    calls: list[Callable[[], None]] = [
        lambda: d.dd.pull_kv_cache(idx, Cache(d.ids[1])),
        lambda: d.dd.pull_kv_cache(idx, Cache(d.ids[1]), 3, 16),
        lambda: d.dd.pull_kv_cache(idx, Cache(d.ids[1]), 2, -1, layers),
        lambda: d.dd.pull_kv_blocks(blk, Cache(d.ids[1]), [3, 4, 0], [5, 6, 7]),
        lambda: d.dd.pull_kv_blocks(blk, Cache(d.ids[1]), (1,), (0,), KvCacheExtParam((2, 2), (0, 0), 2)),
        lambda: p.dd.push_kv_blocks(Cache(p.ids[1], (), p.descs[1]), push, [0, 1], [6, 7]),
        lambda: p.dd.push_kv_blocks(Cache(p.ids[1], (), p.descs[1]), push, [2], [3], layers),
        lambda: p.dd.push_kv_cache(Cache(p.ids[1], (), p.descs[1]), CacheIndex(2, d.ids[1], 4), 1),
        lambda: p.dd.push_kv_cache(Cache(p.ids[1], (), p.descs[1]), CacheIndex(2, d.ids[1], 7), 0, -1, layers),
    ]
    for i, call in enumerate(calls):
        assert _both_ways(pair, call, i), f"call {i} was not taken"


def test_a_push_whose_destination_runs_out_of_layers_is_declined(pair: tuple[Side, Side]) -> None:
    """§3.12 step 7: a 2-layer push into layers 1-2 of a 2-layer remote cache writes layer 0 and
    then fails at layer 1 (upstream writes partially); the compiled path must leave that to the
    Python path (same bytes, same error), for blocks and rows."""
    p, d = pair
    src = Cache(p.ids[1], (), p.descs[1])  # 6 tensors: 3 layers of 2
    idx = CacheIndex(2, d.ids[0], 0)  # 4 tensors: 2 layers of 2
    ext = KvCacheExtParam((0, 1), (1, 2), 2)
    for call in (lambda: p.dd.push_kv_blocks(src, idx, [0], [0], ext),
                 lambda: p.dd.push_kv_cache(src, idx, 0, -1, ext)):
        assert not _both_ways(pair, call, 7)
        assert outcome(call)[0] == "LLMParamInvalidError"


def test_pull_row_bytes(pair: tuple[Side, Side]) -> None:
    """The bytes an accepted PullKvCache moves, and none other (6 tensors, S = 32)."""
    p, d = pair
    p.fill(1)
    d.fill(2)
    before = d.arena.copy()
    taken = fast(d).taken
    d.dd.pull_kv_cache(CacheIndex(1, p.ids[1], 5), Cache(d.ids[1]), 2, 20)
    assert fast(d).taken == taken + 1
    off_p = off_d = sum(n * int(np.prod(s)) for n, s in GEOMETRIES[:1])
    expect = before.copy()
    for k in range(6):
        dst = off_d + k * 256 + 2 * 32
        expect[dst:dst + 20] = p.arena[off_p + k * 256 + 5 * 32: off_p + k * 256 + 5 * 32 + 20]
    np.testing.assert_array_equal(d.arena, expect)


def test_declines_leave_statuses_to_the_python_path(pair: tuple[Side, Side]) -> None:
    p, d = pair
    compiled = fast(d)
    declined = compiled.declined
    with pytest.raises(kvdd.LLMParamInvalidError, match="batch_index"):
        d.dd.pull_kv_cache(CacheIndex(1, p.ids[1], 0), Cache(d.ids[1]), 8)
    with pytest.raises(kvdd.LLMKvCacheNotExistError):
        d.dd.pull_kv_cache(CacheIndex(1, 12345, 0), Cache(d.ids[1]))
    with pytest.raises(TypeError):
        d.dd.pull_kv_cache(CacheIndex(1, p.ids[1], 0), d.ids[1])  # type: ignore[arg-type]
    assert compiled.declined == declined + 3


def test_armed_faults_and_broken_links_take_the_python_path(pair: tuple[Side, Side]) -> None:
    p, d = pair
    compiled = fast(d)
    idx = CacheIndex(1, p.ids[0], 0)
    taken = compiled.taken
    with faults.inject("pull_kv_cache", delay_ms=1, count=1):
        d.dd.pull_kv_cache(idx, Cache(d.ids[0]))
    assert compiled.taken == taken
    entity = d.dd.backend.entities[1]  # type: ignore[attr-defined]
    entity.broken = True
    try:
        with pytest.raises(kvdd.LLMTimeoutError):
            d.dd.pull_kv_cache(idx, Cache(d.ids[0]))
    finally:
        entity.broken = False
    assert compiled.taken == taken
    d.dd.pull_kv_cache(idx, Cache(d.ids[0]))
    assert compiled.taken == taken + 1


def test_unregistered_caches_are_not_copied() -> None:
    """After UnregisterKvCache (either side) the compiled path declines and the Python path
    returns LLM_KV_CACHE_NOT_EXIST; the regions' leases are closed."""
    p, d = _side(1, LlmRole.PROMPT), _side(2, LlmRole.DECODER)
    try:
        _link(d, p)
        idx = CacheIndex(1, p.ids[0], 0)
        d.dd.pull_kv_cache(idx, Cache(d.ids[0]))
        entry = p.dd.backend.caches[p.ids[0]]  # type: ignore[attr-defined]
        table = entry.table
        p.dd.unregister_kv_cache(p.ids[0])
        assert table.closed and table.inflight == 0 and not table.acquire()
        before = d.arena.copy()
        with pytest.raises(kvdd.LLMKvCacheNotExistError):
            d.dd.pull_kv_cache(idx, Cache(d.ids[0]))
        d.dd.unregister_kv_cache(d.ids[0])
        with pytest.raises(kvdd.LLMKvCacheNotExistError):
            d.dd.pull_kv_cache(CacheIndex(1, p.ids[1], 0), Cache(d.ids[0]))
        np.testing.assert_array_equal(d.arena, before)
    finally:
        d.dd.finalize()
        p.dd.finalize()


def test_env_var_turns_it_off() -> None:
    """KVDD_SIM_FAST_PATH=0 at import: every call takes the Python path."""
    code = ("import kvdd.sim._fastpath as f; print(f.set_enabled(True))")
    for value, want in (("0", "False"), ("off", "False"), (" False", "False"), ("no", "False"), ("1", "True"),
                        ("", "True")):
        env = dict(os.environ, **{_fastpath.ENV_VAR: value})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stderr)


@pytest.mark.parametrize("pairs", [257, 1500, 20_000, _fastpath.MAX_PAIRS + 1])
def test_long_block_lists(pairs: int) -> None:
    """Block lists past the stack buffer (256 pairs) are planned in heap memory: the same bytes
    either way, taken; one index past the end is declined (and refused by the Python path alike).
    A list longer than MAX_PAIRS takes the Python path (its pairs then form one run, so that the
    request fits the 2 MiB request limit of §3.11 step 8)."""
    def side(cluster_id: int, role: int) -> tuple[LlmDataDist, np.ndarray, int]:
        dd = LlmDataDist(cluster_id, role, backend="sim")
        dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", kvdd.OPTION_DEVICE_ID: str(cluster_id)})
        mem = np.zeros(2 * 2 * pairs * 16, np.uint8)
        desc = CacheDesc(2, U8, (2 * pairs, 16))
        half = mem.size // 2
        return dd, mem, dd.register_kv_cache(desc, tensor_addrs([mem[:half], mem[half:]]))

    (p, pm, pid), (d, dm, did) = side(1, LlmRole.PROMPT), side(2, LlmRole.DECODER)
    try:
        d.link_llm_clusters([ClusterInfo(remote_cluster_id=1, remote_ip_infos=(IpInfo(LOCALHOST, p.listening_port),))])
        rng = np.random.default_rng(pairs)
        too_long = pairs > _fastpath.MAX_PAIRS
        src = list(range(pairs)) if too_long else [int(x) for x in rng.permutation(2 * pairs)[:pairs]]
        dst = list(range(pairs, 2 * pairs)) if too_long else [int(x) for x in rng.permutation(2 * pairs)[:pairs]]
        compiled = d.backend.fast_transfers  # type: ignore[attr-defined]
        idx, cache = CacheIndex(1, pid, 0), Cache(did)
        for bad in (False, True):
            s2 = src[:-1] + [2 * pairs] if bad else src
            results = []
            for on in (True, False):
                pm[:] = rng.integers(0, 256, pm.size, dtype=np.uint8) if on else pm
                dm[:] = 0
                taken = compiled.taken
                prev = _fastpath.set_enabled(on)
                try:
                    out = outcome(lambda: d.pull_kv_blocks(idx, cache, s2, dst))
                finally:
                    _fastpath.set_enabled(prev)
                results.append((out, dm.copy(), compiled.taken - taken))
            (o1, m1, t1), (o2, m2, _) = results
            assert o1 == o2 and t1 == (0 if bad or too_long else 1), (bad, o1, t1)
            np.testing.assert_array_equal(m1, m2)
            if not bad:
                assert o1[0] == "ok" and m1.any()
    finally:
        d.finalize()
        p.finalize()
