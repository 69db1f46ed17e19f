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

import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

from ..options import OptionError, is_ipv4_literal, is_ipv6_literal
from ..status import FAILED, PARAM_INVALID, S_OK, Status
from ..types import Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, RegisterCfg
from . import fabric, faults, pulls, pushes, reaper
from ._fastpath import FastTransfers
from .checks import (
    CACHE_TABLE_LIMIT,
    REQUEST_LIMIT,
    Rejected,
    reject,
    require_clusters,
    require_initialized,
)
from .caches import CacheTable
from .entries import CacheEntry, Entity, retire_all
from .fabric import LinkOffer, PeerHandle, RemoteCache
from .options import (
    cache_engine_options,
    check_link_comm_res,
    comm_switch_listen,
    hixl_switch_engine,
    plan_initialize,
    switch_options,
)

__all__ = ["SimBackend", "CacheEntry", "Entity", "CACHE_TABLE_LIMIT", "REQUEST_LIMIT"]


class SimBackend:
    """The simulator backend: one LLM-DataDist instance on host memory.

    Implements :class:`kvdd.backend.Backend`; statuses are returned, never raised.  An instance
    that becomes unreachable without :meth:`finalize` is torn down as upstream's destructor does
    (§3.1, :meth:`destroy`, :mod:`kvdd.sim.reaper`): the fabric holds it only weakly.
    """

    def __init__(self, cluster_id: int, role: int) -> None:
        faults.load_env()  # KVDD_SIM_FAULTS, once per process (FaultSpecError when malformed)
        self.cluster_id = int(cluster_id)
        self.role = int(role)
        self._lock = threading.RLock()
        self._local = threading.local()
        self._finalizing: threading.Event | None = None
        # §3.2 step 10: the listener of an Initialize that failed after it started listening
        self._failed_listener: fabric.Listener | None = None
        self.dropped = False  # unreachable, waiting for the reaper: refuses links (§3.1)
        self._pid = os.getpid()  # a forked child never tears down its parent's instances
        self._reset()
        reaper.start()
        #: the compiled path of common in-process transfers (kvdd.backend.FastTransfers)
        self.fast_transfers = FastTransfers(self)

    def __del__(self) -> None:
        # §3.1: the last reference is gone (or a collected cycle).  Only lock-free steps here;
        # the reaper thread runs destroy() and then lets the object go (kvdd.sim.reaper).
        if sys.is_finalizing() or self.__dict__.get("_pid") != os.getpid():
            return  # exiting, half constructed, or the parent's instance in a forked child
        listeners = [lst for lst in (self.__dict__.get("listener"),
                                     self.__dict__.get("_failed_listener")) if lst is not None]
        if not listeners and not self.__dict__.get("initialized"):
            return
        self.dropped = True
        for listener in listeners:
            listener.stop_accepting()
        reaper.submit(self)

    def destroy(self) -> None:
        """What upstream's destructor does (§3.1): :meth:`finalize` when initialized, and free a
        port that a failed Initialize left bound (§3.2 step 10).  The instance is not usable
        afterwards only in the sense that it is uninitialized; it may be initialized again."""
        self.finalize()
        with self._lock:
            self._release_failed_listener()

    def _release_failed_listener(self) -> None:
        listener, self._failed_listener = self._failed_listener, None
        if listener is not None:
            listener.close()

    # -- state ------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.initialized = False
        self.transfer_backend = "comm"
        self.device_id = 0
        self.sync_wait_ms = 1000
        self.listener: fabric.Listener | None = None
        self.listen_port_text: str | None = None  # comm: llm.ListenPort while listening (§3.4)
        self.local_engine: str | None = None  # hixl: "ip:port" of Initialize (§3.4 step 5)
        self.has_comm_res = False
        self.comm_res_text: str | None = None  # comm: a non-empty llm.LocalCommRes
        self.cache_table = CacheTable(self._lock)
        self.caches = self.cache_table.caches  # registered now (read by every transfer)
        self.entities: dict[int, Entity] = {}
        # hixl (§3.5): every open connection by remote "ip:port", including those of entities a
        # re-link re-pointed their cluster id away from (kept open until Finalize)
        self.hixl_addrs: dict[tuple[str, int], Entity] = {}
        self.closing: dict[int, Entity] = {}  # entities being closed (later callers wait too)

    def note_failure(self, status: int, detail: str) -> int:
        """Record ``detail`` as why this thread's current call fails with ``status`` (read back by
        :meth:`last_error_detail`); returns ``status``.  Used by the fault hooks too."""
        self._local.detail = detail
        return status

    def _rejected(self, exc: Rejected) -> int:
        """The status a Backend method returns for a rejection (its detail kept for the message)."""
        return self.note_failure(exc.status, exc.detail)

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
        if not (is_ipv4_literal(ip) or is_ipv6_literal(ip)):  # msg_handler_plugin.cc GetAiFamily
            reject(PARAM_INVALID, f"cannot listen on {ip!r}: not an IP address literal")
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
        try:  # steps 3-8 up to listening (kvdd.sim.options); a port left bound goes at step 6
            plan = plan_initialize(options, engine_replaced=self._release_failed_listener)
        except OptionError as exc:
            reject(exc.status, str(exc))
        if plan.listen is not None:  # step 8: start listening (bind failure -> FAILED)
            self._start_listening(*plan.listen)  # step 10: a failure leaves it uninitialized
        try:
            sync_wait_ms = cache_engine_options(options)  # step 9
        except OptionError as exc:
            # step 10: the failure cleanup skips the transfer engine, so the port stays bound by
            # this instance until it is initialized again or destroyed (not by Finalize)
            self._failed_listener, self.listener = self.listener, None
            reject(exc.status, str(exc))
        self.transfer_backend = plan.backend
        self.device_id = plan.device_id
        self.sync_wait_ms = sync_wait_ms
        self.comm_res_text = plan.comm_res_text
        self.has_comm_res = plan.has_comm_res
        self.listen_port_text = plan.listen_port_text
        self.local_engine = plan.local_engine
        self.initialized = True
        return S_OK

    # -- §3.3 Finalize ------------------------------------------------------------------------
    def finalize(self) -> None:
        with self._lock:
            if not self.initialized:
                busy = self._finalizing
                if busy is not None:  # another thread is finalizing: return when it does (§10 rule 5)
                    busy.wait()
                return
            self.initialized = False
            self._stop_listening()
            # what was kept for this instance's next links, also when no listener closes now
            # (a link's worker may have made it after SetRole stopped the listener)
            fabric.announce.closed(id(self))
            # hixl: also the connections of re-pointed entities (§3.5), and entities being closed
            # by another thread, each closed once
            entities = list({id(e): e for e in (*self.entities.values(), *self.closing.values(),
                                                *self.hixl_addrs.values())}.values())
            caches = self.cache_table.all_entries()
            channels = fabric.take_endpoint(self)  # connections to peers in other processes
            self._reset()
            done = self._finalizing = threading.Event()
        try:
            self._finalize_wait(entities, caches, channels)
        finally:
            done.set()

    def _finalize_wait(self, entities: list[Entity], caches: list[CacheEntry],
                       channels: list[fabric.Channel]) -> None:
        for entity in entities:  # no new one-sided copy of any peer's starts on our caches
            fabric.revoke_served(entity.peer)

        def close_links(start: float) -> None:
            with fabric.drain_window(start):  # the closes wait for running ones from one start
                for entity in entities:
                    with entity.lock:  # wait for an in-flight transfer over this link
                        entity.peer.close()

        # every cache's drains revoke first, then the links close, then the waits, all from one
        # start; waits for local and remote leases too: a remote lease ends when its reader
        # releases it, when the reader's connection closes, or at the latest when it expires
        retire_all(caches, between=close_links)
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
        require_initialized(self.initialized)  # 1
        if role not in (1, 2, 3):  # 2
            reject(PARAM_INVALID, f"role {role} is not PROMPT(1), DECODER(2) or MIX(3)")
        try:
            m = switch_options(options)  # 3 (and the internal keys, step 7)
            if self.transfer_backend == "comm":  # 4
                if self.entities:
                    reject(Status.LLM_EXIST_LINK, "unlink all clusters before SetRole")
                self._switch_comm_listener(comm_switch_listen(m))
            else:  # 5: no link check; the listen address cannot change, it never stops listening
                engine = hixl_switch_engine(m)
                if engine is not None and engine != self.local_engine:
                    reject(Status.LLM_FEATURE_NOT_ENABLED, f"the hixl backend cannot change its "
                           f"listen address ({self.local_engine} -> {engine})")
        except OptionError as exc:
            reject(exc.status, str(exc))
        self.role = role  # 6
        return S_OK

    def _switch_comm_listener(self, listen: tuple[str, int, str] | None) -> None:
        """§3.4 step 4: same port text -> nothing; another -> move; none -> stop listening."""
        if listen is not None and self.listen_port_text is not None:
            if self.listen_port_text == listen[2]:
                return
        self._stop_listening()
        self.listen_port_text = None
        if listen is not None:
            self._start_listening(listen[0], listen[1])
            self.listen_port_text = listen[2]

    # -- §3.5 / §3.6 links --------------------------------------------------------------------
    def link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int) -> tuple[int, list[int]]:
        try:
            require_clusters(self.initialized, clusters, timeout_ms)  # steps 1-4
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
            self.note_failure(status, "; ".join(details))
        return status, rets

    def _link_one(self, cluster: ClusterInfo, timeout_ms: int) -> tuple[int, str]:
        if len(cluster.remote_ip_infos) != 1:
            return PARAM_INVALID, "exactly one remote_ip_infos entry is required"
        if self.transfer_backend == "comm" and not self.has_comm_res:
            if len(cluster.local_ip_infos) != 1:
                return PARAM_INVALID, ("without llm.LocalCommRes or a listen address at Initialize, "
                                       "exactly one local_ip_infos entry is required")
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
        # connect() gives a connection exactly when it succeeds, so "and" decides as "or" does
        if status != S_OK or conn is None:  # mutation: equivalent(or -> and)
            why = (f"no answer within {timeout_ms} ms" if status == Status.LLM_TIMEOUT
                   else "refused or unreachable")
            return status, (f"cannot connect to {remote.ip}:{remote.port} ({why}: is the peer "
                            f"initialized and listening on that address?)")
        try:
            force_link = cluster.remote_cluster_id not in self.entities  # comm: §3.5 d
            # the peer's side first: backend/initialized check, on comm its acceptance (§3.5 e)
            res = conn.link(self, force_link)
            # a link result carries an offer and a handle exactly when it succeeded (both
            # Connection.link's), so "and" decides as "or" does
            if res.status != S_OK or res.offer is None or res.handle is None:  # mutation: equivalent(or -> and)
                return res.status, res.detail or "the peer refused the link"
            handle = res.handle
            if self.transfer_backend == "hixl":
                with self._lock:  # one-way: keyed by the user-supplied id (§2.3)
                    if address in self.hixl_addrs:  # connected meanwhile by another thread
                        handle.close()
                        return Status.LLM_ALREADY_LINK, f"already connected to {remote.ip}:{remote.port}"
                    # re-points the id: an entity it named stays open under its address (§3.5)
                    entity = Entity(handle, address)
                    self.entities[cluster.remote_cluster_id] = entity
                    self.hixl_addrs[address] = entity
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
                if (not self.initialized or self.dropped
                        or peer.transfer_backend != self.transfer_backend):
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
            for whose, text in (("our", self.comm_res_text), ("the peer's", peer.comm_res_text)):
                try:
                    check_link_comm_res(text)
                except OptionError as exc:
                    return self.note_failure(exc.status, f"{whose} {exc}"), None
            key = peer.cluster_id
            if force_link and key in self.entities:
                old = self._pop_entity(key)
            if key in self.entities:
                return self.note_failure(Status.LLM_ALREADY_LINK, f"already linked to cluster {key}"), old
            self.entities[key] = Entity(make_handle(), address)
            return S_OK, old

    def _pop_entity(self, key: int) -> Entity | None:
        with self._lock:
            entity = self.entities.pop(key, None)
            if entity is not None and self.hixl_addrs.get(entity.address) is entity:
                del self.hixl_addrs[entity.address]  # hixl: this connection closes
            return entity

    @staticmethod
    def _close_entity(entity: Entity) -> None:
        with entity.lock:  # wait for an in-flight transfer (§10 rule 5)
            entity.peer.close()

    def _destroy_entity(self, key: int) -> bool:
        """Unlink ``key``: return once no transfer over it runs, also when another thread is
        unlinking it right now (§10 rule 5)."""
        with self._lock:
            entity = self._pop_entity(key)
            popped = entity is not None
            if entity is None:
                entity = self.closing.get(key)
            else:
                self.closing[key] = entity
        if entity is None:
            return False
        self._close_entity(entity)
        with self._lock:
            if self.closing.get(key) is entity:
                del self.closing[key]
        return popped

    def unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int,
                            force: bool) -> tuple[int, list[int]]:
        try:
            require_clusters(self.initialized, clusters, timeout_ms)  # steps 1-4
        except Rejected as exc:
            return self._rejected(exc), []
        status: int = S_OK
        rets: list[int] = []
        with self._lock:  # no new one-sided copy of the named peers' starts on our caches, so
            named = [self.entities.get(c.remote_cluster_id) for c in clusters]
        for entity in named:  # that their closes wait for running ones from one start
            if entity is not None:
                fabric.revoke_served(entity.peer)
        with fabric.drain_window():
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
            return self.note_failure(PARAM_INVALID, "exactly one remote_ip_infos entry is required")
        status = faults.on_unlink(self, cluster.remote_cluster_id, timeout_ms, force=False)
        if status != S_OK:
            return status
        remote = cluster.remote_ip_infos[0]
        status, conn = fabric.connect(remote.ip, remote.port, timeout_ms)
        # connect() gives a connection exactly when it succeeds, so "and" decides as "or" does
        if status != S_OK or conn is None:  # mutation: equivalent(or -> and)
            if status == Status.LLM_LINK_FAILED:
                status = Status.LLM_UNLINK_FAILED
            return self.note_failure(status, f"cannot reach {remote.ip}:{remote.port} to unlink")
        try:
            peer_status = conn.notify_unlink(self)  # "disconnect(my cluster id)"
        finally:
            conn.close()
        self._destroy_entity(cluster.remote_cluster_id)
        if peer_status != S_OK:
            return self.note_failure(peer_status, f"the peer at {remote.ip}:{remote.port} did not confirm the unlink")
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
                require_initialized(self.initialized)  # step 1; steps 2-10: kvdd.sim.caches
                return S_OK, self.cache_table.register(cache_desc, addrs, self)
            except Rejected as exc:
                return self._rejected(exc), -1

    def unregister_kv_cache(self, cache_id: int) -> int:
        with self._lock:
            if not self.initialized:
                return self.note_failure(FAILED, "not initialized")
            table = self.cache_table
            entry = table.take(cache_id)
        if entry is not None:  # waits for its transfers, as does a second caller (§10 rule 5)
            table.retire(cache_id, entry)
        return S_OK

    # -- §3.9 --------------------------------------------------------------------------------
    def allocate_cache(self, cache_desc: CacheDesc) -> tuple[int, Cache | None]:
        return self.note_failure(Status.LLM_FEATURE_NOT_ENABLED, "AllocateCache is not supported by V2"), None

    def deallocate_cache(self, cache_id: int) -> int:
        return self.note_failure(Status.LLM_FEATURE_NOT_ENABLED, "DeallocateCache is not supported by V2")

    def copy_kv_cache(self, src_cache: Cache, dst_cache: Cache, src_batch_index: int,
                      dst_batch_index: int, offset: int, size: int) -> int:
        return self.note_failure(Status.LLM_FEATURE_NOT_ENABLED, "CopyKvCache is not supported by V2")

    def copy_kv_blocks(self, src_cache: Cache, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks_list: Sequence[Sequence[int]]) -> int:
        return self.note_failure(Status.LLM_FEATURE_NOT_ENABLED, "CopyKvBlocks is not supported by V2")

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

    # -- for the cross-process fabric ----------------------------------------------------
    def snapshot_for_link(self) -> tuple[dict[int, RemoteCache], dict[int, CacheEntry]]:
        """The caches a peer linking now may use (:meth:`kvdd.sim.caches.CacheTable.snapshot`)."""
        with self._lock:
            table = self.cache_table
        return table.snapshot()
