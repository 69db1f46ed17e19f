"""The native pieces of the same-host path (kvdd._native._xproc): pidfds, SO_PEERCRED, the shared
lease table's atomics, and pvm_copy's pidfd guard."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvdd._native import _xproc
from kvdd._native._copy import Region


def _table_fd(slots: int) -> int:
    fd = os.memfd_create("kvdd-test-leases", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, _xproc.LEASE_HEADER + slots * _xproc.LEASE_SLOT)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def test_pidfd_tracks_one_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        fd = _xproc.pidfd_open(child.pid)
        try:
            assert _xproc.pidfd_alive(fd)
            child.kill()
            child.wait()
            assert not _xproc.pidfd_alive(fd)  # reaped: exited for good, whoever gets the pid next
        finally:
            os.close(fd)
    finally:
        child.kill()
    with pytest.raises(ProcessLookupError):
        _xproc.pidfd_open(child.pid)
    with pytest.raises(ValueError):
        _xproc.pidfd_open(0)
    r, w = os.pipe()
    try:  # not a pidfd: a pipe with nothing to read is "alive"; one with data or EOF is not
        os.close(w)
        assert not _xproc.pidfd_alive(r)
    finally:
        os.close(r)


def test_peer_cred_is_the_kernels_word() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert _xproc.peer_cred(a.fileno()) == (os.getpid(), os.getuid(), os.getgid())
    # across processes: the listener reads the pid of the process that connected
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = b"\0kvdd-test-cred-%d" % os.getpid()
    srv.bind(name)
    srv.listen(1)
    code = f"import socket,time; s=socket.socket(socket.AF_UNIX); s.connect({name!r}); s.recv(1)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        conn, _ = srv.accept()
        with conn:
            pid, uid, _gid = _xproc.peer_cred(conn.fileno())
            assert (pid, uid) == (child.pid, os.getuid())
            conn.sendall(b"x")
    finally:
        child.wait(10)
        srv.close()
    with pytest.raises(OSError):
        _xproc.peer_cred(os.open("/dev/null", os.O_RDONLY))


def test_lease_table_counts_and_states() -> None:
    fd = _table_fd(3)
    try:
        owner = _xproc.LeaseTable(fd, 3, True)
        reader = _xproc.LeaseTable(fd, 3)
    finally:
        os.close(fd)  # the mappings keep the memory
    assert reader.header() == (_xproc.LEASE_MAGIC, 3, 0)
    assert reader.enter(1) == 0 and reader.enter(1) == 0
    assert owner.inflight(1) == 2 and owner.inflight(0) == 0
    assert owner.wait_idle(1, 0) == 2  # busy: the deadline passes
    assert owner.wait_idle(0, 0) == 0
    owner.revoke(1, 7)
    assert reader.enter(1) == 7 and owner.inflight(1) == 2  # refused, the count undone
    reader.leave(1)
    reader.leave(1)
    assert owner.wait_idle(1, 0) == 0 and owner.wait_idle(None, 0) == 0
    owner.revoke(-1, 3)  # the whole link
    assert reader.enter(0) == 3 and reader.state(-1) == 3 and owner.inflight(0) == 0
    assert owner.compare_exchange(2, 1, 0, 5) and not owner.compare_exchange(2, 1, 0, 6)
    assert reader.state(2) == 5
    for bad in (-2, 3, 1 << 40):
        with pytest.raises((IndexError, OverflowError)):
            reader.enter(bad)
    with pytest.raises(ValueError):
        _xproc.LeaseTable(-1, _xproc.LEASE_MAX_SLOTS + 1)
    reader.close()
    with pytest.raises(ValueError):
        reader.enter(0)


def test_lease_table_wait_wakes_on_leave_and_on_reader_death() -> None:
    fd = _table_fd(1)
    try:
        owner = _xproc.LeaseTable(fd, 1, True)
        reader = _xproc.LeaseTable(fd, 1)
    finally:
        os.close(fd)
    assert reader.enter(0) == 0
    threading.Timer(0.05, reader.leave, (0,)).start()
    t0 = time.monotonic()
    assert owner.wait_idle(0, 5000) == 0
    assert time.monotonic() - t0 < 2.0
    # garbage in the counter: waits exactly until the deadline, never past it
    assert owner.compare_exchange(0, 0, 0, 0xFFFF_FFFF_0000_0001)
    t0 = time.monotonic()
    assert owner.wait_idle(0, 100) == 2
    assert 0.09 < time.monotonic() - t0 < 2.0
    # a dead reader: its counts are void at once
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pfd = _xproc.pidfd_open(child.pid)
    try:
        child.wait()
        t0 = time.monotonic()
        assert owner.wait_idle(0, 10_000, pfd) == 1
        assert time.monotonic() - t0 < 1.0
    finally:
        os.close(pfd)


def test_lease_table_atomic_under_contention() -> None:
    """Two processes hammer one counter: every increment and decrement is seen."""
    fd = _table_fd(1)
    try:
        owner = _xproc.LeaseTable(fd, 1, True)
        code = ("import os,sys; from kvdd._native import _xproc; "
                "t=_xproc.LeaseTable(int(sys.argv[1]), 1)\n"
                "for _ in range(20000):\n t.enter(0)\n"
                "for _ in range(5000):\n t.leave(0)\n")
        child = subprocess.Popen([sys.executable, "-c", code, str(fd)], pass_fds=(fd,))
    finally:
        os.close(fd)
    for _ in range(20000):
        owner.enter(0)
    for _ in range(5000):
        owner.leave(0)
    assert child.wait(60) == 0
    assert owner.inflight(0) == 30000


def test_pvm_copy_pidfd_guard() -> None:
    a = np.arange(256, dtype=np.uint8)
    b = np.zeros(256, dtype=np.uint8)
    one = np.array([0], np.int64)
    n = np.array([256], np.int64)
    me = _xproc.pidfd_open(os.getpid())
    try:  # alive: copies; allocation-free path and the heap path (> 16 tensors) agree
        assert _xproc.pvm_copy(os.getpid(), [Region(int(b.ctypes.data), 256, b)],
                               [int(a.ctypes.data)], 256, one, one, n, False, pidfd=me) == 256
        assert np.array_equal(a, b)
        many = np.zeros(256 * 20, dtype=np.uint8)
        regs = [Region(int(many.ctypes.data) + 256 * k, 256, many) for k in range(20)]
        assert _xproc.pvm_copy(os.getpid(), regs, [int(a.ctypes.data)] * 20, 256, one, one, n,
                               False, pidfd=me) == 256 * 20
        assert np.array_equal(many, np.tile(a, 20))
    finally:
        os.close(me)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pfd = _xproc.pidfd_open(child.pid)
    child.wait()
    b[:] = 0
    try:  # exited: nothing moves, even when the pid is "ours" (a stand-in for a reused pid)
        with pytest.raises(ProcessLookupError, match="before the copy"):
            _xproc.pvm_copy(os.getpid(), [Region(int(b.ctypes.data), 256, b)],
                            [int(a.ctypes.data)], 256, one, one, n, False, pidfd=pfd)
    finally:
        os.close(pfd)
    assert not b.any()


def test_pvm_bench_runs_moves_exactly_the_runs() -> None:
    """The benchmark's bare scattered process_vm_readv: the same bytes as the runs say."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    runs = 1500  # more than one batch of 1024 iovecs
    lo = np.arange(runs, dtype=np.int64) * 40
    ro = rng.permutation(runs).astype(np.int64) * 40
    ln = np.full(runs, 40, np.int64)
    n = _xproc.pvm_bench_runs(os.getpid(), Region(int(dst.ctypes.data), dst.nbytes, dst),
                              int(src.ctypes.data), lo, ro, ln, False)
    assert n == runs * 40
    exp = np.zeros_like(dst)
    for a, b in zip(lo.tolist(), ro.tolist()):
        exp[a:a + 40] = src[b:b + 40]
    assert np.array_equal(dst, exp)
    with pytest.raises(ValueError):
        _xproc.pvm_bench_runs(os.getpid(), Region(int(dst.ctypes.data), dst.nbytes, dst),
                              int(src.ctypes.data), np.array([1 << 16], np.int64),
                              np.array([0], np.int64), np.array([1], np.int64), False)


def test_pvm_copy_stops_when_its_lease_is_aborted() -> None:
    """An owner that gave up waiting sets the slot (or link) state to LEASE_ABORT: a running copy
    stops at its next system call; lower states (no new copy) do not stop it."""
    fd = _table_fd(2)
    try:
        table = _xproc.LeaseTable(fd, 2, True)
    finally:
        os.close(fd)
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    runs = 16
    args = (os.getpid(), [Region(int(dst.ctypes.data), dst.nbytes, dst)], [int(src.ctypes.data)],
            src.nbytes, np.arange(runs, dtype=np.int64) * 4096, np.arange(runs, dtype=np.int64) * 4096,
            np.full(runs, 4096, np.int64), False)
    table.revoke(1, _xproc.LEASE_ABORT - 1)  # "no new copy": a running one finishes
    assert _xproc.pvm_copy(*args, chunk=4096, leases=table, slot=1) == 1 << 16
    dst[:] = 0
    table.revoke(1, _xproc.LEASE_ABORT)
    with pytest.raises(ConnectionAbortedError, match="after 0 bytes"):
        _xproc.pvm_copy(*args, chunk=4096, leases=table, slot=1)
    assert not dst.any()  # checked before every system call: not even one
    assert _xproc.pvm_copy(*args, chunk=4096, leases=table, slot=0) == 1 << 16  # another slot
    table.revoke(-1, _xproc.LEASE_ABORT)  # the whole link
    with pytest.raises(ConnectionAbortedError):
        _xproc.pvm_copy(*args, chunk=4096, leases=table, slot=0)
    with pytest.raises(IndexError):
        _xproc.pvm_copy(*args, chunk=4096, leases=table, slot=2)


@pytest.mark.parametrize("mapped", [False, True], ids=["proc_mem", "mapped"])
def test_mem_and_mapped_copies_stop_when_their_lease_is_aborted(mapped: bool) -> None:
    """The same abort for the copies the same-host path makes: ``pread``/``pwrite`` on the peer's
    /proc/<pid>/mem and memory copies through a mapping of its file.  The link's state
    (``revoke(-1, LEASE_ABORT)``: an unlink's or finalize's drain) stops them as the slot's does;
    nothing is copied."""
    fd = _table_fd(2)
    try:
        table = _xproc.LeaseTable(fd, 2, True)
    finally:
        os.close(fd)
    pidfd = _xproc.pidfd_open(os.getpid())
    mem = _xproc.mem_open(os.getpid(), pidfd)
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    runs = np.arange(16, dtype=np.int64) * 4096
    args = (os.getpid(), [Region(int(dst.ctypes.data), dst.nbytes, dst)], [int(src.ctypes.data)],
            src.nbytes, runs, runs, np.full(16, 4096, np.int64), False)
    maps: _xproc.PeerMaps | None = None
    if mapped:  # the source tensor placed in a sealed file of 64 KiB (copies read the file)
        sfd = os.memfd_create("kvdd-test-source", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(sfd, 1 << 16)
        os.pwrite(sfd, src.tobytes(), 0)
        fcntl.fcntl(sfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        maps = _xproc.PeerMaps(2)
        try:
            assert maps.place(0, 0, maps.add(sfd, os.fstat(sfd).st_ino), 0)
        finally:
            os.close(sfd)  # (the mapping keeps the memory)
    placed: tuple[int, ...] | None = (0,) if mapped else None

    def copy() -> int:
        return _xproc.pvm_copy(*args, chunk=4096, leases=table, slot=0, mem_fd=mem, pidfd=pidfd,
                               maps=maps, map_tensors=placed)

    try:
        assert copy() == 1 << 16
        assert np.array_equal(dst, src)
        assert maps is None or maps.uses > 0  # (through the mapping, not /proc/<pid>/mem)
        for slot in (0, -1):  # the slot's state, then (the slot clear again) the whole link's
            dst[:] = 0
            table.revoke(slot, _xproc.LEASE_ABORT)
            with pytest.raises(ConnectionAbortedError):
                copy()
            assert not dst.any()
            table.revoke(0, 0)
            if slot == 0:  # cleared: the slot copies again
                assert copy() == 1 << 16
    finally:
        os.close(mem)
        os.close(pidfd)
