"""A peer that accepts, reads the request and closes without answering: SEMANTICS.md §3.5 g, §3.6.

Upstream's ``RecvMsg`` fails on the end of stream → ``ge::FAILED``: the cluster's status is
LLM_FAILED on link (LINK_FAILED is for connect failures) and on a non-force unlink, whose local
entity is already destroyed.  kvdd's own authentication refusal (upstream has none) keeps its
documented LINK_FAILED / UNLINK_FAILED (docs/spec/SEMANTICS.md, kvdd's notes to §3.5 g).

The peer here is a plain socket server in this process: it reads what arrives (on kvdd's fabric,
after the challenge-response when ``stage`` says so) and closes.
"""

from __future__ import annotations

import hashlib
import importlib
import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvdd import LlmRole, Status
from kvdd.sim.fabric import wire
from kvdd.sim.fabric.auth import NONCE_BYTES, load_secret, mac
from kvdd.sim.fabric.handshake import auth_refusal, transcript_of

from .harness import (
    ALREADY_LINK,
    FAILED,
    LINK_FAILED,
    LOCALHOST,
    NOT_YET_LINK,
    UNLINK_FAILED,
    World,
    cluster,
    link,
    linked,
    raises,
)

#: What the fake peer does: "read" (read the first bytes, close: any wire protocol),
#: "request" (kvdd fabric: authenticate, read the link/unlink request, close),
#: "refuse" (kvdd fabric: refuse the authentication with a reason, close).
STAGES = ("read", "request", "refuse")


def _frame(conn: socket.socket) -> tuple[int, bytes]:
    ftype, _req, length = wire.read_header(conn)
    return ftype, bytes(wire.recv_exact(conn, length))


def _authenticate(conn: socket.socket) -> None:
    """The acceptor's side of the fabric's challenge-response, with this process's secret."""
    _t, hello = _frame(conn)
    secret = load_secret()
    nonce_a = secrets.token_bytes(NONCE_BYTES)
    challenge = nonce_a + bytes([int(secret.auth_off)])
    conn.sendall(wire.frame(wire.F_AUTH_CHALLENGE, 0, challenge))
    t0 = transcript_of(hello, challenge)
    _t, proof = _frame(conn)
    t1 = hashlib.sha256(t0 + proof).digest()
    conn.sendall(wire.frame(wire.F_AUTH_OK, 0, mac(secret.key, "acceptor", hello[:NONCE_BYTES],
                                                   nonce_a, t1)))


@contextmanager
def hanging_up_peer(stage: str) -> Iterator[tuple[int, list[int]]]:
    """A listening port whose connections end as ``stage`` says; yields (port, frame types of
    the requests it read)."""
    server = socket.create_server((LOCALHOST, 0))
    port = server.getsockname()[1]
    requests: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _addr = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    if stage == "read":
                        conn.recv(65536)
                    elif stage == "refuse":
                        _frame(conn)
                        conn.sendall(auth_refusal(Status.LLM_LINK_FAILED, "not for you"))
                    else:
                        _authenticate(conn)
                        requests.append(_frame(conn)[0])
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port, requests
    finally:
        stop.set()
        thread.join(5)
        server.close()


def _skip_unless_kvdd_fabric(backend: str, stage: str) -> None:
    if stage == "read" or backend == "sim":
        return
    try:  # a native build against kvdd's simulated CANN root links over kvdd's fabric
        if importlib.import_module("kvdd._build_config").NATIVE_TEST_DOUBLE:
            return
    except ImportError:
        pass
    pytest.skip("speaks kvdd's fabric protocol (the simulator, or kvdd's simulated CANN root)")


@pytest.mark.parametrize("stage", STAGES)
def test_link_to_a_peer_that_hangs_up(world: World, backend: str, transfer: str,
                                      stage: str) -> None:
    _skip_unless_kvdd_fabric(backend, stage)
    d = world.dut()
    d.initialize(transfer=transfer)
    p = world.peer(1, LlmRole.PROMPT)
    p.initialize(listen=True, transfer=transfer)
    with hanging_up_peer(stage) as (port, requests):
        expected = LINK_FAILED if stage == "refuse" else FAILED
        with raises(expected, rets=[expected.status, Status.LLM_SUCCESS]):
            d.link_clusters([cluster(port, 9), cluster(p.listen_port or 0, 1)])
        if stage == "request":
            assert requests == [wire.F_HELLO_LINK]
    # the other cluster of the same call was linked
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p)


@pytest.mark.parametrize("stage", STAGES)
def test_non_force_unlink_from_a_peer_that_hangs_up(world: World, backend: str,
                                                    stage: str) -> None:
    _skip_unless_kvdd_fabric(backend, stage)
    d, p, dh, ph = linked(world)
    d.pull_kv_cache(ph.index(), dh.cache())
    with hanging_up_peer(stage) as (port, requests):
        # the unlink names the linked cluster, at an address where the peer hangs up
        expected = UNLINK_FAILED if stage == "refuse" else FAILED
        with raises(expected, rets=[expected.status]):
            d.unlink_clusters([cluster(port, p.cluster_id)])
        if stage == "request":
            assert requests == [wire.F_HELLO_UNLINK]
    # the local entity was destroyed before the peer's status was read
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(), dh.cache())
    assert link(d, p) == [Status.LLM_SUCCESS]
    d.pull_kv_cache(ph.index(), dh.cache())
