"""The fabric's wire format: frame header, frame types and their length limits, payload codecs.

Every frame: header ``<2sBBII>`` = magic ``b"KV"``, protocol version, frame type, request id,
payload length; then the payload.  Lengths are bounded per type (:data:`MAX_LEN`); anything else
closes the connection.  Integers little-endian; never pickle.  DATA frames carry at most
:data:`MAX_DATA` bytes of a transfer's byte stream (tensor k outer, run j inner).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping, Sequence

import numpy as np

from ...status import Status
from .protocol import KIND_BLOCKS, KIND_MIX, LinkOffer, RemoteCache, ServedCache

#: Version 2: mutual authentication before anything else (version 1 had none).  Version 3: the
#: one-round-trip LEASE_READ / LEASE_WRITE requests for small transfers.  Version 4: the
#: acceptor's authentication answer carries an announcement after its MAC (its same-host endpoint).
#: Version 5: the same-host proof's last message is the initiator's lease table (no
#: acknowledgement; :mod:`.samehost`), so kvdd versions that disagree on it refuse each other.
#: Version 6: a READ may name its LEASE's request instead of a lease (:data:`CHAINED_LEASE`).
PROTOCOL_VERSION = 6
MAGIC = b"KV"
HDR = struct.Struct("<2sBBII")

MAX_AUTH = 256  # every frame before authentication completes
MAX_CONTROL = 64 << 10
MAX_HELLO = 2 << 20  # a hello or its reply (offer + snapshot + extensions)
MAX_REQUEST = 4 << 20
MAX_DATA = 64 << 20

F_HELLO_LINK = 1
F_HELLO_UNLINK = 2
F_LINK_REPLY = 3
F_UNLINK_REPLY = 4
F_LEASE = 10  # a cache id, or 0 + the owner's request (leases.LeaseResolver)
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
F_LEASE_READ = 22  # lease + READ + release in one request (small transfers; DATA + DONE answer)
F_LEASE_WRITE = 23  # lease + WRITE + release in one request (then its DATA; DONE answers)
F_AUTH_HELLO = 30  # initiator: nonce, auth mode
F_AUTH_CHALLENGE = 31  # acceptor: nonce, auth mode
F_AUTH_PROOF = 32  # initiator: MAC
F_AUTH_OK = 33  # acceptor: MAC
F_AUTH_REFUSED = 34  # either: status, why (then the connection closes)

MAX_LEN = {
    F_HELLO_LINK: MAX_HELLO, F_HELLO_UNLINK: MAX_CONTROL, F_LINK_REPLY: MAX_HELLO,
    F_UNLINK_REPLY: MAX_CONTROL, F_LEASE: MAX_CONTROL, F_LEASE_REPLY: MAX_CONTROL,
    F_RELEASE: MAX_CONTROL, F_READ: MAX_REQUEST, F_WRITE: MAX_REQUEST, F_DATA: MAX_DATA,
    F_DONE: MAX_CONTROL, F_PING: MAX_CONTROL, F_PONG: MAX_CONTROL, F_CLOSE_HANDLE: MAX_CONTROL,
    F_GOODBYE: MAX_CONTROL, F_LEASE_READ: MAX_CONTROL, F_LEASE_WRITE: MAX_CONTROL,
    F_AUTH_HELLO: MAX_AUTH, F_AUTH_CHALLENGE: MAX_AUTH,
    F_AUTH_PROOF: MAX_AUTH, F_AUTH_OK: MAX_AUTH, F_AUTH_REFUSED: MAX_AUTH,
}
AUTH_FRAMES = frozenset((F_AUTH_HELLO, F_AUTH_CHALLENGE, F_AUTH_PROOF, F_AUTH_OK, F_AUTH_REFUSED))

# ---- bounds (docs/security.md) ----
PREAUTH_TIMEOUT_S = 2.0  # a connection must authenticate within this, from accept
MAX_PREAUTH = 256  # connections not yet authenticated, per listener (fair eviction: admission.py)
MAX_PREAUTH_PER_SOURCE = MAX_PREAUTH  # of them from one address (IPv4, or an IPv6 /64): all
#   (a full table evicts from the largest source, so one address's share only sets how long its
#   own progressed entries last under its own flood)
HELLO_TIMEOUT_S = 5.0  # an authenticated connection must deliver its whole hello within this
MAX_POSTAUTH = 64  # authenticated connections still sending their hello, per listener
MAX_POSTAUTH_PER_SOURCE = 16  # of them from one address
MAX_HELLO_BUFFERED = 8 << 20  # hello bytes those hold in all (the biggest is evicted beyond)
HANDSHAKE_WORKERS = 4  # threads per listener serving complete hellos (a fixed pool)
MAX_QUEUED_HELLOS = 64  # complete hellos waiting for a worker, per listener
MAX_QUEUED_HELLOS_PER_SOURCE = 16  # of them from one address
MAX_DRAINING = 64  # answered connections read until the peer closes, at most LINGER_S each
LINGER_S = 1.0
MAX_LINKS = 256  # links accepted by one listening instance, in all
MAX_LINKS_PER_SOURCE = 32  # of them from one address
MAX_LINKED_CACHES = 131072  # caches in the peers' tables of those links, in all (~300 B each)
MAX_LINKED_CACHES_PER_SOURCE = 32768  # of them from one address (one hello's most)
REPLY_TIMEOUT_S = 2.0  # sending a hello's reply (a peer that does not read it loses the link)
HANDSHAKE_TIMEOUT_S = 10.0  # an initiator's whole handshake, when its caller gives no timeout
MAX_SNAPSHOT_CACHES = 32768  # caches in one hello
MAX_EXTENSIONS = 8  # extension entries in one hello
MAX_EXTENSION_BYTES = 4096  # their names and values, in all
#: A READ's lease field with this bit set names an earlier LEASE request of the connection (its id
#: in the low 32 bits; the bits between must be 0): the lease that request got, once (the caller
#: sends its READ right behind its LEASE: one round trip).
CHAINED_LEASE = 1 << 63
MAX_LEASES = 64  # outstanding leases per connection (a peer needs one at a time)
MAX_JOBS = 16  # queued requests per connection
MAX_QUEUED_BYTES = 8 << 20  # their payload bytes
# tensors x runs of one READ/WRITE served to another process: above what LLM-DataDist's 2 MiB
# request limit lets a pull ask (K + 2G <= 131064; a push layer would need > 16k tensors per layer
# to reach it), so no real transfer is refused, while a request bomb costs nothing
MAX_RUNS = 1 << 31
LEASE_GRACE_MS = 250
MAX_LEASE_MS = 60_000  # the longest SyncKvCacheWaitTime an owner honours for a peer's lease
CLOSE_LINGER_S = 2.0
STAGE_RUN_BYTES = 64 << 10  # runs shorter than this on average go through one staging copy
STAGE_CHUNK = 4 << 20  # bytes staged at a time when the server streams short runs
# a LEASE_READ / LEASE_WRITE moves at most this many bytes in at most SMALL_MAX_RUNS tensors x
# runs (a peer asking for more breaks the protocol: its connection is closed)
SMALL_BYTES = 64 << 10
SMALL_MAX_RUNS = 256

BACKENDS = ("comm", "hixl")
RC = struct.Struct("<QIQIQBB")  # cache_id, n, T, B, S, ragged, placement
# CANN's Python package (PYPKG.md §4.1): an entry's type, N, remote-accessible flag, key count;
# then per key (req_id, model_id, batch position)
RC_EXTRA = struct.Struct("<BQBI")
RC_KEY = struct.Struct("<QQI")
REQ = struct.Struct("<QII")  # lease id, K tensors, J runs


class ProtocolError(Exception):
    """A peer sent something this protocol does not allow; its connection is closed."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version (``version``; the frame type in ``ftype``)."""

    def __init__(self, version: int, ftype: int) -> None:
        super().__init__(f"the peer speaks fabric protocol version {version}, this process "
                         f"{PROTOCOL_VERSION}: use the same kvdd version on both sides")
        self.version = version
        self.ftype = ftype


class Writer:
    def __init__(self) -> None:
        self.buf = bytearray()

    def pack(self, fmt: str, *values: object) -> Writer:
        self.buf += struct.pack("<" + fmt, *values)
        return self

    def text(self, value: str | None, long: bool = False) -> Writer:
        if value is None:
            return self.pack("B", 0)
        data = value.encode("utf-8", "surrogatepass")
        self.pack("B", 1)
        self.pack("I" if long else "H", len(data))
        self.buf += data
        return self

    def raw(self, data: bytes) -> Writer:
        self.buf += data
        return self


class Reader:
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


def frame(ftype: int, req: int, payload: bytes | bytearray = b"") -> bytes:
    return HDR.pack(MAGIC, PROTOCOL_VERSION, ftype, req & 0xFFFFFFFF, len(payload)) + payload


#: Bytes asked of one recv_into: big rows arrive in pieces the socket buffer holds (a single
#: huge recv_into makes the kernel copy in step with the sender instead of draining its queue).
RECV_CHUNK = 1 << 20


def recv_into(sock: socket.socket, mv: memoryview) -> None:
    while len(mv):
        n = sock.recv_into(mv[:RECV_CHUNK] if len(mv) > RECV_CHUNK else mv)
        if n == 0:
            raise ConnectionError("connection closed by the peer")
        mv = mv[n:]


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; memory grows with the bytes that actually arrive (a peer announcing
    a large frame and sending nothing costs at most 1 MiB)."""
    if n <= 1 << 20:
        buf = bytearray(n)
        recv_into(sock, memoryview(buf))
        return buf
    out = bytearray()
    while len(out) < n:
        chunk = bytearray(min(n - len(out), 1 << 20))
        recv_into(sock, memoryview(chunk))
        out += chunk
    return out


def discard(sock: socket.socket, n: int) -> None:
    scratch = bytearray(min(n, 1 << 20)) if n else b""
    mv = memoryview(scratch)
    while n > 0:
        take = min(n, len(mv))
        recv_into(sock, mv[:take])
        n -= take


def check_header(head: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """``(type, request id, length)`` of a frame header, checked against this protocol."""
    magic, version, ftype, req, length = HDR.unpack(head)
    if magic != MAGIC:
        raise ProtocolError("bad magic")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version, ftype)
    limit = MAX_LEN.get(ftype)
    if limit is None:
        raise ProtocolError(f"unknown frame type {ftype}")
    if length > limit:
        raise ProtocolError(f"frame type {ftype} of {length} bytes exceeds {limit}")
    return ftype, req, length


def read_header(sock: socket.socket) -> tuple[int, int, int]:
    return check_header(recv_exact(sock, HDR.size))


def version_refusal(version: int, ftype: int) -> bytes:
    """What a peer of another protocol version gets: a reply it can parse (versions 1 to 3 share
    the link/unlink reply layout: status, text) saying why, in its own version's header."""
    why = (f"fabric protocol version mismatch: the peer speaks version {PROTOCOL_VERSION}, "
           f"this process {version}; use the same kvdd version on both sides")
    if ftype == F_HELLO_UNLINK:
        body = struct.pack("<I", Status.LLM_UNLINK_FAILED)
        rtype = F_UNLINK_REPLY
    else:
        body = bytes(Writer().pack("I", Status.LLM_LINK_FAILED).text(why).buf)
        rtype = F_LINK_REPLY
    return HDR.pack(MAGIC, version & 0xFF, rtype, 0, len(body)) + body


def encode_offer(w: Writer, offer: LinkOffer) -> None:
    w.pack("QBI", offer.cluster_id & 0xFFFFFFFFFFFFFFFF, BACKENDS.index(offer.transfer_backend),
           max(0, min(offer.sync_wait_ms, 0xFFFFFFFF)))
    w.text(offer.comm_res_text, long=True)


def decode_offer(r: Reader) -> LinkOffer:
    cluster_id, backend, wait_ms = r.unpack("QBI")
    if backend >= len(BACKENDS):
        raise ProtocolError("unknown transfer backend")
    return LinkOffer(cluster_id, BACKENDS[backend], r.text(long=True), wait_ms)


def encode_extensions(w: Writer, ext: Mapping[str, bytes]) -> None:
    w.pack("B", len(ext))
    for name, value in ext.items():
        w.text(name)
        w.pack("H", len(value)).raw(value)


def decode_extensions(r: Reader) -> dict[str, bytes]:
    """At most MAX_EXTENSIONS entries of at most MAX_EXTENSION_BYTES (names and values) in all."""
    count = r.u("B")
    if count > MAX_EXTENSIONS:
        raise ProtocolError(f"{count} extensions (at most {MAX_EXTENSIONS})")
    out: dict[str, bytes] = {}
    total = 0
    for _ in range(count):
        name = r.text()
        if name is None or name in out:
            raise ProtocolError("malformed extension")
        value = bytes(r.take(r.u("H")))
        total += len(name) + len(value)
        if total > MAX_EXTENSION_BYTES:
            raise ProtocolError(f"extensions exceed {MAX_EXTENSION_BYTES} bytes")
        out[name] = value
    return out


def encode_snapshot(w: Writer, entries: Mapping[int, ServedCache]) -> None:
    w.pack("I", len(entries))
    parts: list[bytes] = []
    pack = RC.pack
    for cid, e in entries.items():
        parts.append(pack(cid, e.n, e.T, e.B, e.S, int(e.ragged), e.placement & 0xFF))
        a = e.addrs
        # (a few addresses without numpy's per-call cost: 1004 caches in a fraction of a ms)
        parts.append(struct.pack(f"<{len(a)}Q", *a) if len(a) <= 64
                     else np.asarray(a, dtype="<u8").tobytes())
    w.buf += b"".join(parts)


def _uniform_snapshot(r: Reader, count: int
                      ) -> tuple[dict[int, RemoteCache], dict[int, tuple[int, ...]]] | None:
    """:func:`decode_snapshot` of a table whose caches all have the same number of tensors (at
    most 64), in one numpy pass with the same checks; None when it is not such a table."""
    n0 = RC.unpack_from(r.mv, r.pos)[1]
    size = RC.size + 8 * n0
    if not 0 < n0 <= 64 or count * size > len(r.mv) - r.pos:
        return None
    rec = np.frombuffer(r.mv, dtype=_snapshot_dtype(n0), count=count, offset=r.pos)
    if not bool(np.all(rec["n"] == n0)):
        return None
    cids = rec["cid"].tolist()
    t = rec["t"]
    a = rec["a"]
    if (len(set(cids)) != count or bool(np.any(t >= 1 << 62)) or bool(np.any(a == 0))
            or bool(np.any(a > (np.uint64((1 << 64) - 1) - t)[:, None]))):
        raise ProtocolError("malformed cache snapshot")
    r.take(count * size)
    vals = [tuple(row) for row in a.tolist()]
    snap = {cid: RemoteCache(cid, n0, tt, b, s, bool(rg), cid)
            for cid, tt, b, s, rg in zip(cids, t.tolist(), rec["b"].tolist(), rec["s"].tolist(),
                                         rec["ragged"].tolist())}
    return snap, dict(zip(cids, vals))


_SNAPSHOT_DTYPES: dict[int, np.dtype[np.void]] = {}


def _snapshot_dtype(n: int) -> np.dtype[np.void]:
    """One cache of a snapshot (:data:`RC` then ``n`` addresses) as a packed numpy record."""
    dt = _SNAPSHOT_DTYPES.get(n)
    if dt is None:
        dt = np.dtype([("cid", "<u8"), ("n", "<u4"), ("t", "<u8"), ("b", "<u4"), ("s", "<u8"),
                       ("ragged", "u1"), ("placement", "u1"), ("a", "<u8", (n,))])
        _SNAPSHOT_DTYPES[n] = dt
    return dt


def decode_snapshot(r: Reader) -> tuple[dict[int, RemoteCache], dict[int, tuple[int, ...]]]:
    count = r.u("I")
    if count > MAX_SNAPSHOT_CACHES or count * RC.size > len(r.mv) - r.pos:
        raise ProtocolError(f"a snapshot of {count} caches (at most {MAX_SNAPSHOT_CACHES})")
    if count >= 16:  # (many caches of one shape: one numpy pass)
        uniform = _uniform_snapshot(r, count)
        if uniform is not None:
            return uniform
    snap: dict[int, RemoteCache] = {}
    addrs: dict[int, tuple[int, ...]] = {}
    for _ in range(count):
        cid, n, t, b, s, ragged, _placement = RC.unpack(r.take(RC.size))
        if n == 0 or cid in snap:
            raise ProtocolError("malformed cache snapshot")
        raw = r.take(8 * n)
        if n <= 64:  # (the common case, without numpy's per-call cost: 1004 caches in ~1 ms)
            vals: tuple[int, ...] = struct.unpack(f"<{n}Q", raw)
            bad = 0 in vals or max(vals) > (1 << 64) - 1 - t
        else:
            a = np.frombuffer(raw, dtype="<u8")
            bad = bool(np.any(a == 0) or np.any(a > (1 << 64) - 1 - t))
            vals = tuple(int(x) for x in a)
        if t >= 1 << 62 or bad:
            raise ProtocolError("malformed cache snapshot")
        snap[cid] = RemoteCache(cid, n, t, b, s, bool(ragged), cid)
        addrs[cid] = vals
    return snap, addrs


def encode_table_extras(w: Writer, entries: Mapping[int, ServedCache],
                        views: Mapping[int, RemoteCache]) -> None:
    """The cache-table fields of CANN's Python package (PYPKG.md §4.1), after the extensions of a
    hello or its reply, only when some view needs them (a C++-face table adds no byte): for every
    view that is not a plain served MIX entry, its type, N, remote-accessible flag and keys; a
    view not served is listed without addresses (it is never leased)."""
    extras = [v for cid, v in views.items()
              if v.kind != KIND_MIX or not v.remote_accessible or v.keys or cid not in entries]
    if not extras:
        return
    w.pack("I", len(extras))
    for v in extras:
        w.raw(RC.pack(v.cache_id, v.num_tensors, v.tensor_nbytes, v.batch_size, v.stride_nbytes,
                      int(v.ragged), 0))
        w.raw(RC_EXTRA.pack(v.kind, v.blocks, int(v.remote_accessible), len(v.keys)))
        for key in v.keys:
            w.raw(RC_KEY.pack(*key))


def decode_table_extras(r: Reader, snap: dict[int, RemoteCache]) -> None:
    """Merge :func:`encode_table_extras` (when present: the payload continues) into ``snap``."""
    if r.pos == len(r.mv):
        return
    extras = r.u("I")
    if extras > MAX_SNAPSHOT_CACHES or extras * (RC.size + RC_EXTRA.size) > len(r.mv) - r.pos:
        raise ProtocolError(f"a snapshot of {extras} listed caches (at most {MAX_SNAPSHOT_CACHES})")
    seen: set[int] = set()
    for _ in range(extras):
        cid, n, t, b, s, ragged, _placement = RC.unpack(r.take(RC.size))
        kind, blocks, ra, nkeys = RC_EXTRA.unpack(r.take(RC_EXTRA.size))
        if nkeys * RC_KEY.size > len(r.mv) - r.pos:
            raise ProtocolError("malformed cache snapshot keys")
        keys = tuple(RC_KEY.unpack(r.take(RC_KEY.size)) for _ in range(nkeys))
        served = snap.get(cid)
        if (cid in seen or kind > KIND_BLOCKS or n == 0 or t >= 1 << 62
                or (served is None and ra)  # a remote-accessible cache is served
                or (served is not None and (served.num_tensors, served.tensor_nbytes,
                                            served.batch_size, served.stride_nbytes) != (n, t, b, s))):
            raise ProtocolError("malformed cache snapshot extras")
        seen.add(cid)
        snap[cid] = RemoteCache(cid, n, t, b, s, bool(ragged), cid, kind,
                                -1 if kind == KIND_MIX else blocks, bool(ra), keys)


def encode_request(lease: int, tensors: Sequence[int], off: np.ndarray,
                    length: np.ndarray) -> bytes:
    t = np.asarray(tensors, dtype="<u4")
    o = np.ascontiguousarray(off, dtype="<i8")
    n = np.ascontiguousarray(length, dtype="<i8")
    return REQ.pack(lease, len(t), len(n)) + t.tobytes() + o.tobytes() + n.tobytes()


def decode_request(payload: bytes | bytearray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    r = Reader(payload)
    lease, k, j = REQ.unpack(r.take(REQ.size))
    t = np.frombuffer(r.take(4 * k), dtype="<u4").astype(np.int64)
    o = np.frombuffer(r.take(8 * j), dtype="<i8").astype(np.int64)
    n = np.frombuffer(r.take(8 * j), dtype="<i8").astype(np.int64)
    r.end()
    return lease, t, o, n
