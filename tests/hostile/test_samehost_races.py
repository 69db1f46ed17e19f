"""Unregister, unlink and finalize racing same-host copies from a reader in another process
(kvdd.sim.fabric.samehost_path.ServedTable against OneSidedPeer): once the owner's call returned,
no byte is written into the cache and none read out of it.

The reader loops 1 MiB pulls or pushes (one system call each, or one copy-kernel call when the
cache lives in kvdd.empty memory, which the reader maps) as fast as it can; the owner removes
the cache (or the whole link) while they run, then at once fills the memory with a marker and
watches it: a push landing later would change it, a pull reading later would carry the marker
into the reader's destination."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvdd
from kvdd import Status
from kvdd._native import _xproc
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.samehost_path import STATE_CLOSED, STATE_FINALIZED, ServedTable
from shared_support import FakeServedCache as _Entry

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

N = 1 << 20
MARK = 0xEE

# The reader: copies (cache 3, 1 MiB at the owner's address) until "stop", then reports
# "<successes> <refusals> <pulls that carried the marker> <last status>".
_READER = r"""
import os, sys, threading, numpy as np
from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.samehost_path import OneSidedPeer
from kvdd.sim.fabric.protocol import RemoteCache
owner, fd, addr, n, write = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                             int(sys.argv[4]), sys.argv[5] == "1")
r = OneSidedPeer(samehost.SameHostLink(owner, os.getuid(), _xproc.pidfd_open(owner), fd, 1))
rc = RemoteCache(3, 1, n, 1, n, False, 3)
buf = np.full(n, 0xAB, np.uint8); z = np.array([0], np.int64); ln = np.array([n], np.int64)
print(os.getpid(), int(r.maps is not None), flush=True); sys.stdin.readline()
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
ok = refused = marked = 0
last = 0
while not stop.is_set():
    got = r.acquire(rc, (addr,), 5000)
    if got is None or got[0] != 0:
        refused += 1
        last = -1 if got is None else got[0]
        continue
    if not write:
        buf[:] = 0
    st = r.move(got[1], [0], [Region(int(buf.ctypes.data), n, buf)], z, z, ln, write)
    r.release(got[1])
    last = st
    if st == 0:
        ok += 1
    if not write and (buf == 0xEE).any():
        marked += 1
print(ok, refused, marked, last, flush=True)
"""


@pytest.mark.parametrize("alloc", ["numpy", "shm"])
@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("removal", ["unregister", "unlink", "finalize"])
def test_nothing_moves_after_removal_returns(removal: str, write: bool, alloc: str) -> None:
    """``alloc``: the cache in numpy memory (copies through /proc/<pid>/mem) or in kvdd.empty
    memory (mapped by the reader)."""
    arena = kvdd.empty(N, np.uint8) if alloc == "shm" else np.empty(N, np.uint8)
    arena[:] = 0x11
    entry = _Entry(3, (int(arena.ctypes.data),), N)
    served = ServedTable({3: entry})  # type: ignore[dict-item]
    served.announce()
    fd, _slots = served.take_fd()
    p = subprocess.Popen([sys.executable, "-c", _READER, str(os.getpid()), str(fd),
                          str(int(arena.ctypes.data)), str(N), "1" if write else "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=[fd])
    try:
        assert p.stdout is not None and p.stdin is not None
        rpid, mapped = (int(x) for x in p.stdout.readline().split())
        assert mapped == (alloc == "shm")
        served.attach(samehost.SameHostLink(rpid, os.getuid(), _xproc.pidfd_open(rpid)), 5000)
        p.stdin.write("go\n")
        p.stdin.flush()
        deadline = time.monotonic() + 10
        while not (arena == 0xAB).any() if write else served.table.inflight(0) == 0:
            assert time.monotonic() < deadline, "the reader never copied"
            time.sleep(0.0005)
        t0 = time.monotonic()
        if removal == "unregister":
            entry.unregister()
        else:
            served.close(STATE_CLOSED if removal == "unlink" else STATE_FINALIZED)
        took = time.monotonic() - t0
        arena[:] = MARK  # the owner reuses the memory at once
        time.sleep(0.3)  # the reader keeps trying meanwhile
        unchanged = bool((arena == MARK).all())
        p.stdin.write("stop\n")
        p.stdin.flush()
        ok, refused, marked, last = (int(x) for x in p.stdout.readline().split())
        p.wait(10)
        assert unchanged  # no byte written after the removal returned
        assert marked == 0  # no byte read after it
        assert ok > 0 and refused > 0  # copies ran before, none was admitted after
        assert last in (-1, Status.LLM_KV_CACHE_NOT_EXIST)
        assert took < 1.1  # an honest reader's copy ends quickly: no abort needed
    finally:
        p.kill()
        p.wait()
        served.close()
        os.close(fd)


def test_closing_the_link_path_revokes_the_table_it_serves() -> None:
    """Unlink of this side closes the link's data path, and with it the table through which the
    peer reads our caches: no copy of the peer's starts after that (a peer that keeps its own
    entity, e.g. after a force unlink here, is refused one-sided access)."""
    from kvdd.sim.fabric.samehost_link import SameHostPath
    entry = _Entry(3)
    served = ServedTable({3: entry})  # type: ignore[dict-item]
    fd, _slots = served.take_fd()
    try:
        path = SameHostPath()
        path.serve(served)
        assert served.table.state(-1) == 0 and not served.closed
        path.close()
        assert served.table.state(-1) == STATE_CLOSED and served.closed
        late = ServedTable({3: _Entry(3)})
        path.serve(late)  # served after the close: closed at once
        assert late.table.state(-1) == STATE_CLOSED  # (its fd closed with it)
    finally:
        os.close(fd)
