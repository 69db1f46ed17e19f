"""A forked child must not act on its parent's connections.

The watchdog's heap of timers is inherited by a forked child, and the child's first timer of its
own (any kvdd use: a link, a request) starts a watchdog thread there that runs the parent's
timers: a request the parent had in flight at the fork is still waiting in the child's copy at
its deadline, and the child's DeadlineGuard ``kill()``s the connection, whose
``shutdown(SHUT_RDWR)`` acts on the socket the parent and the child share.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvdd.sim.fabric import wire
from kvdd.sim.fabric.channel import Channel
from kvdd.sim.fabric.watchdog import WATCHDOG

ANSWER_AFTER_S = 0.3
DEADLINE_S = 1.0


class MinimalOwner:
    cluster_id = 7
    transfer_backend = "comm"
    comm_res_text: str | None = None
    sync_wait_ms = 2000
    initialized = True


def _slow_pong_peer(server: socket.socket) -> None:
    s, _ = server.accept()
    with s:
        while True:
            head = s.recv(wire.HDR.size, socket.MSG_WAITALL)
            if len(head) < wire.HDR.size:
                return
            _m, _v, ftype, req, n = wire.HDR.unpack(head)
            if n:
                s.recv(n, socket.MSG_WAITALL)
            if ftype == wire.F_PING:
                time.sleep(ANSWER_AFTER_S)
                s.sendall(wire.HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, wire.F_PONG, req, 0))


def test_a_forked_childs_timers_leave_the_parents_connection_alone() -> None:
    """A PING in flight at the fork, answered in time in the parent; the child arms one timer and
    lives past the PING's deadline: the parent's connection answers a second PING."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        threading.Thread(target=_slow_pong_peer, args=(server,), daemon=True).start()
        sock = socket.create_connection(server.getsockname())
        chan = Channel(sock, MinimalOwner(), "fork-timers")  # type: ignore[arg-type]
        chan.start()
        got: list[bytes | None] = []
        t = threading.Thread(target=lambda: got.append(
            chan.request(wire.F_PING, b"", time.monotonic() + DEADLINE_S)))
        t.start()
        time.sleep(ANSWER_AFTER_S / 3)  # the PING is in flight
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                WATCHDOG.schedule(0.0, lambda: None)
                time.sleep(DEADLINE_S + 0.5)
            finally:
                os._exit(0)
        try:
            t.join()
            assert got == [b""]  # answered in time, in the parent
            time.sleep(DEADLINE_S + 0.2)  # the child's copy of the request is late by now
            assert not chan.dead.is_set(), "the parent's connection was shut down by its child"
            assert chan.request(wire.F_PING, b"", time.monotonic() + DEADLINE_S) == b""
        finally:
            os.waitpid(pid, 0)
            chan.kill()
