"""Listening and linking for the simulator: how one instance reaches a peer's registered memory.

The engine (:mod:`kvdd.sim.engine`) keeps all LLM-DataDist semantics; this module gives it

* :class:`Listener` — the real TCP socket bound for ``llm.ListenIpInfo`` (SEMANTICS.md §10 rule 6),
  the in-process registry of listening instances keyed by ``(ip, port)``, and a server thread that
  accepts link / unlink handshakes from other processes and hosts;
* :func:`connect` — "dial" a peer address and get a :class:`Connection` whose ``link`` /
  ``notify_unlink`` work identically for a peer in this process (:class:`InProcessConnection`) and
  one elsewhere (:class:`RemoteConnection`); refused → LINK_FAILED at once, silence → TIMEOUT;
* :class:`PeerHandle` — what a link entity uses to reach the peer: the snapshot of its caches at
  link time, leases on a remote cache for the duration of a transfer (the owner's unregister and
  finalize wait for them, §10 rule 5), reads and writes of remote tensor bytes.

Data paths, chosen per link and direction
-----------------------------------------
* same process: :class:`InProcessPeer`, the copy kernels directly (``copy_runs``);
* same host, other process: one-sided ``process_vm_readv`` / ``process_vm_writev``
  (:mod:`kvdd._native._xproc`) on the tensor addresses of the snapshot; the peer's Python only grants
  and releases the lease.  Used when both ends report the same boot id and reading a random nonce
  the peer announced at its announced address returns that nonce; ``EPERM`` later (ptrace rules)
  falls back to TCP for good.  ``KVDD_SIM_XPROC=tcp`` disables it;
* other host (or the fallback): DATA frames over the link's TCP connection, read or written by the
  owner's server threads, only inside caches registered and visible to that peer.

Cross-process semantics
-----------------------
One TCP connection per link carries a versioned binary protocol (``struct``; never pickle).
Both ends run the same :class:`_Channel`: a reader thread (parses every frame, receives DATA into
memory directly), a worker thread (answers requests, sends READ data) and the callers' threads
(send requests, wait for the reply with the deadline ``llm.SyncKvCacheWaitTime``).  On the comm
backend the connection serves both directions (the acceptor's entity for the initiator uses it
too); on hixl only the initiator has an entity.

Leases (rule 5 across processes): a transfer first asks the owner for a lease on the remote cache;
the owner checks the cache is still registered (else LLM_KV_CACHE_NOT_EXIST) and counts it in the
entry's in-flight count, so unregister / unlink / finalize wait for it.  A lease ends when the
reader releases it, when the reader's connection closes (a dead reader releases at once), or when
it expires: ``SyncKvCacheWaitTime`` of the reader (announced in the handshake, at most 10 min)
plus 250 ms; if the owner's server is still moving bytes for it then, the connection is closed.
The reader never touches remote memory past its own deadline, which is earlier.

Failures: a connection reset, EOF, or ESRCH is certain death → LLM_TIMEOUT at once; silence →
LLM_TIMEOUT at the deadline, after which the connection is closed (the engine marks the link
broken until relinked, rule 8).  A peer that *finalized* says so (a GOODBYE frame) before closing:
its caches then give LLM_KV_CACHE_NOT_EXIST over that link, as for an in-process peer (rule 2); a
peer that vanished without saying so gives LLM_TIMEOUT.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..status import Status
from . import faults
from .memory import Region, copy_runs

if TYPE_CHECKING:
    from .engine import CacheEntry, SimBackend

try:  # always built on Linux; absent elsewhere → TCP only
    from .._native import _xproc
except ImportError:  # pragma: no cover
    _xproc = None  # type: ignore[assignment]

__all__ = [
    "RemoteCache",
    "PeerHandle",
    "InProcessPeer",
    "RemotePeer",
    "LinkOffer",
    "LinkResult",
    "Connection",
    "InProcessConnection",
    "RemoteConnection",
    "Listener",
    "connect",
    "lookup_listener",
    "close_endpoint",
    "take_endpoint",
    "close_channels",
    "in_process_peer",
    "PROTOCOL_VERSION",
    "ENV_XPROC",
]

S_OK = Status.LLM_SUCCESS
TIMEOUT = Status.LLM_TIMEOUT
NOT_EXIST = Status.LLM_KV_CACHE_NOT_EXIST

#: Environment variable selecting the same-host data path: ``auto`` (default) or ``tcp``.
ENV_XPROC = "KVDD_SIM_XPROC"


@dataclass(frozen=True)
class RemoteCache:
    """What a link's snapshot knows of one of the peer's caches (SEMANTICS.md §2.4)."""

    cache_id: int
    num_tensors: int
    tensor_nbytes: int  # T
    batch_size: int  # B
    stride_nbytes: int  # S (0 when B > T: only possible for ragged sub-byte caches)
    ragged: bool  # T % S != 0 or S == 0 (kvdd rule 10)
    token: object  # identifies this registration on its owner (ids restart after re-Initialize)


class PeerHandle(Protocol):
    """The engine's view of the peer at the other end of a link."""

    peer_cluster_id: int
    transfer_backend: str

    def snapshot(self) -> dict[int, RemoteCache]:
        """The peer's caches registered before this link was created (visibility rule)."""
        ...

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        """Check the cache is still registered and take a lease on it: ``(status, lease)``.

        LLM_KV_CACHE_NOT_EXIST when the owner unregistered it or finalized (§10 rule 2),
        LLM_TIMEOUT when the owner cannot be reached."""
        ...

    def release(self, lease: object) -> None: ...

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        """remote[tensors[k]] bytes at src_off[j] → dst[k] at dst_off[j] (length[j]); a status."""
        ...

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        """src[k] at src_off[j] → remote[tensors[k]] at dst_off[j] (length[j]); a status."""
        ...

    def close(self) -> None:
        """Drop the connection (local teardown; the peer is not told)."""
        ...


class InProcessPeer:
    """A peer instance living in this process: copies go straight through the copy kernels."""

    def __init__(self, peer: SimBackend, snapshot: dict[int, RemoteCache],
                 entries: dict[int, CacheEntry]) -> None:
        self.peer = peer
        self.peer_cluster_id = peer.cluster_id
        self.transfer_backend = peer.transfer_backend
        self._snapshot = snapshot
        self._entries = entries  # token -> live entry objects at snapshot time

    def snapshot(self) -> dict[int, RemoteCache]:
        return self._snapshot

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        entry: CacheEntry = rc.token  # type: ignore[assignment]
        if not entry.acquire():
            return Status.LLM_KV_CACHE_NOT_EXIST, None
        return Status.LLM_SUCCESS, entry

    def release(self, lease: object) -> None:
        entry: CacheEntry = lease  # type: ignore[assignment]
        entry.release()

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        entry: CacheEntry = lease  # type: ignore[assignment]
        src = [entry.regions[i] for i in tensors]
        copy_runs(src, dst, src_off, dst_off, length)
        return Status.LLM_SUCCESS

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        entry: CacheEntry = lease  # type: ignore[assignment]
        dst = [entry.regions[i] for i in tensors]
        copy_runs(src, dst, src_off, dst_off, length)
        return Status.LLM_SUCCESS

    def close(self) -> None:
        pass


def in_process_peer(peer: SimBackend) -> InProcessPeer:
    """A handle on ``peer`` (same process) with its caches registered now as the snapshot."""
    snap, entries = peer.snapshot_for_link()
    return InProcessPeer(peer, snap, entries)


# ---- what a link handshake exchanges -------------------------------------------------------------


@dataclass(frozen=True)
class LinkOffer:
    """One side's identity in a link handshake (the fields the acceptance logic of §3.5 e reads)."""

    cluster_id: int  # the real cluster id (constructor argument)
    transfer_backend: str  # "comm" or "hixl"
    comm_res_text: str | None  # llm.LocalCommRes, validated by both sides
    sync_wait_ms: int  # llm.SyncKvCacheWaitTime: the lifetime of this side's leases on the peer

    @classmethod
    def of(cls, backend: SimBackend) -> LinkOffer:
        return cls(backend.cluster_id, backend.transfer_backend, backend.comm_res_text,
                   backend.sync_wait_ms)


@dataclass
class LinkResult:
    """What ``Connection.link`` returns: the peer's status (and why), its offer, our handle on it."""

    status: int
    detail: str = ""
    offer: LinkOffer | None = None
    handle: PeerHandle | None = None


class Connection(Protocol):
    """A dialled peer (see :func:`connect`); ``close`` keeps what a handle adopted."""

    def link(self, local: SimBackend, force_link: bool) -> LinkResult:
        """Run the peer's side of a link handshake (§3.5: comm acceptance / hixl connect)."""
        ...

    def notify_unlink(self, local: SimBackend) -> int:
        """Non-force comm unlink: the peer drops its entity for ``local``'s real id (§3.6)."""
        ...

    def close(self) -> None: ...


class InProcessConnection:
    """The peer listens in this process: the handshake is a pair of method calls."""

    def __init__(self, peer: SimBackend) -> None:
        self.peer = peer

    def link(self, local: SimBackend, force_link: bool) -> LinkResult:
        # our snapshot is taken before the peer's lock is held (no nested instance locks)
        mine = local.snapshot_for_link()
        status, detail, snap = self.peer._serve_link(LinkOffer.of(local), force_link,
                                                     lambda: InProcessPeer(local, *mine))
        if status != S_OK or snap is None:
            return LinkResult(status, detail)
        return LinkResult(S_OK, "", LinkOffer.of(self.peer), InProcessPeer(self.peer, *snap))

    def notify_unlink(self, local: SimBackend) -> int:
        if self.peer is local:
            return S_OK
        return self.peer._peer_unlinked(local.cluster_id)

    def close(self) -> None:
        pass


# ---- wire format ---------------------------------------------------------------------------------
#
# Every frame: header <2sBBII> = magic b"KV", protocol version, frame type, request id, payload
# length; then the payload.  Lengths are bounded per type (_MAX_LEN); anything else closes the
# connection.  Integers little-endian.  DATA frames carry at most MAX_DATA bytes of a transfer's
# byte stream (tensor k outer, run j inner).

PROTOCOL_VERSION = 1
MAGIC = b"KV"
_HDR = struct.Struct("<2sBBII")

MAX_CONTROL = 64 << 10
MAX_HELLO = 16 << 20
MAX_REQUEST = 4 << 20
MAX_DATA = 64 << 20

F_HELLO_LINK = 1
F_HELLO_UNLINK = 2
F_LINK_REPLY = 3
F_UNLINK_REPLY = 4
F_LEASE = 10
F_LEASE_REPLY = 11
F_RELEASE = 12
F_READ = 13
F_WRITE = 14
F_DATA = 15
F_DONE = 16
F_PING = 17
F_PONG = 18
F_CLOSE_HANDLE = 20
F_GOODBYE = 21

_MAX_LEN = {
    F_HELLO_LINK: MAX_HELLO, F_HELLO_UNLINK: MAX_CONTROL, F_LINK_REPLY: MAX_HELLO,
    F_UNLINK_REPLY: MAX_CONTROL, F_LEASE: MAX_CONTROL, F_LEASE_REPLY: MAX_CONTROL,
    F_RELEASE: MAX_CONTROL, F_READ: MAX_REQUEST, F_WRITE: MAX_REQUEST, F_DATA: MAX_DATA,
    F_DONE: MAX_CONTROL, F_PING: MAX_CONTROL, F_PONG: MAX_CONTROL, F_CLOSE_HANDLE: MAX_CONTROL,
    F_GOODBYE: MAX_CONTROL,
}

HANDSHAKE_TIMEOUT_S = 10.0  # a connection must complete its handshake within this
MAX_HANDSHAKES = 64  # concurrent connections still in their handshake, per listener
MAX_LEASES = 64  # outstanding leases per connection (a peer needs one at a time)
MAX_JOBS = 64  # queued requests per connection
LEASE_GRACE_MS = 250
MAX_LEASE_MS = 600_000
CLOSE_LINGER_S = 2.0
STAGE_RUN_BYTES = 64 << 10  # runs shorter than this on average go through one staging copy
PVM_CHUNK = 16 << 20
_J_SEND = -1  # worker job: send this end's own frame (RELEASE, CLOSE_HANDLE)
_J_CLOSE = -2  # worker job: (GOODBYE and) FIN, after every frame queued before

_BACKENDS = ("comm", "hixl")
_RC = struct.Struct("<QIQIQBB")  # cache_id, n, T, B, S, ragged, placement
_REQ = struct.Struct("<QII")  # lease id, K tensors, J runs


class ProtocolError(Exception):
    """A peer sent something this protocol does not allow; its connection is closed."""


class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()

    def pack(self, fmt: str, *values: object) -> _Writer:
        self.buf += struct.pack("<" + fmt, *values)
        return self

    def text(self, value: str | None, long: bool = False) -> _Writer:
        if value is None:
            return self.pack("B", 0)
        data = value.encode("utf-8", "surrogatepass")
        self.pack("B", 1)
        self.pack("I" if long else "H", len(data))
        self.buf += data
        return self

    def raw(self, data: bytes) -> _Writer:
        self.buf += data
        return self


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.mv = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.mv):
            raise ProtocolError("truncated payload")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple[int, ...]:
        s = struct.Struct("<" + fmt)
        values: tuple[int, ...] = s.unpack(self.take(s.size))
        return values

    def u(self, fmt: str) -> int:
        return self.unpack(fmt)[0]

    def text(self, long: bool = False) -> str | None:
        if self.u("B") == 0:
            return None
        n = self.u("I" if long else "H")
        try:
            return bytes(self.take(n)).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise ProtocolError("invalid text") from None

    def end(self) -> None:
        if self.pos != len(self.mv):
            raise ProtocolError("trailing bytes in payload")


def _frame(ftype: int, req: int, payload: bytes | bytearray = b"") -> bytes:
    return _HDR.pack(MAGIC, PROTOCOL_VERSION, ftype, req & 0xFFFFFFFF, len(payload)) + payload


def _recv_into(sock: socket.socket, mv: memoryview) -> None:
    while len(mv):
        n = sock.recv_into(mv)
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        mv = mv[n:]


def _recv(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; memory grows with the bytes that actually arrive (a peer announcing
    a large frame and sending nothing costs at most 1 MiB)."""
    if n <= 1 << 20:
        buf = bytearray(n)
        _recv_into(sock, memoryview(buf))
        return buf
    out = bytearray()
    while len(out) < n:
        chunk = bytearray(min(n - len(out), 1 << 20))
        _recv_into(sock, memoryview(chunk))
        out += chunk
    return out


def _discard(sock: socket.socket, n: int) -> None:
    scratch = bytearray(min(n, 1 << 20)) if n else b""
    mv = memoryview(scratch)
    while n > 0:
        take = min(n, len(mv))
        _recv_into(sock, mv[:take])
        n -= take


def _read_header(sock: socket.socket) -> tuple[int, int, int]:
    magic, version, ftype, req, length = _HDR.unpack(_recv(sock, _HDR.size))
    if magic != MAGIC:
        raise ProtocolError("bad magic")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} (this is {PROTOCOL_VERSION})")
    limit = _MAX_LEN.get(ftype)
    if limit is None:
        raise ProtocolError(f"unknown frame type {ftype}")
    if length > limit:
        raise ProtocolError(f"frame type {ftype} of {length} bytes exceeds {limit}")
    return ftype, req, length


def _encode_offer(w: _Writer, offer: LinkOffer) -> None:
    w.pack("QBI", offer.cluster_id & 0xFFFFFFFFFFFFFFFF, _BACKENDS.index(offer.transfer_backend),
           max(0, min(offer.sync_wait_ms, 0xFFFFFFFF)))
    w.text(offer.comm_res_text, long=True)


def _decode_offer(r: _Reader) -> LinkOffer:
    cluster_id, backend, wait_ms = r.unpack("QBI")
    if backend >= len(_BACKENDS):
        raise ProtocolError("unknown transfer backend")
    return LinkOffer(cluster_id, _BACKENDS[backend], r.text(long=True), wait_ms)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


# This process's identity for choosing the data path; the probe nonce lives at _PROBE_ADDR.
_BOOT_ID = _boot_id()
_PROBE = ctypes.create_string_buffer(secrets.token_bytes(16), 16)
_PROBE_ADDR = ctypes.addressof(_PROBE)


@dataclass(frozen=True)
class _Host:
    pid: int
    boot_id: str
    hostname: str
    probe_addr: int
    nonce: bytes


def _my_host() -> _Host:
    return _Host(os.getpid(), _BOOT_ID, socket.gethostname(), _PROBE_ADDR, bytes(_PROBE.raw))


def _encode_host(w: _Writer, host: _Host) -> None:
    w.pack("IQ", host.pid, host.probe_addr).raw(host.nonce).text(host.boot_id).text(host.hostname)


def _decode_host(r: _Reader) -> _Host:
    pid, addr = r.unpack("IQ")
    nonce = bytes(r.take(16))
    return _Host(pid, r.text() or "", r.text() or "", addr, nonce)


def _encode_snapshot(w: _Writer, entries: dict[int, CacheEntry]) -> None:
    w.pack("I", len(entries))
    for cid, e in entries.items():
        w.raw(_RC.pack(cid, e.n, e.T, e.B, e.S, int(e.ragged), e.placement & 0xFF))
        w.raw(np.asarray(e.addrs, dtype="<u8").tobytes())


def _decode_snapshot(r: _Reader) -> tuple[dict[int, RemoteCache], dict[int, tuple[int, ...]]]:
    count = r.u("I")
    snap: dict[int, RemoteCache] = {}
    addrs: dict[int, tuple[int, ...]] = {}
    for _ in range(count):
        cid, n, t, b, s, ragged, _placement = _RC.unpack(r.take(_RC.size))
        if n == 0 or cid in snap:
            raise ProtocolError("malformed cache snapshot")
        a = np.frombuffer(r.take(8 * n), dtype="<u8")
        if t >= 1 << 62 or np.any(a == 0) or np.any(a > (1 << 64) - 1 - t):
            raise ProtocolError("malformed cache snapshot")
        snap[cid] = RemoteCache(cid, n, t, b, s, bool(ragged), cid)
        addrs[cid] = tuple(int(x) for x in a)
    return snap, addrs


def _xproc_mode() -> str:
    return os.environ.get(ENV_XPROC, "auto").strip().lower() or "auto"


def _pvm_usable(peer: _Host) -> bool:
    """True when process_vm_readv on the peer reaches the process that sent ``peer``."""
    if _xproc is None or _xproc_mode() == "tcp":
        return False
    if peer.pid == os.getpid() or not peer.boot_id or peer.boot_id != _BOOT_ID:
        return False
    try:
        return _xproc.pvm_read_bytes(peer.pid, peer.probe_addr, 16) == peer.nonce
    except (OSError, ValueError):
        return False


# ---- a watchdog for deadlines --------------------------------------------------------------------


class _Timer:
    __slots__ = ("deadline", "seq", "fn", "alive")

    def __init__(self, deadline: float, seq: int, fn: Callable[[], None]) -> None:
        self.deadline = deadline
        self.seq = seq
        self.fn = fn
        self.alive = True

    def __lt__(self, other: _Timer) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class _Watchdog:
    """One daemon thread running callbacks at deadlines (lease expiry, I/O deadlines)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._heap: list[_Timer] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, delay_s: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(time.monotonic() + max(delay_s, 0.0), next(self._seq), fn)
        with self._cv:
            heapq.heappush(self._heap, timer)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvdd-sim-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()
        return timer

    @staticmethod
    def cancel(timer: _Timer | None) -> None:
        if timer is not None:
            timer.alive = False

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._heap and not self._heap[0].alive:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait(5.0)
                    if not self._heap:
                        continue
                    continue
                delay = self._heap[0].deadline - time.monotonic()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                timer = heapq.heappop(self._heap)
            if timer.alive:
                timer.alive = False
                try:
                    timer.fn()
                except Exception:  # a callback must never stop the watchdog
                    pass


_watchdog = _Watchdog()


# ---- byte streams of a transfer ------------------------------------------------------------------


def _region_view(region: Region) -> memoryview:
    n = region.nbytes
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(region.addr)).cast("B")


class _Layout:
    """The byte stream of runs ``(off[j], length[j])`` of regions ``k`` (k outer, j inner).

    Long runs are sent from / received into the regions directly (memoryviews); many short runs
    go through one staging buffer and one ``copy_runs`` call (gather before sending, scatter after
    receiving)."""

    def __init__(self, regions: Sequence[Region], off: np.ndarray, length: np.ndarray) -> None:
        self.regions = list(regions)
        self.off = np.ascontiguousarray(off, dtype=np.int64)
        self.length = np.ascontiguousarray(length, dtype=np.int64)
        per_k = int(self.length.sum())
        self.per_k = per_k
        self.total = per_k * len(self.regions)
        runs = len(self.regions) * int(np.count_nonzero(self.length))
        self.staged = 0 < self.total <= MAX_DATA and self.total < STAGE_RUN_BYTES * runs
        self.views: list[memoryview] = []
        self._stage: np.ndarray | None = None
        self._stage_regions: list[Region] = []
        if self.total == 0:
            return
        if self.staged:
            stage = np.empty(self.total, dtype=np.uint8)
            base = int(stage.ctypes.data)
            self._stage = stage
            self._stage_regions = [Region(base + k * per_k, per_k, stage)
                                   for k in range(len(self.regions))]
            self._cum = np.concatenate(([0], np.cumsum(self.length)[:-1])).astype(np.int64)
            self.views = [stage.data.cast("B")]
        else:
            for region in self.regions:
                mv = _region_view(region)
                for o, n in zip(self.off.tolist(), self.length.tolist()):
                    if n:
                        if o < 0 or o + n > len(mv):
                            raise ValueError("run outside its region")
                        self.views.append(mv[o:o + n])

    def gather(self) -> None:
        if self.staged:
            copy_runs(self.regions, self._stage_regions, self.off, self._cum, self.length)

    def scatter(self) -> None:
        if self.staged:
            copy_runs(self._stage_regions, self.regions, self._cum, self.off, self.length)


class _Cursor:
    """Fills a layout's views from the socket, frame by frame."""

    def __init__(self, layout: _Layout) -> None:
        self.views = layout.views
        self.i = 0
        self.pos = 0
        self.left = layout.total

    def recv(self, sock: socket.socket, n: int) -> None:
        if n > self.left:
            raise ProtocolError("more DATA than the transfer holds")
        self.left -= n
        while n > 0:
            v = self.views[self.i]
            take = min(n, len(v) - self.pos)
            _recv_into(sock, v[self.pos:self.pos + take])
            self.pos += take
            n -= take
            if self.pos == len(v):
                self.i += 1
                self.pos = 0


def _sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """sendmsg (gather, zero-copy) until every buffer is sent."""
    while bufs:
        sent = sock.sendmsg(bufs)
        while sent and bufs:
            if sent >= len(bufs[0]):
                sent -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][sent:]
                sent = 0


def _send_stream(sock: socket.socket, req: int, layout: _Layout) -> None:
    """The layout's bytes as DATA frames of at most MAX_DATA bytes, each sent by gathering
    the header and up to 64 views per system call (zero-copy)."""
    left = layout.total
    views = iter(layout.views)
    cur: memoryview | None = None
    while left > 0:
        n = min(left, MAX_DATA)
        batch = [memoryview(_HDR.pack(MAGIC, PROTOCOL_VERSION, F_DATA, req, n))]
        left -= n
        while n > 0:
            if cur is None or len(cur) == 0:
                cur = next(views)
            take = min(n, len(cur))
            batch.append(cur[:take])
            cur = cur[take:]
            n -= take
            if len(batch) == 64:
                _sendmsg_all(sock, batch)
                batch = []
        _sendmsg_all(sock, batch)


def _encode_request(lease: int, tensors: Sequence[int], off: np.ndarray,
                    length: np.ndarray) -> bytes:
    t = np.asarray(tensors, dtype="<u4")
    o = np.ascontiguousarray(off, dtype="<i8")
    n = np.ascontiguousarray(length, dtype="<i8")
    return _REQ.pack(lease, len(t), len(n)) + t.tobytes() + o.tobytes() + n.tobytes()


def _decode_request(payload: bytes | bytearray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    r = _Reader(payload)
    lease, k, j = _REQ.unpack(r.take(_REQ.size))
    t = np.frombuffer(r.take(4 * k), dtype="<u4").astype(np.int64)
    o = np.frombuffer(r.take(8 * j), dtype="<i8").astype(np.int64)
    n = np.frombuffer(r.take(8 * j), dtype="<i8").astype(np.int64)
    r.end()
    return lease, t, o, n


# ---- one link's connection -----------------------------------------------------------------------


class _Pending:
    __slots__ = ("req", "event", "lock", "reply", "cursor", "cancelled", "failed")

    def __init__(self, req: int, cursor: _Cursor | None) -> None:
        self.req = req
        self.event = threading.Event()
        self.lock = threading.Lock()  # held by the reader while it writes into the caller's memory
        self.reply: bytes | None = None
        self.cursor = cursor
        self.cancelled = False
        self.failed = False


class _Lease:
    """The owner's record of a peer's lease on one of its caches."""

    __slots__ = ("lease_id", "entry", "chan", "users", "dropped", "released", "timer", "lock")

    def __init__(self, lease_id: int, entry: CacheEntry, chan: _Channel) -> None:
        self.lease_id = lease_id
        self.entry = entry
        self.chan = chan
        self.users = 0  # server threads moving bytes under this lease right now
        self.dropped = False
        self.released = False
        self.timer: _Timer | None = None
        self.lock = threading.Lock()

    def use(self) -> bool:
        with self.lock:
            if self.dropped:
                return False
            self.users += 1
            return True

    def unuse(self) -> None:
        with self.lock:
            self.users -= 1
            fin = self.dropped and self.users == 0 and not self.released
            if fin:
                self.released = True
        if fin:
            self.entry.release()

    def drop(self) -> None:
        with self.lock:
            if self.dropped:
                return
            self.dropped = True
            _watchdog.cancel(self.timer)
            fin = self.users == 0 and not self.released
            if fin:
                self.released = True
        if fin:
            self.entry.release()

    def expire(self) -> None:
        with self.lock:
            busy = self.users > 0
        self.chan.forget_lease(self.lease_id)
        self.drop()
        if busy:  # a server thread is still moving bytes: stop it, the memory may go away now
            self.chan.kill()


_endpoint_lock = threading.Lock()
_endpoints: weakref.WeakKeyDictionary[SimBackend, set[_Channel]] = weakref.WeakKeyDictionary()


def take_endpoint(owner: SimBackend) -> list[_Channel]:
    """Finalize, first half: the connections of ``owner`` (to close once its caches are retired;
    until then they keep serving lease releases)."""
    with _endpoint_lock:
        return list(_endpoints.pop(owner, ()))


def close_channels(chans: Sequence[_Channel]) -> None:
    """Finalize, second half: tell every connected peer (GOODBYE) and close the connections."""
    for chan in chans:
        chan.close(goodbye=True)


def close_endpoint(owner: SimBackend) -> None:
    """GOODBYE to every peer connected to ``owner`` and close those connections."""
    close_channels(take_endpoint(owner))


class _Channel:
    """One end of a link's TCP connection: serves the peer's requests on ``owner``'s caches and
    carries this end's requests (see the module docstring)."""

    def __init__(self, sock: socket.socket, owner: SimBackend, label: str) -> None:
        self.sock = sock
        self.owner = owner
        self.label = label
        self.served: dict[int, CacheEntry] = {}  # our caches visible to the peer over this link
        self.peer_wait_ms = 1000
        self.send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._req_ids = itertools.count(1)
        self._jobs: deque[tuple[int, int, bytes | bytearray | int] | None] = deque()
        self._jobs_cv = threading.Condition(self._lock)
        self._closing = False
        self._closed_wr = threading.Event()  # the worker sent FIN (after GOODBYE, if asked)
        self.dead = threading.Event()
        self.peer_finalized = False
        self.local_user = False  # our PeerHandle on the peer uses this connection
        self.peer_user = False  # the peer's PeerHandle on us uses it
        self._started = False

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.sock.settimeout(None)
        with _endpoint_lock:
            _endpoints.setdefault(self.owner, set()).add(self)
        self._started = True
        threading.Thread(target=self._reader, name=f"kvdd-sim-rx {self.label}", daemon=True).start()
        threading.Thread(target=self._worker, name=f"kvdd-sim-tx {self.label}", daemon=True).start()

    def kill(self) -> None:
        """Abort the connection (errors, deadlines): both directions stop at once."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self._started:
            self._on_dead()

    def close(self, goodbye: bool = False) -> None:
        """Close gracefully: optional GOODBYE, then FIN; the reader drains until the peer closes
        (at most CLOSE_LINGER_S)."""
        with self._lock:
            if self._closing or self.dead.is_set():
                return
            self._closing = True
        if not self._started:
            self._on_dead()
            return
        with self._lock:  # after the frames already queued (CLOSE_HANDLE, RELEASE)
            self._jobs.append((_J_CLOSE, int(goodbye), b""))
            self._jobs_cv.notify()
        _watchdog.schedule(CLOSE_LINGER_S, self.kill)
        if goodbye:  # finalize returns once the peers have been told (or the link is dead)
            self._closed_wr.wait(CLOSE_LINGER_S)

    def release_local_user(self) -> None:
        """Our handle is closed: tell the peer; close when neither side uses the connection."""
        with self._lock:
            if not self.local_user:
                return
            self.local_user = False
            unused = not self.peer_user
        if unused:
            self.close()
        else:
            self.send_oneway(F_CLOSE_HANDLE, b"")

    def _peer_released(self) -> None:
        with self._lock:
            self.peer_user = False
            unused = not self.local_user
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            lease.drop()
        if unused:
            self.close()

    def _on_dead(self) -> None:
        with self._lock:
            if self.dead.is_set():
                return
            self.dead.set()
            leases = list(self._leases.values())
            self._leases.clear()
            pending = list(self._pending.values())
            self._jobs.clear()
            self._jobs.append(None)
            self._jobs_cv.notify_all()
        for lease in leases:  # a dead reader releases its leases at once
            lease.drop()
        for p in pending:
            p.failed = True
            p.event.set()
        self._closed_wr.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a worker blocked in send
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        with _endpoint_lock:
            chans = _endpoints.get(self.owner)
            if chans is not None:
                chans.discard(self)

    # -- the reader thread ------------------------------------------------------------------------
    def _reader(self) -> None:
        sock = self.sock
        try:
            while True:
                ftype, req, length = _read_header(sock)
                if ftype == F_DATA:
                    self._recv_data(req, length)
                    continue
                payload = _recv(sock, length)
                if ftype in (F_LEASE_REPLY, F_DONE, F_PONG):
                    with self._lock:
                        p = self._pending.get(req)
                    if p is not None:
                        p.reply = bytes(payload)
                        p.event.set()
                elif ftype in (F_LEASE, F_READ, F_PING):
                    self._enqueue(ftype, req, payload)
                elif ftype == F_WRITE:
                    self._serve_write(req, payload)
                elif ftype == F_RELEASE:
                    lease_id = _Reader(payload).u("Q")
                    lease = self.forget_lease(lease_id)
                    if lease is not None:
                        lease.drop()
                elif ftype == F_CLOSE_HANDLE:
                    self._peer_released()
                elif ftype == F_GOODBYE:
                    # The peer finalized: it serves nothing more.  Our handle on it (a stale
                    # entity) now finds no cache (§10 rule 2); requests in flight end now.
                    self.peer_finalized = True
                    self._peer_released()
                    return
                else:
                    raise ProtocolError(f"unexpected frame type {ftype} on a link")
        except Exception:  # malformed input, a dead socket, anything: this connection ends
            pass
        finally:
            self._on_dead()

    def _enqueue(self, ftype: int, req: int, payload: bytes | bytearray | int) -> None:
        """Queue a request of the peer for the worker (at most MAX_JOBS of the peer's waiting)."""
        with self._lock:
            if sum(1 for job in self._jobs if job is not None and job[0] > 0) >= MAX_JOBS:
                raise ProtocolError("too many queued requests")
            self._jobs.append((ftype, req, payload))
            self._jobs_cv.notify()

    def _recv_data(self, req: int, length: int) -> None:
        """DATA for our pending READ: straight into the caller's memory (unless it gave up)."""
        with self._lock:
            p = self._pending.get(req)
        if p is None or p.cursor is None:
            raise ProtocolError("DATA without a pending read")
        with p.lock:
            if p.cancelled:
                _discard(self.sock, length)
            else:
                p.cursor.recv(self.sock, length)

    def forget_lease(self, lease_id: int) -> _Lease | None:
        with self._lock:
            return self._leases.pop(lease_id, None)

    def _check_runs(self, lease_id: int, tensors: np.ndarray, off: np.ndarray,
                    length: np.ndarray) -> tuple[int, _Lease | None]:
        """The server's checks of a READ/WRITE: a live lease of this connection on a visible,
        registered cache, tensors and byte ranges inside it (kvdd rule 1)."""
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None or not lease.use():
            return TIMEOUT, None  # only an expired (or forged) lease gets here
        entry = lease.entry
        t = entry.T
        if (len(tensors) and (int(tensors.max()) >= entry.n)) or np.any(off < 0) \
                or np.any(length < 0) or np.any(length > t) or np.any(off > t - length):
            lease.unuse()
            return Status.LLM_PARAM_INVALID, None
        return S_OK, lease

    def _serve_write(self, req: int, payload: bytes | bytearray) -> None:
        """A WRITE and its DATA frames, received by the reader straight into the owner's cache.

        A WRITE the checks refuse ends the connection: a correct peer never sends one (its engine
        ran the same checks), except after its lease expired, when it has timed out anyway."""
        lease_id, tensors, off, length = _decode_request(payload)
        status, lease = self._check_runs(lease_id, tensors, off, length)
        if lease is None:
            raise ProtocolError(f"refused WRITE (status {status:#x})")
        try:
            layout = _Layout([lease.entry.regions[int(i)] for i in tensors], off, length)
            faults.on_serve(self.owner, "write", layout.total)
            cursor = _Cursor(layout)
            while cursor.left > 0:
                ftype, freq, n = _read_header(self.sock)
                if ftype != F_DATA or freq != req:
                    raise ProtocolError("WRITE data expected")
                cursor.recv(self.sock, n)
            layout.scatter()
        finally:
            lease.unuse()
        self._enqueue(F_DONE, req, status)

    # -- the worker thread ------------------------------------------------------------------------
    def _worker(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._jobs:
                        self._jobs_cv.wait()
                    job = self._jobs.popleft()
                if job is None:
                    return
                ftype, req, payload = job
                if ftype == F_LEASE:
                    assert not isinstance(payload, int)
                    self._send(F_LEASE_REPLY, req, self._serve_lease(payload))
                elif ftype == F_READ:
                    assert not isinstance(payload, int)
                    self._serve_read(req, payload)
                elif ftype == F_DONE:
                    assert isinstance(payload, int)
                    self._send(F_DONE, req, struct.pack("<I", payload))
                elif ftype == F_PING:
                    self._send(F_PONG, req, b"")
                elif ftype == _J_SEND:
                    assert not isinstance(payload, int)
                    with self.send_lock:
                        self.sock.sendall(payload)
                elif ftype == _J_CLOSE:
                    try:
                        with self.send_lock:
                            if req:
                                self.sock.sendall(_frame(F_GOODBYE, 0))
                            self.sock.shutdown(socket.SHUT_WR)
                    finally:
                        self._closed_wr.set()
                    return  # the reader drains until the peer closes too
        except Exception:  # the connection ends; the owner's leases are dropped by the reader
            self.kill()

    def _send(self, ftype: int, req: int, payload: bytes | bytearray) -> None:
        with self.send_lock:
            self.sock.sendall(_frame(ftype, req, payload))

    def _serve_lease(self, payload: bytes | bytearray) -> bytes:
        r = _Reader(payload)
        cache_id = r.u("Q")
        r.end()
        owner = self.owner
        faults.on_serve(owner, "lease")  # serve=1 fault injections: a slow server
        entry = self.served.get(cache_id)
        if not owner.initialized or entry is None:  # finalized, or not visible over this link
            return struct.pack("<IQ", NOT_EXIST, 0)
        with self._lock:
            if len(self._leases) >= MAX_LEASES:
                return struct.pack("<IQ", Status.LLM_FAILED, 0)
        if not entry.acquire():  # unregistered (§10 rule 2)
            return struct.pack("<IQ", NOT_EXIST, 0)
        lease = _Lease(next(self._lease_ids), entry, self)
        with self._lock:
            if self.dead.is_set():
                lease.drop()
                return struct.pack("<IQ", TIMEOUT, 0)
            self._leases[lease.lease_id] = lease
        ms = min(self.peer_wait_ms, MAX_LEASE_MS) + LEASE_GRACE_MS
        lease.timer = _watchdog.schedule(ms / 1000.0, lease.expire)
        return struct.pack("<IQ", S_OK, lease.lease_id)

    def _serve_read(self, req: int, payload: bytes | bytearray) -> None:
        lease_id, tensors, off, length = _decode_request(payload)
        status, lease = self._check_runs(lease_id, tensors, off, length)
        if lease is None:
            self._send(F_DONE, req, struct.pack("<I", status))
            return
        try:
            layout = _Layout([lease.entry.regions[int(i)] for i in tensors], off, length)
            faults.on_serve(self.owner, "read", layout.total)
            layout.gather()
            with self.send_lock:
                _send_stream(self.sock, req, layout)
                self.sock.sendall(_frame(F_DONE, req, struct.pack("<I", S_OK)))
        finally:
            lease.unuse()

    # -- requests of this end -----------------------------------------------------------------------
    def send_oneway(self, ftype: int, payload: bytes) -> None:
        """A frame with no reply (RELEASE, CLOSE_HANDLE), sent by the worker thread: the caller
        never waits behind a long transfer the worker is sending in the other direction (a
        RELEASE that comes late only keeps a lease until it arrives or expires)."""
        if self.dead.is_set():
            return
        with self._lock:
            if not self._closing:
                self._jobs.append((_J_SEND, 0, _frame(ftype, 0, payload)))
                self._jobs_cv.notify()

    def request(self, ftype: int, payload: bytes, deadline: float,
                cursor: _Cursor | None = None, data: _Layout | None = None) -> bytes | None:
        """Send a request (and WRITE data) and wait for its reply until ``deadline``.

        None when the peer did not answer in time (the connection is then closed: the link is
        broken) or the connection died."""
        if self.dead.is_set():
            return None
        req = next(self._req_ids) & 0xFFFFFFFF
        p = _Pending(req, cursor)
        with self._lock:
            self._pending[req] = p
        try:
            left = deadline - time.monotonic()
            if left <= 0 or not self.send_lock.acquire(timeout=left):
                return None
            guard = _watchdog.schedule(deadline - time.monotonic(), self.kill)
            try:
                self.sock.sendall(_frame(ftype, req, payload))
                if data is not None:
                    _send_stream(self.sock, req, data)
            except OSError:
                self.kill()
                return None
            finally:
                _watchdog.cancel(guard)
                self.send_lock.release()
            if not p.event.wait(max(deadline - time.monotonic(), 0.0)):
                self.kill()  # silent peer: the link is broken; stop the reader touching our memory
                with p.lock:
                    p.cancelled = True
                return None
            if p.failed:
                with p.lock:
                    p.cancelled = True
                return None
            return p.reply
        finally:
            with self._lock:
                self._pending.pop(req, None)


class _ClientLease:
    __slots__ = ("lease_id", "rc", "deadline")

    def __init__(self, lease_id: int, rc: RemoteCache, deadline: float) -> None:
        self.lease_id = lease_id
        self.rc = rc
        self.deadline = deadline


class RemotePeer:
    """A peer in another process or on another host, reached through a link's connection."""

    def __init__(self, chan: _Channel, offer: LinkOffer, snapshot: dict[int, RemoteCache],
                 addrs: dict[int, tuple[int, ...]], host: _Host) -> None:
        self._chan = chan
        self.peer_cluster_id = offer.cluster_id
        self.transfer_backend = offer.transfer_backend
        self._snapshot = snapshot
        self._addrs = addrs
        self._pid = host.pid
        self.pvm = _pvm_usable(host)
        self._closed = False

    @property
    def data_path(self) -> str:
        """``"process_vm"`` or ``"tcp"`` (for tests and ``kvdd doctor``)."""
        return "process_vm" if self.pvm else "tcp"

    def snapshot(self) -> dict[int, RemoteCache]:
        return self._snapshot

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        chan = self._chan
        if chan.peer_finalized:
            return NOT_EXIST, None
        if chan.dead.is_set() or timeout_ms <= 0:  # §10 rule 9: a 0 ms wait always times out
            return TIMEOUT, None
        deadline = time.monotonic() + timeout_ms / 1000.0
        reply = chan.request(F_LEASE, struct.pack("<Q", rc.cache_id), deadline)
        if reply is None:
            return (NOT_EXIST if chan.peer_finalized else TIMEOUT), None
        try:
            status, lease_id = struct.unpack("<IQ", reply)
        except struct.error:
            chan.kill()
            return TIMEOUT, None
        if status != S_OK:
            return status, None
        return S_OK, _ClientLease(lease_id, rc, deadline)

    def release(self, lease: object) -> None:
        assert isinstance(lease, _ClientLease)
        self._chan.send_oneway(F_RELEASE, struct.pack("<Q", lease.lease_id))

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        assert isinstance(lease, _ClientLease)
        return self._move(lease, tensors, dst, dst_off, src_off, length, False)

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        assert isinstance(lease, _ClientLease)
        return self._move(lease, tensors, src, src_off, dst_off, length, True)

    def _move(self, lease: _ClientLease, tensors: Sequence[int], local: Sequence[Region],
              local_off: np.ndarray, remote_off: np.ndarray, length: np.ndarray,
              write: bool) -> int:
        chan = self._chan
        if chan.dead.is_set():
            return TIMEOUT
        left_ms = int((lease.deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return TIMEOUT
        if self.pvm:
            status = self._move_pvm(lease, tensors, local, local_off, remote_off, length, write,
                                    left_ms)
            if status is not None:
                return status
        layout = _Layout(local, local_off, length)
        payload = _encode_request(lease.lease_id, tensors, remote_off, length)
        cursor: _Cursor | None = None
        if write:
            layout.gather()
            reply = chan.request(F_WRITE, payload, lease.deadline, data=layout)
        else:
            cursor = _Cursor(layout)
            reply = chan.request(F_READ, payload, lease.deadline, cursor=cursor)
        if reply is None:
            return TIMEOUT
        try:
            (status,) = struct.unpack("<I", reply)
        except struct.error:
            chan.kill()
            return TIMEOUT
        if status == S_OK and cursor is not None:
            if cursor.left:  # the peer claimed success without sending every byte
                chan.kill()
                return TIMEOUT
            layout.scatter()
        return int(status)

    def _move_pvm(self, lease: _ClientLease, tensors: Sequence[int], local: Sequence[Region],
                  local_off: np.ndarray, remote_off: np.ndarray, length: np.ndarray,
                  write: bool, left_ms: int) -> int | None:
        """One-sided copy; None to fall back to TCP (the kernel refused access: EPERM)."""
        assert _xproc is not None
        addrs = self._addrs[lease.rc.cache_id]
        remote = [addrs[int(t)] for t in tensors]
        try:
            _xproc.pvm_copy(self._pid, local, remote, lease.rc.tensor_nbytes,
                            np.ascontiguousarray(local_off, dtype=np.int64),
                            np.ascontiguousarray(remote_off, dtype=np.int64),
                            np.ascontiguousarray(length, dtype=np.int64), write,
                            timeout_ms=left_ms, chunk=PVM_CHUNK)
        except PermissionError:
            self.pvm = False
            return None
        except ProcessLookupError:  # the peer is gone: certain death
            self._chan.kill()
            return TIMEOUT
        except TimeoutError:
            return TIMEOUT
        except ValueError:
            return Status.LLM_PARAM_INVALID
        except OSError:
            # EFAULT: the peer's memory vanished.  A dying peer closes its sockets right after its
            # memory is torn down: then it is death (TIMEOUT); otherwise the owner freed
            # registered memory, a transport error on hardware (LLM_FAILED).
            wait = max(min((lease.deadline - time.monotonic()), 0.5), 0.0)
            if self._chan.dead.wait(wait) or not _alive(self._pid):
                self._chan.kill()
                return TIMEOUT
            return Status.LLM_FAILED
        return S_OK

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._chan.release_local_user()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat.rpartition(b")")[2].split()[:1]
    return bool(state) and state[0] not in (b"Z", b"X", b"x")


# ---- dialling --------------------------------------------------------------------------------------


class RemoteConnection:
    """A TCP connection to a peer in another process (or host), before / during a handshake."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock: socket.socket | None = sock
        self.deadline = deadline

    def _exchange(self, ftype: int, payload: bytes, reply_type: int) -> tuple[int, bytes | None]:
        sock = self.sock
        assert sock is not None
        try:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return TIMEOUT, None
            sock.settimeout(left)
            sock.sendall(_frame(ftype, 0, payload))
            rtype, _req, length = _read_header(sock)
            if rtype != reply_type:
                raise ProtocolError("unexpected reply")
            sock.settimeout(max(self.deadline - time.monotonic(), 0.001))
            return S_OK, bytes(_recv(sock, length))
        except socket.timeout:
            return TIMEOUT, None
        except (OSError, ProtocolError):
            return Status.LLM_LINK_FAILED, None

    def link(self, local: SimBackend, force_link: bool) -> LinkResult:
        comm = local.transfer_backend == "comm"
        snap, entries = local.snapshot_for_link() if comm else ({}, {})
        w = _Writer()
        _encode_offer(w, LinkOffer.of(local))
        w.pack("B", int(force_link))
        _encode_host(w, _my_host())
        _encode_snapshot(w, entries)
        if len(w.buf) > MAX_HELLO:
            return LinkResult(Status.LLM_FAILED, "the local cache table is too large to link")
        status, reply = self._exchange(F_HELLO_LINK, bytes(w.buf), F_LINK_REPLY)
        if status != S_OK or reply is None:
            why = "no answer within the timeout" if status == TIMEOUT else "the handshake failed"
            return LinkResult(status, why)
        try:
            r = _Reader(reply)
            peer_status = r.u("I")
            detail = r.text() or ""
            if peer_status != S_OK:
                return LinkResult(peer_status, detail or "the peer refused the link")
            offer = _decode_offer(r)
            host = _decode_host(r)
            peer_snap, addrs = _decode_snapshot(r)
            r.end()
        except (ProtocolError, struct.error):
            return LinkResult(Status.LLM_LINK_FAILED, "malformed handshake reply")
        sock = self.sock
        assert sock is not None
        self.sock = None  # adopted by the channel
        chan = _Channel(sock, local, f"{local.cluster_id}->{offer.cluster_id}")
        chan.served = entries
        chan.peer_wait_ms = offer.sync_wait_ms
        chan.peer_user = comm  # comm: the acceptor made an entity for us over this connection
        chan.local_user = True
        handle = RemotePeer(chan, offer, peer_snap, addrs, host)
        chan.start()
        return LinkResult(S_OK, "", offer, handle)

    def notify_unlink(self, local: SimBackend) -> int:
        status, reply = self._exchange(F_HELLO_UNLINK,
                                       struct.pack("<BQ", PROTOCOL_VERSION, local.cluster_id),
                                       F_UNLINK_REPLY)
        if status != S_OK or reply is None:
            return Status.LLM_UNLINK_FAILED if status == Status.LLM_LINK_FAILED else status
        try:
            (peer_status,) = struct.unpack("<I", reply)
        except struct.error:
            return Status.LLM_UNLINK_FAILED
        return int(peer_status)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


def connect(ip: str, port: int, timeout_ms: int) -> tuple[int, Connection | None]:
    """Reach whatever listens on ``ip:port``: ``(status, connection)``.

    An instance of this process gives an :class:`InProcessConnection`.  Otherwise a real TCP
    connection is opened: refused / unreachable → LLM_LINK_FAILED at once; no answer in
    ``timeout_ms`` → LLM_TIMEOUT (SEMANTICS.md §10 rule 6).  The handshake that follows (``link``
    / ``notify_unlink``) must complete within the same ``timeout_ms``.
    """
    port &= 0xFFFF
    peer = lookup_listener(ip, port)
    if peer is not None:
        return Status.LLM_SUCCESS, InProcessConnection(peer)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    deadline = time.monotonic() + timeout_ms / 1000.0
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect((ip, port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (socket.timeout, TimeoutError):
        sock.close()
        return Status.LLM_TIMEOUT, None
    except (OSError, OverflowError):
        # ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EADDRNOTAVAIL, ...: at once, no retry
        sock.close()
        return Status.LLM_LINK_FAILED, None
    return Status.LLM_SUCCESS, RemoteConnection(sock, deadline)


# ---- listening -----------------------------------------------------------------------------------

_registry_lock = threading.Lock()
_registry: dict[tuple[str, int], SimBackend] = {}


def _norm_ip(ip: str) -> str:
    try:
        if ":" in ip:
            return socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, ip))
        return socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, ip))
    except OSError:
        return ip


class Listener:
    """A real listening TCP socket for one instance, registered for in-process lookup, with a
    server thread answering link and unlink handshakes from other processes and hosts."""

    def __init__(self, owner: SimBackend, ip: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ip, port & 0xFFFF))  # upstream accepts ports up to 2**32-1; htons keeps 16 bits
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self.ip = _norm_ip(ip)
        self.port: int = sock.getsockname()[1]
        self.owner = owner
        self._closed = False
        self._handshakes = 0
        self._hs_lock = threading.Lock()
        with _registry_lock:
            _registry[(self.ip, self.port)] = owner
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvdd-sim-listen {self.ip}:{self.port}")
        self._thread.start()

    def close(self) -> None:
        """Stop accepting (links already made stay until unlink / finalize)."""
        with _registry_lock:
            if _registry.get((self.ip, self.port)) is self.owner:
                del _registry[(self.ip, self.port)]
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _addr = self.sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE and friends: do not spin
                continue
            with self._hs_lock:
                busy = self._handshakes >= MAX_HANDSHAKES
                if not busy:
                    self._handshakes += 1
            if busy:
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn,), daemon=True,
                             name="kvdd-sim-handshake").start()

    def _handshake(self, conn: socket.socket) -> None:
        keep = False
        # The whole first frame must arrive within HANDSHAKE_TIMEOUT_S (a peer dripping bytes
        # cannot hold one of the MAX_HANDSHAKES slots longer).
        gate = threading.Lock()
        reading = [True]

        def too_slow() -> None:
            with gate:
                if reading[0]:
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        timer = _watchdog.schedule(HANDSHAKE_TIMEOUT_S, too_slow)
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                ftype, _req, length = _read_header(conn)
                payload = _recv(conn, length)
            finally:
                with gate:
                    reading[0] = False
                _watchdog.cancel(timer)
            if ftype == F_HELLO_LINK:
                keep = self._serve_link(conn, payload)
            elif ftype == F_HELLO_UNLINK:
                self._serve_unlink(conn, payload)
        except Exception:  # malformed or truncated handshakes just close the connection
            pass
        finally:
            with self._hs_lock:
                self._handshakes -= 1
            if not keep:
                try:
                    conn.close()
                except OSError:
                    pass

    def _serve_unlink(self, conn: socket.socket, payload: bytearray) -> None:
        r = _Reader(payload)
        version, cluster_id = r.unpack("BQ")
        r.end()
        if version != PROTOCOL_VERSION:
            raise ProtocolError("protocol version")
        status = self.owner._peer_unlinked(cluster_id)
        conn.sendall(_frame(F_UNLINK_REPLY, 0, struct.pack("<I", status)))
        _linger(conn)

    def _serve_link(self, conn: socket.socket, payload: bytearray) -> bool:
        """The acceptor's side of a link handshake; True when the connection became a link."""
        r = _Reader(payload)
        offer = _decode_offer(r)
        force_link = bool(r.u("B"))
        host = _decode_host(r)
        snap, addrs = _decode_snapshot(r)
        r.end()
        owner = self.owner
        chan = _Channel(conn, owner, f"{owner.cluster_id}<-{offer.cluster_id}")
        chan.peer_wait_ms = offer.sync_wait_ms
        made: list[RemotePeer] = []

        def make_handle() -> PeerHandle:
            # comm: our entity for the initiator lives on this same connection
            handle = RemotePeer(chan, offer, snap, addrs, host)
            chan.local_user = True
            made.append(handle)
            return handle

        # Our handle may be used as soon as the entity exists: hold the send lock until the
        # reply is out, so no request of ours can precede it on the wire.
        with chan.send_lock:
            status, detail, mine = owner._serve_link(offer, force_link, make_handle)
            w = _Writer().pack("I", status).text(detail[:4000])
            if status == S_OK and mine is not None:
                _encode_offer(w, LinkOffer.of(owner))
                _encode_host(w, _my_host())
                _encode_snapshot(w, mine[1])
                if len(w.buf) > MAX_HELLO:
                    w = _Writer().pack("I", Status.LLM_FAILED).text("cache table too large")
                    status = Status.LLM_FAILED
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                conn.sendall(_frame(F_LINK_REPLY, 0, bytes(w.buf)))
            except OSError:
                status = Status.LLM_FAILED
            if status != S_OK or mine is None:
                for handle in made:
                    handle.pvm = False
                chan.local_user = False
                if made:  # our entity exists but its connection is gone: transfers time out
                    chan.dead.set()
                _linger(conn)
                return False
            chan.served = mine[1]
            chan.peer_user = True
        chan.start()
        return True


def _linger(conn: socket.socket, seconds: float = 1.0) -> None:
    """Close after the peer read our last frame: FIN, then wait (at most ``seconds`` in all) for
    its FIN, so that closing does not reset the connection under our reply."""
    end = time.monotonic() + seconds
    try:
        conn.shutdown(socket.SHUT_WR)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            conn.settimeout(left)
            if not conn.recv(4096):
                return
    except OSError:
        pass


def lookup_listener(ip: str, port: int) -> SimBackend | None:
    """The in-process instance listening on ``ip:port`` (or on the wildcard address), if any."""
    ip = _norm_ip(ip)
    with _registry_lock:
        found = _registry.get((ip, port))
        if found is None:
            found = _registry.get(("0.0.0.0", port)) or _registry.get(("::", port))
    return found
