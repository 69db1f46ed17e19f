"""SimBackend: one simulated LLM-DataDist instance, reproducing SEMANTICS.md check by check.

Each public method follows the numbered validation order of its SEMANTICS.md section; the
comments name the step.  All validation (including kvdd's §10 rules) precedes any data movement,
except multi-layer pushes, which upstream applies layer by layer (§3.12 step 7).

This module holds the instance's lifecycle, links and registrations; the transfers live in
:mod:`kvdd.sim.pulls` and :mod:`kvdd.sim.pushes`, the shared checks in :mod:`kvdd.sim.checks`.
A check raises :class:`kvdd.sim.checks.Rejected`; each Backend method turns it into its returned
status once.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence

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
from ..status import FAILED, PARAM_INVALID, S_OK, Status
from ..types import Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, RegisterCfg
from . import fabric, faults, pulls, pushes
from .checks import CACHE_TABLE_LIMIT, REQUEST_LIMIT, Rejected, reject, require_initialized
from .entries import CacheEntry, Entity
from .fabric import LinkOffer, PeerHandle, RemoteCache
from .memory import first_inaccessible
from .options import check_comm_options, check_mem_pool_config, port_text, valid_comm_res

__all__ = ["SimBackend", "CacheEntry", "Entity", "CACHE_TABLE_LIMIT", "REQUEST_LIMIT"]


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

    def _rejected(self, exc: Rejected) -> int:
        """The status a Backend method returns for a rejection (its detail kept for the message)."""
        return self._fail(exc.status, exc.detail)

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

    def _start_listening(self, ip: str, port: int) -> None:
        try:
            self.listener = fabric.Listener(self, ip, port)
        except OSError as exc:
            reject(FAILED, f"cannot listen on {ip}:{port & 0xFFFF}: {exc.strerror}")

    def _stop_listening(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    # -- §3.2 Initialize ----------------------------------------------------------------------
    def initialize(self, options: Mapping[str, str]) -> int:
        with self._lock:
            try:
                return self._initialize(options)
            except Rejected as exc:
                return self._rejected(exc)

    def _initialize(self, options: Mapping[str, str]) -> int:
        if self.initialized:  # step 1: options ignored
            return S_OK
        if self.role not in (1, 2, 3):  # step 2
            reject(PARAM_INVALID, f"role {self.role} is not PROMPT(1), DECODER(2) or MIX(3)")
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
                check_comm_options(options)
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
            reject(exc.status, str(exc))
        self.transfer_backend = backend
        self.device_id = device_id
        self.comm_res_text = options.get(OPTION_LOCAL_COMM_RES)
        if listen is not None:  # step 8: start listening (bind failure -> FAILED)
            self._start_listening(*listen)  # step 10: a failure leaves it uninitialized
        try:
            self.sync_wait_ms = parse_sync_wait_time(options)  # step 9
            for key in ("llm.MemPoolConfig", "llm.HostMemPoolConfig"):
                if key in options:
                    check_mem_pool_config(key, options[key])
        except OptionError as exc:
            self._stop_listening()
            reject(exc.status, str(exc))
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
            try:
                return self._set_role(role, options)
            except Rejected as exc:
                return self._rejected(exc)

    def _set_role(self, role: int, options: Mapping[str, str]) -> int:
        require_initialized(self.initialized)
        if role not in (1, 2, 3):
            reject(PARAM_INVALID, f"role {role} is not PROMPT(1), DECODER(2) or MIX(3)")
        listen_text = options.get(OPTION_LISTEN_IP_INFO)
        listen = None
        if listen_text is not None:
            try:
                listen = parse_listen_ip_info(listen_text)
            except OptionError as exc:
                reject(exc.status, str(exc))
        if self.transfer_backend == "comm":
            if self.entities:
                reject(Status.LLM_EXIST_LINK, "unlink all clusters before SetRole")
            if listen is not None:
                assert listen_text is not None
                same_port = (self.listener is not None and self.listen_text is not None
                             and port_text(self.listen_text) == port_text(listen_text))
                if not same_port:
                    self._stop_listening()
                    self.listen_text = None
                    self._start_listening(*listen)
                    self.listen_text = listen_text
            else:
                self._stop_listening()
                self.listen_text = None
        else:
            # hixl: no link check; the listen address cannot change (kvdd rule 15: as strings)
            if listen_text is not None and listen_text != self.listen_text:
                reject(Status.LLM_FEATURE_NOT_ENABLED, "the hixl backend cannot change its listen address")
        self.role = role
        return S_OK

    # -- §3.5 / §3.6 links --------------------------------------------------------------------
    @staticmethod
    def _convert_clusters(initialized: bool, clusters: Sequence[ClusterInfo], timeout_ms: int) -> None:
        require_initialized(initialized)  # step 1
        if timeout_ms <= 0:  # step 2
            reject(PARAM_INVALID, f"timeout {timeout_ms} ms must be > 0")
        for i, cluster in enumerate(clusters):  # step 3
            for info in (*cluster.remote_ip_infos, *cluster.local_ip_infos):
                if info.ip == "" or not is_ipv4_literal(info.ip):
                    reject(PARAM_INVALID, f"clusters[{i}]: IP {info.ip!r} is not an IPv4 literal")
        if not clusters:  # step 4
            reject(PARAM_INVALID, "clusters is empty")

    def link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int) -> tuple[int, list[int]]:
        try:
            self._convert_clusters(self.initialized, clusters, timeout_ms)
        except Rejected as exc:
            return self._rejected(exc), []
        status: int = S_OK
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
            if self.comm_res_text is not None and not valid_comm_res(self.comm_res_text):
                return self._fail(PARAM_INVALID, "llm.LocalCommRes is not valid JSON with version 1.0 or 1.2"), None
            if peer.comm_res_text is not None and not valid_comm_res(peer.comm_res_text):
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
        try:
            self._convert_clusters(self.initialized, clusters, timeout_ms)
        except Rejected as exc:
            return self._rejected(exc), []
        status: int = S_OK
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
            try:
                return S_OK, self._register(cache_desc, addrs)
            except Rejected as exc:
                return self._rejected(exc), -1

    def _register(self, cache_desc: CacheDesc, addrs: Sequence[int]) -> int:
        """§3.7 steps 1-10: the new cache id."""
        require_initialized(self.initialized)  # 1
        if len(addrs) == 0:  # 2
            reject(PARAM_INVALID, "addrs is empty")
        if len(addrs) != cache_desc.num_tensors:  # 3
            reject(PARAM_INVALID, f"{len(addrs)} addrs but num_tensors={cache_desc.num_tensors}")
        for i, a in enumerate(addrs):  # 4
            if a == 0:
                reject(PARAM_INVALID, f"addrs[{i}] is 0")
        shape = cache_desc.shape  # 6
        if len(shape) == 0 or len(shape) >= 32:
            reject(PARAM_INVALID, f"shape must have 1..31 dims, has {len(shape)}")
        cache_id = self.next_cache_id  # 7: the id is consumed from here on
        self.next_cache_id += 1
        try:  # 8
            T = cache_desc.tensor_nbytes
        except ValueError as exc:
            reject(PARAM_INVALID, f"cannot size the tensors: {exc}")
        bad = first_inaccessible(addrs, T)  # 9 (kvdd rule 4)
        if bad >= 0:
            reject(FAILED, f"tensor {bad} at 0x{addrs[bad]:x} ({T} bytes) is not readable "
                   "and writable memory of this process")
        status = faults.on_register(self)  # in place of the transport registration
        if status != S_OK:
            reject(status, self.last_error_detail() or "the transport refused the registration")
        owners = tuple(getattr(addrs, "owners", ()))
        entry = CacheEntry(cache_id, len(addrs), T, shape[0] & 0xFFFFFFFF,
                           int(cache_desc.placement), addrs, owners)
        self.caches[cache_id] = entry  # 10
        table = 24 + sum(64 + 8 * e.n for e in self.caches.values())
        if table > CACHE_TABLE_LIMIT:
            reject(PARAM_INVALID, f"cache table would be {table} bytes (> 1 MiB); "
                   "the cache stays registered as upstream")
        return cache_id

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

    # -- §3.10 - §3.13 transfers (kvdd.sim.pulls, kvdd.sim.pushes) ---------------------------
    def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int,
                      size: int, ext_param: KvCacheExtParam) -> int:
        try:
            return pulls.pull_kv_cache(self, src_cache_index, dst_cache, batch_index, size, ext_param)
        except Rejected as exc:
            return self._rejected(exc)

    def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam) -> int:
        try:
            return pulls.pull_kv_blocks(self, src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        except Rejected as exc:
            return self._rejected(exc)

    def push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int,
                      size: int, ext_param: KvCacheExtParam) -> int:
        try:
            return pushes.push_kv_cache(self, src_cache, dst_cache_index, src_batch_index, size, ext_param)
        except Rejected as exc:
            return self._rejected(exc)

    def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam) -> int:
        try:
            return pushes.push_kv_blocks(self, src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param)
        except Rejected as exc:
            return self._rejected(exc)

    # -- introspection for tests and the cross-process fabric -----------------------------
    def snapshot_for_link(self) -> tuple[dict[int, RemoteCache], dict[int, CacheEntry]]:
        """The caches a peer linking now may use (registered before the link, §10 rule 3)."""
        with self._lock:
            entries = dict(self.caches)
        return {cid: e.remote_view() for cid, e in entries.items()}, entries
