"""An independent, deliberately simple reference model of SEMANTICS.md (LLM-DataDist V2 + kvdd rules).

Written from docs/spec/SEMANTICS.md only: it imports nothing from ``kvdd`` (the status
numbers and the data-type table are restated from §1 and §5), so a bug in the simulator cannot be
copied into the expectation.  It models *instances in one process* (several ``World`` instances
sharing one flat byte arena), which is what the property tests drive.

What it predicts for every call: the status (and ``rets`` for link/unlink, the cache id for
registration) and every byte of the arena afterwards.  Transfers are modelled as the formulas of
§3.10-§3.13 applied run by run with ``memmove`` semantics (kvdd rule 11).

Section references (§) are to SEMANTICS.md.  Where the spec leaves an order open the choice is
commented (``ORDER:``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .model_links import Fault, Lifecycle
from .model_state import (
    Arena, CacheLike, Entity, ExtLike, FAILED, IndexLike, Instance, KV_CACHE_NOT_EXIST,
    NOT_YET_LINK, PARAM_INVALID, Registration, SUCCESS, TIMEOUT,
)

__all__ = ["Arena", "Fault", "Instance", "SUCCESS", "World"]


class World(Lifecycle):
    """Instances of one process plus the arena; every method returns what the call returns."""

    def _transfer_point(self, me: Instance, ent: Entity, kind: str, remote: Registration,
                        first: bool = True) -> int:
        """Where bytes would move: broken link (rule 8), injected fault, gone owner (rule 2)."""
        if ent.broken:
            return TIMEOUT
        if first:
            st = self._fault(kind, me)
            if st != SUCCESS:
                if st == TIMEOUT:
                    ent.broken = True
                return st
        if not remote.alive:
            return KV_CACHE_NOT_EXIST
        return SUCCESS

    def _copy(self, dst: Sequence[int], dst_off: Sequence[int], src: Sequence[int],
              src_off: Sequence[int], length: Sequence[int]) -> None:
        """k outer, run inner, each run a memmove (kvdd rule 11)."""
        for d_addr, s_addr in zip(dst, src):
            for do, so, ln in zip(dst_off, src_off, length):
                if ln:
                    self.arena.move(d_addr + do, s_addr + so, ln)

    @staticmethod
    def _groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
        """§3.11 step 7."""
        out: list[tuple[int, int, int]] = []
        for s, d in zip(src, dst):
            if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
                s0, d0, ln = out[-1]
                out[-1] = (s0, d0, ln + 1)
            else:
                out.append((s, d, 1))
        return out

    def _pull_prefix(self, me: Instance, idx: IndexLike, dst_cache: CacheLike, batch_index: int,
                     size: int, ext: ExtLike
                     ) -> tuple[int, Registration | None, Entity | None, range | None, range | None]:
        """§3.10 steps 4-11 (shared by PullKvBlocks, §3.11 step 6)."""
        t = ext.tensor_num_per_layer
        (s0, s1), (d0, d1) = ext.src_layer_range, ext.dst_layer_range
        src_list = dst_list = None
        if s0 >= 0 and d0 >= 0:
            src_list = range(s0 * t, (s1 + 1) * t)
            dst_list = range(d0 * t, (d1 + 1) * t)
        if idx.cluster_id == me.cluster_id:
            return PARAM_INVALID, None, None, None, None
        local = me.caches.get(dst_cache.cache_id)
        if local is None:
            return KV_CACHE_NOT_EXIST, None, None, None, None
        if batch_index >= local.B:
            return PARAM_INVALID, None, None, None, None
        if size > 0 and size > local.S:
            return PARAM_INVALID, None, None, None, None
        if src_list is not None and dst_list is not None:
            if local.n % t != 0:
                return PARAM_INVALID, None, None, None, None
            if len(dst_list) > local.n or dst_list[0] >= local.n or dst_list[-1] >= local.n:
                return PARAM_INVALID, None, None, None, None
            if len(src_list) != len(dst_list):
                return PARAM_INVALID, None, None, None, None
        ent = me.entities.get(idx.cluster_id)
        if ent is None:
            return NOT_YET_LINK, None, None, None, None
        return SUCCESS, local, ent, src_list, dst_list

    # -- §3.10 ---------------------------------------------------------------------------------
    def pull_kv_cache(self, me: Instance, idx: IndexLike, dst_cache: CacheLike, batch_index: int,
                      size: int, ext: ExtLike) -> int:
        if not me.initialized:
            return FAILED
        if not (size == -1 or size > 0):
            return PARAM_INVALID
        if not self._ext_ok(ext, False):
            return PARAM_INVALID
        st, local, ent, src_list, dst_list = self._pull_prefix(me, idx, dst_cache, batch_index, size, ext)
        if st != SUCCESS:
            return st
        assert local is not None and ent is not None
        remote = self._lookup(ent, idx.cache_id)
        if remote is None:
            return KV_CACHE_NOT_EXIST
        if src_list is None and remote.n != local.n:
            return PARAM_INVALID
        nbytes = size if size > 0 else local.S
        if nbytes > remote.S:
            return PARAM_INVALID
        if local.ragged or remote.ragged:
            return PARAM_INVALID  # rule 10
        rtensors = src_list if src_list is not None else range(local.n)
        if rtensors[-1] >= remote.n:
            return PARAM_INVALID  # rule 1 (§7.8)
        src_off = idx.batch_index * local.S  # quirk: the local stride
        if src_off + nbytes > remote.T:
            return PARAM_INVALID  # rule 1
        ltensors = dst_list if dst_list is not None else range(local.n)
        st = self._transfer_point(me, ent, "pull_kv_cache", remote)
        if st != SUCCESS:
            return st
        self._copy([local.addrs[i] for i in ltensors], [batch_index * local.S],
                   [remote.addrs[i] for i in rtensors], [src_off], [nbytes])
        return SUCCESS

    # -- §3.11 ---------------------------------------------------------------------------------
    def pull_kv_blocks(self, me: Instance, idx: IndexLike, dst_cache: CacheLike,
                       src_blocks: Sequence[int], dst_blocks: Sequence[int], ext: ExtLike) -> int:
        if not me.initialized:
            return FAILED
        if idx.batch_index != 0:
            return PARAM_INVALID
        if not self._ext_ok(ext, False):
            return PARAM_INVALID
        if len(src_blocks) == 0:
            return PARAM_INVALID
        if len(src_blocks) != len(dst_blocks):
            return PARAM_INVALID
        st, local, ent, src_list, dst_list = self._pull_prefix(me, idx, dst_cache, 0, -1, ext)
        if st != SUCCESS:
            return st
        assert local is not None and ent is not None
        groups = self._groups(src_blocks, dst_blocks)
        K = len(dst_list) if dst_list is not None else local.n
        if 120 + 16 * (K + 2 * len(groups)) > (2 << 20) - 8:
            return PARAM_INVALID
        for _s0, d0, ln in groups:
            if d0 >= local.B or d0 + ln - 1 >= local.B:
                return PARAM_INVALID
        remote = self._lookup(ent, idx.cache_id)
        if remote is None:
            return KV_CACHE_NOT_EXIST
        if src_list is None and remote.n != local.n:
            return PARAM_INVALID
        S = local.S
        if S == 0:
            return PARAM_INVALID  # ragged (rule 10); also keeps step 11 from dividing by 0
        for s0, _d0, ln in groups:
            if s0 >= -(-remote.T // S) or ln * S > remote.T:
                return PARAM_INVALID
        if local.ragged or remote.ragged:
            return PARAM_INVALID
        rtensors = src_list if src_list is not None else range(local.n)
        if rtensors[-1] >= remote.n:
            return PARAM_INVALID  # rule 1
        lengths = [g[2] * S for g in groups]
        if remote.T % S:  # §3.11 quirk: the last group copies only R.T % L.S bytes
            lengths[-1] = remote.T % S
        if any(g[0] * S + n > remote.T for g, n in zip(groups, lengths)):
            return PARAM_INVALID  # rule 1: a run that starts in range but ends past the tensor
        ltensors = dst_list if dst_list is not None else range(local.n)
        st = self._transfer_point(me, ent, "pull_kv_blocks", remote)
        if st != SUCCESS:
            return st
        self._copy([local.addrs[i] for i in ltensors], [g[1] * S for g in groups],
                   [remote.addrs[i] for i in rtensors], [g[0] * S for g in groups], lengths)
        return SUCCESS

    # -- §3.12 / §3.13 -------------------------------------------------------------------------
    def _push_plan(self, src_cache: CacheLike, ext: ExtLike) -> int | Iterator[tuple[int, int]]:
        """Steps 4-6 of §3.12 (7 of §3.13): PARAM_INVALID or the layer plan (lazy: a plan may
        name 2**32 layers, and the loop stops at the first layer that fails)."""
        if not self._ext_ok(ext, True):
            return PARAM_INVALID
        t = ext.tensor_num_per_layer
        (s0, s1), (d0, _d1) = ext.src_layer_range, ext.dst_layer_range
        u = src_cache.cache_desc.num_tensors
        if s0 < 0 and not (s0 == -1 and u > 0):
            return PARAM_INVALID
        if s0 >= 0 and s0 == s1:
            return iter([(s0, d0)])
        if s0 == -1:
            m = 0 if u < t else (u // t - 1 if u % t == 0 else u // t)
            return ((layer, layer) for layer in range(m + 1))
        return ((layer, d0 + (layer - s0)) for layer in range(s0, s1 + 1))

    def _push_layer(self, me: Instance, src_cache: CacheLike, idx: IndexLike, t: int, ld: int
                    ) -> tuple[int, Registration | None, Entity | None, Registration | None]:
        local = me.caches.get(src_cache.cache_id)  # a
        if local is None:
            return KV_CACHE_NOT_EXIST, None, None, None
        ent = me.entities.get(idx.cluster_id)  # b
        if ent is None:
            return NOT_YET_LINK, None, None, None
        remote = self._lookup(ent, idx.cache_id)  # c
        if remote is None:
            return KV_CACHE_NOT_EXIST, None, None, None
        if ld < 0 or ld >= remote.n // t:  # d
            return PARAM_INVALID, None, None, None
        return SUCCESS, local, ent, remote

    def push_kv_cache(self, me: Instance, src_cache: CacheLike, idx: IndexLike, src_batch_index: int,
                      size: int, ext: ExtLike) -> int:
        if not me.initialized:
            return FAILED
        if src_cache.cache_desc.placement != 1:
            return PARAM_INVALID
        if size != -1:
            return PARAM_INVALID
        plan = self._push_plan(src_cache, ext)
        if isinstance(plan, int):
            return plan
        t = ext.tensor_num_per_layer
        bd = idx.batch_index
        for i, (ls, ld) in enumerate(plan):
            st, local, ent, remote = self._push_layer(me, src_cache, idx, t, ld)
            if st != SUCCESS:
                return st
            assert local is not None and ent is not None and remote is not None
            if bd >= remote.B:  # e
                return PARAM_INVALID
            if ls >= local.n // t or local.n % t != 0:  # f, g
                return PARAM_INVALID
            if src_batch_index >= local.B:  # h
                return PARAM_INVALID
            if local.ragged or remote.ragged:
                return PARAM_INVALID
            dst_off = bd * remote.S
            if dst_off + local.S > remote.T:
                return PARAM_INVALID  # rule 1
            st = self._transfer_point(me, ent, "push_kv_cache", remote, first=i == 0)
            if st != SUCCESS:
                return st
            self._copy([remote.addrs[ld * t + k] for k in range(t)], [dst_off],
                       [local.addrs[ls * t + k] for k in range(t)], [src_batch_index * local.S],
                       [local.S])
        return SUCCESS

    def push_kv_blocks(self, me: Instance, src_cache: CacheLike, idx: IndexLike,
                       src_blocks: Sequence[int], dst_blocks: Sequence[int], ext: ExtLike) -> int:
        if not me.initialized:
            return FAILED
        if src_cache.cache_desc.placement != 1:
            return PARAM_INVALID
        if len(src_blocks) == 0:
            return PARAM_INVALID
        if len(src_blocks) != len(dst_blocks):
            return PARAM_INVALID
        if idx.batch_index != 0:
            return PARAM_INVALID
        plan = self._push_plan(src_cache, ext)
        if isinstance(plan, int):
            return plan
        t = ext.tensor_num_per_layer
        groups = self._groups(src_blocks, dst_blocks)
        for i, (ls, ld) in enumerate(plan):
            st, local, ent, remote = self._push_layer(me, src_cache, idx, t, ld)
            if st != SUCCESS:
                return st
            assert local is not None and ent is not None and remote is not None
            if max(dst_blocks) >= remote.B:
                return PARAM_INVALID
            if ls >= local.n // t or local.n % t != 0:
                return PARAM_INVALID
            if any(s0 >= local.B or s0 + ln - 1 >= local.B for s0, _d0, ln in groups):
                return PARAM_INVALID
            if local.ragged or remote.ragged:
                return PARAM_INVALID
            S = local.S
            if any((d0 + ln) * S > remote.T for _s0, d0, ln in groups):
                return PARAM_INVALID  # rule 1
            st = self._transfer_point(me, ent, "push_kv_blocks", remote, first=i == 0)
            if st != SUCCESS:
                return st
            self._copy([remote.addrs[ld * t + k] for k in range(t)], [g[1] * S for g in groups],
                       [local.addrs[ls * t + k] for k in range(t)], [g[0] * S for g in groups],
                       [g[2] * S for g in groups])
        return SUCCESS
