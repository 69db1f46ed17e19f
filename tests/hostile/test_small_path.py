"""Hostile peers against the one-request small path (LEASE_READ / LEASE_WRITE).

* As an *owner* answering our small READ: the caller reads its own reply from the socket now, so
  a peer's DATA for it reaches the caller's memory only when the owner's DONE says LLM_SUCCESS and
  every byte came; too much DATA, DATA for another request or a silent owner break the link; not
  one byte of the caller's memory outside the destination run changes, guard bytes included.
* As a *reader*: small requests naming tensors or runs outside the victim's cache get
  LLM_PARAM_INVALID and no DATA, and the victim's memory is not touched (the ``victim`` fixture of
  :mod:`test_attacks` checks every arena of every process).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvdd
from kvdd import Status
from kvdd.sim.fabric import wire

from conformance.harness import World, register
from hostile import rawpeer
from hostile.test_attacks import BIG, Victim, victim  # noqa: F401  (the fixture)

S = Status.LLM_SUCCESS
GUARD = 4096
SIZE = 64
ATTACKER = 9100
Reply = Callable[[int], bytes]  # request id -> what the hostile owner sends back


def _done(req: int, status: int) -> bytes:
    return rawpeer.frame(wire.F_DONE, struct.pack("<I", status), req)


def _data(req: int, payload: bytes) -> bytes:
    return rawpeer.frame(wire.F_DATA, payload, req)


PATTERN = bytes((7 * i + 3) & 0xFF for i in range(SIZE))
REPLIES: dict[str, tuple[Reply, Status | None]] = {
    # what the owner sends for our LEASE_READ, and the status the pull gets (None: TIMEOUT)
    "valid": (lambda r: _data(r, PATTERN) + _done(r, S), S),
    "data_then_refusal": (lambda r: _data(r, b"\xaa" * SIZE) + _done(r, Status.LLM_PARAM_INVALID),
                          Status.LLM_PARAM_INVALID),
    "too_much_data": (lambda r: _data(r, b"\xbb" * (SIZE + 1)) + _done(r, S), None),
    "data_for_another_request": (lambda r: _data(r + 1, b"\xcc" * SIZE) + _done(r, S), None),
    "success_without_all_bytes": (lambda r: _data(r, b"\xdd" * (SIZE // 2)) + _done(r, S), None),
    "silent": (lambda r: b"", None),
    # the caller's compiled reader: several DATA frames; a DONE of the wrong size; no DATA;
    # a garbage header; the peer's own request (served on the way) before the answer
    "data_in_three_frames": (lambda r: _data(r, PATTERN[:10]) + _data(r, PATTERN[10:11])
                             + _data(r, PATTERN[11:]) + _done(r, S), S),
    "long_done": (lambda r: _data(r, PATTERN) + rawpeer.frame(wire.F_DONE, bytes(8), r), None),
    "success_without_data": (lambda r: _done(r, S), None),
    "bad_header": (lambda r: b"XY" + bytes(10) + _data(r, PATTERN) + _done(r, S), None),
    "ping_first": (lambda r: rawpeer.frame(wire.F_PING, b"", 999) + _data(r, PATTERN)
                   + _done(r, S), S),
}


class Caller:
    """An instance in this process that listens; a raw hostile peer links to it (comm: our entity
    for the peer uses that connection) and announces one 64-byte cache."""

    def __init__(self) -> None:
        self.dd = kvdd.LlmDataDist(ATTACKER + 1, kvdd.LlmRole.DECODER, backend="sim")
        self.dd.initialize({kvdd.OPTION_DEVICE_ID: "0",
                            kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0",
                            kvdd.OPTION_SYNC_CACHE_WAIT_TIME: "500"})
        self.arena = np.full(SIZE + 2 * GUARD, 0x5A, dtype=np.uint8)
        self.desc = kvdd.CacheDesc(1, kvdd.DataType.DT_UINT8, (1, SIZE))
        addr = int(self.arena.ctypes.data) + GUARD
        self.cache = kvdd.Cache(self.dd.register_kv_cache(self.desc, [addr]), (addr,), self.desc)

    def pull(self) -> Status:
        try:
            self.dd.pull_kv_cache(kvdd.CacheIndex(ATTACKER, 1, 0), self.cache, 0, -1,
                                  kvdd.KvCacheExtParam(tensor_num_per_layer=1))
        except kvdd.LLMError as exc:
            return exc.status
        return S


@pytest.fixture
def caller(monkeypatch: pytest.MonkeyPatch) -> Iterator[Caller]:
    monkeypatch.setenv("KVDD_SIM_XPROC", "tcp")
    c = Caller()
    try:
        yield c
    finally:
        c.dd.finalize()


def _owner(s: socket.socket, reply: Reply, seen: list[tuple[int, int, bytes]]) -> None:
    """The hostile owner: answers every LEASE_READ with ``reply``; records what it got."""
    try:
        while True:
            ftype, req, body = rawpeer.read_frame(s)
            seen.append((ftype, req, body))
            if ftype == wire.F_LEASE_READ:
                s.sendall(reply(req))
    except (OSError, AssertionError, struct.error):
        return  # the caller closed the link


@pytest.mark.parametrize("case", list(REPLIES))
def test_hostile_owner_cannot_write_outside_a_successful_small_read(caller: Caller,
                                                                    case: str) -> None:
    """The caller's memory changes only by a complete, successful answer, and only in the
    destination run; a broken answer breaks the link (LLM_TIMEOUT), a refusal is that status."""
    reply, want = REPLIES[case]
    port = caller.dd.listen_port
    assert port
    s, _snap = rawpeer.link(port, ATTACKER, caches=1)
    seen: list[tuple[int, int, bytes]] = []
    t = threading.Thread(target=_owner, args=(s, reply, seen), daemon=True)
    t.start()
    try:
        before = caller.arena.copy()
        got = caller.pull()
        assert got == (Status.LLM_TIMEOUT if want is None else want)
        expected = before.copy()
        if want == S:
            expected[GUARD:GUARD + SIZE] = np.frombuffer(PATTERN, dtype=np.uint8)
        changed = np.flatnonzero(caller.arena != expected)
        assert changed.size == 0, f"{changed.size} byte(s) changed, first at {changed[:4]}"
        # the request itself: one LEASE_READ naming the announced cache and the whole tensor
        reads = [(req, body) for ftype, req, body in seen if ftype == wire.F_LEASE_READ]
        assert len(reads) == 1
        cache_id, tensors, off, length = wire.decode_request(reads[0][1])
        assert (cache_id, tensors.tolist(), off.tolist(), length.tolist()) == (1, [0], [0], [SIZE])
        if want is None:  # the link is broken until relinked (SEMANTICS.md §10 rule 8)
            assert caller.pull() == Status.LLM_TIMEOUT
            assert (caller.arena == expected).all()
    finally:
        s.close()
        t.join(10)


@pytest.mark.parametrize("tensor, off, n", [
    (0, -8, 16),  # negative offset
    (0, 1 << 62, 16),  # far past the tensor
    (0, (1 << 63) - 8, 16),  # offset + length overflows 64 bits
    (1000, 0, 16),  # a tensor the cache does not have
    ((1 << 32) - 1, 0, 16),  # the largest tensor index the wire carries
])
def test_small_reads_outside_the_cache_are_refused(victim: Victim, tensor: int, off: int,  # noqa: F811
                                                   n: int) -> None:
    """LEASE_READs outside the victim's registered tensors: LLM_PARAM_INVALID, no DATA, nothing
    touched (every arena of every process checked by the fixture); the link stays usable."""
    ph = victim.ph
    s, _snap = rawpeer.link(victim.port, 4949)
    with s:
        body = struct.pack("<QII", ph.cache_id, 1, 1) + struct.pack("<Iqq", tensor, off, n)
        s.sendall(rawpeer.frame(wire.F_LEASE_READ, body, 11))
        ftype, rreq, reply = rawpeer.read_frame(s)
        assert (ftype, rreq, struct.unpack("<I", reply)[0]) == (wire.F_DONE, 11,
                                                                 Status.LLM_PARAM_INVALID)
        # still served: a valid small read on the same connection gets its exact bytes
        good = struct.pack("<QII", ph.cache_id, 1, 1) + struct.pack("<Iqq", 0, 0, 16)
        s.sendall(rawpeer.frame(wire.F_LEASE_READ, good, 12))
        ftype, rreq, data = rawpeer.read_frame(s)
        assert (ftype, rreq, len(data)) == (wire.F_DATA, 12, 16)
        ftype, rreq, reply = rawpeer.read_frame(s)
        assert (ftype, rreq, struct.unpack("<I", reply)[0]) == (wire.F_DONE, 12, S)


def test_small_request_with_no_tensors_moves_nothing(victim: Victim) -> None:  # noqa: F811
    """k = 0 tensors x 4,000 runs (in range) moves nothing: LLM_SUCCESS with no DATA, nothing
    touched, the victim's memory bounded (the fixture checks its RSS)."""
    ph = victim.ph
    s, _snap = rawpeer.link(victim.port, 5050)
    with s:
        j = 4000
        body = struct.pack("<QII", ph.cache_id, 0, j) + bytes(16 * j)
        s.sendall(rawpeer.frame(wire.F_LEASE_READ, body, 13))
        ftype, rreq, reply = rawpeer.read_frame(s)
        assert (ftype, rreq) == (wire.F_DONE, 13)
        assert struct.unpack("<I", reply)[0] == S



def _runs(ftype: int, cache_id: int, tensors: list[int], off: list[int], length: list[int],
          req: int) -> bytes:
    body = wire.encode_request(cache_id, tensors, np.array(off, np.int64), np.array(length, np.int64))
    return rawpeer.frame(ftype, body, req)


def _nothing_then_closed(s: socket.socket) -> None:
    """The victim sends nothing and closes the connection (within 5 s)."""
    s.settimeout(5.0)
    got = b""
    try:
        while chunk := s.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the connection is still open ({len(got)} byte(s) answered)")
    assert got == b"", f"the victim answered {len(got)} byte(s)"


@pytest.mark.parametrize("tensors, off, length", [
    ([0], [0, 8], [16, -1]),
    ([0], [200, 0], [-1, 16]),
    ([2, 5], [0, 0], [16, -(2**63)]),
])
def test_small_reads_of_several_runs_with_a_negative_length_are_refused(
        victim: Victim, world: World, tensors: list[int], off: list[int],  # noqa: F811
        length: list[int]) -> None:
    """A LEASE_READ of several runs, one of negative length: DONE(LLM_PARAM_INVALID) and no DATA
    (not one byte of the victim's memory is sent); the same runs without it then get exactly
    their bytes on the same connection."""
    ph = victim.ph
    s, _snap = rawpeer.link(victim.port, 5151)
    with s:
        s.sendall(_runs(wire.F_LEASE_READ, ph.cache_id, tensors, off, length, 21))
        ftype, rreq, reply = rawpeer.read_frame(s)
        assert (ftype, rreq, reply) == (wire.F_DONE, 21,
                                        struct.pack("<I", Status.LLM_PARAM_INVALID))
        good = [(o, n) for o, n in zip(off, length) if n > 0]
        s.sendall(_runs(wire.F_LEASE_READ, ph.cache_id, tensors, [o for o, _ in good],
                        [n for _, n in good], 22))
        ftype, rreq, data = rawpeer.read_frame(s)
        mem = world.snapshot().tensors(ph)
        assert (ftype, rreq) == (wire.F_DATA, 22)
        assert data == b"".join(bytes(mem[k][o:o + n]) for k in tensors for o, n in good)
        ftype, rreq, reply = rawpeer.read_frame(s)
        assert (ftype, rreq, reply) == (wire.F_DONE, 22, struct.pack("<I", S))


HALF = wire.SMALL_BYTES // 2


@pytest.mark.parametrize("ftype", [wire.F_LEASE_READ, wire.F_LEASE_WRITE],
                         ids=["lease_read", "lease_write"])
def test_small_requests_of_several_runs_are_served_up_to_small_bytes(
        victim: Victim, world: World, ftype: int) -> None:  # noqa: F811
    """Exactly SMALL_BYTES in two runs: a LEASE_READ gets every byte of both runs, a
    LEASE_WRITE lands every byte; both end with DONE(LLM_SUCCESS)."""
    p = victim.p
    big = register(p, BIG)
    s, _snap = rawpeer.link(victim.port, 5252)
    with s:
        off, length = [0, HALF + 64], [HALF, HALF]
        new = bytes((3 * i + 1) & 0xFF for i in range(wire.SMALL_BYTES))
        before = world.snapshot().tensors(big)[1].copy()
        if ftype == wire.F_LEASE_READ:
            s.sendall(_runs(ftype, big.cache_id, [1], off, length, 31))
            rftype, rreq, data = rawpeer.read_frame(s)
            assert (rftype, rreq) == (wire.F_DATA, 31)
            assert data == bytes(before[:HALF]) + bytes(before[HALF + 64:2 * HALF + 64])
        else:
            s.sendall(_runs(ftype, big.cache_id, [1], off, length, 31)
                      + rawpeer.frame(wire.F_DATA, new, 31))
        rftype, rreq, reply = rawpeer.read_frame(s)
        assert (rftype, rreq, reply) == (wire.F_DONE, 31, struct.pack("<I", S))
        after = world.snapshot().tensors(big)[1]
        if ftype == wire.F_LEASE_WRITE:
            before[:HALF] = np.frombuffer(new[:HALF], np.uint8)
            before[HALF + 64:2 * HALF + 64] = np.frombuffer(new[HALF:], np.uint8)
        assert (after == before).all()
    p.unregister(big.cache_id)


@pytest.mark.parametrize("ftype", [wire.F_LEASE_READ, wire.F_LEASE_WRITE],
                         ids=["lease_read", "lease_write"])
def test_small_requests_of_several_runs_beyond_small_bytes_close_the_link(
        victim: Victim, world: World, ftype: int) -> None:  # noqa: F811
    """One byte past SMALL_BYTES in two runs (a correct peer sends it as LEASE + READ / WRITE):
    the connection closes, nothing is answered and no byte of the cache changes."""
    p = victim.p
    big = register(p, BIG)
    s, _snap = rawpeer.link(victim.port, 5353)
    with s:
        before = world.snapshot().tensors(big)[1].copy()
        request = _runs(ftype, big.cache_id, [1], [0, HALF + 64], [HALF, HALF + 1], 41)
        if ftype == wire.F_LEASE_WRITE:
            request += rawpeer.frame(wire.F_DATA, b"\xee" * (wire.SMALL_BYTES + 1), 41)
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while the DATA was on its way
        _nothing_then_closed(s)
        assert (world.snapshot().tensors(big)[1] == before).all()
    p.unregister(big.cache_id)
