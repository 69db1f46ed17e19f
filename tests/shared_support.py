"""Test helpers shared across the suites (``tests/`` is on ``sys.path`` through its conftest):
a served cache as the fabric sees it, and a check run in a forked child."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["FakeServedCache", "in_a_forked_child", "passes_in_a_forked_child"]

R = TypeVar("R")


@dataclass(eq=False)
class FakeServedCache:
    """A registered cache as the fabric sees it (``kvdd.sim.fabric.protocol.ServedCache``): it
    counts acquisitions and releases, keeps the drains added to it and runs them on
    :meth:`unregister`, after which it refuses new leases and drains (``registered`` False).

    Equality is identity (``eq=False``), like a real entry's."""

    cache_id: int = 0
    addrs: tuple[int, ...] = ()
    T: int = 0  # bytes per tensor
    registered: bool = True
    drains: list[Callable[[], None]] = field(default_factory=list)
    acquired: int = 0
    releases: int = 0

    def acquire(self) -> bool:
        self.acquired += 1
        return self.registered

    def release(self) -> None:
        self.releases += 1

    def add_drain(self, fn: Callable[[], None]) -> bool:
        if not self.registered:
            return False
        self.drains.append(fn)
        return True

    def remove_drain(self, fn: Callable[[], None]) -> None:
        self.drains.remove(fn)

    def unregister(self) -> None:
        self.registered = False
        for fn in list(self.drains):
            fn()


def in_a_forked_child(fn: Callable[[], R]) -> R:
    """Run ``fn`` in a forked child and return what it returned (pickled back through a pipe).

    The child leaves with ``os._exit`` (no atexit, no pytest teardown); an exception in it, or a
    child that dies before reporting, fails the calling test with what happened."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(r)
            try:
                report = pickle.dumps((True, fn()))
            except BaseException as exc:  # reported to the parent, which fails the test
                report = pickle.dumps((False, f"{type(exc).__name__}: {exc}"))
            with os.fdopen(w, "wb") as out:
                out.write(report)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as inp:
        report = inp.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and report, f"the forked child: status {status}"
    ok, value = pickle.loads(report)
    assert ok, f"the forked child raised {value}"
    return value  # type: ignore[no-any-return]


def passes_in_a_forked_child(check: Callable[[], bool]) -> None:
    """Run ``check`` in a forked child: it must return True (False or an exception fails)."""
    assert in_a_forked_child(check), "the check returned False in the forked child"
