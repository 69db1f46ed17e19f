"""A lease whose READ is being answered, against a raw peer that stops reading: the copy in
progress holds the cache at most until the lease expires (the reader's announced wait plus the
grace), and then loses its connection, even when the lease is revoked by an unregister or released
by the peer meanwhile (neither stops that clock)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvdd.sim.fabric import wire

from hostile import rawpeer
from hostile.test_small_path_requests import S, Honest, make  # noqa: F401 (fixture)

N = 16 << 20  # more than the owner's send buffer and the peer's 64 KiB receive buffer hold
ANNOUNCED_WAIT_S = 1.0  # the raw peer's llm.SyncKvCacheWaitTime (its link hello)


def _drain(s: socket.socket) -> int:
    """Bytes the connection still delivers before it closes."""
    s.settimeout(5)
    got = 0
    try:
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                return got
            got += len(chunk)
    except ConnectionResetError:
        return got


@pytest.mark.parametrize("meanwhile", ["unregister revokes the lease", "the peer releases it"])
def test_a_stalled_answer_holds_the_cache_only_until_its_lease_expires(
        make: Callable[..., Honest], meanwhile: str) -> None:
    """LEASE, then a 16 MiB READ the peer does not read: the owner is left mid-answer.  An
    unregister waits for that copy (a living reader is waited for) and returns once the lease
    expires, 1.25 s after it was granted, when the owner closes the connection: the answer
    never completes.  (The revocation after 1 s, or the peer's RELEASE, used to cancel the
    expiry: the unregister then waited for as long as the peer kept its connection open.)"""
    h = make(N)
    cid = h.caches[0].cache_id
    s = h.link()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    done = threading.Event()
    try:
        t0 = time.monotonic()
        status, lease_id = rawpeer.lease(s, cid, 1)
        assert status == S
        s.sendall(rawpeer.frame(wire.F_READ, wire.encode_request(
            lease_id, [0], np.array([0]), np.array([N])), 2))
        time.sleep(0.05)  # the answer has begun, and stalled (the revocation then comes 1.05 s
        # after the grant, well before the expiry at 1.25 s)
        if meanwhile == "the peer releases it":
            s.sendall(rawpeer.frame(wire.F_RELEASE, struct.pack("<Q", lease_id)))

        def unregister() -> None:
            h.dd.unregister_kv_cache(cid)
            done.set()

        t = threading.Thread(target=unregister, daemon=True)
        t.start()
        assert not done.wait(0.5)  # the copy is in progress: waited for
        assert done.wait(10), "the unregister waited past the lease's expiry"
        took = time.monotonic() - t0
        assert ANNOUNCED_WAIT_S < took < ANNOUNCED_WAIT_S + wire.LEASE_GRACE_MS / 1000 + 1.0, took
        assert _drain(s) < N  # closed mid-answer: no DONE
    finally:
        s.close()  # (frees a hung unregister when the expiry failed)
        done.wait(10)
