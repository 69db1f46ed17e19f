"""What a listening instance lets authenticated peers make of it: a fixed pool of handshake
workers, and the links it accepts, counted per source address and in all.

The listener's selector thread (:mod:`.listener`) reads every hello whole before it hands it
here, so a worker never waits for a peer's bytes: it decodes the hello, asks the engine for the
link (:func:`.handshake.serve_link`) or the unlink, sends the reply (within
``REPLY_TIMEOUT_S``) and hands the connection back to the listener to be read until the peer
closes (``LINGER_S``) without holding a thread.  ``HANDSHAKE_WORKERS`` threads serve every hello of
the listener, whatever the number of connections; at most ``MAX_QUEUED_HELLOS`` complete hellos
wait for them, ``MAX_QUEUED_HELLOS_PER_SOURCE`` from one address, ``MAX_HELLO_BUFFERED`` bytes in all
and ``MAX_QUEUED_BYTES_PER_SOURCE`` from one address (more are closed, and logged), so
a key holder sending hellos faster than they are served delays another address's by at most
that many.

Links: at most ``MAX_LINKS`` accepted by the instance and ``MAX_LINKS_PER_SOURCE`` from one address
(:func:`.admission.source_of`).  A link over either gets ``LLM_LINK_FAILED`` in its reply, with a
message naming the bound (upstream has no link limit that returns a status of its own:
``LLM_CLUSTER_NUM_EXCEED_LIMIT`` is never returned, SEMANTICS.md §7).  A relink of a cluster id
for which the same address has a link whose entity is open is let through (the engine replaces
or refuses it as always), so a peer at its bound can still recover its own link; when it is
made, the link it replaced (same address, same cluster id, our handle closed by the engine) has
its connection aborted, so relinks never hold more than one link per cluster id past the bounds
(any other relink counts like a new link).  A link holds its place until its connection ended
*and* the engine closed our handle on the peer (unlink, a replacing link, finalize): a broken
link keeps its entity, and the peer's table, until then, so a peer cannot make entities without
bound by dropping its connections, nor by resetting its connection before our reply (the entity
made for it is then counted as a broken link).  When an address is at its bound (links
or tables) and has broken links, the oldest of them is dropped to make room (the engine forgets
it as after the peer's unlink: ``LLM_NOT_YET_LINK`` on it from then on), so a peer that restarts
under new cluster ids can always link again.

Cache tables: a link keeps the peer's table (its caches visible over the link, decoded into
objects: about 300 bytes each), so the tables of the links from one address hold at most
``MAX_LINKED_CACHES_PER_SOURCE`` caches and those of all links ``MAX_LINKED_CACHES``; a hello over
them gets ``LLM_LINK_FAILED`` before its table is decoded.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable

from .auth import Session
from .channel import Channel
from .handshake import serve_link, serve_unlink
from .peers import RemotePeer
from .logutil import warn_limited
from .protocol import LinkOwner
from .wire import (F_HELLO_LINK, F_HELLO_UNLINK, HANDSHAKE_WORKERS, MAX_LINKED_CACHES,
                   MAX_LINKED_CACHES_PER_SOURCE, MAX_LINKS,
                   MAX_LINKS_PER_SOURCE, MAX_QUEUED_HELLOS, MAX_QUEUED_HELLOS_PER_SOURCE,
                   MAX_HELLO_BUFFERED, ProtocolError)

logger = logging.getLogger(__name__)

__all__ = ["HandshakeGate", "Ticket", "MAX_QUEUED_BYTES_PER_SOURCE"]

MAX_QUEUED_BYTES_PER_SOURCE = 4 << 20  # hello bytes one address may have waiting (one hello
#                                        of any size is always let in)


class Ticket:
    """One hello's place in the link bounds (:class:`~.handshake.LinkAdmission`)."""

    __slots__ = ("_gate", "_source", "_reserved", "_caches")

    def __init__(self, gate: HandshakeGate, source: str) -> None:
        self._gate = gate
        self._source = source
        self._reserved = False
        self._caches = 0

    def reserve(self, cluster_id: int) -> str | None:
        """Take a link slot for ``cluster_id``; None when taken, else why not (for the reply)."""
        self._reserved = self._gate._reserve(self._source, cluster_id)
        while not self._reserved and self._gate._forget_broken(self._source):
            self._reserved = self._gate._reserve(self._source, cluster_id)
        if self._reserved:
            return None
        return (f"the peer accepts at most {MAX_LINKS_PER_SOURCE} links from one address and "
                f"{MAX_LINKS} in all (kvdd fabric bounds, docs/security.md); unlink one first")

    def charge(self, caches: int) -> str | None:
        """Count the peer's table of ``caches`` caches (kept with the link); None when within
        MAX_LINKED_CACHES_PER_SOURCE and MAX_LINKED_CACHES, else why not."""
        while not self._gate._charge(self._source, caches):
            if not self._gate._forget_broken(self._source):
                break
        else:
            self._caches = caches
            return None
        return (f"the peer keeps the cache tables of its links from one address up to "
                f"{MAX_LINKED_CACHES_PER_SOURCE} caches and {MAX_LINKED_CACHES} in all (kvdd "
                f"fabric bounds, docs/security.md); this link's table has {caches}")

    def attach(self, chan: Channel, cluster_id: int, handle: RemotePeer | None) -> None:
        """The link was made on ``chan`` (and our entity for the peer uses ``handle``, on comm):
        it holds its place until the connection ended and the handle was closed (unlink, a
        replacing link, finalize): a broken link keeps its entity, and its table, until then."""
        if self._reserved:
            self._reserved = False
            self._gate._attach(self._source, chan, cluster_id, self._caches, handle)
            self._caches = 0

    def cancel(self) -> None:
        if self._reserved:
            self._reserved = False
            self._gate._release(self._source, self._caches)
            self._caches = 0


class HandshakeGate:
    """The handshake workers and link accounting of one listener (see the module docstring).

    Parameters
    ----------
    owner : callable
        The listening instance (a weak reference: None once it is gone).
    finish : callable
        Takes an answered connection that is not a link (the listener reads it until the peer
        closes, then closes it).
    label : str
        For thread names and logs.
    """

    def __init__(self, owner: Callable[[], LinkOwner | None],
                 finish: Callable[[socket.socket], None], label: str) -> None:
        self._owner = owner  # a weak reference: never keeps the instance alive (SEMANTICS.md §3.1)
        self._finish = finish
        self._label = label
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._jobs: deque[tuple[socket.socket, Session, int, bytearray | mmap.mmap, str] | None] = deque()
        self._workers = 0
        self._idle = 0
        self._queued: dict[str, tuple[int, int]] = {}  # source -> (hellos, bytes) waiting
        self._queued_bytes = 0
        self._closed = False
        # source -> link -> [cluster id, caches, connection alive, handle open, had a handle]
        self._links: dict[str, dict[Channel, list[int]]] = {}
        self._reserved: dict[str, int] = {}
        self._total = 0  # live links + reservations
        self._caches: dict[str, int] = {}  # caches in the tables of the links (and reservations)
        self._caches_total = 0

    # -- link accounting ---------------------------------------------------------------------------
    def links(self, source: str | None = None) -> int:
        """Links accepted and alive (from ``source``, or in all), reservations included."""
        with self._lock:
            if source is None:
                return self._total
            return len(self._links.get(source, ())) + self._reserved.get(source, 0)

    def _reserve(self, source: str, cluster_id: int) -> bool:
        with self._lock:
            mine = self._links.get(source, {})
            relink = any(rec[0] == cluster_id and rec[3] for rec in mine.values())
            if not relink and (self._total >= MAX_LINKS or len(mine)
                               + self._reserved.get(source, 0) >= MAX_LINKS_PER_SOURCE):
                return False
            self._reserved[source] = self._reserved.get(source, 0) + 1
            self._total += 1
            return True

    def _forget_broken(self, source: str) -> bool:
        """Drop the oldest broken link from ``source`` (its connection ended, our entity for the
        peer remains): the engine forgets it as if the peer had unlinked it.  False when that
        address has none."""
        with self._lock:
            cluster_id = next((rec[0] for rec in self._links.get(source, {}).values()
                               if not rec[2] and rec[3]), None)
        if cluster_id is None:
            return False
        owner = self._owner()
        if owner is None:
            return False
        logger.info("kvdd fabric %s: dropping the broken link of cluster %d from %s to make room",
                    self._label, cluster_id, source)
        owner.peer_unlinked(cluster_id)
        return True

    def _charge(self, source: str, caches: int) -> bool:
        with self._lock:
            mine = self._caches.get(source, 0)
            if (mine + caches > MAX_LINKED_CACHES_PER_SOURCE
                    or self._caches_total + caches > MAX_LINKED_CACHES):
                return False
            self._caches[source] = mine + caches
            self._caches_total += caches
            return True

    def _uncharge(self, source: str, caches: int) -> None:  # (with the lock)
        if caches:
            left = self._caches.get(source, 0) - caches
            if left > 0:
                self._caches[source] = left
            else:
                self._caches.pop(source, None)
            self._caches_total -= caches

    def _release(self, source: str, caches: int = 0) -> None:
        with self._lock:
            n = self._reserved.get(source, 0) - 1
            if n > 0:
                self._reserved[source] = n
            else:
                self._reserved.pop(source, None)
            self._total -= 1
            self._uncharge(source, caches)

    def _attach(self, source: str, chan: Channel, cluster_id: int, caches: int,
                handle: RemotePeer | None) -> None:
        with self._lock:
            n = self._reserved.get(source, 0) - 1
            if n > 0:
                self._reserved[source] = n
            else:
                self._reserved.pop(source, None)
            mine = self._links.setdefault(source, {})
            # the links this one replaced: same address and cluster id, our entity closed
            # (by the engine, for this link), their connection still up
            replaced = [old for old, rec in mine.items()
                        if rec[0] == cluster_id and rec[2] and rec[4] and not rec[3]]
            mine[chan] = [cluster_id, caches, 1, int(handle is not None),
                          int(handle is not None)]
        for old in replaced:  # its place is freed when its connection ended (``_gone``)
            logger.info("kvdd fabric %s: closing the link of cluster %d from %s that a relink "
                        "replaced", self._label, cluster_id, source)
            old.kill()
        chan.on_dead = lambda: self._gone(source, chan, 2)
        if chan.dead.is_set():
            self._gone(source, chan, 2)
        if handle is not None:
            handle.on_close = lambda: self._gone(source, chan, 3)
            if handle.closed:
                self._gone(source, chan, 3)

    def _gone(self, source: str, chan: Channel, what: int) -> None:
        """The connection (``what`` 2) or the handle (3) of a link ended; its place is free when
        both did."""
        with self._lock:
            mine = self._links.get(source)
            rec = None if mine is None else mine.get(chan)
            if mine is None or rec is None:
                return
            rec[what] = 0
            if rec[2] or rec[3]:
                return
            del mine[chan]
            if not mine:
                del self._links[source]
            self._total -= 1
            self._uncharge(source, rec[1])

    # -- the workers -------------------------------------------------------------------------------
    def submit(self, conn: socket.socket, session: Session, ftype: int,
               payload: bytearray | mmap.mmap,
               source: str) -> bool:
        """Queue a complete hello; False (the caller closes it) when MAX_QUEUED_HELLOS wait."""
        size = len(payload)
        with self._lock:
            count, nbytes = self._queued.get(source, (0, 0))
            if (self._closed or len(self._jobs) >= MAX_QUEUED_HELLOS
                    or count >= MAX_QUEUED_HELLOS_PER_SOURCE
                    or self._queued_bytes + size > MAX_HELLO_BUFFERED
                    or (nbytes and nbytes + size > MAX_QUEUED_BYTES_PER_SOURCE)):
                return False
            self._queued[source] = (count + 1, nbytes + size)
            self._queued_bytes += size
            self._jobs.append((conn, session, ftype, payload, source))
            if not self._idle and self._workers < HANDSHAKE_WORKERS:
                try:
                    threading.Thread(target=self._work, daemon=True,
                                     name=f"kvdd-sim-handshake {self._label}").start()
                except RuntimeError as exc:  # no thread now: the running workers serve it
                    warn_limited(logger, "worker", "kvdd fabric: no handshake worker started "
                                 "on %s: %s", self._label, exc)
                    if not self._workers:  # none at all: refused (a later hello tries again)
                        self._jobs.pop()
                        self._queued_bytes -= size
                        if count:
                            self._queued[source] = (count, nbytes)
                        else:
                            del self._queued[source]
                        return False
                else:
                    self._workers += 1
            else:
                self._cv.notify()
        return True

    def close(self) -> None:
        """Stop the workers (links already made stay); queued hellos are closed."""
        with self._lock:
            self._closed = True
            dropped = [job for job in self._jobs if job is not None]
            self._jobs.clear()
            for _ in range(self._workers):
                self._jobs.append(None)
            self._cv.notify_all()
        for conn, *_rest in dropped:
            with contextlib.suppress(OSError):
                conn.close()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._idle += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._idle -= 1
                job = self._jobs.popleft()
            if job is None:
                return
            with self._lock:
                count, nbytes = self._queued.pop(job[4], (1, 0))
                size = len(job[3])
                self._queued_bytes -= size
                if count > 1:
                    self._queued[job[4]] = (count - 1, nbytes - size)
            self._serve(*job)

    def _serve(self, conn: socket.socket, session: Session, ftype: int,
               payload: bytearray | mmap.mmap,
               source: str) -> None:
        keep = handed = False
        owner = self._owner()
        try:
            conn.setblocking(True)
            if owner is None:  # the instance was dropped: the connection closes
                handed = False
            elif ftype == F_HELLO_LINK:
                keep = serve_link(owner, conn, memoryview(payload), session,
                                  Ticket(self, source), self._finish)
                handed = True  # a link, or given to ``finish``
            elif ftype == F_HELLO_UNLINK:
                serve_unlink(owner, conn, memoryview(payload), self._finish)
                handed = True
            else:
                raise ProtocolError(f"frame type {ftype} instead of a hello")
        except (OSError, ProtocolError, ValueError, struct.error) as exc:  # malformed, too slow
            warn_limited(logger, "hello", "kvdd fabric: a handshake on %s ended: %s",
                         self._label, exc)
        except Exception:  # a bug: log it; the connection closes
            logger.exception("kvdd fabric: handshake failed")
        finally:
            del owner
            if not keep and not handed:
                with contextlib.suppress(OSError):
                    conn.close()
