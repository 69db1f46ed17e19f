"""Edge values where kvdd.sim._fastpath (the compiled path) and the Python path must give the same
outcome and bytes (the compiled path on, then off, from the same bytes), beyond
tests/sim/test_fastpath.py's random calls (which use <= 6 block pairs, uint8 caches, the comm
backend and one fixed link)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvdd
from kvdd import (
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmDataDist,
    LlmRole,
    tensor_addrs,
)
from kvdd.sim import _fastpath

from fastpath_support import both_ways

LOCALHOST = "127.0.0.1"
U8 = DataType.DT_UINT8


@dataclass
class Side:
    """One instance and the host memory of its caches (one arena per cache)."""

    dd: LlmDataDist
    arenas: dict[int, np.ndarray] = field(default_factory=dict)
    descs: dict[int, CacheDesc] = field(default_factory=dict)

    def register(self, n: int, shape: tuple[int, ...], dtype: DataType = U8, nbytes: int | None = None) -> int:
        desc = CacheDesc(n, dtype, shape)
        T = desc.tensor_nbytes if nbytes is None else nbytes
        arena = np.zeros(n * T, np.uint8)
        cid = self.dd.register_kv_cache(desc, tensor_addrs([arena[k * T:(k + 1) * T] for k in range(n)]))
        self.arenas[cid] = arena
        self.descs[cid] = desc
        return cid

    def cache(self, cid: int) -> Cache:
        return Cache(cid, (), self.descs[cid])

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for a in self.arenas.values():
            a[:] = rng.integers(0, 256, a.size, dtype=np.uint8)

    def memory(self) -> list[np.ndarray]:
        return [a.copy() for _, a in sorted(self.arenas.items())]


def make_side(cluster_id: int, role: int = LlmRole.PROMPT, transfer: str | None = None) -> Side:
    dd = LlmDataDist(cluster_id, role, backend="sim")
    opts = {kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", kvdd.OPTION_DEVICE_ID: str(cluster_id)}
    if transfer is not None:
        opts[kvdd.OPTION_TRANSFER_BACKEND] = transfer
        opts[kvdd.OPTION_LOCAL_COMM_RES] = ""
    dd.initialize(opts)
    return Side(dd)


def link(a: Side, b: Side, remote_cluster_id: int | None = None) -> None:
    rid = b.dd.cluster_id if remote_cluster_id is None else remote_cluster_id
    a.dd.link_llm_clusters([ClusterInfo(remote_cluster_id=rid,
                                        remote_ip_infos=(IpInfo(LOCALHOST, b.dd.listening_port),))])


@pytest.fixture
def pd() -> Iterator[tuple[Side, Side]]:
    p, d = make_side(1, LlmRole.PROMPT), make_side(2, LlmRole.DECODER)
    try:
        yield p, d
    finally:
        d.dd.finalize()
        p.dd.finalize()


# ---- long block lists: 65..256 pairs take numpy/_runs in Python, byte_plan in the compiled path
# (which plans more than 256 pairs in heap memory since the integrator's MAX_PAIRS change) ----

@pytest.mark.parametrize("npairs", [1, 64, 65, 128, 255, 256, 257])
@pytest.mark.parametrize("stride_pair", [((300, 48), (300, 48)), ((300, 48), (200, 64)), ((320, 40), (256, 50))])
def test_long_block_lists_and_the_tail_quirk(pd: tuple[Side, Side], npairs: int,
                                            stride_pair: tuple[tuple[int, int], tuple[int, int]]) -> None:
    """Block pulls and pushes of up to 257 scattered pairs between caches whose strides differ
    (the §3.11 tail: the last run copies R.T % L.S bytes)."""
    p, d = pd
    (lb, ls), (rb, rs) = stride_pair
    rid = p.register(4, (rb, rs))
    lid = d.register(4, (lb, ls))
    link(d, p)
    rng = np.random.default_rng(npairs)
    remote_blocks = (rb * rs) // ls
    src = [int(x) for x in rng.permutation(min(lb, remote_blocks))[:npairs]]
    dst = [int(x) for x in rng.permutation(min(lb, remote_blocks))[:npairs]]
    src[-1:] = [remote_blocks if (rb * rs) % ls else remote_blocks - 1]  # the last: the tail block
    n = min(len(src), len(dst))
    src, dst = src[:n], dst[:n]
    took, out = both_ways((p, d), lambda: d.dd.pull_kv_blocks(CacheIndex(1, rid, 0), Cache(lid), src, dst))
    assert took == (out[0] == "ok" and n <= _fastpath.MAX_PAIRS)
    # consecutive runs: one run of n blocks ending at the tail
    start = max(0, remote_blocks - n + 1)
    run = list(range(start, start + n))
    both_ways((p, d), lambda: d.dd.pull_kv_blocks(CacheIndex(1, rid, 0), Cache(lid), run, list(range(n))))
    both_ways((p, d), lambda: d.dd.push_kv_blocks(d.cache(lid), CacheIndex(1, rid, 0), dst, src))
    both_ways((p, d), lambda: d.dd.push_kv_blocks(d.cache(lid), CacheIndex(1, rid, 0), tuple(dst), tuple(src)))


WRAPS = [
    ([2**64 - 1, 0], [0, 1]), ([0, 1], [2**64 - 1, 0]), ([2**64 - 2, 2**64 - 1], [3, 4]),
    ([2**32 - 1, 2**32], [0, 1]), ([0], [2**32]), ([2**63], [0]), ([1, 2**64 - 1], [1, 2]),
    ([3, 3, 3], [0, 0, 0]), ([0, 1, 0, 1], [1, 2, 3, 4]),
]


@pytest.mark.parametrize("src, dst", WRAPS)
def test_huge_and_wrapping_block_indices(pd: tuple[Side, Side], src: list[int], dst: list[int]) -> None:
    p, d = pd
    rid = p.register(4, (8, 32))
    lid = d.register(4, (8, 32))
    link(d, p)
    both_ways((p, d), lambda: d.dd.pull_kv_blocks(CacheIndex(1, rid, 0), Cache(lid), src, dst))
    both_ways((p, d), lambda: d.dd.push_kv_blocks(d.cache(lid), CacheIndex(1, rid, 0), src, dst))


class MyInt(int):
    pass


ODD_VALUES: list[object] = [True, False, np.int64(1), np.uint32(1), MyInt(1), 1.0, -1, 2**32, 2**64, None,
                             2**32 - 1, 2**31, 2**62, 2**63 - 1, 2**63, -2**63]


@pytest.mark.parametrize("value", ODD_VALUES, ids=repr)
def test_odd_argument_types(pd: tuple[Side, Side], value: object) -> None:
    """bools, numpy ints, int subclasses, floats and out-of-width ints in every integer argument:
    the compiled path declines them all and the facade decides (same outcome, same bytes)."""
    p, d = pd
    rid = p.register(4, (8, 32))
    lid = d.register(4, (8, 32))
    link(d, p)
    idx = CacheIndex(1, rid, 0)
    v: object = value
    calls: list[Callable[[], None]] = [
        lambda: d.dd.pull_kv_cache(idx, Cache(lid), v),  # type: ignore[arg-type]
        lambda: d.dd.pull_kv_cache(idx, Cache(lid), 0, v),  # type: ignore[arg-type]
        lambda: d.dd.push_kv_cache(d.cache(lid), idx, v),  # type: ignore[arg-type]
        lambda: d.dd.push_kv_cache(d.cache(lid), idx, 0, v),  # type: ignore[arg-type]
        lambda: d.dd.pull_kv_blocks(idx, Cache(lid), [v, 2], [3, 4]),  # type: ignore[list-item]
        lambda: d.dd.pull_kv_blocks(idx, Cache(lid), [1, 2], [3, v]),  # type: ignore[list-item]
        lambda: d.dd.push_kv_blocks(d.cache(lid), idx, (v,), (1,)),  # type: ignore[arg-type]
        lambda: d.dd.pull_kv_blocks(idx, Cache(lid), np.array([1, 2]), np.array([3, 4])),  # type: ignore[arg-type]
        lambda: d.dd.push_kv_blocks(d.cache(lid), idx, range(2), range(2)),
    ]
    for call in calls:
        both_ways((p, d), call)


@pytest.mark.parametrize("ext", [
    KvCacheExtParam((0, 0), (0, 0), 255), KvCacheExtParam(tensor_num_per_layer=255),
    KvCacheExtParam((0, 2**31 - 1), (0, 2**31 - 1), 255), KvCacheExtParam((2**31 - 1, 2**31 - 1), (0, 0), 1),
    KvCacheExtParam((0, 0), (2**31 - 1, 2**31 - 1), 1), KvCacheExtParam((-1, 5), (0, 0), 1),
    KvCacheExtParam((0, 1), (-1, -1), 2), KvCacheExtParam((0, 0), (-1, 0), 2), KvCacheExtParam((1, 1), (0, 0), 4),
    KvCacheExtParam((0, 3), (0, 0), 1), KvCacheExtParam((0, 0), (0, 3), 1),
], ids=repr)
def test_extreme_layer_ranges(pd: tuple[Side, Side], ext: KvCacheExtParam) -> None:
    p, d = pd
    rid = p.register(4, (8, 32))
    lid = d.register(4, (8, 32))
    link(d, p)
    idx = CacheIndex(1, rid, 1)
    both_ways((p, d), lambda: d.dd.pull_kv_cache(idx, Cache(lid), 1, -1, ext))
    both_ways((p, d), lambda: d.dd.push_kv_cache(d.cache(lid), idx, 1, -1, ext))
    blk = CacheIndex(1, rid, 0)
    both_ways((p, d), lambda: d.dd.pull_kv_blocks(blk, Cache(lid), [1, 2], [5, 6], ext))
    both_ways((p, d), lambda: d.dd.push_kv_blocks(d.cache(lid), blk, [1, 2], [5, 6], ext))


@pytest.mark.parametrize("dtype, shape", [
    (DataType.DT_INT4, (8, 64)), (DataType.DT_INT4, (3, 3)), (DataType.DT_INT4, (5, 1)),
    (DataType.DT_UINT1, (8, 8)), (DataType.DT_UINT1, (7, 3)), (DataType.DT_BF16, (4, 16)),
])
def test_sub_byte_and_ragged_caches(pd: tuple[Side, Side], dtype: DataType, shape: tuple[int, ...]) -> None:
    """Sub-byte caches, ragged (T not a multiple of T // B) and not, on either side."""
    p, d = pd
    rid = p.register(2, shape, dtype)
    lid = d.register(2, shape, dtype)
    rid8 = p.register(2, (8, 32))
    link(d, p)
    for r in (rid, rid8):
        for row in (0, 1, 2):
            idx = CacheIndex(1, r, row)
            both_ways((p, d), lambda: d.dd.pull_kv_cache(idx, Cache(lid), row))
            both_ways((p, d), lambda: d.dd.push_kv_cache(d.cache(lid), idx, row))
        blk = CacheIndex(1, r, 0)
        both_ways((p, d), lambda: d.dd.pull_kv_blocks(blk, Cache(lid), [0, 1], [1, 0]))
        both_ways((p, d), lambda: d.dd.push_kv_blocks(d.cache(lid), blk, [0], [1]))


# ---- link state: caches after the link, re-initialize with reused ids, hixl, unlink/relink ---------

def _calls(caller: Side, lid: int, cluster: int, rid: int) -> list[Callable[[], None]]:
    return [
        lambda: caller.dd.pull_kv_cache(CacheIndex(cluster, rid, 1), Cache(lid)),
        lambda: caller.dd.pull_kv_blocks(CacheIndex(cluster, rid, 0), Cache(lid), [0, 1], [2, 3]),
        lambda: caller.dd.push_kv_cache(caller.cache(lid), CacheIndex(cluster, rid, 1), 2),
        lambda: caller.dd.push_kv_blocks(caller.cache(lid), CacheIndex(cluster, rid, 0), [4], [5]),
    ]


def test_caches_registered_after_the_link(pd: tuple[Side, Side]) -> None:
    p, d = pd
    before = p.register(4, (8, 32))
    lid = d.register(4, (8, 32))
    link(d, p)
    after = p.register(4, (8, 32))
    for call in _calls(d, lid, 1, before):
        assert both_ways((p, d), call)[0]
    for call in _calls(d, lid, 1, after):
        took, out = both_ways((p, d), call)
        assert not took and out[0] == "LLMKvCacheNotExistError"
    lid2 = d.register(4, (8, 32))  # the caller's own caches need no relink
    for call in _calls(d, lid2, 1, before):
        assert both_ways((p, d), call)[0]


def test_reinitialized_owner_with_reused_cache_ids(pd: tuple[Side, Side]) -> None:
    """The owner finalizes and initializes again: its new caches reuse the ids the caller's stale
    entity still names; both paths refuse them alike until a relink."""
    p, d = pd
    rid = p.register(4, (8, 32))
    lid = d.register(4, (8, 32))
    link(d, p)
    p.dd.finalize()
    p.arenas.clear()
    p.descs.clear()
    p.dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", kvdd.OPTION_DEVICE_ID: "1"})
    rid2 = p.register(4, (8, 32))
    assert rid2 == rid
    for call in _calls(d, lid, 1, rid):
        took, out = both_ways((p, d), call)
        assert not took and out[0] == "LLMKvCacheNotExistError"
    d.dd.unlink_llm_clusters([ClusterInfo(remote_cluster_id=1, remote_ip_infos=(IpInfo(LOCALHOST, 1),))],
                             force=True)
    link(d, p)
    for call in _calls(d, lid, 1, rid2):
        assert both_ways((p, d), call)[0]


def test_hixl_one_way_links_and_user_cluster_ids() -> None:
    p, d = make_side(1, LlmRole.PROMPT, "hixl"), make_side(2, LlmRole.DECODER, "hixl")
    try:
        rid = p.register(4, (8, 32))
        lid = d.register(4, (8, 32))
        link(d, p, remote_cluster_id=5)
        for call in _calls(d, lid, 5, rid):
            assert both_ways((p, d), call)[0]
        for call in _calls(d, lid, 1, rid) + _calls(p, rid, 2, lid):  # the real id; the acceptor
            took, out = both_ways((p, d), call)
            assert not took and out[0] == "LLMNotYetLinkError"
        for call in _calls(d, lid, 2, rid):  # its own cluster id
            assert not both_ways((p, d), call)[0]
    finally:
        d.dd.finalize()
        p.dd.finalize()


def test_unlinked_and_relinked_peers(pd: tuple[Side, Side]) -> None:
    p, d = pd
    rid = p.register(4, (8, 32))
    lid = d.register(4, (8, 32))
    link(d, p)
    entity = d.dd.backend.entities[1]  # type: ignore[attr-defined]
    info = ClusterInfo(remote_cluster_id=1, remote_ip_infos=(IpInfo(LOCALHOST, p.dd.listening_port),))
    d.dd.unlink_llm_clusters([info])
    assert entity.peer.closed
    for call in _calls(d, lid, 1, rid) + _calls(p, rid, 2, lid):
        took, out = both_ways((p, d), call)
        assert not took and out[0] == "LLMNotYetLinkError"
    link(p, d)  # the other direction this time
    for call in _calls(d, lid, 1, rid) + _calls(p, rid, 2, lid):
        assert both_ways((p, d), call)[0]


def test_hixl_link_to_itself_copies_within_one_instance() -> None:
    """hixl: an instance linked to its own address under another id: source and destination are
    the same cache (overlapping runs) or two caches of one instance."""
    p = make_side(1, LlmRole.PROMPT, "hixl")
    try:
        rid = p.register(4, (8, 32))
        rid2 = p.register(4, (8, 32))
        link(p, p, remote_cluster_id=5)
        calls: list[Callable[[], None]] = [
            lambda: p.dd.pull_kv_cache(CacheIndex(5, rid, 1), Cache(rid), 2),
            lambda: p.dd.pull_kv_cache(CacheIndex(5, rid, 1), Cache(rid), 1),
            lambda: p.dd.pull_kv_blocks(CacheIndex(5, rid, 0), Cache(rid), [0, 1, 2], [1, 2, 3]),
            lambda: p.dd.push_kv_blocks(p.cache(rid), CacheIndex(5, rid, 0), [1, 2, 3], [0, 1, 2]),
            lambda: p.dd.push_kv_cache(p.cache(rid), CacheIndex(5, rid2, 0), 3),
        ]
        for call in calls:
            assert both_ways((p,), call)[0]
        took, out = both_ways((p,), lambda: p.dd.pull_kv_cache(CacheIndex(1, rid, 1), Cache(rid2)))
        assert not took and out[0] == "LLMParamInvalidError"  # its own cluster id
    finally:
        p.dd.finalize()


@pytest.mark.parametrize("shape", [(1, 1), (8,), (2, 1)])
def test_tiny_caches(pd: tuple[Side, Side], shape: tuple[int, ...]) -> None:
    """1-byte rows and tensors, against each other and against 32-byte rows."""
    p, d = pd
    r, big_r = p.register(2, shape), p.register(2, (8, 32))
    lo, big_l = d.register(2, shape), d.register(2, (8, 32))
    link(d, p)
    for rr, ll in ((r, lo), (big_r, lo), (r, big_l)):
        for call in _calls(d, ll, 1, rr):
            both_ways((p, d), call)
        both_ways((p, d), lambda: d.dd.pull_kv_blocks(CacheIndex(1, rr, 0), Cache(ll), [0], [0]))


@pytest.mark.parametrize("remote", [(4, 64), (16, 16), (5, 48), (3, 100)])
def test_row_transfers_between_different_strides(pd: tuple[Side, Side], remote: tuple[int, int]) -> None:
    """PullKvCache reads the remote row at row x L.S (the quirk), PushKvCache writes L.S bytes at
    row x R.S: every row and size around the bounds, both ways."""
    p, d = pd
    rid = p.register(4, remote)
    lid = d.register(4, (8, 32))
    link(d, p)
    for row in range(0, 10):
        for size in (-1, 1, 16, 32, 33, 48, 64):
            both_ways((p, d), lambda: d.dd.pull_kv_cache(CacheIndex(1, rid, row), Cache(lid), row % 8, size))
        both_ways((p, d), lambda: d.dd.push_kv_cache(d.cache(lid), CacheIndex(1, rid, row), row % 8))
        both_ways((p, d), lambda: p.dd.push_kv_cache(p.cache(rid), CacheIndex(2, lid, row), row % remote[0]))
