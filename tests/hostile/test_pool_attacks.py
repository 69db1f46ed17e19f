"""Hostile peers against the fabric's pool (kvdd/sim/fabric/reactor.py: 4 threads per process).

With one attacking connection per pool thread, every other connection of the process must still
be served: a pool task handles a share of a connection's frames *and* of the reads within one
frame (a request's DATA) before the others' turn, a thread looks for ready sockets before taking
queued work when nobody else does, a WRITE / LEASE_WRITE refuses a DATA frame of 0 bytes (it only
spins the reader), and a refused WRITE's data is discarded for no longer than a lease would last.

Connections are :class:`~kvdd.sim.fabric.channel.Channel` objects over loopback TCP (as in
``tests/sim/test_fabric_pool.py``, with a real link's socket buffers); the attackers pump from a
process of their own (a pumping thread of this process would wait for the GIL while the pool
holds it, and the socket would drain meanwhile: the attack needs a sender that is not slowed by
the victim).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from kvdd.sim.fabric import wire
from kvdd.sim.fabric.channel import Channel
from kvdd.sim.fabric.reactor import POOL_THREADS
from kvdd.sim.fabric.small import encode_one_run

from hostile import rawpeer
from hostile.rawpeer import MinimalOwner

ANSWER_WITHIN_S = 1.0
ATTACK_S = 4.0




def _endless(kind: str) -> tuple[bytes, bytes]:
    """The request that opens the data, and the DATA frame repeated after it (or, for a flood of
    whole requests, nothing and the request repeated)."""
    if kind == "lease_read_flood":  # valid small reads (of a cache the owner does not serve)
        return b"", b"".join(rawpeer.frame(wire.F_LEASE_READ, encode_one_run(1, 0, 0, 0), r)
                             for r in range(1, 101))
    if kind == "lease_write_empty_data":
        return (rawpeer.frame(wire.F_LEASE_WRITE, encode_one_run(1, 0, 0, 1), 1),
                rawpeer.frame(wire.F_DATA, req=1))
    assert kind == "forged_write_byte_data"
    return (rawpeer.frame(wire.F_WRITE, wire.encode_request(0xDEAD, [0], np.array([0]),
                                                           np.array([1 << 40])), 1),
            rawpeer.frame(wire.F_DATA, b"x", 1))


PUMP = r"""
import socket, sys, threading, time
first, unit = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
burst = unit * ((256 << 10) // len(unit))
end = time.monotonic() + float(sys.argv[3])
def drain(s):
    try:
        while s.recv(1 << 20):
            pass
    except OSError:
        pass
def pump(fd):
    s = socket.socket(fileno=fd)
    threading.Thread(target=drain, args=(s,), daemon=True).start()  # answers are read
    try:
        s.sendall(first)
        while time.monotonic() < end:
            s.sendall(burst)
    except OSError:  # closed by the victim (a fix may refuse the frames)
        pass
ts = [threading.Thread(target=pump, args=(int(fd),)) for fd in sys.argv[4:]]
for t in ts: t.start()
for t in ts: t.join()
"""


def _open(n: int, owner: MinimalOwner) -> list[tuple[Channel, socket.socket]]:
    out = []
    with socket.create_server(("127.0.0.1", 0)) as server:  # TCP: socket buffers of MiBs
        for i in range(n):
            theirs = socket.create_connection(server.getsockname())
            mine, _ = server.accept()
            chan = Channel(mine, owner, f"pool-attack-{i}")  # type: ignore[arg-type]
            chan.start()
            out.append((chan, theirs))
    return out


@pytest.mark.parametrize("kind", ["lease_write_empty_data", "forged_write_byte_data"])
def test_endless_data_of_one_request_holds_no_pool_thread(kind: str) -> None:
    """POOL_THREADS connections each stream one request's DATA as fast as they can for 4 s; a
    PING on another connection is answered within 1 s meanwhile (each of 5 tries)."""
    _attack_and_ping(kind)


def test_requeued_tasks_do_not_starve_other_connections() -> None:
    """POOL_THREADS connections each send valid LEASE_READs as fast as they can for 4 s and read
    every answer (nothing is queued, no bound is crossed); a PING on another connection is
    answered within 1 s meanwhile."""
    _attack_and_ping("lease_read_flood")


def _attack_and_ping(kind: str) -> None:
    owner = MinimalOwner()
    attackers = _open(POOL_THREADS, owner)
    (other, theirs), = _open(1, owner)
    theirs.settimeout(ANSWER_WITHIN_S)
    first, unit = _endless(kind)

    fds = [s.fileno() for _, s in attackers]
    pump = subprocess.Popen([sys.executable, "-c", PUMP, first.hex(), unit.hex(), str(ATTACK_S),
                             *map(str, fds)], pass_fds=fds)
    late = []
    try:
        time.sleep(1.0)  # the pump process is up and the socket full
        for req in range(1, 6):
            t0 = time.monotonic()
            theirs.sendall(rawpeer.frame(wire.F_PING, req=req))
            try:
                head = theirs.recv(wire.HDR.size, socket.MSG_WAITALL)
                ftype, rreq = wire.HDR.unpack(head)[2:4]
                assert (ftype, rreq) == (wire.F_PONG, req)
            except TimeoutError:
                late.append(req)
                break
            assert time.monotonic() - t0 < ANSWER_WITHIN_S
            time.sleep(0.2)
    finally:
        for chan, s in attackers:
            chan.kill()
            s.close()
        pump.kill()
        pump.wait(5)
        other.kill()
        theirs.close()
    assert not late, f"PING {late} not answered within {ANSWER_WITHIN_S} s"


@pytest.mark.parametrize("kind", ["lease_write_empty_data", "forged_write_empty_data"])
def test_an_empty_data_frame_of_a_write_ends_the_connection(kind: str) -> None:
    """A LEASE_WRITE (1 byte announced) or a refused WRITE followed by a DATA frame of 0 bytes:
    the owner closes the connection at once (a correct peer never sends one)."""
    first = (_endless("lease_write_empty_data")[0] if kind == "lease_write_empty_data"
             else _endless("forged_write_byte_data")[0])
    owner = MinimalOwner()
    (chan, theirs), = _open(1, owner)
    try:
        theirs.settimeout(ANSWER_WITHIN_S)
        theirs.sendall(first + rawpeer.frame(wire.F_DATA, req=1))
        assert _closed_by_owner(theirs)
    finally:
        chan.kill()
        theirs.close()


def test_a_refused_writes_data_is_discarded_no_longer_than_a_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A WRITE refused for its lease announces 1 TiB and sends it one byte per frame: the owner
    reads it into nothing only for as long as a lease could last (here 0.2 s), then closes; the
    same stream stays open while within that time."""
    from kvdd.sim.fabric import serving
    monkeypatch.setattr(serving, "MAX_LEASE_MS", 0)
    monkeypatch.setattr(serving, "LEASE_GRACE_MS", 200)
    owner = MinimalOwner()
    (chan, theirs), = _open(1, owner)
    try:
        theirs.settimeout(0.05)
        theirs.sendall(_endless("forged_write_byte_data")[0])
        t0 = time.monotonic()
        closed_at = None
        while time.monotonic() - t0 < 1.5 and closed_at is None:
            try:
                theirs.sendall(rawpeer.frame(wire.F_DATA, b"x", 1))
                if theirs.recv(1) == b"":
                    closed_at = time.monotonic() - t0
            except TimeoutError:
                pass
            except OSError:
                closed_at = time.monotonic() - t0
        assert closed_at is not None, "the discard went on past the lease time"
        assert 0.15 <= closed_at <= 0.8, closed_at
    finally:
        chan.kill()
        theirs.close()


def _closed_by_owner(s: socket.socket) -> bool:
    try:
        while True:
            data = s.recv(1 << 16)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
