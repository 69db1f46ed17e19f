"""The reference model's lifecycle (see :mod:`tests.property.model`): faults, initialization, roles,
links and registration, §3.2-§3.9 of SEMANTICS.md."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from .model_state import (
    ALREADY_LINK, Arena, ClusterLike, DescLike, EXIST_LINK, Entity, ExtLike, FAILED,
    FEATURE_NOT_ENABLED, Instance, KV_CACHE_NOT_EXIST, LINK_FAILED, PARAM_INVALID, Registration,
    SUCCESS, UNLINK_FAILED, comm_res_ok, device_id_ok, digits, ipv4, listen_ok, parsed, stream_int,
    tensor_bytes,
)

# ---- the model ----------------------------------------------------------------------------------


@dataclass
class Fault:
    """An armed one-shot injection: the next ``kind`` call of cluster ``instance`` that reaches
    its injection point returns ``status`` (kvdd.sim.faults, as documented there)."""

    kind: str
    instance: int
    status: int


class Lifecycle:
    """Instances of one process plus the arena: initialization, roles, links and registration
    (§3.2-§3.9); every method returns what the call returns.  :class:`World` adds the transfers."""

    LOCAL = "127.0.0.1"

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.instances: list[Instance] = []
        self.faults: list[Fault] = []

    def add(self, cluster_id: int, role: int) -> Instance:
        inst = Instance(cluster_id, role)
        self.instances.append(inst)
        return inst

    def listener_at(self, ip: str, port: int) -> Instance | None:
        if ip != self.LOCAL:
            return None
        for inst in self.instances:
            if inst.listening and inst.port == port:
                return inst
        return None

    def _fault(self, kind: str, me: Instance) -> int:
        for i, f in enumerate(self.faults):
            if f.kind == kind and f.instance == me.cluster_id:
                del self.faults[i]
                return f.status
        return SUCCESS

    # -- §3.2 / §3.3 / §3.4 ---------------------------------------------------------------------
    def initialize(self, me: Instance, options: dict[str, str]) -> int:
        if me.initialized:
            return SUCCESS  # step 1
        if me.role not in (1, 2, 3):
            return PARAM_INVALID
        if not device_id_ok(options):
            return PARAM_INVALID
        listen = options.get("llm.ListenIpInfo")
        if listen is not None and not listen_ok(listen):
            return PARAM_INVALID
        tb = options.get("llm.TransferBackend")
        if tb is not None and tb != "hixl":
            return PARAM_INVALID
        backend = "hixl" if tb == "hixl" else "comm"
        if backend == "comm":
            for key, lo, hi in (("llm.RdmaTrafficClass", -(2**32 - 1), 2**32 - 1),  # uint32: '-' wraps
                                ("llm.RdmaServiceLevel", -(2**32 - 1), 2**32 - 1),
                                ("llm.LinkTotalTime", -(2**31), 2**31 - 1),
                                ("llm.LinkRetryCount", 1, 100)):
                if key in options:
                    v = stream_int(options[key])
                    if v is None or not lo <= v <= hi:
                        return PARAM_INVALID
        else:
            if listen is None:
                return PARAM_INVALID
            grc = options.get("llm.GlobalResourceConfig")
            if grc:  # §3.2 step 8: empty skipped, else a JSON object (known keys not generated)
                try:
                    doc = json.loads(grc)
                except ValueError:
                    return PARAM_INVALID
                if not isinstance(doc, dict):
                    return PARAM_INVALID
        wait = options.get("llm.SyncKvCacheWaitTime")
        if wait is not None and not digits(wait):
            return PARAM_INVALID
        if backend == "hixl" and options.get("llm.LocalCommRes"):
            try:
                json.loads(options["llm.LocalCommRes"])  # §3.2 step 8: valid JSON on hixl
            except ValueError:
                return PARAM_INVALID
        me.initialized = True
        me.backend = backend
        me.comm_res_text = options.get("llm.LocalCommRes") or None  # empty counts as absent
        # §3.2 step 8: without llm.LocalCommRes, a listen IP makes Initialize generate the local
        # comm resource (kept after SetRole stops listening; a listener SetRole starts makes none)
        me.has_comm_res = me.comm_res_text is not None or listen is not None
        me.listening = listen is not None
        if listen is not None:
            ip, port = parsed(listen)
            me.listen_port_text = port if backend == "comm" else None
            me.local_engine = f"{ip}:{port}" if backend == "hixl" else None
        return SUCCESS

    def finalize(self, me: Instance) -> None:
        if me.initialized:
            me.reset()  # the peers keep their (now stale) entities for us

    def set_role(self, me: Instance, role: int, options: dict[str, str]) -> int:
        if not me.initialized:
            return FAILED
        if role not in (1, 2, 3):
            return PARAM_INVALID
        listen = options.get("llm.ListenIpInfo")
        if listen is not None and not listen_ok(listen):
            return PARAM_INVALID
        if me.backend == "comm":
            if me.entities:
                return EXIST_LINK
            if listen is not None:
                port = parsed(listen)[1]  # §3.4 step 4: the normalized port text
                if not (me.listening and me.listen_port_text == port):
                    me.listening = True
                    me.port = None  # a new socket: the test reads the new port
                    me.listen_port_text = port
            else:
                me.listening = False
                me.port = None
                me.listen_port_text = None
        else:
            if listen is not None and ":".join(parsed(listen)) != me.local_engine:
                return FEATURE_NOT_ENABLED  # §3.4 step 5: parsed ip:port compared
        me.role = role
        return SUCCESS

    # -- §3.5 / §3.6 ----------------------------------------------------------------------------
    def _clusters_ok(self, clusters: Sequence[ClusterLike], timeout_ms: int) -> int:
        if timeout_ms <= 0:
            return PARAM_INVALID
        for c in clusters:
            for info in (*c.remote_ip_infos, *c.local_ip_infos):
                if info.ip == "" or not ipv4(info.ip):
                    return PARAM_INVALID
        if not clusters:
            return PARAM_INVALID
        return SUCCESS

    def link(self, me: Instance, clusters: Sequence[ClusterLike], timeout_ms: int) -> tuple[int, list[int]]:
        if not me.initialized:
            return FAILED, []
        st = self._clusters_ok(clusters, timeout_ms)
        if st != SUCCESS:
            return st, []
        rets = [self._link_one(me, c) for c in clusters]
        overall = SUCCESS
        for r in rets:
            if r != SUCCESS:
                overall = r  # the last failing cluster wins
        return overall, rets

    def _link_one(self, me: Instance, c: ClusterLike) -> int:
        if len(c.remote_ip_infos) != 1:
            return PARAM_INVALID
        if me.backend == "comm" and not me.has_comm_res:
            if len(c.local_ip_infos) != 1:
                return PARAM_INVALID
            me.has_comm_res = True  # generated once from local_ip_infos[0]
        remote = c.remote_ip_infos[0]
        address = (remote.ip, remote.port)
        if me.backend == "hixl" and address in me.hixl_addrs:
            return ALREADY_LINK
        st = self._fault("link", me)  # faults: in place of connecting
        if st != SUCCESS:
            return st
        peer = self.listener_at(remote.ip, remote.port)
        if peer is None:
            return LINK_FAILED  # kvdd rule 6: connection refused
        assert peer.backend == me.backend, "the tests keep one transfer backend per world"
        if me.backend == "hixl":
            # §3.5: re-points the id; the entity it named keeps its connection open
            ent = Entity(peer, address, dict(peer.published))
            me.entities[c.remote_cluster_id] = ent
            me.hixl_addrs[address] = ent
            return SUCCESS
        force = c.remote_cluster_id not in me.entities  # §3.5 d
        st = self._accept(peer, me, force, ("", 0))  # the peer runs the acceptance first (f)
        if st != SUCCESS:
            return st
        return self._accept(me, peer, force, address)

    def _accept(self, acceptor: Instance, other: Instance, force: bool, address: tuple[str, int]) -> int:
        if not (comm_res_ok(acceptor.comm_res_text) and comm_res_ok(other.comm_res_text)):
            return PARAM_INVALID
        key = other.cluster_id  # keyed by the other side's real id (§2.3)
        if force:
            acceptor.entities.pop(key, None)
        if key in acceptor.entities:
            return ALREADY_LINK
        acceptor.entities[key] = Entity(other, address, dict(other.published))
        return SUCCESS

    def _destroy(self, me: Instance, key: int) -> None:
        ent = me.entities.pop(key, None)
        if ent is not None and me.hixl_addrs.get(ent.address) is ent:
            del me.hixl_addrs[ent.address]

    def unlink(self, me: Instance, clusters: Sequence[ClusterLike], timeout_ms: int,
               force: bool) -> tuple[int, list[int]]:
        if not me.initialized:
            return FAILED, []
        st = self._clusters_ok(clusters, timeout_ms)
        if st != SUCCESS:
            return st, []
        rets = [self._unlink_one(me, c, force) for c in clusters]
        overall = SUCCESS
        for r in rets:
            if r != SUCCESS:
                overall = r
        return overall, rets

    def _unlink_one(self, me: Instance, c: ClusterLike, force: bool) -> int:
        if me.backend == "hixl" or force:
            st = self._fault("unlink", me)
            if st != SUCCESS:
                return st
            self._destroy(me, c.remote_cluster_id)
            return SUCCESS
        if len(c.remote_ip_infos) != 1:
            return PARAM_INVALID
        st = self._fault("unlink", me)
        if st != SUCCESS:
            return st
        remote = c.remote_ip_infos[0]
        peer = self.listener_at(remote.ip, remote.port)
        if peer is None:
            return UNLINK_FAILED
        if peer is not me:
            self._destroy(peer, me.cluster_id)
        self._destroy(me, c.remote_cluster_id)
        return SUCCESS

    # -- §3.7 / §3.8 / §3.9 ----------------------------------------------------------------------
    def register(self, me: Instance, desc: DescLike, addrs: Sequence[int]) -> tuple[int, int | None]:
        if not me.initialized:
            return FAILED, None
        if len(addrs) == 0:
            return PARAM_INVALID, None
        if len(addrs) != desc.num_tensors:
            return PARAM_INVALID, None
        if any(a == 0 for a in addrs):
            return PARAM_INVALID, None
        if len(desc.shape) == 0 or len(desc.shape) >= 32:
            return PARAM_INVALID, None
        cache_id = me.next_cache_id  # step 7: consumed from here on
        me.next_cache_id += 1
        T = tensor_bytes(desc.shape, desc.data_type)
        if T is None:
            return PARAM_INVALID, None
        if not all(self.arena.accessible(a, T) for a in addrs):
            return FAILED, None  # kvdd rule 4
        st = self._fault("register", me)
        if st != SUCCESS:
            return st, None
        me.caches[cache_id] = Registration(me, cache_id, len(addrs), T, desc.shape[0] & 0xFFFFFFFF,
                                           tuple(addrs))
        if not self._publish(me):
            return PARAM_INVALID, None  # the entry stays registered, unpublished (§3.7 step 10)
        return SUCCESS, cache_id

    @staticmethod
    def _publish(me: Instance) -> bool:
        """§3.7 step 10: peers read the last cache table that fit 1 MiB."""
        if 24 + sum(64 + 8 * r.n for r in me.caches.values()) > 1 << 20:
            return False
        me.published = dict(me.caches)
        return True

    def unregister(self, me: Instance, cache_id: int) -> int:
        if not me.initialized:
            return FAILED
        reg = me.caches.pop(cache_id, None)
        if reg is not None:
            reg.alive = False
            self._publish(me)
        return SUCCESS

    @staticmethod
    def unsupported() -> int:
        return FEATURE_NOT_ENABLED  # §3.9, even uninitialized

    # -- transfers: shared pieces ------------------------------------------------------------
    @staticmethod
    def _ext_ok(ext: ExtLike, equal_len: bool) -> bool:
        (s0, s1), (d0, d1), t = ext.src_layer_range, ext.dst_layer_range, ext.tensor_num_per_layer
        if not (s0 >= -1 and s1 >= -1 and s0 <= s1):
            return False
        if not (d0 >= -1 and d1 >= -1 and d0 <= d1):
            return False
        if t <= 0:
            return False
        return not (equal_len and s1 - s0 != d1 - d0)

    @staticmethod
    def _lookup(ent: Entity, cache_id: int) -> Registration | None:
        """§3.10 step 13 with rule 3: the link's snapshot (a stale entry is still found here;
        rule 2 turns it into KV_CACHE_NOT_EXIST at the transfer, after the checks that upstream
        runs on the stale entry)."""
        if cache_id <= 0:
            return None
        return ent.snapshot.get(cache_id)
