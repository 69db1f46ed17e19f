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

from hostile import rawpeer
from hostile.test_attacks import Victim, victim  # noqa: F401  (the fixture)

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
