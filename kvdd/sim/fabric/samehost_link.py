"""The ``"samehost"`` handshake extension: gives a link the one-sided same-host data path.

Registered with :func:`kvdd.sim.fabric.register_extension` (and as the announcer of
:mod:`.announce`) when the fabric is imported (:func:`install`).  Per link:

* acceptor, authentication answer: when this process can use the path, the answer announces its
  endpoint (:func:`~.samehost.announcement`) and the endpoint expects the session;
* initiator, authenticated: when the announcement's hints match, it connects to the endpoint and
  sends its proof at once (:func:`~.samehost.start_proof`), makes its lease table, then sends its
  link hello with its ``offer`` (version, uid, boot id, ``SyncKvCacheWaitTime``);
* acceptor ``accept`` (the initiator's entry) then ``offer`` (its reply): when the hints match, the
  endpoint's session is bound to this link; the acceptor's handle (comm) gets a
  :class:`SameHostPath` that starts serving once the initiator proved itself; once the reply is
  sent, the endpoint answers the proof (a rendezvous: whichever of the proof and the decision
  comes second answers: our table is attached to the proven initiator, then sent), and a link not
  made abandons the session; the initiator's table, when it comes, opens our reads;
* initiator ``accept`` (the reply): finishes the proof (:func:`~.samehost.finish_proof`); its handle
  gets a :class:`SameHostPath`, or TCP when the proof fails (logged with the reason).  It returns
  once its own table is sent: it waits for no acknowledgement, and a transfer of the acceptor's
  that starts meanwhile waits for that table (:meth:`SameHostPath.acquire`).

Each side makes the lease table of the caches it serves (:class:`~.samehost_path.ServedTable`,
:class:`_Tables`) ahead of the proof's round trips (the acceptor from its link reply's snapshot once
the reply is sent, the initiator right after its proof left), hands it over once the peer
has proven itself and attaches the proven reader then (a cache unregistered meanwhile is revoked),
labelled by cache id, so a reader only ever uses a cache that both its own snapshot and the owner's
table name.  The tables kept, bounded per reader, are in :mod:`.samehost_tables`.
"""

from __future__ import annotations

import logging
import math
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..memory import Region
from .announce import set_announcer
from .auth import Session
from .protocol import LinkOwner, RemoteCache, ServedCache
from .samehost import (EXTENSION, SETUP_TIMEOUT_S, SameHostLink, SameHostRefused, SessionKeys,
                       announced_name, announcement,
                       availability, endpoint, expect, finish_proof, offer, same_host,
                       start_proof)
from .samehost_attest import close_fd
from .samehost_close import close_socket
from . import samehost_spare as spare
from .samehost_path import OneSidedLease, OneSidedPeer, ServedTable
from .samehost_tables import live_tables, serve, sweep

logger = logging.getLogger(__name__)

__all__ = ["SameHostPath", "install", "extension_offer", "extension_accept", "live_tables"]

_WAIT = struct.Struct("<I")  # SyncKvCacheWaitTime (ms) of the side that sends the entry
OPENING_WAIT_S = 0.1  # the longest a close of the path waits for a reader being built
_STATE_TTL_S = 30.0
_MAX_STATES = 1024


class SameHostPath:
    """A link's one-sided data path (:class:`~kvdd.sim.fabric.protocol.DataPath`).

    ``name`` is ``"process_vm"`` while the path serves transfers, ``"tcp"`` before the proof
    completed (acceptor side), after it failed, or after the kernel refused ``process_vm``.

    Acceptor side: once its table went to the proven initiator (:meth:`expect_reader`), the
    initiator's link call returns as soon as the initiator's table is sent; a transfer of ours
    that starts before that table came waits for it (at most until ``SETUP_TIMEOUT_S`` after our
    table left, and at most half of the transfer's timeout, so that TCP still has the other
    half), so that a transfer after the initiator's link returned uses this path."""

    def __init__(self) -> None:
        self._name = "tcp"
        self._settled = threading.Event()  # no reader is on its way (set unless expect_reader)
        self._settled.set()
        self._reader_by = 0.0  # expect_reader: the reader comes by then (time.monotonic())
        self._reader: OneSidedPeer | None = None
        self._served: ServedTable | None = None  # the table of our caches the peer reads
        self._lock = threading.Lock()
        self._opening = threading.Lock()  # held while our reader is built: a close waits for it
        self._closed = False
        self._prepare: Callable[[Mapping[int, ServedCache]], None] | None = None
        self._decide: Callable[[], None] | None = None
        self._after: Callable[[Mapping[int, ServedCache]], None] | None = None
        self._entries: Mapping[int, ServedCache] = {}  # the caches the link reply announced

    def prepare(self, entries: Mapping[int, ServedCache]) -> None:
        """The link reply is sent (acceptor): make this side's lease table now, from the caches
        that reply announced, instead of on the peer's proof (:class:`_Tables`), then let the
        endpoint answer the peer's proof (now, if it came already)."""
        prepare, decide = self._prepare, self._decide
        self._entries = entries
        if prepare is not None and not self._closed:
            prepare(entries)
        if decide is not None:  # (also when no handle of ours uses the path: hixl)
            decide()

    def after_reply(self) -> None:
        """The link is made and its reply out (acceptor): the table of the next link is made
        now, off that link's path (:mod:`.samehost_spare`)."""
        after = self._after
        if after is not None and not self._closed:
            after(self._entries)

    def serve(self, table: ServedTable) -> None:
        """The table through which the peer of this link reads our caches: closed with the path
        (unlink of this side), so no copy of the peer's starts, and none runs, once that returns."""
        with self._lock:
            if not self._closed:
                self._served = table
                return
        table.close()

    @property
    def name(self) -> str:
        """``"process_vm"`` or ``"tcp"``: what a transfer starting now uses (after the wait for a
        reader on its way, as :meth:`acquire`)."""
        if not self._settled.is_set():
            self._await_reader(int(SETUP_TIMEOUT_S * 2000))  # (until the reader's deadline)
        return self._name

    def expect_reader(self, within_s: float) -> None:
        """Our table went to the proven peer: its table, which opens our reads, comes within
        ``within_s`` seconds (else :meth:`settle` ends the wait sooner)."""
        with self._lock:
            if not self._closed and self._reader is None:
                self._reader_by = time.monotonic() + within_s
                self._settled.clear()

    def settle(self) -> None:
        """No reader is on its way any more (it came, or never will): transfers stop waiting."""
        self._settled.set()

    def activate(self, reader: OneSidedPeer) -> None:
        with self._lock:
            if not self._closed:
                self._reader = reader
                self._name = "process_vm"
                self._settled.set()
                return
        self._settled.set()
        reader.close()

    def open_reads(self, link: SameHostLink) -> None:
        """Build our reader of the proven peer and start using it, unless the path closed
        (raises SameHostRefused).  A close waits for a reader being built, at most
        ``OPENING_WAIT_S``: building never waits for the peer, but the kernel can hold one of
        its calls (``pidfd_getfd`` on a peer in ``execve`` waits while the old address space is
        freed); a reader finished after the close is closed unused (:meth:`activate`)."""
        with self._opening:
            if self._closed:
                raise SameHostRefused("the link closed before its reads opened")
            self.activate(OneSidedPeer(link))

    def _await_reader(self, timeout_ms: int) -> OneSidedPeer | None:
        """The reader, after waiting for one on its way (bounded: see the class docstring)."""
        if not self._settled.is_set():
            left = min(self._reader_by - time.monotonic(), max(timeout_ms, 0) / 2000.0)
            if left > 0:
                self._settled.wait(left)
        return self._reader

    def acquire(self, rc: RemoteCache, addrs: tuple[int, ...],
                timeout_ms: int) -> tuple[int, object] | None:
        reader = self._reader
        if reader is None and not self._settled.is_set():
            start = time.monotonic()
            reader = self._await_reader(timeout_ms)
            # (the wait comes out of the transfer's time: the caller's deadline stands)
            timeout_ms = max(0, timeout_ms - math.ceil((time.monotonic() - start) * 1000))
        if reader is None:
            return None
        got = reader.acquire(rc, addrs, timeout_ms)
        if got is None and not reader.usable:
            self._name = "tcp"
        return got

    def one_sided_mover(self) -> object | None:
        """The compiled copy of the active path (``_xproc.SameHostMover``), or None (TCP; also
        while a reader is on its way: the caller's Python path waits for it, within its
        timeout, in :meth:`acquire`)."""
        reader = self._reader
        return reader.mover if reader is not None and reader.usable else None

    def release(self, lease: object) -> None:
        assert self._reader is not None and isinstance(lease, OneSidedLease)
        self._reader.release(lease)

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        assert self._reader is not None and isinstance(lease, OneSidedLease)
        return self._reader.move(lease, tensors, dst, dst_off, src_off, length, False)

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        assert self._reader is not None and isinstance(lease, OneSidedLease)
        return self._reader.move(lease, tensors, src, src_off, dst_off, length, True)

    def revoke_served(self) -> None:
        """No new copy of the peer's on our caches (the close that follows waits for running
        ones): finalize revokes every link's table before it closes the first."""
        served = self._served
        if served is not None:
            served.revoke()

    def _detach(self) -> tuple[OneSidedPeer | None, ServedTable | None]:
        """Close the path (TCP from now on) and hand back its reader and served table."""
        with self._lock:
            self._closed = True
            reader, self._reader = self._reader, None
            served, self._served = self._served, None
            self._name = "tcp"
        self._settled.set()
        return reader, served

    def _detach_after_opening(self) -> tuple[OneSidedPeer | None, ServedTable | None]:
        """:meth:`_detach`, then the wait (bounded) for a reader being built, which closes it."""
        got = self._detach()  # (closed: no reader starts being built from now on)
        if self._opening.acquire(timeout=OPENING_WAIT_S):
            self._opening.release()
        return got

    def close(self) -> None:
        reader, served = self._detach_after_opening()
        if reader is not None:
            reader.close()
        if served is not None:  # revoke the peer's access and wait for its copies (bounded)
            served.close()

    def abandon(self) -> bool:
        """The proof failed after the tables were exchanged (the link uses TCP): our reads stop
        (the reader closes now, its mappings on the unmapper thread, not whenever the collector
        frees it), the peer's access to our table is revoked without waiting here (the link call
        returns; an unregister still waits for a copy of its, bounded, once); True when a table
        was served (it stays attached until its reader exits)."""
        reader, served = self._detach_after_opening()
        if reader is not None:
            reader.close()
        if served is not None:
            served.revoke()
        return served is not None


class _LinkState:
    """One handshake's same-host state between this side's two extension callbacks; on the
    initiator, its proof under way (the socket, its tables and its own table's fd)."""

    def __init__(self, owner: LinkOwner | None, hints: bytes, peer_wait_ms: int,
                 proof: tuple[socket.socket, _Tables, tuple[int, int]] | None = None) -> None:
        # weak: an abandoned handshake's state never keeps the instance alive (SEMANTICS.md §3.1)
        self._owner = None if owner is None else weakref.ref(owner)
        self.hints = hints
        self.peer_wait_ms = peer_wait_ms
        self.path = SameHostPath()
        self.created = time.monotonic()
        self.proof = proof
        self.deadline: float | None = None  # the initiator's link call ends by then

    @property
    def owner(self) -> LinkOwner | None:
        return None if self._owner is None else self._owner()

    def end(self, keep_tables: bool = False) -> None:
        """Close the proof's socket and our table's fd (and the tables, unless kept)."""
        proof, self.proof = self.proof, None
        if proof is not None:
            sock, tables, own = proof
            close_socket(sock)  # (files the acceptor queued are closed off this thread)
            close_fd(own[0])
            if not keep_tables:
                tables.close()


_lock = threading.Lock()
# by session transcript: the initiator's owner (offer -> accept), the acceptor's path (accept ->
# offer); entries of handshakes that never got to the second callback expire
_states: dict[tuple[bool, bytes], _LinkState] = {}


def _put(initiator: bool, session: SessionKeys, state: _LinkState) -> bool:
    now = time.monotonic()
    with _lock:
        stale = [_states.pop(k) for k, s in list(_states.items()) if now - s.created > _STATE_TTL_S]
        put = len(_states) < _MAX_STATES
        if put:
            _states[(initiator, bytes(session.transcript))] = state
    for old in stale:
        old.end()
    return put


def held_states() -> int:
    """Link states kept between a side's two extension callbacks now (diagnostics, tests)."""
    with _lock:
        return len(_states)


def _take(initiator: bool, session: SessionKeys) -> _LinkState | None:
    with _lock:
        return _states.pop((initiator, bytes(session.transcript)), None)


class _Tables:
    """This side's lease table of one link: the caches it serves (registered before the link; a
    reader only uses those its own snapshot, taken at link time, also names), made ahead from
    the link reply's snapshot (:meth:`prepare`, acceptor) or when the proof asks (:meth:`make`).
    A cache unregistered before the table is attached is revoked then
    (:meth:`~.samehost_path.ServedTable.attach`).  :meth:`close` closes every table made."""

    def __init__(self, owner: LinkOwner) -> None:
        self.owner = owner
        self.made: list[ServedTable] = []
        self._ahead: ServedTable | None = None
        self._closed = False
        self._lock = threading.Lock()

    def prepare(self, entries: Mapping[int, ServedCache]) -> None:
        with self._lock:
            if not self._closed and not self.made:
                ahead = spare.take(self.owner, entries) if self.owner.initialized else None
                self._ahead = ahead or ServedTable(entries if self.owner.initialized else {})
                self.made.append(self._ahead)
                self._ahead.announce()  # the shareable memory's records, off the proof's path

    def make(self) -> tuple[int, int]:
        with self._lock:
            table, self._ahead = self._ahead, None
            if table is None:
                _snap, entries = self.owner.snapshot_for_link()
                table = ServedTable(entries if self.owner.initialized else {})
                self.made.append(table)
            return table.take_fd()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            made = list(self.made)
        for table in made:
            table.close()


def _serve_table(link: SameHostLink, table: ServedTable, peer_wait_ms: int,
                 path: SameHostPath) -> bool:
    """The peer is proven: attach our table to the reader (it holds its own duplicate of the
    pidfd) before the peer gets it; unregister waits for the peer's copies from now on.  Never
    waits for a copy of another link's (:mod:`.samehost_tables`: eviction revokes).  False: too
    many evicted tables of this reader (the table is closed, never attached)."""
    if not serve(table, link, peer_wait_ms):
        return False
    path.serve(table)
    return True


def _read(link: SameHostLink, path: SameHostPath, reads: bool) -> None:
    """Start our reads of the proven peer (``reads``: our handle uses this path), or let the
    link go."""
    if not reads:
        link.close()
        return
    try:
        path.open_reads(link)
    except SameHostRefused as exc:
        logger.info("kvdd same-host: not reading pid %d one-sided: %s", link.peer_pid, exc)
        link.close()
        path.settle()


def _wait_ms(owner: LinkOwner) -> bytes:
    return _WAIT.pack(max(0, min(owner.sync_wait_ms, 0xFFFFFFFF)))


def extension_offer(session: SessionKeys, owner: LinkOwner) -> bytes | None:
    """``offer`` of the extension, both roles (see the module docstring)."""
    if session.initiator:
        return _offer_and_prove(session, owner)
    state = _take(False, session)
    if state is None or not same_host(state.hints):  # no usable offer from the initiator
        return None
    sweep()
    tables = _Tables(owner)
    reads = owner.transfer_backend == "comm"  # hixl: only the initiator has an entity
    path = state.path

    # (on_proven runs on the thread that answers the proof, on_link(None) on the one that ends
    # it, possibly at once: one lock, so a give-up never closes a table as it is attached, nor
    # leaves our transfers waiting for a reader that will not come)
    lock = threading.Lock()
    served = given_up = False

    def on_proven(link: SameHostLink) -> bool:
        nonlocal served
        with lock:
            # our table is attached to the proven initiator before it goes to it
            if given_up or not _serve_table(link, tables.made[-1], state.peer_wait_ms, path):
                return False
            served = True
            if reads:  # our transfers wait for the initiator's table, which is on its way
                path.expect_reader(SETUP_TIMEOUT_S)
            return True

    def on_link(link: SameHostLink | None) -> None:
        nonlocal given_up
        if link is not None:
            _read(link, path, reads)  # (the reader side owns ``link`` from then on)
            return
        with lock:
            given_up = True
            path.settle()
            if not served:  # (a table that went to the peer stays served: the path closes it)
                tables.close()

    # (not announced, expired, abandoned: no same-host path)
    if not endpoint().bind(session, tables.make, on_proven, on_link):
        return None
    path._prepare = tables.prepare
    path._decide = lambda: endpoint().decide(session)
    path._after = lambda entries: spare.make(owner, entries)
    return offer() + _wait_ms(owner)


def _offer_and_prove(session: SessionKeys, owner: LinkOwner) -> bytes | None:
    """The initiator's entry (None: nothing announced, or the path is not usable: TCP); its
    proof leaves for the announced endpoint once the hello is sent (:func:`_start`)."""
    announced = getattr(session, "announced", b"")
    mine = offer() if announced else b""
    if not mine:
        return None
    try:
        announced_name(announced)
    except SameHostRefused as exc:
        logger.info("kvdd same-host: this link uses TCP: %s", exc)
        return None
    if not _put(True, session, _LinkState(owner, mine, 0)):
        return None
    return mine + _wait_ms(owner)


def _start(session: SessionKeys, deadline: float) -> None:
    """Our hello left: our proof to the announced endpoint, then our table (made while the
    acceptor serves the hello and checks the proof), every wait of the proof bounded by the
    link call's ``deadline`` (the connect, which precedes our wait for the reply, by half the
    time left).  On failure the link uses TCP (our ``accept`` finds no proof; the
    acceptor's session expires unclaimed)."""
    with _lock:
        state = _states.get((True, bytes(session.transcript)))
    owner = None if state is None else state.owner
    if state is None or owner is None or state.proof is not None:
        return
    announced = getattr(session, "announced", b"")
    state.deadline = deadline
    left = deadline - time.monotonic()
    if left <= 0:
        return
    try:  # (half of what is left at most: the link's reply, over TCP, must still have time
        #     when the endpoint's queue is full and its connect waits for room to the end)
        sock = start_proof(announced, session, min(left / 2, SETUP_TIMEOUT_S))
    except SameHostRefused as exc:
        logger.info("kvdd same-host: this link uses TCP: %s", exc)
        return
    sweep()
    tables = _Tables(owner)
    try:
        own = tables.make()
    except BaseException:
        close_socket(sock)
        tables.close()
        raise
    state.proof = (sock, tables, own)


def extension_accept(session: SessionKeys, value: bytes) -> object:
    """``accept`` of the extension: the acceptor's pending path, the initiator's proven one, or
    None (TCP)."""
    if not session.initiator:  # acceptor: the initiator's hints; its proof is on its way
        if len(value) < _WAIT.size:
            return None
        body, (peer_wait_ms,) = value[:-_WAIT.size], _WAIT.unpack(value[-_WAIT.size:])
        state = _LinkState(None, body, peer_wait_ms)
        _put(False, session, state)
        return state.path
    mine = _take(True, session)
    if mine is None:
        return None
    proof = mine.proof
    owner = mine.owner
    if (proof is None or owner is None or len(value) < _WAIT.size
            or not same_host(value[:-_WAIT.size])):
        mine.end()
        return None
    (peer_wait_ms,) = _WAIT.unpack(value[-_WAIT.size:])
    sock, tables, own = proof
    path = mine.path

    def attach(link: SameHostLink | None) -> None:
        # (not served: the table is closed, so the peer's reads of us find it revoked: TCP)
        assert link is not None
        _serve_table(link, tables.made[-1], peer_wait_ms, path)

    try:
        link = finish_proof(sock, session, own, attach, lambda link: _read(link, path, True),
                            mine.deadline)
    except SameHostRefused as exc:
        logger.info("kvdd same-host: this link uses TCP: %s", exc)
        mine.end(keep_tables=path.abandon())
        return None
    mine.end(keep_tables=True)
    if path.name != "process_vm":
        logger.info("kvdd same-host: peer pid %d proven, but its lease table is unusable: TCP",
                    link.peer_pid)
    return path


class _Announcer:
    """The acceptor's announcement of its endpoint in authentication answers (:mod:`.announce`),
    and the initiator's end of a proof whose link failed."""

    def announcement(self) -> bytes:
        return announcement()

    def expect(self, session: Session) -> bool:
        return expect(session)

    def abandon(self, session: Session) -> None:
        endpoint().abandon(session)
        state = _take(False, session)  # (a link made took it already: a refused one's goes now)
        if state is not None:
            state.end()

    def sent(self, session: Session, deadline: float) -> None:
        _start(session, deadline)

    def discard(self, session: Session) -> None:
        state = _take(True, session)
        if state is not None:
            state.end()

    def closed(self, owner_id: int) -> None:
        spare.drop(owner_id)


def install() -> None:
    """Register the extension with the fabric (once per process)."""
    from .extensions import register_extension
    ok, why = availability()
    if not ok:
        logger.debug("kvdd same-host path unavailable: %s", why)
    register_extension(EXTENSION, extension_offer, extension_accept)
    set_announcer(_Announcer())
