"""Property test: arbitrary call sequences on two in-process simulator instances vs the reference model.

Hypothesis drives every method of ``kvdd.LlmDataDist`` (backend ``"sim"``) with arbitrary, often
invalid, arguments in arbitrary order on two instances that share one guarded memory arena
(:mod:`.arena`), and arms one-shot faults (:mod:`kvdd.sim.faults`) now and then.  After every call:

* the outcome is exactly what :mod:`.model` (written from SEMANTICS.md alone) predicts: success with
  its result, or an :class:`kvdd.LLMError` with its status (and ``rets``), or — for arguments that do
  not fit the C++ types — a ``TypeError``/``ValueError`` raised before the backend runs, with no
  effect;
* every byte of the arena equals the model's bytes (so nothing outside a transfer's targets moved);
* which instances listen agrees.

A crash or a hang fails the run (the stress suite adds a watchdog; here pytest's own timeout, if
any, applies).  Profiles: ``KVDD_HYPOTHESIS_PROFILE=ci`` (default) or ``long``; see conftest.py.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import kvdd
from kvdd import (
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    IpInfo,
    KvCacheExtParam,
    LLMError,
)
from kvdd.sim import faults

from . import model as M
from .arena import GuardedArena

ARENA = 32 << 10
GUARD = 16 << 10  # larger than any tensor generated: a range off the arena end hits the guard
LOCAL = "127.0.0.1"
T = TypeVar("T")

_arena: GuardedArena | None = None
_dead: socket.socket | None = None
_seeds = itertools.count(1)


def shared_arena() -> GuardedArena:
    """One arena for the whole session (refilled per example; instances are finalized first)."""
    global _arena
    if _arena is None:
        _arena = GuardedArena(ARENA, GUARD)
    return _arena


def dead_port() -> int:
    """A port bound on 127.0.0.1 but never listening: connecting is refused, and nobody else can
    take it while the session runs."""
    global _dead
    if _dead is None:
        _dead = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _dead.bind((LOCAL, 0))
    port: int = _dead.getsockname()[1]
    return port


# ---- strategies -------------------------------------------------------------------------------

DEVICE_IDS = ["0", "0", "0", "1", " 2", "+3", "", "-1", "abc", "0;", "0;1", "1x"]
LISTENS = ["127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:00", "127.0.0.1", "localhost:0", "1.1.1.1:-1",
           "127.0.0.1:x"]
WAITS = ["0", "1000", "abc", "+5", ""]
COMM_RES = ['{"version": "1.0"}', '{"version": "1.2"}', '{"version": "1.9"}', "mock"]
RETRIES = ["1", "5", "0", "101", "x"]
STATUSES = [kvdd.Status.LLM_TIMEOUT, kvdd.Status.LLM_LINK_FAILED, kvdd.Status.LLM_KV_CACHE_NOT_EXIST,
            kvdd.Status.LLM_FAILED, kvdd.Status.LLM_OUT_OF_MEMORY, kvdd.Status.LLM_UNLINK_FAILED]
DTYPES_OK = [3, 3, 3, 1, 2, 27, 9, 13, 29]  # INT32 x3, FLOAT16, INT8, BF16, INT64, STRING, INT4
DTYPES_BAD = [28, 5, 43, 200, -1]
KINDS = list(faults.CALL_KINDS)
STATUS_VALUES = {int(s) for s in kvdd.Status}


def options(data: st.DataObject, backend: str, good: bool) -> dict[str, str]:
    """Initialize options: mostly valid for ``backend``; with ``good`` False anything goes."""
    opts: dict[str, str] = {}
    draw = data.draw
    if good:
        opts["llm.DeviceId"] = "0"
        if backend == "hixl" or draw(st.booleans()):
            opts["llm.ListenIpInfo"] = "127.0.0.1:0"
        if backend == "hixl":
            opts["llm.TransferBackend"] = "hixl"
        return opts
    if draw(st.integers(0, 9)) > 0:
        opts["llm.DeviceId"] = draw(st.sampled_from(DEVICE_IDS))
    if draw(st.booleans()):
        opts["llm.ListenIpInfo"] = draw(st.sampled_from(LISTENS))
    if backend == "hixl":
        opts["llm.TransferBackend"] = draw(st.sampled_from(["hixl", "hixl", "hixl", "foo"]))
    elif draw(st.integers(0, 5)) == 0:
        opts["llm.TransferBackend"] = draw(st.sampled_from(["foo", ""]))
    if draw(st.integers(0, 3)) == 0:
        opts["llm.SyncKvCacheWaitTime"] = draw(st.sampled_from(WAITS))
    if draw(st.integers(0, 3)) == 0:
        opts["llm.LocalCommRes"] = draw(st.sampled_from(COMM_RES))
    if draw(st.integers(0, 4)) == 0:
        opts["llm.LinkRetryCount"] = draw(st.sampled_from(RETRIES))
    return opts


def layer_range() -> st.SearchStrategy[tuple[int, int]]:
    return st.one_of(
        st.just((-1, -1)), st.just((-1, -1)),
        st.sampled_from([(0, 2**31 - 1), (3, 2**31 - 1), (-1, 2**31 - 1), (2**31 - 1, 2**31 - 1)]),
        st.tuples(st.integers(-1, 5), st.integers(-1, 5)).map(lambda r: (min(r), max(r))),
        st.tuples(st.integers(-3, 6), st.integers(-3, 6)),
    )


EXT = st.one_of(
    st.none(), st.none(), st.none(),
    st.builds(KvCacheExtParam, src_layer_range=layer_range(), dst_layer_range=layer_range(),
              tensor_num_per_layer=st.sampled_from([2, 2, 2, 1, 1, 3, 5, 0, 255])),
)
SIZES = st.sampled_from([-1] * 8 + [0, -2, 1, 16, 32, 64, 65, 128, 512, 2**40])
BATCH = st.one_of(st.integers(0, 1), st.integers(0, 1), st.integers(0, 8), st.just(2**32 - 1))
HUGE_BLOCK = 2**64 - 1  # the largest uint64 block index (once an engine OverflowError)
BLOCKS = st.one_of(
    st.lists(st.integers(0, 3), min_size=1, max_size=4),
    st.lists(st.one_of(st.integers(0, 9), st.just(HUGE_BLOCK)), min_size=0, max_size=6),
)


def shapes() -> st.SearchStrategy[tuple[int, ...]]:
    good = st.lists(st.integers(1, 8), min_size=1, max_size=3).map(tuple)
    bad = st.sampled_from([(), (0,), (4, 0), (-1, 16), (1,) * 32, (1,) * 31, (2**40, 2**40),
                           (2**31,), (2, 5), (16, 1), (3, 3)])
    return st.one_of(good, good, good, bad)


# ---- the machine ------------------------------------------------------------------------------


def outcome(fn: Callable[[], T]) -> tuple[int, T | None, list[int] | None]:
    """Run a facade call: (status, result, rets)."""
    try:
        result = fn()
    except LLMError as exc:
        return int(exc.status), None, None if exc.rets is None else [int(r) for r in exc.rets]
    return M.SUCCESS, result, None


class SimVsModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.arena = shared_arena()
        self.arena.fill(next(_seeds))
        self.world = M.World(M.Arena(self.arena.base, self.arena.bytes()))
        self.dds: list[kvdd.LlmDataDist] = []
        self.insts: list[M.Instance] = []
        self.backend = "comm"
        self.injections: list[faults.Injection] = []

    # -- helpers ---------------------------------------------------------------------------
    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, len(self.dds) - 1), label="instance")

    def refresh_ports(self) -> None:
        for dd, inst in zip(self.dds, self.insts):
            port = dd.listen_port
            assert (port is not None) == inst.listening, (
                f"cluster {inst.cluster_id}: listening {port is not None}, model says {inst.listening}")
            inst.port = port

    def target(self, data: st.DataObject, i: int) -> tuple[int, int]:
        """(remote_cluster_id, port) for a link/unlink from instance i: usually the other one."""
        other = self.insts[1 - i]
        port = other.port if other.port is not None else dead_port()
        if data.draw(st.integers(0, 9)) == 0:
            port = dead_port()
        cid = data.draw(st.sampled_from([other.cluster_id] * 6 + [77, self.insts[i].cluster_id]),
                        label="remote_cluster_id")
        return cid, port

    def clusters(self, data: st.DataObject, i: int) -> list[ClusterInfo]:
        out = []
        for _ in range(data.draw(st.sampled_from([1, 1, 1, 1, 2, 0]), label="n_clusters")):
            cid, port = self.target(data, i)
            remote: tuple[IpInfo, ...] = (IpInfo(LOCAL, port),)
            shape = data.draw(st.integers(0, 12), label="remote_ip_shape")
            if shape == 0:
                remote = ()
            elif shape == 1:
                remote = (IpInfo(LOCAL, port), IpInfo(LOCAL, port))
            elif shape == 2:
                remote = (IpInfo(data.draw(st.sampled_from(["", "::1", "localhost", "1.2.3"])), port),)
            local: tuple[IpInfo, ...] = data.draw(st.sampled_from(
                [(IpInfo(LOCAL),), (IpInfo(LOCAL),), (), (IpInfo(LOCAL), IpInfo(LOCAL)),
                 (IpInfo("::1"),)]), label="local_ip_infos")
            out.append(ClusterInfo(remote_cluster_id=cid, local_ip_infos=local, remote_ip_infos=remote))
        return out

    def cache_id(self, data: st.DataObject, owner: int) -> int:
        known = sorted(self.insts[owner].caches) or [1]
        return data.draw(st.sampled_from(known * 4 + [0, -1, 1, 2, 99]), label="cache_id")

    def index(self, data: st.DataObject, i: int) -> CacheIndex:
        other = 1 - i
        cid = data.draw(st.sampled_from([self.insts[other].cluster_id] * 6 + [self.insts[i].cluster_id, 99]),
                        label="cluster_id")
        return CacheIndex(cluster_id=cid, cache_id=self.cache_id(data, other), batch_index=data.draw(BATCH))

    def check(self, what: str, got: tuple[int, Any, list[int] | None], want_status: int,
              want_result: object = None, want_rets: list[int] | None = None) -> None:
        status, result, rets = got
        event(f"{what.split('(')[0]} -> {kvdd.Status(want_status).name if want_status in STATUS_VALUES else want_status}")
        assert status == want_status, (
            f"{what}: got {kvdd.status_name(status)}, model predicts {kvdd.status_name(want_status)}")
        if want_status == M.SUCCESS and want_result is not None:
            assert result == want_result, f"{what}: got result {result!r}, model predicts {want_result!r}"
        if want_rets is not None and want_status != M.SUCCESS:
            assert rets == want_rets, f"{what}: got rets {rets}, model predicts {want_rets}"
        if want_rets is not None and want_status == M.SUCCESS:
            assert [int(r) for r in result] == want_rets, f"{what}: got rets {result}, model {want_rets}"

    # -- set-up ----------------------------------------------------------------------------
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.backend = data.draw(st.sampled_from(["comm", "comm", "comm", "hixl"]), label="backend")
        ids = data.draw(st.sampled_from([(1, 2), (1, 2), (2, 1), (0, 2**64 - 1), (5, 6)]), label="ids")
        for cid in ids:
            role = data.draw(st.sampled_from([1, 2, 3] * 6 + [0, 4]), label="role")
            self.dds.append(kvdd.LlmDataDist(cid, role, backend="sim"))
            self.insts.append(self.world.add(cid, role))
        if data.draw(st.integers(0, 3)) > 0:
            self.bootstrap(data)  # both up with a matching cache each, linked: transfers can succeed
        else:
            for i in range(2):
                if data.draw(st.integers(0, 4)) > 0:
                    self.do_initialize(i, options(data, self.backend, good=True))
        self.refresh_ports()

    def teardown(self) -> None:
        for inj in self.injections:
            inj.remove()
        for dd in self.dds:
            dd.finalize()

    @invariant()
    def bytes_and_listeners_agree(self) -> None:
        if not self.dds:
            return
        self.refresh_ports()
        got = self.arena.bytes()
        want = bytes(self.world.arena.mem)
        if got != want:
            diff = [k for k in range(len(got)) if got[k] != want[k]]
            raise AssertionError(f"arena differs from the model at {len(diff)} bytes, first at offset "
                                 f"{diff[0]} (got {got[diff[0]]}, model {want[diff[0]]})")

    # -- lifecycle -------------------------------------------------------------------------
    def do_initialize(self, i: int, opts: dict[str, str]) -> None:
        got = outcome(lambda: self.dds[i].initialize(opts))
        self.check(f"initialize({opts})", got, self.world.initialize(self.insts[i], opts))
        self.refresh_ports()

    @rule(data=st.data(), good=st.booleans())
    def initialize_(self, data: st.DataObject, good: bool) -> None:
        i = self.pick(data)
        self.do_initialize(i, options(data, self.backend, good))

    @rule(data=st.data())
    def finalize_(self, data: st.DataObject) -> None:
        i = self.pick(data)
        self.dds[i].finalize()
        self.world.finalize(self.insts[i])

    @rule(data=st.data(), role=st.sampled_from([1, 2, 3, 3, 0, 4]))
    def set_role(self, data: st.DataObject, role: int) -> None:
        i = self.pick(data)
        opts: dict[str, str] = {}
        if data.draw(st.booleans()):
            opts["llm.ListenIpInfo"] = data.draw(st.sampled_from(LISTENS))
        got = outcome(lambda: self.dds[i].set_role(role, opts))
        self.check(f"set_role({role}, {opts})", got, self.world.set_role(self.insts[i], role, opts))
        self.refresh_ports()

    # -- links -----------------------------------------------------------------------------
    @rule(data=st.data(), timeout=st.sampled_from([1000, 1000, 1000, 0, -1]))
    def link(self, data: st.DataObject, timeout: int) -> None:
        i = self.pick(data)
        clusters = self.clusters(data, i)
        got = outcome(lambda: self.dds[i].link_llm_clusters(clusters, timeout))
        want, rets = self.world.link(self.insts[i], clusters, timeout)
        self.check(f"link({clusters}, {timeout})", got, want, want_rets=rets)

    @rule(data=st.data(), timeout=st.sampled_from([1000, 1000, 0]), force=st.booleans())
    def unlink(self, data: st.DataObject, timeout: int, force: bool) -> None:
        i = self.pick(data)
        clusters = self.clusters(data, i)
        got = outcome(lambda: self.dds[i].unlink_llm_clusters(clusters, timeout, force))
        want, rets = self.world.unlink(self.insts[i], clusters, timeout, force)
        self.check(f"unlink({clusters}, {timeout}, force={force})", got, want, want_rets=rets)

    # -- registration ----------------------------------------------------------------------
    @rule(data=st.data(), shape=shapes(), bad_dtype=st.integers(0, 9))
    def register(self, data: st.DataObject, shape: tuple[int, ...], bad_dtype: int) -> None:
        i = self.pick(data)
        dtype = data.draw(st.sampled_from(DTYPES_BAD if bad_dtype == 0 else DTYPES_OK), label="dtype")
        if dtype == 29 and max(shape, default=0) >= 2**20:
            dtype = 3  # sub-byte sizes past 2**31 bits are undefined upstream (§5); not modelled
        n = data.draw(st.sampled_from([1, 2, 2, 4, 4, 6]), label="n")
        offsets = st.one_of(st.integers(0, ARENA // 64 - 1).map(lambda k: k * 64),
                            st.integers(-4096, ARENA - 1))
        addrs = [self.arena.base + data.draw(offsets, label="offset") for _ in range(n)]
        extra = data.draw(st.integers(0, 15), label="addr_twist")
        if extra == 0:
            addrs[-1] = 0
        elif extra == 1:
            addrs[0] = 1
        elif extra == 2:
            addrs.append(self.arena.base)
        elif extra == 3:
            addrs[0] = 2**64 - 16
        num = n if data.draw(st.integers(0, 9)) else data.draw(st.integers(0, 7))
        placement = data.draw(st.sampled_from([1, 1, 0]), label="placement")
        desc = CacheDesc(num_tensors=num, data_type=dtype, shape=shape, placement=placement)
        got = outcome(lambda: self.dds[i].register_kv_cache(desc, addrs))
        want, cache_id = self.world.register(self.insts[i], desc, addrs)
        self.check(f"register({desc}, {len(addrs)} addrs)", got, want, want_result=cache_id)

    @rule(data=st.data())
    def unregister(self, data: st.DataObject) -> None:
        i = self.pick(data)
        cid = self.cache_id(data, i)
        got = outcome(lambda: self.dds[i].unregister_kv_cache(cid))
        self.check(f"unregister({cid})", got, self.world.unregister(self.insts[i], cid))

    @rule(data=st.data(), which=st.integers(0, 3))
    def unsupported(self, data: st.DataObject, which: int) -> None:
        dd = self.dds[self.pick(data)]
        calls: list[Callable[[], object]] = [
            lambda: dd.allocate_cache(CacheDesc()), lambda: dd.deallocate_cache(0),
            lambda: dd.copy_kv_cache(Cache(), Cache()), lambda: dd.copy_kv_blocks(Cache(), Cache(), [0], [[0]])]
        self.check("unsupported", outcome(calls[which]), self.world.unsupported())

    # -- transfers -------------------------------------------------------------------------
    @rule(data=st.data(), batch_index=BATCH, size=SIZES, ext=EXT)
    def pull_kv_cache(self, data: st.DataObject, batch_index: int, size: int,
                      ext: KvCacheExtParam | None) -> None:
        i = self.pick(data)
        idx = self.index(data, i)
        dst = Cache(cache_id=self.cache_id(data, i))
        got = outcome(lambda: self.dds[i].pull_kv_cache(idx, dst, batch_index, size, ext))
        want = self.world.pull_kv_cache(self.insts[i], idx, dst, batch_index, size, ext or KvCacheExtParam())
        self.check(f"pull_kv_cache({idx}, {dst.cache_id}, {batch_index}, {size}, {ext})", got, want)

    @rule(data=st.data(), src=BLOCKS, dst_blocks=BLOCKS, ext=EXT)
    def pull_kv_blocks(self, data: st.DataObject, src: list[int], dst_blocks: list[int],
                       ext: KvCacheExtParam | None) -> None:
        i = self.pick(data)
        idx = self.index(data, i)
        if data.draw(st.integers(0, 3)):
            idx = CacheIndex(idx.cluster_id, idx.cache_id, 0)
        if data.draw(st.integers(0, 2)):
            dst_blocks = (dst_blocks + src)[:len(src)]
        dst = Cache(cache_id=self.cache_id(data, i))
        got = outcome(lambda: self.dds[i].pull_kv_blocks(idx, dst, src, dst_blocks, ext))
        want = self.world.pull_kv_blocks(self.insts[i], idx, dst, src, dst_blocks, ext or KvCacheExtParam())
        self.check(f"pull_kv_blocks({idx}, {dst.cache_id}, {src}, {dst_blocks}, {ext})", got, want)

    def src_cache(self, data: st.DataObject, i: int) -> Cache:
        cid = self.cache_id(data, i)
        reg = self.insts[i].caches.get(cid)
        n = reg.n if reg is not None else 4
        huge = [2**32 - 1]
        num = data.draw(st.sampled_from([n, n, n, 0, 1, 3, 12, *huge]), label="num_tensors")
        placement = data.draw(st.sampled_from([1, 1, 1, 1, 0, 7]), label="placement")
        return Cache(cache_id=cid, cache_desc=CacheDesc(num_tensors=num, placement=placement))

    @rule(data=st.data(), src_batch=BATCH, size=st.sampled_from([-1, -1, -1, -1, 0, 64]), ext=EXT)
    def push_kv_cache(self, data: st.DataObject, src_batch: int, size: int,
                      ext: KvCacheExtParam | None) -> None:
        i = self.pick(data)
        src = self.src_cache(data, i)
        idx = self.index(data, i)
        got = outcome(lambda: self.dds[i].push_kv_cache(src, idx, src_batch, size, ext))
        want = self.world.push_kv_cache(self.insts[i], src, idx, src_batch, size, ext or KvCacheExtParam())
        self.check(f"push_kv_cache({src}, {idx}, {src_batch}, {size}, {ext})", got, want)

    @rule(data=st.data(), src_blocks=BLOCKS, dst_blocks=BLOCKS, ext=EXT)
    def push_kv_blocks(self, data: st.DataObject, src_blocks: list[int], dst_blocks: list[int],
                       ext: KvCacheExtParam | None) -> None:
        i = self.pick(data)
        src = self.src_cache(data, i)
        idx = self.index(data, i)
        if data.draw(st.integers(0, 3)):
            idx = CacheIndex(idx.cluster_id, idx.cache_id, 0)
        if data.draw(st.integers(0, 2)):
            dst_blocks = (dst_blocks + src_blocks)[:len(src_blocks)]
        got = outcome(lambda: self.dds[i].push_kv_blocks(src, idx, src_blocks, dst_blocks, ext))
        want = self.world.push_kv_blocks(self.insts[i], src, idx, src_blocks, dst_blocks,
                                         ext or KvCacheExtParam())
        self.check(f"push_kv_blocks({src}, {idx}, {src_blocks}, {dst_blocks}, {ext})", got, want)

    @rule(data=st.data(), which=st.integers(0, 3))
    def transfer_plausible(self, data: st.DataObject, which: int) -> None:
        """A transfer between known caches with mostly-default arguments (so that many succeed)."""
        i = self.pick(data)
        me, other = self.insts[i], self.insts[1 - i]
        if not me.caches or not other.caches:
            return
        mine = data.draw(st.sampled_from(sorted(me.caches)), label="mine")
        theirs = data.draw(st.sampled_from(sorted(other.caches)), label="theirs")
        b = data.draw(st.integers(0, 3), label="batch")
        blocks = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=4), label="blocks")
        dblocks = data.draw(st.permutations(range(4)), label="dst_blocks")[:len(blocks)]
        ext = data.draw(st.one_of(st.none(), st.builds(
            KvCacheExtParam, src_layer_range=st.sampled_from([(0, 0), (1, 1), (0, 1), (-1, -1)]),
            dst_layer_range=st.sampled_from([(0, 0), (1, 1), (0, 1), (-1, -1)]),
            tensor_num_per_layer=st.sampled_from([1, 2]))), label="ext")
        e = ext or KvCacheExtParam()
        dd, reg = self.dds[i], me.caches[mine]
        if which == 0:
            idx, dst = CacheIndex(other.cluster_id, theirs, b), Cache(cache_id=mine)
            got = outcome(lambda: dd.pull_kv_cache(idx, dst, b, -1, ext))
            want = self.world.pull_kv_cache(me, idx, dst, b, -1, e)
        elif which == 1:
            idx, dst = CacheIndex(other.cluster_id, theirs, 0), Cache(cache_id=mine)
            got = outcome(lambda: dd.pull_kv_blocks(idx, dst, blocks, dblocks, ext))
            want = self.world.pull_kv_blocks(me, idx, dst, blocks, dblocks, e)
        elif which == 2:
            src = Cache(cache_id=mine, cache_desc=CacheDesc(num_tensors=reg.n))
            idx = CacheIndex(other.cluster_id, theirs, b)
            got = outcome(lambda: dd.push_kv_cache(src, idx, b, -1, ext))
            want = self.world.push_kv_cache(me, src, idx, b, -1, e)
        else:
            src = Cache(cache_id=mine, cache_desc=CacheDesc(num_tensors=reg.n))
            idx = CacheIndex(other.cluster_id, theirs, 0)
            got = outcome(lambda: dd.push_kv_blocks(src, idx, blocks, dblocks, ext))
            want = self.world.push_kv_blocks(me, src, idx, blocks, dblocks, e)
        self.check(f"plausible_{['pull_kv_cache', 'pull_kv_blocks', 'push_kv_cache', 'push_kv_blocks'][which]}"
                   f"(mine={mine}, theirs={theirs}, b={b}, blocks={blocks}->{dblocks}, {ext})", got, want)

    # -- a productive shortcut: both sides up, one matching cache each, linked ----------------
    @rule(data=st.data())
    def bootstrap(self, data: st.DataObject) -> None:
        for i in range(2):
            if not self.insts[i].initialized:
                opts = {"llm.DeviceId": "0", "llm.ListenIpInfo": "127.0.0.1:0"}
                if self.backend == "hixl":
                    opts["llm.TransferBackend"] = "hixl"
                self.do_initialize(i, opts)
        shape = data.draw(st.sampled_from([(4, 16), (4, 16), (2, 32), (8, 8)]), label="boot_shape")
        n = data.draw(st.sampled_from([2, 4]), label="boot_n")
        for i in range(2):
            nbytes = 4 * shape[0] * shape[1]
            base = data.draw(st.integers(0, (ARENA - n * nbytes) // 64), label="boot_base") * 64
            addrs = [self.arena.base + base + k * nbytes for k in range(n)]
            desc = CacheDesc(num_tensors=n, data_type=3, shape=shape)
            got = outcome(lambda: self.dds[i].register_kv_cache(desc, addrs))
            want, cache_id = self.world.register(self.insts[i], desc, addrs)
            self.check("bootstrap register", got, want, want_result=cache_id)
        self.refresh_ports()
        i = self.pick(data)
        other = self.insts[1 - i]
        if other.port is not None:
            cl = [ClusterInfo(remote_cluster_id=other.cluster_id, local_ip_infos=(IpInfo(LOCAL),),
                              remote_ip_infos=(IpInfo(LOCAL, other.port),))]
            linked = outcome(lambda: self.dds[i].link_llm_clusters(cl))
            want, rets = self.world.link(self.insts[i], cl, 1000)
            self.check("bootstrap link", linked, want, want_rets=rets)

    # -- faults ------------------------------------------------------------------------------
    @rule(data=st.data(), kind=st.sampled_from(KINDS), status=st.sampled_from(STATUSES))
    def arm_fault(self, data: st.DataObject, kind: str, status: int) -> None:
        i = self.pick(data)
        cid = self.insts[i].cluster_id
        self.injections.append(faults.inject(kind, status=status, instance=cid, count=1))
        self.world.faults.append(M.Fault(kind, cid, int(status)))

    # -- arguments that do not fit the C++ types -----------------------------------------------
    @rule(data=st.data(), which=st.integers(0, 17))
    def bad_arguments(self, data: st.DataObject, which: int) -> None:
        dd = self.dds[self.pick(data)]
        idx = CacheIndex(1, 1)
        calls: list[Callable[[], object]] = [
            lambda: dd.initialize({"llm.DeviceId": 0}),  # type: ignore[dict-item]
            lambda: dd.initialize("llm.DeviceId=0"),  # type: ignore[arg-type]
            lambda: dd.set_role(True),
            lambda: dd.set_role(2**31),
            lambda: dd.link_llm_clusters([ClusterInfo()], 2**31),
            lambda: dd.link_llm_clusters(ClusterInfo()),  # type: ignore[arg-type]
            lambda: dd.unlink_llm_clusters([ClusterInfo()], 1000, 1),  # type: ignore[arg-type]
            lambda: dd.register_kv_cache(CacheDesc(1, 3, (1,)), [-1]),
            lambda: dd.register_kv_cache(CacheDesc(1, 3, (1,)), "abc"),  # type: ignore[arg-type]
            lambda: dd.register_kv_cache(None, [1]),  # type: ignore[arg-type]
            lambda: dd.unregister_kv_cache(2**63),
            lambda: dd.pull_kv_cache(idx, Cache(1), -1),
            lambda: dd.pull_kv_cache(idx, Cache(1), 0, 2**63),
            lambda: dd.pull_kv_cache(idx, 1),  # type: ignore[arg-type]
            lambda: dd.pull_kv_blocks(idx, Cache(1), [2**64], [0]),
            lambda: dd.push_kv_cache(Cache(1), idx, 2**32),
            lambda: dd.push_kv_blocks(Cache(1), idx, [0], [0.5]),  # type: ignore[list-item]
            lambda: dd.pull_kv_cache(idx, Cache(1), ext_param=(0, 0)),  # type: ignore[arg-type]
        ]
        with pytest.raises((TypeError, ValueError)) as info:
            calls[which]()
        assert not isinstance(info.value, LLMError), f"bad argument reached the backend: {info.value!r}"

    @rule(which=st.integers(0, 6))
    def bad_value_types(self, which: int) -> None:
        makers: list[Callable[[], object]] = [
            lambda: CacheIndex(-1, 1), lambda: CacheIndex(1, 1, 2**32),
            lambda: KvCacheExtParam(tensor_num_per_layer=256), lambda: KvCacheExtParam((0, 2**31), (0, 0)),
            lambda: CacheDesc(num_tensors=-1), lambda: IpInfo("127.0.0.1", 65536),
            lambda: ClusterInfo(remote_ip_infos=["127.0.0.1"]),  # type: ignore[list-item]
        ]
        with pytest.raises((TypeError, ValueError)):
            makers[which]()


TestSimVsModel = SimVsModel.TestCase


@pytest.mark.slow
def test_sim_vs_model_long() -> None:
    """The same machine with many more examples (``-m slow`` or the long profile)."""
    run_state_machine_as_test(SimVsModel, settings=settings(
        max_examples=max(settings().max_examples, 1500), stateful_step_count=80))
