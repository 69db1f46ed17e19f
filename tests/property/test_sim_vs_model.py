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

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule, run_state_machine_as_test

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, IpInfo, KvCacheExtParam, LLMError
from kvdd.sim import faults

from . import model as M
from .machine import ARENA, LOCAL, MachineBase, outcome
from .strategies import (BATCH, BLOCKS, DTYPES_BAD, DTYPES_OK, EXT, KINDS, LISTENS, SIZES, STATUSES, options,
                         shapes)


class SimVsModel(MachineBase):
    """The rules: every ``LlmDataDist`` method, often with invalid arguments, checked after each call
    against the model (:class:`machine.MachineBase` holds the state and the checks)."""

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
