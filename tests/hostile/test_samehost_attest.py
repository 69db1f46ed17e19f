"""What the same-host identity proof (``samehost_attest``) learns of a pidfd: the pid it names,
the four uids of that process, and what it says of a process that exited or of an fd that is not a
pidfd; each test runs both ways the kernel is asked (``PIDFD_GET_INFO`` and the /proc reads of
kernels without it)."""

from __future__ import annotations

import os
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
