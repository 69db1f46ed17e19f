"""SimBackend: one simulated LLM-DataDist instance, reproducing SEMANTICS.md check by check.

Each public method follows the numbered validation order of its SEMANTICS.md section; the
comments name the step.  All validation (including kvdd's §10 rules) precedes any data movement,
except multi-layer pushes, which upstream applies layer by layer (§3.12 step 7).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..options import (
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LISTEN_IP_INFO,
    OPTION_LOCAL_COMM_RES,
    OPTION_TRANSFER_BACKEND,
    OptionError,
    is_ipv4_literal,
    parse_device_id,
    parse_listen_ip_info,
    parse_sync_wait_time,
)
from ..status import Status
from ..types import Cache, CacheDesc, CacheIndex, CachePlacement, ClusterInfo, KvCacheExtParam, RegisterCfg
from . import fabric, faults
from .fabric import LinkOffer, PeerHandle, RemoteCache
from .memory import Region, first_inaccessible

__all__ = ["SimBackend", "CacheEntry"]

S_OK = Status.LLM_SUCCESS
FAILED = Status.LLM_FAILED
PARAM_INVALID = Status.LLM_PARAM_INVALID
NOT_EXIST = Status.LLM_KV_CACHE_NOT_EXIST
NOT_YET_LINK = Status.LLM_NOT_YET_LINK
TIMEOUT = Status.LLM_TIMEOUT

#: §3.7 step 10: the serialized cache table must fit 1 MiB.
CACHE_TABLE_LIMIT = 1 << 20
#: §3.11 step 8: a transfer request (120 + 16*(K + 2*G) bytes) must fit 2 MiB - 8.
REQUEST_LIMIT = (2 << 20) - 8
HARDWARE_UNCHECKED = "unchecked on hardware (undefined there); the simulator refuses it"

_I64 = np.int64


class CacheEntry:
    """A registered cache on its owner (SEMANTICS.md §2.1)."""

    __slots__ = ("cache_id", "n", "T", "B", "S", "ragged", "placement", "addrs", "regions",
                 "owners", "_lock", "_inflight", "_drained", "registered")

    def __init__(self, cache_id: int, n: int, T: int, B: int, placement: int,
                 addrs: Sequence[int], owners: tuple[object, ...]) -> None:
        self.cache_id = cache_id
        self.n = n
        self.T = T
        self.B = B
        self.S = T // B if B else 0
        self.ragged = self.S == 0 or T % self.S != 0
        self.placement = placement
        self.addrs = tuple(addrs)
        self.regions = [Region(a, T, owners) for a in self.addrs]
        self.owners = owners
        self._lock = threading.Lock()
        self._inflight = 0
        self._drained: threading.Event | None = None
        self.registered = True

    def remote_view(self) -> RemoteCache:
        return RemoteCache(self.cache_id, self.n, self.T, self.B, self.S, self.ragged, self)

    def acquire(self) -> bool:
        """Take a lease for a transfer; False once unregistered."""
        with self._lock:
            if not self.registered:
                return False
            self._inflight += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0 and self._drained is not None:
                self._drained.set()

    def retire(self, timeout: float | None = None) -> bool:
        """Unregister: refuse new leases, then wait for in-flight transfers (§10 rule 5).

        Returns False when ``timeout`` (seconds) passed with leases still held."""
        with self._lock:
            self.registered = False
            drained = None
            if self._inflight:
                drained = self._drained = threading.Event()
        if drained is not None and not drained.wait(timeout):
            return False
        self.regions = []
        return True


@dataclass
class Entity:
    """A link entity: this instance's handle on one peer (keyed per SEMANTICS.md §2.3)."""

    peer: PeerHandle
    address: tuple[str, int]
    lock: threading.Lock = field(default_factory=threading.Lock)  # per-link serialization
    broken: bool = False  # §10 rule 8: a transfer timed out


class _Runs:
    """§3.11 step 7: pairs grouped into maximal runs where both indices step by +1, in list order.

    Arrays, one entry per run: first/last src and dst block (uint64) and run length (int64).
    """

    __slots__ = ("s0", "d0", "ln", "s_last", "d_last", "d_max")

    def __init__(self, src: Sequence[int], dst: Sequence[int]) -> None:
        s = np.asarray(src, dtype=np.uint64)
        d = np.asarray(dst, dtype=np.uint64)
        # uint64 arithmetic as in C: the index after 2**64-1 wraps to 0 (and fails a bound later)
        with np.errstate(over="ignore"):
            cont = (s[1:] == s[:-1] + np.uint64(1)) & (d[1:] == d[:-1] + np.uint64(1))
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        ends = np.append(starts[1:], len(s))
        self.s0 = s[starts]
        self.d0 = d[starts]
        self.ln = (ends - starts).astype(_I64)
        self.s_last = s[ends - 1]
        self.d_last = d[ends - 1]
        self.d_max = int(d.max())

    def __len__(self) -> int:
        return len(self.ln)

    def first_at_or_above(self, first: np.ndarray, last: np.ndarray, bound: int) -> int | None:
        """The first run whose first or last index is >= bound (its offending index), or None."""
        bad = (first >= np.uint64(bound)) | (last >= np.uint64(bound))
        if not bad.any():
            return None
        i = int(np.argmax(bad))
        return int(first[i]) if first[i] >= bound else int(last[i])


def _check_ext(ext: KvCacheExtParam, equal_len: bool) -> bool:
    """CheckKvCacheExtParam (§2.5)."""
    s0, s1 = ext.src_layer_range
    d0, d1 = ext.dst_layer_range
    if not (s0 >= -1 and s1 >= -1 and s0 <= s1):
        return False
    if not (d0 >= -1 and d1 >= -1 and d0 <= d1):
        return False
    if ext.tensor_num_per_layer <= 0:
        return False
    if equal_len and s1 - s0 != d1 - d0:
        return False
    return True


def _valid_comm_res(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("version") in ("1.0", "1.2")


class SimBackend:
    """The simulator backend: one LLM-DataDist instance on host memory.

    Implements :class:`kvdd.backend.Backend`; statuses are returned, never raised.
    """

    def __init__(self, cluster_id: int, role: int) -> None:
        self.cluster_id = int(cluster_id)
        self.role = int(role)
        self._lock = threading.RLock()
        self._local = threading.local()
        self._reset()

    # -- state ------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.initialized = False
        self.transfer_backend = "comm"
        self.device_id = 0
        self.sync_wait_ms = 1000
        self.listener: fabric.Listener | None = None
        self.listen_text: str | None = None  # the raw llm.ListenIpInfo value
        self.has_comm_res = False
        self.comm_res_text: str | None = None
        self.next_cache_id = 1
        self.caches: dict[int, CacheEntry] = {}
        self.entities: dict[int, Entity] = {}
        self.hixl_addrs: dict[tuple[str, int], int] = {}  # ip:port -> entity key (hixl)

    def _fail(self, status: int, detail: str) -> int:
        self._local.detail = detail
        return status

    def last_error_detail(self) -> str | None:
        """Why the last failing call of this thread failed (for the exception message)."""
        detail: str | None = getattr(self._local, "detail", None)
        self._local.detail = None
        return detail

    @property
    def listen_port(self) -> int | None:
        listener = self.listener
        return None if listener is None else listener.port

    def link_data_path(self, remote_cluster_id: int) -> str | None:
        """How this instance's link to `remote_cluster_id` moves bytes: ``"in_process"`` (a peer in
        this process: the copy kernels), ``"process_vm"`` (same host: process_vm_readv/writev) or
        ``"tcp"``; None when there is no such link.  Public introspection for benchmarks and tests."""
        entity = self.entities.get(int(remote_cluster_id))
        return None if entity is None else str(getattr(entity.peer, "data_path", "in_process"))

    def _start_listening(self, ip: str, port: int) -> int:
        try:
            self.listener = fabric.Listener(self, ip, port)
        except OSError as exc:
            return self._fail(FAILED, f"cannot listen on {ip}:{port & 0xFFFF}: {exc.strerror}")
        return S_OK

    def _stop_listening(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    # -- §3.2 Initialize ----------------------------------------------------------------------
    def initialize(self, options: Mapping[str, str]) -> int:
        with self._lock:
            if self.initialized:  # step 1: options ignored
                return S_OK
            if self.role not in (1, 2, 3):  # step 2
                return self._fail(PARAM_INVALID, f"role {self.role} is not PROMPT(1), DECODER(2) or MIX(3)")
            try:
                device_id = parse_device_id(options)  # step 3
                listen: tuple[str, int] | None = None
                listen_text = options.get(OPTION_LISTEN_IP_INFO)
                if listen_text is not None:  # step 4
                    listen = parse_listen_ip_info(listen_text)
                backend_opt = options.get(OPTION_TRANSFER_BACKEND)  # step 6
                if backend_opt is None:
                    backend = "comm"
                elif backend_opt == "hixl":
                    backend = "hixl"
                else:
                    raise OptionError(f"{OPTION_TRANSFER_BACKEND}={backend_opt!r}: only 'hixl' is supported")
                if backend == "comm":  # step 8, comm engine options
                    _check_comm_options(options)
                else:
                    if listen is None:
                        raise OptionError(f"the hixl transfer backend needs {OPTION_LISTEN_IP_INFO}")
                    grc = options.get(OPTION_GLOBAL_RESOURCE_CONFIG)
                    if grc is not None:
                        try:
                            json.loads(grc)
                        except ValueError:
                            raise OptionError(f"{OPTION_GLOBAL_RESOURCE_CONFIG} is not valid JSON") from None
            except OptionError as exc:
                return self._fail(exc.status, str(exc))
            self.transfer_backend = backend
            self.device_id = device_id
            self.comm_res_text = options.get(OPTION_LOCAL_COMM_RES)
            if listen is not None:  # step 8: start listening (bind failure -> FAILED)
                status = self._start_listening(*listen)
                if status != S_OK:
                    return status  # step 10: stays uninitialized
            try:
                self.sync_wait_ms = parse_sync_wait_time(options)  # step 9
                for key in ("llm.MemPoolConfig", "llm.HostMemPoolConfig"):
                    if key in options:
                        _check_mem_pool_config(key, options[key])
            except OptionError as exc:
                self._stop_listening()
                return self._fail(exc.status, str(exc))
            # a listen address lets upstream generate the local comm resource at Initialize
            self.has_comm_res = self.comm_res_text is not None or listen is not None
            self.listen_text = listen_text if listen is not None else None
            self.initialized = True
            return S_OK

    # -- §3.3 Finalize ------------------------------------------------------------------------
    def finalize(self) -> None:
        with self._lock:
            if not self.initialized:
                return
            self.initialized = False
            self._stop_listening()
            entities = list(self.entities.values())
            caches = list(self.caches.values())
            channels = fabric.take_endpoint(self)  # connections to peers in other processes
            self._reset()
        for entity in entities:
            with entity.lock:  # wait for an in-flight transfer over this link
                entity.peer.close()
        for entry in caches:
            # waits for local and remote leases; a remote lease ends when its reader releases it,
            # when the reader's connection closes, or at the latest when it expires
            entry.retire()
        # the peers keep stale entities (§3.3); over them our caches are now not found (GOODBYE)
        fabric.close_channels(channels)

    # -- §3.4 SetRole -------------------------------------------------------------------------
    def set_role(self, role: int, options: Mapping[str, str]) -> int:
        with self._lock:
            if not self.initialized:
                return self._fail(FAILED, "not initialized")
            if role not in (1, 2, 3):
                return self._fail(PARAM_INVALID, f"role {role} is not PROMPT(1), DECODER(2) or MIX(3)")
            listen_text = options.get(OPTION_LISTEN_IP_INFO)
            listen = None
            if listen_text is not None:
                try:
                    listen = parse_listen_ip_info(listen_text)
                except OptionError as exc:
                    return self._fail(exc.status, str(exc))
            if self.transfer_backend == "comm":
                if self.entities:
                    return self._fail(Status.LLM_EXIST_LINK, "unlink all clusters before SetRole")
                if listen is not None:
                    assert listen_text is not None
                    same_port = (self.listener is not None and self.listen_text is not None
                                 and _port_text(self.listen_text) == _port_text(listen_text))
                    if not same_port:
                        self._stop_listening()
                        self.listen_text = None
                        status = self._start_listening(*listen)
                        if status != S_OK:
                            return status
                        self.listen_text = listen_text
                else:
                    self._stop_listening()
                    self.listen_text = None
            else:
                # hixl: no link check; the listen address cannot change (kvdd rule 15: as strings)
                if listen_text is not None and listen_text != self.listen_text:
                    return self._fail(Status.LLM_FEATURE_NOT_ENABLED,
                                      "the hixl backend cannot change its listen address")
            self.role = role
            return S_OK

    # -- §3.5 / §3.6 links --------------------------------------------------------------------
    def _convert_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int) -> int:
        if timeout_ms <= 0:  # step 2
            return self._fail(PARAM_INVALID, f"timeout {timeout_ms} ms must be > 0")
        for i, cluster in enumerate(clusters):  # step 3
            for info in (*cluster.remote_ip_infos, *cluster.local_ip_infos):
                if info.ip == "" or not is_ipv4_literal(info.ip):
                    return self._fail(PARAM_INVALID, f"clusters[{i}]: IP {info.ip!r} is not an IPv4 literal")
        if not clusters:  # step 4
            return self._fail(PARAM_INVALID, "clusters is empty")
        return S_OK

    def link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int) -> tuple[int, list[int]]:
        if not self.initialized:
            return self._fail(FAILED, "not initialized"), []
        status = self._convert_clusters(clusters, timeout_ms)
        if status != S_OK:
            return status, []
        rets: list[int] = []
        details: list[str] = []
        for cluster in clusters:
            st, why = self._link_one(cluster, timeout_ms)
            rets.append(st)
            if st != S_OK:
                details.append(f"cluster {cluster.remote_cluster_id}: {why}")
                status = st  # the last failing cluster wins
        if status != S_OK:
            self._fail(status, "; ".join(details))
        return status, rets

    def _link_one(self, cluster: ClusterInfo, timeout_ms: int) -> tuple[int, str]:
        if len(cluster.remote_ip_infos) != 1:
            return PARAM_INVALID, "exactly one remote_ip_infos entry is required"
        if self.transfer_backend == "comm" and not self.has_comm_res and self.listener is None:
            if len(cluster.local_ip_infos) != 1:
                return PARAM_INVALID, ("without llm.LocalCommRes or a listen address, exactly one "
                                       "local_ip_infos entry is required")
            self.has_comm_res = True  # generated once from local_ip_infos[0]
        remote = cluster.remote_ip_infos[0]
        address = (remote.ip, remote.port)
        if self.transfer_backend == "hixl" and address in self.hixl_addrs:
            return Status.LLM_ALREADY_LINK, f"already connected to {remote.ip}:{remote.port}"
        status = faults.on_link(self, cluster.remote_cluster_id, timeout_ms)  # in place of connecting
        if status != S_OK:
            return status, self.last_error_detail() or "injected fault"
        # the same connection object whether the peer lives in this process or elsewhere
        status, conn = fabric.connect(remote.ip, remote.port, timeout_ms)
        if status != S_OK or conn is None:
            return status, f"cannot connect to {remote.ip}:{remote.port}"
        try:
            force_link = cluster.remote_cluster_id not in self.entities  # comm: §3.5 d
            # the peer's side first: backend/initialized check, on comm its acceptance (§3.5 e)
            res = conn.link(self, force_link)
            if res.status != S_OK or res.offer is None or res.handle is None:
                return res.status, res.detail or "the peer refused the link"
            handle = res.handle
            if self.transfer_backend == "hixl":
                with self._lock:  # one-way: keyed by the user-supplied id, overwriting (§2.3)
                    old = self.entities.get(cluster.remote_cluster_id)
                    if old is not None:
                        self.hixl_addrs.pop(old.address, None)
                    self.entities[cluster.remote_cluster_id] = Entity(handle, address)
                    self.hixl_addrs[address] = cluster.remote_cluster_id
                if old is not None:
                    self._close_entity(old)
                return S_OK, ""
            # comm backend: both sides accept (peer first), each keyed by the other's real id
            st, old = self._accept_link(res.offer, force_link, lambda: handle, address)
            if old is not None:
                self._close_entity(old)
            if st != S_OK:
                handle.close()
                return st, self.last_error_detail() or "link rejected locally"
            return S_OK, ""
        finally:
            conn.close()

    def serve_link(self, peer: LinkOffer, force_link: bool, make_handle: Callable[[], PeerHandle]
                    ) -> tuple[int, str, tuple[dict[int, RemoteCache], dict[int, CacheEntry]] | None]:
        """The acceptor's side of a link (called by the fabric, for initiators in this process
        and elsewhere): the initiator must be initialized on the same transfer backend; on comm the
        acceptance logic (§3.5 e) makes our entity for the initiator's real id with
        ``make_handle()``; hixl keeps none (§2.3).  Returns the status, why it failed, and on
        success our caches the initiator may use over this link (its snapshot, §10 rule 3)."""
        old: Entity | None = None
        try:
            with self._lock:
                if not self.initialized or peer.transfer_backend != self.transfer_backend:
                    return (Status.LLM_LINK_FAILED, "the peer is not initialized or uses another "
                            "transfer backend", None)
                if self.transfer_backend == "comm":
                    st, old = self._accept_link(peer, force_link, make_handle)
                    if st != S_OK:
                        return st, self.last_error_detail() or "the peer refused the link", None
                return S_OK, "", self.snapshot_for_link()
        finally:
            if old is not None:  # closed after our lock is released (may wait for a transfer)
                self._close_entity(old)

    def _accept_link(self, peer: LinkOffer, force_link: bool, make_handle: Callable[[], PeerHandle],
                     address: tuple[str, int] = ("", 0)) -> tuple[int, Entity | None]:
        """Comm-backend acceptance logic run by both sides (§3.5 e).

        Returns the status and the entity a force link replaced; the caller closes that one after
        releasing our lock (closing waits for its in-flight transfer, §10 rule 5)."""
        old: Entity | None = None
        with self._lock:
            if not self.initialized:
                return Status.LLM_LINK_FAILED, None
            if self.comm_res_text is not None and not _valid_comm_res(self.comm_res_text):
                return self._fail(PARAM_INVALID, "llm.LocalCommRes is not valid JSON with version 1.0 or 1.2"), None
            if peer.comm_res_text is not None and not _valid_comm_res(peer.comm_res_text):
                return self._fail(PARAM_INVALID, "the peer's llm.LocalCommRes is invalid"), None
            key = peer.cluster_id
            if force_link and key in self.entities:
                old = self._pop_entity(key)
            if key in self.entities:
                return self._fail(Status.LLM_ALREADY_LINK, f"already linked to cluster {key}"), old
            self.entities[key] = Entity(make_handle(), address)
            return S_OK, old

    def _pop_entity(self, key: int) -> Entity | None:
        with self._lock:
            entity = self.entities.pop(key, None)
            if entity is not None and self.transfer_backend == "hixl":
                self.hixl_addrs.pop(entity.address, None)
            return entity

    @staticmethod
    def _close_entity(entity: Entity) -> None:
        with entity.lock:  # wait for an in-flight transfer (§10 rule 5)
            entity.peer.close()

    def _destroy_entity(self, key: int) -> bool:
        entity = self._pop_entity(key)
        if entity is None:
            return False
        self._close_entity(entity)
        return True

    def unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int,
                            force: bool) -> tuple[int, list[int]]:
        if not self.initialized:
            return self._fail(FAILED, "not initialized"), []
        status = self._convert_clusters(clusters, timeout_ms)
        if status != S_OK:
            return status, []
        rets: list[int] = []
        for cluster in clusters:
            st = self._unlink_one(cluster, timeout_ms, force)
            rets.append(st)
            if st != S_OK:
                status = st
        return status, rets

    def _unlink_one(self, cluster: ClusterInfo, timeout_ms: int, force: bool) -> int:
        if self.transfer_backend == "hixl" or force:
            status = faults.on_unlink(self, cluster.remote_cluster_id, timeout_ms, force=True)
            if status != S_OK:
                return status
            self._destroy_entity(cluster.remote_cluster_id)
            return S_OK
        if len(cluster.remote_ip_infos) != 1:
            return self._fail(PARAM_INVALID, "exactly one remote_ip_infos entry is required")
        status = faults.on_unlink(self, cluster.remote_cluster_id, timeout_ms, force=False)
        if status != S_OK:
            return status
        remote = cluster.remote_ip_infos[0]
        status, conn = fabric.connect(remote.ip, remote.port, timeout_ms)
        if status != S_OK or conn is None:
            if status == Status.LLM_LINK_FAILED:
                status = Status.LLM_UNLINK_FAILED
            return self._fail(status, f"cannot reach {remote.ip}:{remote.port} to unlink")
        try:
            peer_status = conn.notify_unlink(self)  # "disconnect(my cluster id)"
        finally:
            conn.close()
        self._destroy_entity(cluster.remote_cluster_id)
        if peer_status != S_OK:
            return self._fail(peer_status, f"the peer at {remote.ip}:{remote.port} did not confirm the unlink")
        return peer_status

    def peer_unlinked(self, peer_cluster_id: int) -> int:
        """A peer asked (non-force unlink) to drop our entity for it; absent is success."""
        if self.initialized:
            self._destroy_entity(peer_cluster_id)
        return S_OK

    # -- §3.7 / §3.8 registration -----------------------------------------------------------
    def register_kv_cache(self, cache_desc: CacheDesc, addrs: Sequence[int],
                          cfg: RegisterCfg) -> tuple[int, int]:
        with self._lock:
            if not self.initialized:  # 1
                return self._fail(FAILED, "not initialized"), -1
            if len(addrs) == 0:  # 2
                return self._fail(PARAM_INVALID, "addrs is empty"), -1
            if len(addrs) != cache_desc.num_tensors:  # 3
                return self._fail(PARAM_INVALID,
                                  f"{len(addrs)} addrs but num_tensors={cache_desc.num_tensors}"), -1
            for i, a in enumerate(addrs):  # 4
                if a == 0:
                    return self._fail(PARAM_INVALID, f"addrs[{i}] is 0"), -1
            shape = cache_desc.shape  # 6
            if len(shape) == 0 or len(shape) >= 32:
                return self._fail(PARAM_INVALID, f"shape must have 1..31 dims, has {len(shape)}"), -1
            cache_id = self.next_cache_id  # 7: the id is consumed from here on
            self.next_cache_id += 1
            try:  # 8
                T = cache_desc.tensor_nbytes
            except ValueError as exc:
                return self._fail(PARAM_INVALID, f"cannot size the tensors: {exc}"), -1
            bad = first_inaccessible(addrs, T)  # 9 (kvdd rule 4)
            if bad >= 0:
                return self._fail(FAILED, f"tensor {bad} at 0x{addrs[bad]:x} ({T} bytes) is not readable "
                                  "and writable memory of this process"), -1
            status = faults.on_register(self)  # in place of the transport registration
            if status != S_OK:
                return status, -1
            owners = tuple(getattr(addrs, "owners", ()))
            entry = CacheEntry(cache_id, len(addrs), T, shape[0] & 0xFFFFFFFF,
                               int(cache_desc.placement), addrs, owners)
            self.caches[cache_id] = entry  # 10
            table = 24 + sum(64 + 8 * e.n for e in self.caches.values())
            if table > CACHE_TABLE_LIMIT:
                return self._fail(PARAM_INVALID, f"cache table would be {table} bytes (> 1 MiB); "
                                  "the cache stays registered as upstream"), -1
            return S_OK, cache_id

    def unregister_kv_cache(self, cache_id: int) -> int:
        with self._lock:
            if not self.initialized:
                return self._fail(FAILED, "not initialized")
            entry = self.caches.pop(cache_id, None)
        if entry is not None:
            entry.retire()
        return S_OK

    # -- §3.9 --------------------------------------------------------------------------------
    def allocate_cache(self, cache_desc: CacheDesc) -> tuple[int, Cache | None]:
        return self._fail(Status.LLM_FEATURE_NOT_ENABLED, "AllocateCache is not supported by V2"), None

    def deallocate_cache(self, cache_id: int) -> int:
        return self._fail(Status.LLM_FEATURE_NOT_ENABLED, "DeallocateCache is not supported by V2")

    def copy_kv_cache(self, src_cache: Cache, dst_cache: Cache, src_batch_index: int,
                      dst_batch_index: int, offset: int, size: int) -> int:
        return self._fail(Status.LLM_FEATURE_NOT_ENABLED, "CopyKvCache is not supported by V2")

    def copy_kv_blocks(self, src_cache: Cache, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks_list: Sequence[Sequence[int]]) -> int:
        return self._fail(Status.LLM_FEATURE_NOT_ENABLED, "CopyKvBlocks is not supported by V2")

    # -- transfers: shared pieces ----------------------------------------------------------
    def _pull_common(self, idx: CacheIndex, dst_cache: Cache, batch_index: int, size: int,
                     ext: KvCacheExtParam) -> tuple[int, CacheEntry | None, Entity | None,
                                                    range | None, range | None]:
        """PullKvCache steps 4-11 (shared by PullKvBlocks)."""
        t = ext.tensor_num_per_layer
        (s0, s1), (d0, d1) = ext.src_layer_range, ext.dst_layer_range
        src_list = dst_list = None
        if s0 >= 0 and d0 >= 0:  # 4
            src_list = range(s0 * t, (s1 + 1) * t)
            dst_list = range(d0 * t, (d1 + 1) * t)
        if t <= 0:  # 5
            return self._fail(PARAM_INVALID, "tensor_num_per_layer must be > 0"), None, None, None, None
        if idx.cluster_id == self.cluster_id:  # 6
            return self._fail(PARAM_INVALID, "cannot pull from own cluster"), None, None, None, None
        local = self.caches.get(dst_cache.cache_id)  # 7
        if local is None:
            return self._fail(NOT_EXIST, f"local cache {dst_cache.cache_id} is not registered"), None, None, None, None
        if batch_index >= local.B:  # 8
            return self._fail(PARAM_INVALID, f"batch_index {batch_index} >= local batch size {local.B}"), None, None, None, None
        if size > 0 and size > local.S:  # 9
            return self._fail(PARAM_INVALID, f"size {size} > local stride {local.S} bytes"), None, None, None, None
        if dst_list is not None and src_list is not None:  # 10
            if local.n % t != 0:
                return self._fail(PARAM_INVALID, f"local tensor count {local.n} is not a multiple of {t}"), None, None, None, None
            if len(dst_list) > local.n or dst_list[0] >= local.n or dst_list[-1] >= local.n:
                return self._fail(PARAM_INVALID, f"dst layer range {ext.dst_layer_range} exceeds the local {local.n} tensors"), None, None, None, None
            if len(src_list) != len(dst_list):
                return self._fail(PARAM_INVALID, "src and dst layer ranges differ in length"), None, None, None, None
        entity = self.entities.get(idx.cluster_id)  # 11
        if entity is None:
            return self._fail(NOT_YET_LINK, f"no link to cluster {idx.cluster_id}"), None, None, None, None
        return S_OK, local, entity, src_list, dst_list

    def _lookup_remote(self, entity: Entity, cache_id: int) -> tuple[int, RemoteCache | None]:
        if cache_id <= 0:
            return self._fail(NOT_EXIST, f"remote cache id {cache_id} is not > 0"), None
        rc = entity.peer.snapshot().get(cache_id)
        if rc is None:
            return self._fail(NOT_EXIST, f"remote cache {cache_id} is not registered on cluster "
                              f"{entity.peer.peer_cluster_id} (or was registered after the link)"), None
        return S_OK, rc

    def _run(self, entity: Entity, local: CacheEntry, rc: RemoteCache, pull: bool,
             local_tensors: Sequence[int], remote_tensors: Sequence[int],
             local_off: np.ndarray, remote_off: np.ndarray, length: np.ndarray) -> int:
        """Move the bytes (caller holds entity.lock): leases on both caches, then one copy."""
        if entity.broken:
            return self._fail(TIMEOUT, "the link timed out earlier; unlink and link again (kvdd rule 8)")
        if not local.acquire():
            return self._fail(NOT_EXIST, f"local cache {local.cache_id} was unregistered")
        try:
            status, lease = entity.peer.acquire(rc, self.sync_wait_ms)
            if status != S_OK:
                if status == TIMEOUT:
                    entity.broken = True
                return self._fail(status, f"remote cache {rc.cache_id} is gone" if status == NOT_EXIST
                                  else "the peer did not answer")
            try:
                regions = [local.regions[i] for i in local_tensors]
                if pull:
                    status = entity.peer.read(lease, remote_tensors, remote_off, regions, local_off,
                                              length, self.sync_wait_ms)
                else:
                    status = entity.peer.write(lease, remote_tensors, regions, local_off, remote_off,
                                               length, self.sync_wait_ms)
                if status == TIMEOUT:
                    entity.broken = True
                if status != S_OK:
                    return self._fail(status, "the transfer failed")
                return S_OK
            finally:
                entity.peer.release(lease)
        finally:
            local.release()

    # -- §3.10 PullKvCache ------------------------------------------------------------------
    def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int,
                      size: int, ext_param: KvCacheExtParam) -> int:
        if not self.initialized:  # 1
            return self._fail(FAILED, "not initialized")
        if not (size == -1 or size > 0):  # 2
            return self._fail(PARAM_INVALID, f"size {size} must be -1 or > 0")
        if not _check_ext(ext_param, equal_len=False):  # 3
            return self._fail(PARAM_INVALID, f"invalid ext_param {ext_param}")
        status, local, entity, src_list, dst_list = self._pull_common(
            src_cache_index, dst_cache, batch_index, size, ext_param)  # 4-11
        if status != S_OK:
            return status
        assert local is not None and entity is not None
        K = len(dst_list) if dst_list is not None else local.n
        if 120 + 16 * (K + 2) > REQUEST_LIMIT:  # 12
            return self._fail(PARAM_INVALID, "transfer request exceeds 2 MiB")
        with entity.lock:
            status, rc = self._lookup_remote(entity, src_cache_index.cache_id)  # 13
            if status != S_OK:
                return status
            assert rc is not None
            if src_list is None and rc.num_tensors != local.n:  # 14
                return self._fail(PARAM_INVALID, f"remote cache has {rc.num_tensors} tensors, local {local.n}")
            nbytes = size if size > 0 else local.S  # 15
            if nbytes > rc.stride_nbytes:
                return self._fail(PARAM_INVALID, f"{nbytes} bytes per tensor > remote stride {rc.stride_nbytes}")
            if local.ragged or rc.ragged:  # kvdd rule 10
                return self._fail(PARAM_INVALID, "a cache whose tensor size is not a multiple of its "
                                  "stride (ragged sub-byte cache) cannot be transferred (kvdd rule 10)")
            remote_tensors: Sequence[int] = src_list if src_list is not None else range(local.n)
            if remote_tensors[-1] >= rc.num_tensors:  # kvdd rule 1 (§7.8)
                return self._fail(PARAM_INVALID, f"src layer range reaches tensor {remote_tensors[-1]} "
                                  f"of a {rc.num_tensors}-tensor remote cache; {HARDWARE_UNCHECKED}")
            src_off = src_cache_index.batch_index * local.S  # quirk: local stride
            if src_off + nbytes > rc.tensor_nbytes:  # kvdd rule 1
                return self._fail(PARAM_INVALID, f"remote batch_index {src_cache_index.batch_index} reads "
                                  f"past the remote tensor; {HARDWARE_UNCHECKED}")
            local_tensors: Sequence[int] = dst_list if dst_list is not None else range(local.n)
            status = faults.on_transfer(self, "pull_kv_cache", src_cache_index.cluster_id, entity,
                                        len(local_tensors) * nbytes)
            if status != S_OK:
                return status
            return self._run(entity, local, rc, True, local_tensors, remote_tensors,
                             np.array([batch_index * local.S], _I64), np.array([src_off], _I64),
                             np.array([nbytes], _I64))

    # -- §3.11 PullKvBlocks -----------------------------------------------------------------
    def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam) -> int:
        if not self.initialized:  # 1
            return self._fail(FAILED, "not initialized")
        if src_cache_index.batch_index != 0:  # 2
            return self._fail(PARAM_INVALID, "src_cache_index.batch_index must be 0 for blocks")
        if not _check_ext(ext_param, equal_len=False):  # 3
            return self._fail(PARAM_INVALID, f"invalid ext_param {ext_param}")
        if len(src_blocks) == 0:  # 4
            return self._fail(PARAM_INVALID, "src_blocks is empty (pull from a non-block cache is not supported)")
        if len(src_blocks) != len(dst_blocks):  # 5
            return self._fail(PARAM_INVALID, f"{len(src_blocks)} src blocks but {len(dst_blocks)} dst blocks")
        status, local, entity, src_list, dst_list = self._pull_common(
            src_cache_index, dst_cache, 0, -1, ext_param)  # 6
        if status != S_OK:
            return status
        assert local is not None and entity is not None
        runs = _Runs(src_blocks, dst_blocks)  # 7
        K = len(dst_list) if dst_list is not None else local.n
        if 120 + 16 * (K + 2 * len(runs)) > REQUEST_LIMIT:  # 8
            return self._fail(PARAM_INVALID, f"transfer request with {len(runs)} block runs exceeds 2 MiB")
        bad = runs.first_at_or_above(runs.d0, runs.d_last, local.B)  # 9
        if bad is not None:
            return self._fail(PARAM_INVALID, f"dst block {bad} >= local block count {local.B}")
        with entity.lock:
            status, rc = self._lookup_remote(entity, src_cache_index.cache_id)  # 10
            if status != S_OK:
                return status
            assert rc is not None
            if src_list is None and rc.num_tensors != local.n:
                return self._fail(PARAM_INVALID, f"remote cache has {rc.num_tensors} tensors, local {local.n}")
            S = local.S
            if S == 0:
                return self._fail(PARAM_INVALID, "local stride is 0 (ragged sub-byte cache, kvdd rule 10)")
            remote_blocks = -(-rc.tensor_nbytes // S)
            bad = runs.first_at_or_above(runs.s0, runs.s0, remote_blocks)  # 11
            if bad is not None:
                return self._fail(PARAM_INVALID, f"src block {bad} >= remote block count {remote_blocks}")
            longest = int(runs.ln.max())
            if longest * S > rc.tensor_nbytes:
                return self._fail(PARAM_INVALID, f"a run of {longest} blocks exceeds the remote tensor")
            if local.ragged or rc.ragged:  # kvdd rule 10
                return self._fail(PARAM_INVALID, "a ragged sub-byte cache cannot be transferred (kvdd rule 10)")
            remote_tensors: Sequence[int] = src_list if src_list is not None else range(local.n)
            if remote_tensors[-1] >= rc.num_tensors:  # kvdd rule 1
                return self._fail(PARAM_INVALID, f"src layer range reaches tensor {remote_tensors[-1]} "
                                  f"of a {rc.num_tensors}-tensor remote cache; {HARDWARE_UNCHECKED}")
            # all indices are now < 2**32 (bounded by B or by the remote block count)
            src_off = runs.s0.astype(_I64) * S
            dst_off = runs.d0.astype(_I64) * S
            length = runs.ln * S
            tail = rc.tensor_nbytes % S
            if tail:  # quirk §3.11: the last group copies only R.T % L.S bytes
                length[-1] = tail
            if np.any(src_off + length > rc.tensor_nbytes):  # kvdd rule 1
                return self._fail(PARAM_INVALID, f"a block run reads past the remote tensor; {HARDWARE_UNCHECKED}")
            local_tensors: Sequence[int] = dst_list if dst_list is not None else range(local.n)
            status = faults.on_transfer(self, "pull_kv_blocks", src_cache_index.cluster_id, entity,
                                        len(local_tensors) * int(length.sum()))
            if status != S_OK:
                return status
            return self._run(entity, local, rc, True, local_tensors, remote_tensors,
                             dst_off, src_off, length)

    # -- §3.12 / §3.13 push ------------------------------------------------------------------
    def _push_plan(self, src_cache: Cache, ext: KvCacheExtParam) -> tuple[range, int]:
        """§3.12 step 6: the source layers in order and the destination of the first one (the
        others follow consecutively).  Lazy: a plan of 2**31 layers costs nothing until a layer
        fails its checks."""
        t = ext.tensor_num_per_layer
        (s0, s1), (d0, _d1) = ext.src_layer_range, ext.dst_layer_range
        if s0 >= 0 and s0 == s1:  # single layer
            return range(s0, s0 + 1), d0
        if s0 == -1:  # all layers l -> l (dst range ignored)
            u = src_cache.cache_desc.num_tensors
            if u < t:
                m = 0
            elif u % t == 0:
                m = u // t - 1
            else:
                m = u // t  # the partial last layer is planned and fails check g
            return range(0, m + 1), 0
        return range(s0, s1 + 1), d0  # range: l -> d0 + (l - s0)

    def _push_prologue(self, src_cache: Cache, ext: KvCacheExtParam) -> tuple[int, tuple[range, int]]:
        if not _check_ext(ext, equal_len=True):
            return self._fail(PARAM_INVALID, f"invalid ext_param {ext}"), (range(0), 0)
        s0 = ext.src_layer_range[0]
        if not s0 >= 0 and not (s0 == -1 and src_cache.cache_desc.num_tensors > 0):
            return self._fail(PARAM_INVALID, "pushing all layers needs src_cache.cache_desc.num_tensors > 0"), (range(0), 0)
        return S_OK, self._push_plan(src_cache, ext)

    def _push_layer_lookup(self, src_cache: Cache, idx: CacheIndex, t: int, ld: int
                           ) -> tuple[int, CacheEntry | None, Entity | None, RemoteCache | None]:
        local = self.caches.get(src_cache.cache_id)  # a
        if local is None:
            return self._fail(NOT_EXIST, f"local cache {src_cache.cache_id} is not registered"), None, None, None
        entity = self.entities.get(idx.cluster_id)  # b
        if entity is None:
            return self._fail(NOT_YET_LINK, f"no link to cluster {idx.cluster_id}"), None, None, None
        status, rc = self._lookup_remote(entity, idx.cache_id)  # c
        if status != S_OK:
            return status, None, None, None
        assert rc is not None
        if ld < 0 or ld >= rc.num_tensors // t:  # d (a negative layer is a huge unsigned index)
            return self._fail(PARAM_INVALID, f"dst layer {ld} is not below the remote layer count "
                              f"{rc.num_tensors // t}"), None, None, None
        return S_OK, local, entity, rc

    def _push_local_checks(self, local: CacheEntry, t: int, ls: int) -> int:
        if ls >= local.n // t:  # f
            return self._fail(PARAM_INVALID, f"src layer {ls} is not below the local layer count {local.n // t}")
        if local.n % t != 0:  # g
            return self._fail(PARAM_INVALID, f"local tensor count {local.n} is not a multiple of {t}")
        return S_OK

    def _push_layers(self, kind: str, src_cache: Cache, idx: CacheIndex, plan: tuple[range, int],
                     t: int, check_layer: Callable[[CacheEntry, RemoteCache, int], int],
                     offsets: Callable[[CacheEntry, RemoteCache], tuple[np.ndarray, np.ndarray, np.ndarray]]
                     ) -> int:
        """§3.12 step 7 / §3.13 step 8: the per-layer loop.

        Upstream checks and writes layer by layer, stopping at the first failing layer with the
        earlier layers written.  The checks do not depend on the bytes moved, so every planned
        layer is checked first, in the same order; the layers before the first failing one are
        then written in one copy, and that layer's status is returned.
        """
        src_layers, ld0 = plan
        status, local, entity, rc = self._push_layer_lookup(src_cache, idx, t, ld0)  # a-d
        if status != S_OK:
            return status
        assert local is not None and entity is not None and rc is not None
        with entity.lock:
            ok: list[tuple[int, int]] = []
            failed: int = S_OK
            remote_layers = rc.num_tensors // t
            for i, ls in enumerate(src_layers):
                ld = ld0 + i
                if i == 0:
                    failed = check_layer(local, rc, ls)  # e-h, kvdd rules 10 and 1
                # Later layers: only d and f depend on the layer; every other check passed above.
                elif ld < 0 or ld >= remote_layers:  # d
                    failed = self._fail(PARAM_INVALID, f"dst layer {ld} is not below the remote layer "
                                        f"count {remote_layers}")
                else:
                    failed = self._push_local_checks(local, t, ls)  # f (g passed at layer 0)
                if failed != S_OK:
                    break
                ok.append((ls, ld))
            if ok:
                src_off, dst_off, length = offsets(local, rc)
                status = faults.on_transfer(self, kind, idx.cluster_id, entity,
                                            t * len(ok) * int(length.sum()))
                if status != S_OK:
                    return status
                local_tensors = [ls * t + k for ls, _ in ok for k in range(t)]
                remote_tensors = [ld * t + k for _, ld in ok for k in range(t)]
                status = self._run(entity, local, rc, False, local_tensors, remote_tensors,
                                   src_off, dst_off, length)
                if status != S_OK:
                    return status
            return failed

    def push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int,
                      size: int, ext_param: KvCacheExtParam) -> int:
        if not self.initialized:  # 1
            return self._fail(FAILED, "not initialized")
        if src_cache.cache_desc.placement != CachePlacement.DEVICE:  # 2
            return self._fail(PARAM_INVALID, "src_cache.cache_desc.placement must be DEVICE for push")
        if size != -1:  # 3
            return self._fail(PARAM_INVALID, f"size must be -1 for push, got {size}")
        status, plan = self._push_prologue(src_cache, ext_param)  # 4-6
        if status != S_OK:
            return status
        t = ext_param.tensor_num_per_layer
        bd = dst_cache_index.batch_index

        def check_layer(local: CacheEntry, rc: RemoteCache, ls: int) -> int:
            if bd >= rc.batch_size:  # e
                return self._fail(PARAM_INVALID, f"dst batch_index {bd} >= remote batch size {rc.batch_size}")
            status = self._push_local_checks(local, t, ls)  # f, g
            if status != S_OK:
                return status
            if src_batch_index >= local.B:  # h
                return self._fail(PARAM_INVALID, f"src_batch_index {src_batch_index} >= local batch size {local.B}")
            if local.ragged or rc.ragged:  # kvdd rule 10
                return self._fail(PARAM_INVALID, "a ragged sub-byte cache cannot be transferred (kvdd rule 10)")
            if bd * rc.stride_nbytes + local.S > rc.tensor_nbytes:  # kvdd rule 1
                return self._fail(PARAM_INVALID, f"the {local.S}-byte row would be written past the remote "
                                  f"tensor; {HARDWARE_UNCHECKED}")
            return S_OK

        def offsets(local: CacheEntry, rc: RemoteCache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            # exactly L.S bytes of the source row land at the remote row's offset (§3.12, §7.5)
            return (np.array([src_batch_index * local.S], _I64), np.array([bd * rc.stride_nbytes], _I64),
                    np.array([local.S], _I64))

        return self._push_layers("push_kv_cache", src_cache, dst_cache_index, plan, t, check_layer, offsets)  # 7

    def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam) -> int:
        if not self.initialized:  # 1
            return self._fail(FAILED, "not initialized")
        if src_cache.cache_desc.placement != CachePlacement.DEVICE:  # 2
            return self._fail(PARAM_INVALID, "src_cache.cache_desc.placement must be DEVICE for push")
        if len(src_blocks) == 0:  # 3
            return self._fail(PARAM_INVALID, "src_blocks is empty")
        if len(src_blocks) != len(dst_blocks):  # 4
            return self._fail(PARAM_INVALID, f"{len(src_blocks)} src blocks but {len(dst_blocks)} dst blocks")
        if dst_cache_index.batch_index != 0:  # 5
            return self._fail(PARAM_INVALID, "dst_cache_index.batch_index must be 0 for blocks")
        status, plan = self._push_prologue(src_cache, ext_param)  # 6, 7
        if status != S_OK:
            return status
        t = ext_param.tensor_num_per_layer
        runs = _Runs(src_blocks, dst_blocks)

        def check_layer(local: CacheEntry, rc: RemoteCache, ls: int) -> int:
            if runs.d_max >= rc.batch_size:
                return self._fail(PARAM_INVALID, f"dst block {runs.d_max} >= remote block count {rc.batch_size}")
            status = self._push_local_checks(local, t, ls)
            if status != S_OK:
                return status
            bad = runs.first_at_or_above(runs.s0, runs.s_last, local.B)
            if bad is not None:
                return self._fail(PARAM_INVALID, f"src block {bad} >= local block count {local.B}")
            if local.ragged or rc.ragged:  # kvdd rule 10
                return self._fail(PARAM_INVALID, "a ragged sub-byte cache cannot be transferred (kvdd rule 10)")
            # indices are now < 2**32; block size = local stride on both sides (§3.13, §7.4)
            if np.any((runs.d0.astype(_I64) + runs.ln) * local.S > rc.tensor_nbytes):  # kvdd rule 1
                return self._fail(PARAM_INVALID, f"a block run would be written past the remote tensor; "
                                  f"{HARDWARE_UNCHECKED}")
            return S_OK

        def offsets(local: CacheEntry, rc: RemoteCache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            S = local.S
            return runs.s0.astype(_I64) * S, runs.d0.astype(_I64) * S, runs.ln * S

        return self._push_layers("push_kv_blocks", src_cache, dst_cache_index, plan, t, check_layer, offsets)  # 8

    # -- introspection for tests and the cross-process fabric -----------------------------
    def snapshot_for_link(self) -> tuple[dict[int, RemoteCache], dict[int, CacheEntry]]:
        """The caches a peer linking now may use (registered before the link, §10 rule 3)."""
        with self._lock:
            entries = dict(self.caches)
        return {cid: e.remote_view() for cid, e in entries.items()}, entries


def _port_text(listen_text: str) -> str:
    rb = listen_text.find("]")
    if listen_text.find("[") != -1 and rb != -1:
        colon = listen_text.find(":", rb)
        return listen_text[colon + 1:]
    parts = [p for p in listen_text.split(":") if p]
    return parts[-1] if parts else ""


def _check_mem_pool_config(key: str, text: str) -> None:
    """§3.2 step 9: ``{"memory_size": unsigned, "page_shift": [10, 31)}`` with
    ``memory_size >> page_shift < UINT32_MAX``; anything else is PARAM_INVALID."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise OptionError(f"option {key} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise OptionError(f"option {key} must be a JSON object")
    size = doc.get("memory_size")
    if type(size) is not int or not 0 <= size < 2**64:
        raise OptionError(f"option {key}: memory_size must be an unsigned integer")
    shift = doc.get("page_shift", 16)
    if type(shift) is not int or not 10 <= shift < 31:
        raise OptionError(f"option {key}: page_shift must be in [10, 31)")
    if (size >> shift) >= 2**32 - 1:
        raise OptionError(f"option {key}: memory_size >> page_shift must be < UINT32_MAX")


def _check_comm_options(options: Mapping[str, str]) -> None:
    """Comm engine options (§3.2 step 8); malformed → PARAM_INVALID (kvdd rule 14)."""
    for key, lo, hi in (("llm.RdmaTrafficClass", 0, 2**32 - 1), ("llm.RdmaServiceLevel", 0, 2**32 - 1),
                        ("llm.LinkTotalTime", -(2**31), 2**31 - 1), ("llm.LinkRetryCount", 1, 100)):
        raw = options.get(key)
        if raw is None:
            continue
        try:
            value = int(raw.strip()) if raw.strip().lstrip("+-").isdigit() else None
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise OptionError(f"option {key}={raw!r} must be an integer in [{lo}, {hi}]")
