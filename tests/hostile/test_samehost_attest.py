"""What the same-host identity proof (``samehost_attest``) learns of a pidfd: the pid it names,
the four uids of that process, and what it says of a process that exited or of an fd that is not a
pidfd; each test runs both ways the kernel is asked (``PIDFD_GET_INFO`` and the /proc reads of
kernels without it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvdd.sim.fabric import samehost_attest as A

_xproc = pytest.importorskip("kvdd._native._xproc")

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(30)"]


@pytest.fixture(autouse=True, params=["ioctl", "proc"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "proc":
        monkeypatch.setattr(A, "_info_ioctl", False)
    elif not A._has_info_ioctl():
        pytest.skip("the kernel has no PIDFD_GET_INFO (Linux < 6.13): /proc only")
    return str(request.param)


def test_this_kernel_is_asked_with_one_ioctl(way: str) -> None:
    """Linux >= 6.13 (this machine's 6.18 included) answers PIDFD_GET_INFO: no /proc read."""
    if way == "proc":
        pytest.skip("the ioctl's own test")
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    assert A._has_info_ioctl() == ((major, minor) >= (6, 13))


def test_the_identity_of_our_own_pidfd() -> None:
    fd = _xproc.pidfd_open(os.getpid())
    try:
        uid = os.getuid()
        assert A.pidfd_identity(fd) == (os.getpid(), (uid, os.geteuid(), uid, uid))
    finally:
        os.close(fd)


def test_the_pid_of_a_pidfd_and_of_an_exited_process() -> None:
    child = subprocess.Popen(_SLEEPER)
    fd = _xproc.pidfd_open(child.pid)
    try:
        assert A.pidfd_pid(fd) == child.pid
        child.kill()
        child.wait()
        assert A.pidfd_pid(fd) == -1  # exited (and reaped): the kernel says -1
        assert A.pidfd_identity(fd) == (-1, ())
    finally:
        os.close(fd)
        child.kill()


def test_an_fd_that_is_not_a_pidfd_is_refused() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(A.SameHostRefused, match="no pid"):
            A.pidfd_pid(r)
        with pytest.raises(A.SameHostRefused, match="no pid"):
            A.pidfd_identity(r)
    finally:
        os.close(r)
        os.close(w)


def test_the_four_uids_of_a_process() -> None:
    uid = os.getuid()
    assert A.uids_of(os.getpid()) == (uid, os.geteuid(), uid, uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process of another uid")
def test_the_uids_of_another_users_process_and_the_attestation_refuses_it() -> None:
    child = subprocess.Popen(["sleep", "30"], user=65534, group=100, cwd="/")
    fd = _xproc.pidfd_open(child.pid)
    try:
        assert A.uids_of(child.pid) == (65534, 65534, 65534, 65534)  # (its gids are 100)
        assert A.pidfd_identity(fd) == (child.pid, (65534, 65534, 65534, 65534))
        with pytest.raises(A.SameHostRefused, match="uid 65534"):
            A.attest(fd)  # (closes the pidfd on refusal)
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        child.kill()
        child.wait()


def test_an_exited_process_has_no_uids() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(OSError):
        A.uids_of(child.pid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to change a process's effective uid")
def test_a_process_of_our_real_uid_acting_as_another_is_refused() -> None:
    """Real and saved uid ours, effective (and filesystem) uid another's: every uid must match."""
    code = "import os, time; os.setresuid(0, 65534, 0); print('ok', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        assert A.uids_of(child.pid) == (0, 65534, 0, 65534)
        fd = _xproc.pidfd_open(child.pid)
        try:
            assert A.pidfd_identity(fd) == (child.pid, (0, 65534, 0, 65534))
        finally:
            os.close(fd)
        with pytest.raises(A.SameHostRefused, match="uid 65534"):
            A.attest(_xproc.pidfd_open(child.pid))
    finally:
        child.kill()
        child.wait()


# ---- what the attestation refuses ---------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to change a process's real uid")
def test_a_process_acting_as_our_uid_with_another_real_uid_is_refused() -> None:
    """Effective uid ours, real and saved uid another's (a set-uid program another user runs):
    every uid must match, not only the effective one."""
    code = ("import os, time; os.setresuid(65534, 0, 65534); print('ok', flush=True); "
            "time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        fd = _xproc.pidfd_open(child.pid)
        assert A.pidfd_identity(fd) == (child.pid, (65534, 0, 65534, 0))
        with pytest.raises(A.SameHostRefused, match=r"runs as uid 65534 \(real, effective, "
                           r"saved, filesystem: 65534, 0, 65534, 0\), not 0"):
            A.attest(fd)
        with pytest.raises(OSError):
            os.fstat(fd)  # closed on refusal
    finally:
        child.kill()
        child.wait()


def test_our_own_process_is_no_peer() -> None:
    fd = _xproc.pidfd_open(os.getpid())
    with pytest.raises(A.SameHostRefused, match="the kernel reports no usable peer process"):
        A.attest(fd)
    with pytest.raises(OSError):
        os.fstat(fd)


def test_no_pidfd_is_refused_as_such() -> None:
    with pytest.raises(A.SameHostRefused, match="the kernel attached no pidfd to the proof"):
        A.attest(-1)


def test_a_peer_of_ours_is_attested_and_its_pidfd_kept() -> None:
    child = subprocess.Popen(_SLEEPER)
    fd = _xproc.pidfd_open(child.pid)
    try:
        assert A.attest(fd) == (child.pid, os.geteuid(), fd)
        os.fstat(fd)  # kept
    finally:
        os.close(fd)
        child.kill()
        child.wait()


def test_a_peer_that_exits_while_its_uids_are_read_is_refused(way: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """(/proc: its pid was read, then its uids, then it exited: the uids may be another
    process's, so the pidfd must still be alive after the reads.)"""
    if way != "proc":
        pytest.skip("one read with the ioctl")
    child = subprocess.Popen(_SLEEPER)
    real = A.uids_of

    def then_exit(pid: int) -> tuple[int, ...]:
        got = real(pid)
        child.kill()
        child.wait()
        return got

    monkeypatch.setattr(A, "uids_of", then_exit)
    fd = _xproc.pidfd_open(child.pid)
    with pytest.raises(A.SameHostRefused, match="the peer process exited during the proof"):
        A.attest(fd)
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_later_message_from_another_process_is_refused() -> None:
    child = subprocess.Popen(_SLEEPER)
    try:
        A.same_sender(_xproc.pidfd_open(child.pid), child.pid)  # the attested one: fine
        other = _xproc.pidfd_open(os.getpid())
        with pytest.raises(A.SameHostRefused, match="a later proof message came from another process"):
            A.same_sender(other, child.pid)
        with pytest.raises(OSError):
            os.fstat(other)  # closed
        with pytest.raises(A.SameHostRefused, match="came from another process"):
            A.same_sender(-1, child.pid)  # no sender named
    finally:
        child.kill()
        child.wait()


def test_a_message_longer_than_asked_is_refused_as_truncated() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        b.sendall(b"x" * 65)
        with pytest.raises(A.SameHostRefused, match="truncated message"):
            A.recv_msg(a, 64)
        b.sendall(b"x" * 64)
        assert A.recv_msg(a, 64)[:2] == (b"x" * 64, [])
