"""The one-sided same-host path's lease table against hostile and dying peers
(kvdd.sim.fabric.samehost_path): removal waits for copies (SEMANTICS.md §10 rule 5), a dead reader
releases at once, garbage in the shared table is survived and never moves a byte outside the
registered caches."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvdd import Status
from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.protocol import RemoteCache
from kvdd.sim.fabric.samehost_path import (STATE_CLOSED, STATE_UNREGISTERED, OneSidedLease,
                                           OneSidedPeer, ServedTable)
from kvdd.sim.fabric.wire import MAX_LEASE_MS
from shared_support import FakeServedCache

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

GUARD = 4096
T = 8192


class FakeEntry(FakeServedCache):
    """A registered cache in ``arena``, ``GUARD`` bytes in (kvdd.sim.fabric.protocol.ServedCache)."""

    def __init__(self, cache_id: int, arena: np.ndarray) -> None:
        super().__init__(cache_id)
        self.arena = arena

    @property
    def addr(self) -> int:
        return int(self.arena.ctypes.data) + GUARD


def _arena(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, GUARD + T + GUARD, dtype=np.uint8)


@dataclass
class Pair:
    """Owner and reader of one link's table, both in this process (the reader's "peer" is this
    process: process_vm on itself), plus the fd for scribbling."""

    entries: list[FakeEntry]
    served: ServedTable
    reader: OneSidedPeer
    snapshot: dict[int, RemoteCache]
    fd: int


def _pair(reader_pid: int | None = None, wait_ms: int = 5000, cap_ms: int = 60_000) -> Pair:
    entries = [FakeEntry(cid, _arena(cid)) for cid in (3, 5)]
    served = ServedTable({e.cache_id: e for e in entries}, cap_ms)  # type: ignore[misc]
    fd, slots = served.take_fd()
    keep = os.dup(fd)
    me = _xproc.pidfd_open(reader_pid or os.getpid())
    owner_link = samehost.SameHostLink(reader_pid or os.getpid(), os.getuid(), me)
    served.attach(owner_link, wait_ms)
    reader_link = samehost.SameHostLink(os.getpid(), os.getuid(), _xproc.pidfd_open(os.getpid()),
                                        fd, slots)
    snapshot = {e.cache_id: RemoteCache(e.cache_id, 1, T, 1, T, False, e.cache_id)
                for e in entries}
    reader = OneSidedPeer(reader_link)
    return Pair(entries, served, reader, snapshot, keep)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = _pair()
    yield p
    p.served.close()
    os.close(p.fd)


def _addrs(p: Pair, cid: int) -> tuple[int, ...]:
    return next((e.addr,) for e in p.entries if e.cache_id == cid)


def _pull(p: Pair, cid: int, dst: np.ndarray, nbytes: int = T) -> int:
    got = p.reader.acquire(p.snapshot[cid], _addrs(p, cid), 5000)
    if got is None:
        return -1  # not served by this path (TCP would carry it)
    status, lease = got
    if status != Status.LLM_SUCCESS:
        return int(status)
    assert isinstance(lease, OneSidedLease)
    try:
        region = Region(int(dst.ctypes.data) + GUARD, T, dst)
        one = np.array([0], np.int64)
        st = p.reader.move(lease, [0], [region], one, one, np.array([nbytes], np.int64), False)
        assert st is not None
        return st
    finally:
        p.reader.release(lease)


def test_one_sided_pull_moves_exactly_the_cache(pair: Pair) -> None:
    dst = _arena(99)
    before = dst.copy()
    assert _pull(pair, 5, dst) == Status.LLM_SUCCESS
    src = pair.entries[1].arena
    assert np.array_equal(dst[GUARD:GUARD + T], src[GUARD:GUARD + T])
    assert np.array_equal(dst[:GUARD], before[:GUARD]) and np.array_equal(dst[-GUARD:], before[-GUARD:])
    assert pair.served.table.inflight(0) == 0 and pair.served.table.inflight(1) == 0


def test_unregister_waits_for_a_running_copy_then_refuses(pair: Pair) -> None:
    got = pair.reader.acquire(pair.snapshot[3], _addrs(pair, 3), 5000)
    assert got is not None
    status, lease = got
    assert status == Status.LLM_SUCCESS and isinstance(lease, OneSidedLease)
    done = threading.Event()

    def unregister() -> None:
        pair.entries[0].unregister()
        done.set()

    t = threading.Thread(target=unregister)
    t.start()
    assert not done.wait(0.3)  # the copy's lease holds the owner's unregister
    pair.reader.release(lease)
    assert done.wait(5)
    t.join()
    dst = _arena(7)
    before = dst.copy()
    assert _pull(pair, 3, dst) == Status.LLM_KV_CACHE_NOT_EXIST  # no new copy starts
    assert np.array_equal(dst, before)
    assert _pull(pair, 5, dst) == Status.LLM_SUCCESS  # the other cache is untouched by it


def test_a_dead_reader_releases_at_once() -> None:
    """The reader process enters a slot and dies: the owner's unregister returns at once."""
    entries = [FakeEntry(1, _arena(1))]
    served = ServedTable({1: entries[0]})  # type: ignore[dict-item]
    fd, _slots = served.take_fd()
    code = ("import sys, time; from kvdd._native import _xproc\n"
            "t = _xproc.LeaseTable(int(sys.argv[1]), 1)\nassert t.enter(0) == 0\n"
            "print('in', flush=True)\ntime.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(fd)], pass_fds=(fd,),
                             stdout=subprocess.PIPE, text=True)
    os.close(fd)
    try:
        served.attach(samehost.SameHostLink(child.pid, os.getuid(), _xproc.pidfd_open(child.pid)),
                      60_000)
        assert child.stdout is not None and child.stdout.readline().strip() == "in"
        assert served.table.inflight(0) == 1
        child.kill()
        child.wait()
        t0 = time.monotonic()
        entries[0].unregister()
        assert time.monotonic() - t0 < 1.0
        assert served.table.state(0) == STATE_UNREGISTERED
    finally:
        child.kill()
        served.close()


def test_scribbled_table_is_survived_and_bounded() -> None:
    """A peer writes garbage over the whole table: the reader's copies stay inside the registered
    caches (or are refused), the owner's unregister returns within the owner's cap on waiting for
    a living reader (shortened here to 100 ms) plus the grace, then the link's one-sided access is
    closed for good."""
    p = _pair(wait_ms=100, cap_ms=100)
    try:
        m = mmap.mmap(p.fd, _xproc.LEASE_HEADER + 2 * _xproc.LEASE_SLOT)
        rng = np.random.default_rng(11)
        seen = set()
        for trial in range(20):
            m[:] = rng.integers(0, 256, len(m), dtype=np.uint8).tobytes()
            if trial < 6:  # plausible first: both state words zero, the count anything
                m[16:24] = bytes(8)
                m[72:80] = bytes(8)
            dst = _arena(200 + trial)
            before = dst.copy()
            st = _pull(p, 3, dst)
            seen.add(int(st))
            # success, not found, or "not this path" (-1: the reader now leaves the link to TCP)
            assert st in (Status.LLM_SUCCESS, Status.LLM_KV_CACHE_NOT_EXIST, -1)
            assert np.array_equal(dst[:GUARD], before[:GUARD])
            assert np.array_equal(dst[-GUARD:], before[-GUARD:])
            if st == Status.LLM_SUCCESS:
                assert np.array_equal(dst[GUARD:-GUARD], p.entries[0].arena[GUARD:-GUARD])
            else:
                assert np.array_equal(dst, before)
        assert Status.LLM_SUCCESS in seen and len(seen) >= 2
        m[:] = b"\xff" * len(m)  # every count nonzero for good
        m.close()
        t0 = time.monotonic()
        p.entries[1].unregister()
        took = time.monotonic() - t0
        assert 0.09 < took < 0.35 + 1.0  # the cap (100 ms) + 250 ms, with an abort: bounded
        assert p.served.table.state(-1) == STATE_CLOSED
    finally:
        p.served.close()
        os.close(p.fd)


def test_bad_tables_are_refused_before_use() -> None:
    """A table that is not a sealed memfd of the announced size, or has another header, is not
    mapped: that link uses TCP."""
    pid = os.getpid()
    snapshot = {1: RemoteCache(1, 1, T, 1, T, False, 1)}
    unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, _xproc.LEASE_HEADER + _xproc.LEASE_SLOT)
    link = samehost.SameHostLink(pid, os.getuid(), _xproc.pidfd_open(pid), unsealed, 1)
    with pytest.raises(samehost.SameHostRefused, match="sealed"):
        OneSidedPeer(link)
    link.close()
    from kvdd.sim.fabric.samehost_path import new_table_fd
    blank = new_table_fd(1)  # sealed, right size, but no header (never initialized)
    link = samehost.SameHostLink(pid, os.getuid(), _xproc.pidfd_open(pid), blank, 1)
    with pytest.raises(samehost.SameHostRefused, match="header"):
        OneSidedPeer(link)
    link.close()
    link = samehost.SameHostLink(pid, os.getuid(), _xproc.pidfd_open(pid), new_table_fd(2), 1)
    with pytest.raises(samehost.SameHostRefused, match="sealed"):
        OneSidedPeer(link)  # a table of 2 slots announced as 1: wrong size
    link.close()
    # labels: a cache the owner's table does not name (or names twice) is not served one-sided
    entries = {cid: FakeEntry(cid, _arena(cid)) for cid in (4, 6)}
    served = ServedTable(entries)  # type: ignore[arg-type]
    fd, slots = served.take_fd()
    served.table.store(1, 2, 4)  # now "4" twice, "6" nowhere
    reader = OneSidedPeer(samehost.SameHostLink(pid, os.getuid(), _xproc.pidfd_open(pid), fd, 2))
    for cid in (4, 6, 7):
        rc = RemoteCache(cid, 1, T, 1, T, False, cid)
        assert reader.acquire(rc, (entries[cid if cid in entries else 4].addr,), 1000) is None
    assert snapshot  # (the 1-cache snapshot above is what a reader would hold)
    served.close()


def test_pid_reuse_is_guarded_by_the_pidfd(pair: Pair) -> None:
    """The link's pid now names another process (here: stand-in, this process) but the pidfd held
    since the proof says the attested process exited: the reader never opens that pid's memory
    (no path: TCP), so no byte is read or written."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = _xproc.pidfd_open(child.pid)
    child.wait()
    reused = samehost.SameHostLink(os.getpid(), os.getuid(), dead, os.dup(pair.fd), 2)
    with pytest.raises(samehost.SameHostRefused, match="exited"):
        OneSidedPeer(reused)  # the pid is "alive" (ours): only the pidfd knows better
    assert reused.mem_fd == -1
    reused.close()


def test_a_closed_table_sends_the_reader_to_tcp(pair: Pair) -> None:
    """The owner drops a link's table (unlink, eviction, a stuck reader): no new one-sided copy;
    the reader's acquire answers None (use TCP) instead of failing the transfer."""
    assert _pull(pair, 3, _arena(1)) == Status.LLM_SUCCESS
    pair.served.close()
    assert _pull(pair, 3, _arena(2)) == -1 and _pull(pair, 5, _arena(3)) == -1


def test_a_lease_hog_cannot_hold_unregister() -> None:
    """A living reader that announced a 10-minute wait and keeps a slot counted forever: the
    owner's unregister aborts it after DRAIN_PATIENCE_MS, waits for the still-counted living
    reader (§10 rule 5) up to the owner's cap (60 s; shortened to 2 s here) + grace, and returns;
    the link's one-sided access is closed for good (capped reader waits, no copy past a deadline)."""
    from kvdd.sim.fabric.samehost_path import DRAIN_GRACE_MS
    entries = [FakeEntry(1, _arena(1))]
    served = ServedTable({1: entries[0]}, 2000)  # type: ignore[dict-item]
    fd, _slots = served.take_fd()
    code = ("import sys, time; from kvdd._native import _xproc\n"
            "t = _xproc.LeaseTable(int(sys.argv[1]), 1)\nassert t.enter(0) == 0\n"
            "print('in', flush=True)\ntime.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(fd)], pass_fds=(fd,),
                             stdout=subprocess.PIPE, text=True)
    os.close(fd)
    try:
        served.attach(samehost.SameHostLink(child.pid, os.getuid(), _xproc.pidfd_open(child.pid)),
                      600_000)
        assert child.stdout is not None and child.stdout.readline().strip() == "in"
        t0 = time.monotonic()
        entries[0].unregister()
        took = time.monotonic() - t0
        assert (2000 + DRAIN_GRACE_MS) / 1e3 * 0.9 < took < 5.0
        assert served.table.state(-1) == STATE_CLOSED and child.poll() is None
    finally:
        child.kill()
        child.wait()
        served.close()


def test_a_zero_wait_times_out_before_the_table_is_read(pair: Pair) -> None:
    """SEMANTICS.md §10 rule 9 as over TCP: a 0 ms wait is LLM_TIMEOUT whatever the cache's slot
    says (registered or not), and enters no slot; 1 ms reads the slot."""
    cid = 3
    assert pair.reader.acquire(pair.snapshot[cid], _addrs(pair, cid), 0) == (Status.LLM_TIMEOUT, None)
    pair.entries[0].unregister()
    assert pair.reader.acquire(pair.snapshot[cid], _addrs(pair, cid), 0) == (Status.LLM_TIMEOUT, None)
    assert pair.reader.acquire(pair.snapshot[cid], _addrs(pair, cid), 1) == (
        Status.LLM_KV_CACHE_NOT_EXIST, None)
    assert pair.served.table.inflight(0) == 0


@pytest.mark.parametrize("wait_ms", [MAX_LEASE_MS - 1, MAX_LEASE_MS, MAX_LEASE_MS + 1, 0x7FFFFFFF])
def test_a_lease_lives_at_most_the_owners_cap(pair: Pair, wait_ms: int) -> None:
    """The reader's lease deadline is min(its wait, MAX_LEASE_MS): the owner waits no longer for
    it (TCP leases have the same cap)."""
    t0 = time.monotonic()
    got = pair.reader.acquire(pair.snapshot[5], _addrs(pair, 5), wait_ms)
    t1 = time.monotonic()
    assert got is not None and got[0] == Status.LLM_SUCCESS
    lease = got[1]
    assert isinstance(lease, OneSidedLease)
    try:
        limit = min(wait_ms, MAX_LEASE_MS) / 1000.0
        assert t0 + limit <= lease.deadline <= t1 + limit
    finally:
        pair.reader.release(lease)
