"""Rank-table links: ``link`` / ``unlink`` / ``query_register_mem_status`` (PYPKG.md §3.3, §9.2-9.4).

``link(comm_name, {cluster_id: rank}, rank_table)`` draws a comm id (1, 2, ... per engine) and
starts *preparing* the domain in the background: this member becomes reachable (a fabric listener
started on demand, its address published, :mod:`.rendezvous`), links to every member of a higher
rank over kvdd's authenticated fabric (:meth:`SimBackend.link_llm_clusters`: one comm link each,
usable in both directions, keyed by the peer's real cluster id) and waits for the members of a
lower rank to link to it.  Both ends of each link state the domain and their remote-accessible
mode in the handshake (:mod:`.instance`); a link is accepted only into the same domain with the
same members and equal modes.

Status of a comm id: PREPARING until every other member is linked → OK; FAILED at once on a
mismatch, or after ``llm.LinkTotalTime`` seconds (30 when 0) — PREPARING always ends (§9.3).  OK and
FAILED are final.  While PREPARING, a transfer naming a member returns ``LLM_NOT_YET_LINK``
(:meth:`Domains.pending`).  Each side offers the caches registered when it called ``link``: later
ones are invisible over that link (§9.4).  ``unlink`` stops a prepare and drops this side's
entities of the domain (the peers keep theirs until they unlink too).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...status import FAILED, PARAM_INVALID, S_OK, Status
from ...types import ClusterInfo, IpInfo
from .. import fabric, faults
from ..fabric.registry import norm_ip
from . import rendezvous
from .instance import Claim, PkgInstance, Snapshot, stating

__all__ = ["Domains", "Domain", "OK", "PREPARING", "FAILED_STATE", "MAX_DOMAINS",
           "COMM_NAME_MAX_LENGTH"]

logger = logging.getLogger(__name__)

OK, PREPARING, FAILED_STATE = 0, 1, 2  # RegisterMemStatus values
MAX_DOMAINS = 512  # comm_link_manager.cc: comm domains per engine
COMM_NAME_MAX_LENGTH = 128  # bytes, with the terminating NUL (HCCL's communicator name)
_DOC_MAX_CONCURRENT = 16  # docs only: concurrent link builds (logged once, not enforced)
_RETRY_S = 0.05
_ATTEMPT_MS = 2000  # one link attempt's time limit within the link total time


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(limit: str, msg: str, *args: object) -> None:
    """Log a hardware limit the simulator does not enforce, once per process (PYPKG.md §9.5)."""
    with _warned_lock:
        if limit in _warned:
            return
        _warned.add(limit)
    logger.warning(msg, *args)


class Domain:
    """One comm id: its members, status and the entities it made."""

    def __init__(self, comm_id: int, comm_name: str, members: Sequence[tuple[int, int]],
                 own: int, deadline: float, snapshot: Snapshot) -> None:
        self.comm_id = comm_id
        self.comm_name = comm_name
        self.members = tuple(members)  # (cluster_id, rank) in the caller's order
        self.own = own
        order = sorted(self.members, key=lambda m: (m[1], m[0]))
        at = [m[0] for m in order].index(own)
        self.dial = [m[0] for m in order[at + 1:]]  # higher ranks: we link to them
        self.await_ = {m[0] for m in order[:at]}  # lower ranks link to us
        self.deadline = deadline
        self.snapshot = snapshot
        self.status = PREPARING
        self.why = ""
        self.joined: set[int] = set()
        self.entities: dict[int, object] = {}  # cluster id -> the entity this domain made
        self.cv = threading.Condition()
        self.stop = False
        self.entry: Path | None = None
        self.thread: threading.Thread | None = None

    @property
    def others(self) -> set[int]:
        return {m[0] for m in self.members if m[0] != self.own}

    def finish(self, status: int, why: str = "") -> bool:
        """PREPARING -> OK / FAILED (once); False when it had ended already."""
        with self.cv:
            if self.status != PREPARING:
                return False
            self.status = status
            self.why = why
            self.cv.notify_all()
            return True


class Domains:
    """The rank-table domains of one engine (implements :class:`.instance.DomainGate`)."""

    def __init__(self, instance: PkgInstance, link_total_s: int) -> None:
        self.instance = instance
        self.link_total_s = link_total_s
        self._lock = threading.Lock()
        self._next_id = 1
        self._domains: dict[int, Domain] = {}
        self._listeners: dict[tuple[str, int], fabric.Listener] = {}
        self._closed = False

    # -- what transfers and the handshake ask ------------------------------------------------
    def pending(self, cluster_id: int) -> bool:
        """A domain with ``cluster_id`` among its other members is still PREPARING."""
        with self._lock:
            return any(d.status == PREPARING and cluster_id in d.others
                       for d in self._domains.values())

    def _preparing(self, comm_name: str) -> Domain | None:
        with self._lock:
            found = [d for d in self._domains.values()
                     if d.comm_name == comm_name and d.status == PREPARING]
        return found[-1] if found else None

    def admit(self, claim: Claim, remote_accessible: bool) -> tuple[int, str, Snapshot | None]:
        assert claim.comm_name is not None
        d = self._preparing(claim.comm_name)
        if d is None or claim.cluster_id not in d.await_:
            return (Status.LLM_LINK_FAILED, f"cluster {self.instance.cluster_id} is not preparing "
                    f"comm domain {claim.comm_name!r} with cluster {claim.cluster_id} (yet)", None)
        if sorted(claim.members) != sorted(d.members):
            why = (f"comm domain {d.comm_name!r}: cluster_rank_info differs between the members "
                   f"({dict(claim.members)} vs {dict(d.members)})")
            self._fail(d, why)
            return PARAM_INVALID, why, None
        if claim.remote_accessible != remote_accessible:
            why = (f"comm domain {d.comm_name!r}: remote-cache-accessible differs (cluster "
                   f"{self.instance.cluster_id}: {int(remote_accessible)}, cluster "
                   f"{claim.cluster_id}: {int(claim.remote_accessible)})")
            self._fail(d, why)
            return PARAM_INVALID, why, None
        return S_OK, "", d.snapshot

    def joined(self, claim: Claim) -> None:
        assert claim.comm_name is not None
        d = self._preparing(claim.comm_name)
        entity = self.instance.entities.get(claim.cluster_id)
        if d is not None:
            with d.cv:
                if d.status == PREPARING:
                    d.joined.add(claim.cluster_id)
                    d.entities[claim.cluster_id] = entity
                    d.cv.notify_all()
                    return
        # the domain ended (failed or unlinked) while this link was being made: undo it
        if entity is not None and self.instance.entities.get(claim.cluster_id) is entity:
            self.instance.unlink_llm_clusters([ClusterInfo(remote_cluster_id=claim.cluster_id)],
                                              1000, True)

    # -- link / query / unlink -----------------------------------------------------------------
    def link(self, comm_name: str, cluster_rank_info: Sequence[tuple[int, int]],
             rank_table: str) -> tuple[int, int, str]:
        """``(status, comm_id, why)`` of a rank-table link (§3.3 native checks, in order)."""
        inst = self.instance
        if inst.transfer_backend == "hixl":  # hixl_transfer_engine.cc:226-234
            return (Status.LLM_FEATURE_NOT_ENABLED, 0, "the hixl transfer backend does not support "
                    "rank-table links (use link_clusters)")
        if not comm_name:
            return PARAM_INVALID, 0, "comm_name must not be empty"
        if len(comm_name.encode("utf-8", "surrogatepass")) >= COMM_NAME_MAX_LENGTH:
            return (PARAM_INVALID, 0, f"comm_name must be shorter than {COMM_NAME_MAX_LENGTH} "
                    "bytes")
        members = [(int(c), int(r)) for c, r in cluster_rank_info]
        if inst.cluster_id not in {c for c, _ in members}:
            return (PARAM_INVALID, 0, f"this engine's cluster id {inst.cluster_id} is not in "
                    f"cluster_rank_info {dict(members)}")
        with self._lock:
            if len(self._domains) >= MAX_DOMAINS:
                return PARAM_INVALID, 0, f"already {MAX_DOMAINS} comm domains"
        devices = rendezvous.rank_table_members(rank_table)
        if devices is None:
            return (Status.LLM_LINK_FAILED, 0, "the rank table is not a JSON object with a "
                    "server_list (no communicator can be built from it)")
        absent = sorted({r for _, r in members} - devices.keys())
        if absent:
            return (Status.LLM_LINK_FAILED, 0, f"ranks {absent} of cluster_rank_info are not "
                    "rank_ids of the rank table (no communicator can be built from it)")
        others = [c for c, _ in members if c != inst.cluster_id]
        # kvdd.sim.faults: in place of building the communicator (kind "link")
        status = faults.on_call(inst, "link", others[0] if len(others) == 1 else None,
                                self.link_total_s * 1000.0, True)
        if status != S_OK:
            return status, 0, inst.last_error_detail() or "injected fault"
        try:
            addrs = rendezvous.address_map()
            targets = {c: rendezvous.mapped_address(devices.get(r), addrs) for c, r in members}
            listen = targets[inst.cluster_id]
            # the directory: for publishing our address (when it is not mapped) or finding a
            # peer whose address is not mapped
            unmapped = any(t is None for t in targets.values())
            directory = rendezvous.rendezvous_dir() if unmapped else None
            ip, port = self._reachable(listen)
        except rendezvous.RendezvousError as exc:
            return Status.LLM_LINK_FAILED, 0, str(exc)
        except OSError as exc:
            return Status.LLM_LINK_FAILED, 0, f"cannot listen for the rank-table link: {exc.strerror}"
        snapshot = inst.snapshot_for_link()  # the caches registered now (§9.4)
        with self._lock:
            if self._closed:
                return FAILED, 0, "the engine is finalizing"
            comm_id = self._next_id
            self._next_id += 1
            d = Domain(comm_id, comm_name, members, inst.cluster_id,
                       time.monotonic() + self.link_total_s, snapshot)
            self._domains[comm_id] = d
            busy = sum(1 for x in self._domains.values() if x.status == PREPARING)
        if busy > _DOC_MAX_CONCURRENT:
            _warn_once("concurrent", "kvdd: %d rank-table links are being built at once; the "
                       "hardware builds at most %d concurrently (not enforced by the simulator)",
                       busy, _DOC_MAX_CONCURRENT)
        if len(members) > 4:
            _warn_once("members", "kvdd: comm domain %r has %d members; the hardware allows at "
                       "most 4 per domain (not enforced by the simulator)", comm_name, len(members))
        if directory is not None and listen is None:
            try:
                d.entry = rendezvous.publish(directory, comm_name, inst.cluster_id, ip, port)
            except OSError as exc:
                with self._lock:
                    self._domains.pop(comm_id, None)
                return (Status.LLM_LINK_FAILED, 0, f"cannot publish this member's address in "
                        f"the rendezvous directory {directory}: {exc.strerror}")
        d.thread = threading.Thread(target=self._prepare, args=(d, directory, targets), daemon=True,
                                    name=f"kvdd-rank-link {comm_name[:32]}#{comm_id}")
        d.thread.start()
        return S_OK, comm_id, ""

    def _reachable(self, listen: tuple[str, int] | None) -> tuple[str, int]:
        """Where peers reach this member: the mapped address (the engine's own listener when it
        listens there), else a listener started on demand on 127.0.0.1 (one per engine)."""
        key = listen if listen is not None else ("127.0.0.1", 0)
        with self._lock:
            if listen is None:
                for (ip, _), lst in self._listeners.items():
                    if ip == "127.0.0.1":
                        return ip, lst.port
            elif key in self._listeners:
                return key
            else:
                own = self.instance.listener
                if own is not None and own.port == listen[1] \
                        and own.ip in (norm_ip(listen[0]), "0.0.0.0", "::"):
                    return key
            lst = fabric.Listener(self.instance, key[0], key[1])
            self._listeners[(key[0], lst.port if listen is None else key[1])] = lst
            return key[0], lst.port

    def _peer_of(self, d: Domain) -> int | None:
        """The peer a fault injection names for ``d``: its other member when it has one."""
        others = sorted(d.others)
        return others[0] if len(others) == 1 else None

    def query(self, comm_id: int) -> tuple[int, int, str]:
        """``(status, RegisterMemStatus value, why)``; unknown id → NOT_YET_LINK."""
        with self._lock:
            d = self._domains.get(comm_id)
        if d is None:
            return Status.LLM_NOT_YET_LINK, 0, f"no rank-table link with comm id {comm_id}"
        # kvdd.sim.faults: kind "query_register_mem_status"
        status = faults.on_call(self.instance, "query_register_mem_status", self._peer_of(d))
        if status != S_OK:
            return status, 0, self.instance.last_error_detail() or "injected fault"
        return S_OK, d.status, ""

    def unlink(self, comm_id: int) -> tuple[int, str]:
        """``(status, why)``; unknown id → NOT_YET_LINK; an injected failure keeps the domain."""
        with self._lock:
            d = self._domains.get(comm_id)
        if d is None:
            return Status.LLM_NOT_YET_LINK, f"no rank-table link with comm id {comm_id}"
        # kvdd.sim.faults: kind "unlink", in place of the teardown (local: no peer loss)
        status = faults.on_call(self.instance, "unlink", self._peer_of(d))
        if status != S_OK:
            return status, self.instance.last_error_detail() or "injected fault"
        with self._lock:
            if self._domains.get(comm_id) is not d:  # another thread unlinked it meanwhile
                return Status.LLM_NOT_YET_LINK, f"no rank-table link with comm id {comm_id}"
            del self._domains[comm_id]
        self._stop(d)
        return S_OK, ""

    def close(self) -> None:
        """Finalize: stop every prepare, drop the entries and on-demand listeners."""
        with self._lock:
            self._closed = True
            domains = list(self._domains.values())
            self._domains.clear()
            listeners = list(self._listeners.values())
            self._listeners.clear()
        for d in domains:  # every prepare stops first, then each is waited for
            with d.cv:
                d.stop = True
                d.cv.notify_all()
        for d in domains:
            self._stop(d, drop_entities=False)  # the instance's finalize drops every entity
        for lst in listeners:
            lst.close()

    # -- the prepare task ----------------------------------------------------------------------
    def _stop(self, d: Domain, drop_entities: bool = True) -> None:
        with d.cv:
            d.stop = True
            d.cv.notify_all()
        d.finish(FAILED_STATE, "unlinked")
        t = d.thread
        if t is not None and t is not threading.current_thread():
            t.join()
        if d.entry is not None:
            rendezvous.withdraw(d.entry)
            d.entry = None
        if drop_entities:
            self._drop_entities(d)

    def _drop_entities(self, d: Domain) -> None:
        inst = self.instance
        for cid, entity in list(d.entities.items()):
            if entity is not None and inst.entities.get(cid) is entity:
                inst.unlink_llm_clusters([ClusterInfo(remote_cluster_id=cid)], 1000, True)
        d.entities.clear()

    def _fail(self, d: Domain, why: str) -> None:
        if d.finish(FAILED_STATE, why):
            logger.info("kvdd: rank-table link %d (%r) failed: %s", d.comm_id, d.comm_name, why)

    def _prepare(self, d: Domain, directory: Path | None,
                 targets: Mapping[int, tuple[str, int] | None]) -> None:
        try:
            for peer in d.dial:
                if not self._dial(d, peer, directory, targets.get(peer)):
                    break
            with d.cv:
                while d.status == PREPARING and not d.stop and not d.await_ <= d.joined:
                    left = d.deadline - time.monotonic()
                    if left <= 0:
                        break
                    d.cv.wait(left)
            if d.status == PREPARING and not d.stop:
                missing = sorted(d.await_ - d.joined)
                if missing:
                    self._fail(d, f"clusters {missing} did not link within {self.link_total_s} s "
                               "(llm.LinkTotalTime)")
                else:
                    d.finish(OK)
        except Exception as exc:  # never leave a comm id PREPARING
            logger.exception("kvdd: rank-table link %d failed", d.comm_id)
            self._fail(d, f"internal error: {exc}")
        finally:
            if d.entry is not None:
                rendezvous.withdraw(d.entry)
                d.entry = None
            if d.status == FAILED_STATE and not d.stop:
                self._drop_entities(d)

    def _dial(self, d: Domain, peer: int, directory: Path | None,
              mapped: tuple[str, int] | None) -> bool:
        """Link to ``peer`` until it accepts, refuses for good, or the time is up; False when the
        domain failed or stopped."""
        inst = self.instance
        claim = Claim(inst.cluster_id, inst.remote_accessible, d.comm_name, d.members)
        while True:
            with d.cv:
                if d.stop or d.status != PREPARING:
                    return False
            left_ms = int((d.deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                self._fail(d, f"cluster {peer} did not link within {self.link_total_s} s "
                           "(llm.LinkTotalTime)")
                return False
            addr = mapped
            if addr is None and directory is not None:
                addr = rendezvous.lookup(directory, d.comm_name, peer)
            if addr is not None:
                status = self._link_once(peer, addr, min(left_ms, _ATTEMPT_MS), claim, d.snapshot)
                if status == S_OK:
                    with d.cv:
                        d.joined.add(peer)
                        d.entities[peer] = inst.entities.get(peer)
                    return True
                if status == PARAM_INVALID:
                    self._fail(d, inst.last_error_detail() or f"cluster {peer} refused the link")
                    return False
            with d.cv:
                d.cv.wait(_RETRY_S)

    def _link_once(self, peer: int, addr: tuple[str, int], timeout_ms: int, claim: Claim,
                   snapshot: Snapshot) -> int:
        """One comm link to ``peer`` at ``addr`` replacing any link to it (the last registration
        for a cluster id wins); our local comm resource is the rank table's, not one generated
        from the address."""
        inst = self.instance
        if peer in inst.entities:
            inst.unlink_llm_clusters([ClusterInfo(remote_cluster_id=peer)], 1000, True)
        had_comm_res = inst.has_comm_res
        cluster = ClusterInfo(remote_cluster_id=peer, local_ip_infos=[IpInfo("127.0.0.1", 0)],
                              remote_ip_infos=[IpInfo(addr[0], addr[1])])
        try:
            with stating(claim, snapshot):
                status, _ = inst.link_llm_clusters([cluster], timeout_ms)
        finally:
            if not had_comm_res:
                inst.has_comm_res = False
        return int(status)
