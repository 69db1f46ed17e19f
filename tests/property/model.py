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

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# ---- §1 status codes --------------------------------------------------------------------------

SUCCESS = 0
FAILED = 0xFFFFFFFF
_B = 0x5010B000
KV_CACHE_NOT_EXIST = _B + 2
PARAM_INVALID = _B + 5
NOT_YET_LINK = _B + 7
ALREADY_LINK = _B + 8
LINK_FAILED = _B + 9
UNLINK_FAILED = _B + 10
EXIST_LINK = _B + 24
FEATURE_NOT_ENABLED = _B + 25
TIMEOUT = _B + 26

# ---- §5 element sizes, in bits ----------------------------------------------------------------

_BYTES = {0: 4, 1: 2, 2: 1, 3: 4, 4: 1, 6: 2, 7: 2, 8: 4, 9: 8, 10: 8, 11: 8, 12: 1, 13: 16, 14: 1,
          15: 1, 16: 8, 17: 16, 18: 1, 19: 2, 20: 4, 21: 1, 22: 2, 23: 8, 24: 16, 25: 5, 26: 8,
          27: 2, 33: 4, 34: 1, 35: 1, 36: 1, 37: 1}
_BITS = {29: 4, 30: 1, 31: 2, 32: 2, 38: 6, 39: 6, 40: 4, 41: 4}
INT64_MAX = 2**63 - 1


def tensor_bytes(shape: Sequence[int], data_type: int) -> int | None:
    """§2.1 / §3.7 step 8: T, or None where upstream returns PARAM_INVALID."""
    elements = 1
    for d in shape:
        if d <= 0:
            return None
        elements *= d
        if elements > INT64_MAX:
            return None
    if data_type in _BYTES:
        t = elements * _BYTES[data_type]
        return t if t <= INT64_MAX else None
    if data_type in _BITS:
        bits = elements * _BITS[data_type]
        # §5: the bit count is narrowed to int32 before the ceiling division; the property
        # tests keep it far below 2**31, where this is exact.
        if bits >= 2**31:
            raise NotImplementedError("sub-byte tensors of 2**31 bits or more are not modelled")
        return -(-bits // 8)
    return None  # DT_UNDEFINED, reserved 5, >= DT_MAX, negative


# ---- inputs (duck-typed: kvdd's value types fit, and so would any other) -----------------------


class IpInfoLike(Protocol):
    @property
    def ip(self) -> str: ...
    @property
    def port(self) -> int: ...


class ClusterLike(Protocol):
    @property
    def remote_cluster_id(self) -> int: ...
    @property
    def local_ip_infos(self) -> Sequence[IpInfoLike]: ...
    @property
    def remote_ip_infos(self) -> Sequence[IpInfoLike]: ...


class DescLike(Protocol):
    @property
    def num_tensors(self) -> int: ...
    @property
    def data_type(self) -> int: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def placement(self) -> int: ...


class CacheLike(Protocol):
    @property
    def cache_id(self) -> int: ...
    @property
    def cache_desc(self) -> DescLike: ...


class IndexLike(Protocol):
    @property
    def cluster_id(self) -> int: ...
    @property
    def cache_id(self) -> int: ...
    @property
    def batch_index(self) -> int: ...


class ExtLike(Protocol):
    @property
    def src_layer_range(self) -> tuple[int, int]: ...
    @property
    def dst_layer_range(self) -> tuple[int, int]: ...
    @property
    def tensor_num_per_layer(self) -> int: ...


# ---- state ------------------------------------------------------------------------------------


class Arena:
    """The bytes the tests own: ``[base, base + size)`` is readable and writable, the bytes just
    around it are not (guard pages), nothing else is ever addressed."""

    def __init__(self, base: int, data: bytes) -> None:
        self.base = base
        self.mem = bytearray(data)

    def accessible(self, addr: int, n: int) -> bool:
        """kvdd rule 4."""
        return n > 0 and addr >= self.base and addr + n <= self.base + len(self.mem)

    def move(self, dst: int, src: int, n: int) -> None:
        d, s = dst - self.base, src - self.base
        assert 0 <= d and d + n <= len(self.mem) and 0 <= s and s + n <= len(self.mem), "model bug"
        self.mem[d:d + n] = self.mem[s:s + n]  # slice copy first: memmove


@dataclass(eq=False)
class Registration:
    """§2.1: a registered cache on its owner."""

    owner: Instance
    cache_id: int
    n: int
    T: int
    B: int
    addrs: tuple[int, ...]
    alive: bool = True

    @property
    def S(self) -> int:
        return self.T // self.B if self.B else 0

    @property
    def ragged(self) -> bool:  # kvdd rule 10
        return self.S == 0 or self.T % self.S != 0


@dataclass(eq=False)
class Entity:
    """§2.3 a link entity; ``snapshot``: the peer's caches registered before the link (rule 3)."""

    peer: Instance
    address: tuple[str, int]
    snapshot: dict[int, Registration]
    broken: bool = False  # kvdd rule 8


@dataclass(eq=False)
class Instance:
    cluster_id: int
    role: int
    initialized: bool = False
    backend: str = "comm"
    listening: bool = False
    port: int | None = None  # the real port, told by the test (port 0 binds a free one)
    listen_port_text: str | None = None  # comm: normalized port text while listening (§3.4)
    local_engine: str | None = None  # hixl: "ip:port" of Initialize (§3.4 step 5)
    has_comm_res: bool = False
    comm_res_text: str | None = None
    next_cache_id: int = 1
    caches: dict[int, Registration] = field(default_factory=dict)
    published: dict[int, Registration] = field(default_factory=dict)  # §3.7 step 10
    entities: dict[int, Entity] = field(default_factory=dict)
    # hixl: open connections by address, re-pointed entities included (§3.5)
    hixl_addrs: dict[tuple[str, int], Entity] = field(default_factory=dict)

    def reset(self) -> None:
        for reg in self.caches.values():
            reg.alive = False
        self.initialized = False
        self.backend = "comm"
        self.listening = False
        self.port = None
        self.listen_port_text = None
        self.local_engine = None
        self.has_comm_res = False
        self.comm_res_text = None
        self.next_cache_id = 1
        self.caches = {}
        self.published = {}
        self.entities = {}
        self.hixl_addrs = {}


# ---- option parsing (§3.2) ----------------------------------------------------------------------

_WS = " \t\n\r\f\v"


def _stream_int(text: str) -> int | None:
    """``std::stringstream >> int``: leading whitespace, a sign, digits, nothing after."""
    t = text.lstrip(_WS)
    body = t[1:] if t[:1] in ("+", "-") else t
    if not body or not body.isascii() or not body.isdigit():
        return None
    return int(t)


def _device_id_ok(options: dict[str, str]) -> bool:
    raw = options.get("llm.DeviceId")
    if raw is None or raw == "":
        return False
    for item in raw.split(";"):
        v = _stream_int(item)
        if v is None or not -(2**31) <= v < 2**31 or v < 0:
            return False
    v = _stream_int(raw)  # re-parsed as one int32 (ge.exec.deviceId)
    return v is not None and 0 <= v < 2**31


def _ipv4(ip: str) -> bool:
    parts = ip.split(".")
    if len(parts) != 4:
        return False
    for p in parts:
        if not p or not p.isascii() or not p.isdigit() or len(p) > 3 or int(p) > 255:
            return False
        if len(p) > 1 and p[0] == "0":
            return False  # inet_pton(AF_INET) rejects leading zeros
    return True


def _parsed(text: str) -> tuple[str, str]:
    """A valid IPv4 ``llm.ListenIpInfo`` as upstream passes it on: (ip, std::to_string(port))."""
    ip, port = text.split(":")
    v = _stream_int(port)
    assert v is not None
    return ip, str(v)


def listen_ok(text: str) -> bool:
    """§3.2 step 4 for the IPv4 forms the tests generate (bracketed IPv6 is not generated)."""
    if "[" in text:
        raise NotImplementedError("IPv6 listen addresses are not modelled")
    parts = text.split(":")
    if len(parts) != 2 or not _ipv4(parts[0]):
        return False
    v = _stream_int(parts[1])
    return v is not None and 0 <= v <= 0xFFFFFFFF and parts[1] == parts[1].strip(_WS)


def _digits(text: str) -> bool:
    return text != "" and text.isascii() and text.isdigit()


def _comm_res_ok(text: str | None) -> bool:
    if text is None:
        return True
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("version") in ("1.0", "1.2")


# ---- the model ----------------------------------------------------------------------------------


@dataclass
class Fault:
    """An armed one-shot injection: the next ``kind`` call of cluster ``instance`` that reaches
    its injection point returns ``status`` (kvdd.sim.faults, as documented there)."""

    kind: str
    instance: int
    status: int


class World:
    """Instances of one process plus the arena; every method returns what the call returns."""

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
        if not _device_id_ok(options):
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
                    v = _stream_int(options[key])
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
        if wait is not None and not _digits(wait):
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
            ip, port = _parsed(listen)
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
                port = _parsed(listen)[1]  # §3.4 step 4: the normalized port text
                if not (me.listening and me.listen_port_text == port):
                    me.listening = True
                    me.port = None  # a new socket: the test reads the new port
                    me.listen_port_text = port
            else:
                me.listening = False
                me.port = None
                me.listen_port_text = None
        else:
            if listen is not None and ":".join(_parsed(listen)) != me.local_engine:
                return FEATURE_NOT_ENABLED  # §3.4 step 5: parsed ip:port compared
        me.role = role
        return SUCCESS

    # -- §3.5 / §3.6 ----------------------------------------------------------------------------
    def _clusters_ok(self, clusters: Sequence[ClusterLike], timeout_ms: int) -> int:
        if timeout_ms <= 0:
            return PARAM_INVALID
        for c in clusters:
            for info in (*c.remote_ip_infos, *c.local_ip_infos):
                if info.ip == "" or not _ipv4(info.ip):
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
        if not (_comm_res_ok(acceptor.comm_res_text) and _comm_res_ok(other.comm_res_text)):
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
