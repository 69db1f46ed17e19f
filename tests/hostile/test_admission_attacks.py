"""Attacks on the admission bounds (docs/security.md, *Bounds*): each test states a bound the
code promises, at the boundary, with the attack that broke it.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any, cast

import pytest

from kvdd import Status
from kvdd.sim.fabric import samehost, wire
from kvdd.sim.fabric import gate as gate_mod
from kvdd.sim.fabric.admission import FairTable
from kvdd.sim.fabric.auth import Session
from kvdd.sim.fabric.gate import HandshakeGate
from kvdd.sim.fabric.listener import Listener
from kvdd.sim.fabric.protocol import LinkOwner
from kvdd.sim.fabric.wire import HANDSHAKE_WORKERS, MAX_LINKS_PER_SOURCE

from hostile import rawpeer
from hostile.test_attacks import Victim, victim  # noqa: F401 (fixture)
from hostile.test_bounds import ATTACKER, _legit_link, _raw_link, _raw_unlink, _threads
from peer_proc import PeerProcess


def test_a_progressed_entry_outlives_idle_ones_of_sources_as_large() -> None:
    """Every source holds one entry (a flood from many addresses); one of them progressed (the
    legitimate initiator's).  New entries from new sources evict idle entries of the largest
    sources, never the progressed one while an idle one of a source as large remains."""
    for trial in range(50):  # (which source a tie picks depends on the strings' hashes)
        table: FairTable[int] = FairTable(8, 4)
        for i in range(8):
            table.add(i, f"10.{trial}.0.{i}")
        table.progressed(3)  # the legitimate one: sent its whole authentication hello
        for i in range(8, 200):
            evicted = table.add(i, f"10.{trial}.1.{i}")
            assert 3 not in evicted, f"the progressed entry was evicted by entry {i}"


def _ended(s: socket.socket) -> bool:
    """Whether the other end closed ``s`` (whatever data it sent before)."""
    s.settimeout(0.5)
    try:
        while True:
            if not s.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_relinks_of_one_cluster_id_stay_within_the_link_bounds(
        victim: Victim, victim_proc: PeerProcess) -> None:  # noqa: F811
    """One address relinks one cluster id (force) 2 x MAX_LINKS_PER_SOURCE times and keeps every
    connection open: each relink replaces the last (its connection aborted), so the victim holds
    one link's threads for it (besides the handshake workers), and another address still links."""
    pid, port = victim_proc.pid, victim.port
    threads0 = _threads(pid)
    held: list[socket.socket] = []
    try:
        for _ in range(2 * MAX_LINKS_PER_SOURCE):
            status, _detail, s = _raw_link(port, 4242, ATTACKER)
            held.append(s)
        time.sleep(0.3)
        grown = _threads(pid) - threads0
        legit = _legit_link(port, 4243)
        ended = sum(_ended(s) for s in held)
    finally:
        for s in held:
            s.close()
        time.sleep(0.5)
        _raw_unlink(port, 4242, ATTACKER)
    print(f"\nrelinks: {grown} more threads, {ended} connections ended by the victim")
    assert status == Status.LLM_SUCCESS and ended == len(held) - 1  # all but the last link's
    assert grown <= 2 + HANDSHAKE_WORKERS + 8, f"{grown} more threads"  # one link's two
    assert legit is not None


def test_a_reset_before_the_reply_leaves_no_uncounted_entity(
        victim: Victim, victim_proc: PeerProcess) -> None:  # noqa: F811
    """Hellos of 1,000 caches whose connection is reset before the reply is sent: none of them
    leaves an entity the link bounds do not count (at most MAX_LINKS_PER_SOURCE remain)."""
    port = victim.port
    ids = [3_000_000 + i for i in range(3 * MAX_LINKS_PER_SOURCE)]
    for cid in ids:
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(ATTACKER, 0))
        rawpeer.authenticate(s)
        s.sendall(rawpeer.frame(wire.F_HELLO_LINK, rawpeer.hello_link(cid, caches=1000)))
        time.sleep(0.002)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    time.sleep(0.5)
    kept = set(victim.p.entity_keys()) & set(ids)
    for cid in kept:
        _raw_unlink(port, cid, ATTACKER)
    assert len(kept) <= MAX_LINKS_PER_SOURCE, f"{len(kept)} entities kept"


class _Owner:
    """Just what a listener reads of its instance before a hello is complete."""

    cluster_id = 77


def _authenticated(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    rawpeer.authenticate(s)
    return s


def test_an_evicted_hello_is_uncounted_once() -> None:
    """Connection A announces a hello that evicts B's (the biggest, beyond MAX_HELLO_BUFFERED)
    and B sent bytes in the same turn of the listener's loop: B's stale event
    does not subtract its hello a second time, so the count stays the bytes held."""
    owner = _Owner()
    lst = Listener(cast(LinkOwner, owner), "127.0.0.1", 0)
    sel = cast(Any, lst._sel)
    real_select = sel.select
    slow = [False]

    def slow_select(timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if slow[0]:  # the events of what the test sends in between come in one batch
            time.sleep(0.2)
        return cast(list[tuple[selectors.SelectorKey, int]], real_select(timeout))

    sel.select = slow_select
    size = wire.MAX_HELLO
    full = wire.MAX_HELLO_BUFFERED // size
    socks: list[socket.socket] = []
    try:
        for _ in range(3):
            held = [_authenticated(lst.port) for _ in range(full)]
            for h in held:  # MAX_HELLO_BUFFERED is announced: the table is full
                h.sendall(rawpeer.hdr(wire.F_HELLO_LINK, size) + bytes(100))
            a = _authenticated(lst.port)
            socks += [a, *held]
            deadline = time.monotonic() + 5
            while lst._buffered != full * size and time.monotonic() < deadline:
                time.sleep(0.01)
            assert lst._buffered == full * size
            slow[0] = True
            lst._wake()  # the loop starts a slow turn: the events below land in one batch
            time.sleep(0.05)
            a.sendall(rawpeer.hdr(wire.F_HELLO_LINK, size))
            time.sleep(0.01)
            for h in held:  # (the one A evicts among them)
                h.sendall(bytes(100))
            time.sleep(0.4)
            slow[0] = False
            assert lst._buffered == sum(len(h.body) for h in lst._post.items()) == full * size
            for x in (a, *held):  # (the next round starts from nothing held)
                x.close()
            deadline = time.monotonic() + 5
            while lst._buffered and time.monotonic() < deadline:
                time.sleep(0.01)
            assert lst._buffered == 0
    finally:
        for s in socks:
            s.close()
        lst.close()
    del owner


def test_a_worker_that_cannot_start_loses_no_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a handshake worker fails HANDSHAKE_WORKERS times (no thread left): each hello is
    refused (closed by the listener), and once threads can start again a hello is served."""
    fails = [HANDSHAKE_WORKERS]

    class Thread(threading.Thread):
        def start(self) -> None:
            if fails[0]:
                fails[0] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    owner = _Owner()
    gate = HandshakeGate(cast(Callable[[], LinkOwner | None], weakref.ref(owner)),
                         lambda conn: conn.close(), "test")
    monkeypatch.setattr(gate_mod, "threading", types.SimpleNamespace(Thread=Thread))
    session = cast(Session, None)
    pairs = [socket.socketpair() for _ in range(HANDSHAKE_WORKERS + 1)]
    try:
        for ours, _theirs in pairs[:-1]:
            assert not gate.submit(ours, session, 0, bytearray(8), "10.0.0.1")
        del owner  # the instance is gone: a served hello is closed at once
        ours, theirs = pairs[-1]
        assert gate.submit(ours, session, 0, bytearray(8), "10.0.0.1")
        theirs.settimeout(2)
        assert theirs.recv(1) == b""  # served: closed by a worker
    finally:
        gate.close()
        for x, y in pairs:
            x.close()
            y.close()


_EMFILE_CHILD = r"""
import os, resource, socket, threading, time
from kvdd.sim.fabric import samehost
ep = samehost.endpoint()
first, second = (socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2))
for c in (first, second):
    c.settimeout(3)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
hog = []
try:
    while True:
        hog.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
first.connect(ep.name)  # queued: the endpoint's accept fails (EMFILE) until fds are freed
time.sleep(0.2)
for fd in hog:
    os.close(fd)
second.connect(ep.name)
for c in (first, second):  # not a proof: the endpoint closes it after reading it
    c.send(b"not a hello")
    print("closed" if c.recv(64) == b"" else "answered", flush=True)
print(any(t.name == "kvdd-samehost-endpoint" for t in threading.enumerate()))
"""


@pytest.mark.skipif(not samehost.availability()[0], reason=samehost.availability()[1])
def test_the_same_host_endpoint_survives_running_out_of_fds() -> None:
    """Accepts fail with EMFILE for 0.2 s (the process is at RLIMIT_NOFILE): the endpoint keeps
    accepting once fds are free again: both connections, the one queued meanwhile and a new one,
    are read and closed (a connection nobody accepts would wait for the 3 s timeout)."""
    out = subprocess.run([sys.executable, "-c", _EMFILE_CHILD], capture_output=True, text=True,
                         timeout=30, env={**os.environ, "KVDD_SIM_XPROC": "auto"})
    assert out.stdout.split() == ["closed", "closed", "True"], out.stdout + out.stderr


def test_a_full_table_closes_at_accept_what_is_not_a_whole_hello() -> None:
    """The pre-authentication table is full of one address's connections that sent one byte:
    exactly at the bound they are all held; one more from that address that sent one byte is
    closed at accept (nothing evicted), one that sent its whole authentication hello (in one
    write, as every initiator does) is let in (the oldest idle one evicted) and authenticates,
    and one byte from another address (fewer entries) is let in too."""
    owner = _Owner()
    lst = Listener(cast(LinkOwner, owner), "127.0.0.1", 0)
    junk: list[socket.socket] = []

    def one_byte() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", lst.port), timeout=5,
                                     source_address=(ATTACKER, 0))
        s.send(b"K")
        junk.append(s)
        return s

    try:
        for _ in range(wire.MAX_PREAUTH):
            one_byte()
        deadline = time.monotonic() + 5
        while len(lst._pre) < wire.MAX_PREAUTH and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lst._pre) == wire.MAX_PREAUTH and lst.dropped == 0
        oldest = lst._pre.oldest()
        late = one_byte()  # one past the bound, without a whole hello
        late.settimeout(2)
        assert late.recv(1) == b""  # closed at once
        assert lst.dropped == 1 and lst._pre.oldest() is oldest
        with socket.create_connection(("127.0.0.1", lst.port), timeout=5,
                                      source_address=(ATTACKER, 0)) as legit:
            rawpeer.authenticate(legit)  # its hello evicted the oldest idle connection
        assert lst._pre.oldest() is not oldest and lst.dropped == 1
        one_byte()  # (the authenticated one left the table: full again)
        deadline = time.monotonic() + 5
        while len(lst._pre) < wire.MAX_PREAUTH and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lst._pre) == wire.MAX_PREAUTH and lst.dropped == 1
        other = socket.create_connection(("127.0.0.1", lst.port), timeout=5,
                                         source_address=("127.0.0.3", 0))
        junk.append(other)
        other.send(b"K")  # from an address with fewer entries: let in (evicting the flood's)
        deadline = time.monotonic() + 5
        while not lst._pre.count("127.0.0.3") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lst._pre.count("127.0.0.3") == 1 and lst.dropped == 1
        assert len(lst._pre) == wire.MAX_PREAUTH
        # exactly a header of another protocol version, from the largest address: let in and
        # answered with the version refusal; one byte less is no whole header: closed at accept
        head = bytearray(rawpeer.frame(wire.F_AUTH_HELLO, b"")[:wire.HDR.size])
        head[2] = (wire.PROTOCOL_VERSION + 1) & 0xFF
        with socket.create_connection(("127.0.0.1", lst.port), timeout=5,
                                      source_address=(ATTACKER, 0)) as newer:
            newer.sendall(bytes(head))
            newer.settimeout(5)
            assert newer.recv(1 << 16).startswith(bytes(head[:3]))  # the refusal, its version
        assert lst.dropped == 1
        one_byte()  # (the refused one left the table: full again)
        deadline = time.monotonic() + 5
        while len(lst._pre) < wire.MAX_PREAUTH and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(lst._pre) == wire.MAX_PREAUTH
        with socket.create_connection(("127.0.0.1", lst.port), timeout=5,
                                      source_address=(ATTACKER, 0)) as short:
            short.sendall(bytes(head[:-1]))
            short.settimeout(1)
            assert short.recv(1) == b""
        assert lst.dropped == 2
    finally:
        for s in junk:
            s.close()
        lst.close()
    del owner


def _idle_gate(monkeypatch: pytest.MonkeyPatch) -> tuple[HandshakeGate, _Owner]:
    """A gate whose handshake workers are all busy: the hellos submitted to it wait."""

    class BusyWorker(threading.Thread):
        def start(self) -> None:  # started, but never takes a hello
            pass

    owner = _Owner()
    gate = HandshakeGate(cast(Callable[[], LinkOwner | None], weakref.ref(owner)),
                         lambda conn: conn.close(), "test")
    monkeypatch.setattr(gate_mod, "threading", types.SimpleNamespace(Thread=BusyWorker))
    return gate, owner


def test_hellos_waiting_from_one_address_stop_exactly_at_their_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_QUEUED_HELLOS_PER_SOURCE hellos of one address wait for the busy workers; the next
    one from that address is refused (the listener closes it), another address's is not."""
    gate, _owner = _idle_gate(monkeypatch)
    session = cast(Session, None)
    pairs = [socket.socketpair() for _ in range(wire.MAX_QUEUED_HELLOS_PER_SOURCE + 2)]
    try:
        for ours, _theirs in pairs[:wire.MAX_QUEUED_HELLOS_PER_SOURCE]:
            assert gate.submit(ours, session, wire.F_HELLO_LINK, bytearray(8), "10.0.0.1")
        assert not gate.submit(pairs[-2][0], session, wire.F_HELLO_LINK, bytearray(8), "10.0.0.1")
        assert gate.submit(pairs[-1][0], session, wire.F_HELLO_LINK, bytearray(8), "10.0.0.2")
    finally:
        gate.close()
        for x, y in pairs:
            x.close()
            y.close()


def test_linked_caches_of_all_addresses_stop_exactly_at_the_global_cap() -> None:
    """The tables of the links from every address hold at most MAX_LINKED_CACHES caches in all
    (4 addresses at their own cap reach it exactly): one cache more from a fifth address is
    refused with the bound named, and fits again once a link's table is given back."""
    owner = _Owner()
    gate = HandshakeGate(cast(Callable[[], LinkOwner | None], weakref.ref(owner)),
                         lambda conn: conn.close(), "test")
    per_source = wire.MAX_LINKED_CACHES_PER_SOURCE
    sources = wire.MAX_LINKED_CACHES // per_source
    assert sources * per_source == wire.MAX_LINKED_CACHES  # exactly at the cap, no remainder
    tickets = []
    for i in range(sources):
        ticket = gate_mod.Ticket(gate, f"10.0.0.{i + 1}")
        assert ticket.reserve(5000 + i) is None
        assert ticket.charge(per_source) is None
        tickets.append(ticket)
    late = gate_mod.Ticket(gate, "10.0.1.1")
    assert late.reserve(6000) is None
    why = late.charge(1)
    assert why is not None
    assert f"{per_source} caches and {wire.MAX_LINKED_CACHES} in all" in why
    assert why.endswith("this link's table has 1")
    tickets[0].cancel()  # a link that was not made gives its table's count back
    assert late.charge(1) is None
    late.cancel()
    for ticket in tickets[1:]:
        ticket.cancel()
    assert gate.links() == 0
