"""Sessions bound to this process's same-host endpoint (:mod:`kvdd.sim.fabric.samehost_endpoint`),
for the tests that play a hostile initiator against it: a session, the endpoint's calls back for
it, and waits on what the endpoint holds."""

from __future__ import annotations

import secrets
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from kvdd.sim.fabric import samehost, samehost_endpoint
from kvdd.sim.fabric.samehost_path import new_table_fd


@dataclass(frozen=True)
class Session:
    key: bytes
    transcript: bytes
    channel: bytes = b""
    initiator: bool = False


def new_session() -> Session:
    return Session(secrets.token_bytes(32), secrets.token_bytes(32))


class Calls:
    """The endpoint's calls back for one session: the tables it made, the links it told of."""

    def __init__(self) -> None:
        self.tables = 0
        self.proven = 0
        self.links: list[tuple[int, int] | None] = []  # (peer pid, its table's slots) or None
        self.told = threading.Event()

    def make_table(self) -> tuple[int, int]:
        self.tables += 1
        return new_table_fd(1), 1

    def on_proven(self, link: samehost.SameHostLink) -> bool:
        self.proven += 1
        return True

    def on_link(self, link: samehost.SameHostLink | None) -> None:
        self.links.append(None if link is None else (link.peer_pid, link.table_slots))
        if link is not None:
            link.close()
        self.told.set()


def bound_session(ep: samehost_endpoint.Endpoint) -> tuple[Session, Calls]:
    """A session the endpoint expects, bound to fresh :class:`Calls`."""
    s = new_session()
    assert ep.expect(s)
    calls = Calls()
    assert ep.bind(s, calls.make_table, calls.on_proven, calls.on_link)
    return s, calls


def emptied_endpoint(*, proven: bool) -> samehost_endpoint.Endpoint:
    """This process's endpoint once it holds no session and no proof connection (and, with
    ``proven``, no proven session): sessions other tests left are dropped by an expect() once
    expired; this waits for that (at most PENDING_TTL_S)."""
    ep = samehost.endpoint()
    deadline = time.monotonic() + samehost_endpoint.PENDING_TTL_S + 5
    while True:
        probe = new_session()
        if ep.expect(probe):  # (drops the expired ones)
            ep.abandon(probe)
        held = ep.held()
        if held["pending"] == 0 and held["proving"] == 0 and not (proven and held["proven"]):
            return ep
        assert time.monotonic() < deadline, held
        time.sleep(0.1)


def settled(ep: samehost_endpoint.Endpoint, pending: int, proving: int,
            proven: int | None = 0) -> None:
    """Wait (at most 5 s) until the endpoint holds that many sessions, proof connections and
    proven sessions (``proven`` None: any number)."""
    def now() -> tuple[int, int, int | None]:
        held = ep.held()
        return held["pending"], held["proving"], None if proven is None else held["proven"]

    deadline = time.monotonic() + 5
    while now() != (pending, proving, proven):
        assert time.monotonic() < deadline, ep.held()
        time.sleep(0.005)


class InitiatorProcess:
    """A hostile initiator's script in its own process: one command a line, one answer a line,
    each answer within ``ANSWER_S``."""

    ANSWER_S = 15.0

    def __init__(self, script: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, *words: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(words) + "\n")
        self.proc.stdin.flush()
        ready = select.select([self.proc.stdout], [], [], self.ANSWER_S)[0]
        assert ready, f"no answer to {words[0]} within {self.ANSWER_S:.0f} s"
        return self.proc.stdout.readline().split()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)
