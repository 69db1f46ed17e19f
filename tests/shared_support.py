"""Test helpers shared across the suites (``tests/`` is on ``sys.path`` through its conftest):
a served cache as the fabric sees it, a check run in a forked child, and an owner process whose
cache lives in ``kvdd.empty`` memory."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["FakeServedCache", "in_a_forked_child", "owner_pattern", "passes_in_a_forked_child",
           "shm_owner"]

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
    drains: list[Callable[[], object]] = field(default_factory=list)
    acquired: int = 0
    releases: int = 0

    def acquire(self) -> bool:
        self.acquired += 1
        return self.registered

    def release(self) -> None:
        self.releases += 1

    def add_drain(self, fn: Callable[[], object]) -> bool:
        if not self.registered:
            return False
        self.drains.append(fn)
        return True

    def remove_drain(self, fn: Callable[[], object]) -> None:
        self.drains.remove(fn)

    def unregister(self) -> None:
        self.registered = False
        waits = [w for w in (fn() for fn in list(self.drains)) if callable(w)]
        start = time.monotonic()
        for w in waits:
            w(start)


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


_SHM_OWNER = r"""
import sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
n = int(sys.argv[1])
a = kvdd.empty(n, np.uint8)
a[:] = np.arange(n) % 251
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, n)), tensor_addrs([a]))
print(dd.listening_port, cid, flush=True)
sys.stdin.readline()
dd.finalize()
"""


def owner_pattern(n: int) -> npt.NDArray[np.uint8]:
    """The bytes :func:`shm_owner`'s cache holds: ``np.arange(n) % 251`` as uint8."""
    return (np.arange(n) % 251).astype(np.uint8)


@contextmanager
def shm_owner(n: int) -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """An instance (cluster 1) in another process owning one ``[1, n]`` uint8 cache in
    ``kvdd.empty`` memory (:func:`owner_pattern`): ``(process, its port, the cache id)``.  Asked
    to finalize on the way out; killed if it does not within 30 s (or was killed already)."""
    p = subprocess.Popen([sys.executable, "-c", _SHM_OWNER, str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdin is not None
    try:
        port, cid = (int(x) for x in p.stdout.readline().split())
        yield p, port, cid
    finally:
        try:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait(10)
