"""Files a same-host peer hands us whose ``close`` never returns do not hold the link set-up
(kvdd.sim.fabric.samehost_close).

A refused file taken from the owner with ``pidfd_getfd`` (a FUSE file: close sends FLUSH, which
its server need not answer), a refused lease table or an extra file received over the proof's
socket (a TCP socket with ``SO_LINGER`` whose peer never reads, the sender's own copy closed: the
last close waits the linger time) are closed on the closer thread; the set-up returns at once.
What a peer can make us hold is bounded by admission (``MAX_PENDING``): at the cap, a link takes
no more files (its copies use /proc/<pid>/mem) and the proof declines (TCP).  The owner is this
very process, as in test_samehost_shm_checks.py.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvdd._native import _xproc
from kvdd.sim.fabric import samehost, samehost_close, samehost_endpoint
from kvdd.sim.fabric.samehost_endpoint import endpoint
from kvdd.sim.fabric.samehost_path import OneSidedPeer

from hostile.hostile_files import FuseFile, LingeringSocket, fuse_mount_error
from hostile.test_samehost_shm_checks import Owner

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

DEADLINE_S = 1.0  # a set-up step must return within this, whatever close does
LINGER_S = 30  # how long a lingering socket's last close waits (released by the test at once)


@pytest.fixture
def owner() -> Iterator[Owner]:
    o = Owner()
    yield o
    o.close()


_FUSE_ERROR: list[str] = []


@pytest.fixture
def fuse() -> Iterator[FuseFile]:
    if not _FUSE_ERROR:
        _FUSE_ERROR.append(fuse_mount_error())
    if _FUSE_ERROR[0]:
        pytest.skip(_FUSE_ERROR[0])
    f = FuseFile()
    yield f
    f.close()  # aborts the connection: the FLUSH waiting in the closer fails at once
    assert samehost_close.idle(2.0)


@pytest.fixture
def lingering() -> Iterator[LingeringSocket]:
    s = LingeringSocket(LINGER_S)
    assert s.unsent() > 0  # its last close will wait
    yield s
    s.release()
    assert samehost_close.idle(5.0)  # the closer got through the linger once released


def _within(fn: Callable[[], object], deadline_s: float = DEADLINE_S) -> object:
    """Run ``fn`` on a thread; it must return within ``deadline_s`` (its result, or what it
    raised)."""
    out: list[object] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            err.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    assert not t.is_alive(), f"held past {deadline_s} s"
    if err:
        raise err[0]
    return out[0]


def _fds() -> dict[str, str]:
    """This process's pipes and sockets by fd (other files come and go with the collector)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # (the listing's own fd)
            continue
        if link.startswith(("pipe:", "socket:")):
            out[name] = link
    return out


def _wait_until(cond: Callable[[], bool], timeout_s: float = DEADLINE_S) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


# ---- files taken from the owner (pidfd_getfd) ---------------------------------------------------


def test_a_fuse_memory_file_the_reader_refuses_does_not_hold_map_owner(
        owner: Owner, fuse: FuseFile) -> None:
    flushes = fuse.flushes
    owner.announce([owner.row(0), [1, 0, fuse.fd, 0, 2]])  # slot 1: the owner's FUSE file
    maps = _within(lambda: owner.map())
    assert isinstance(maps, _xproc.PeerMaps) and maps.placed(0) == 1 and maps.placed(1) == 0
    maps.close()
    assert _wait_until(lambda: fuse.flushes == flushes + 1)  # its FLUSH is out, unanswered
    assert samehost_close.pending() == 1  # held by the closer, not by the link


def test_a_fuse_records_file_does_not_hold_map_owner(owner: Owner, fuse: FuseFile) -> None:
    owner.table.store_header(3, fuse.fd + 1)
    owner.table.store_header(4, 2)
    assert _within(lambda: owner.map()) is None
    assert samehost_close.pending() >= 1


def test_an_injected_blocking_close_does_not_hold_map_owner(
        owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FUSE cannot be mounted: a close of the refused file (a pipe) that blocks until
    released; the closer closes it once released."""
    r, w = os.pipe()
    release = threading.Event()
    real = os.close
    closed: list[int] = []

    def blocking_close(fd: int) -> None:
        if stat.S_ISFIFO(os.fstat(fd).st_mode) and fd not in (r, w):
            release.wait(30)
            closed.append(fd)
        real(fd)

    monkeypatch.setattr(os, "close", blocking_close)
    try:
        owner.announce([owner.row(0), [1, 0, r, 0, os.fstat(r).st_ino]])
        maps = _within(lambda: owner.map())
        assert isinstance(maps, _xproc.PeerMaps) and maps.placed(0) == 1 and maps.placed(1) == 0
        maps.close()
        assert samehost_close.pending() == 1 and not closed
        release.set()
        assert samehost_close.idle(2.0) and len(closed) == 1
    finally:
        release.set()
        samehost_close.idle(2.0)
        monkeypatch.undo()
        real(r)
        real(w)


def _count_takes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the reader's pidfd_getfd calls (one entry per file taken)."""
    taken: list[int] = []
    real = _xproc.pidfd_getfd

    def counting(pidfd: int, fd: int) -> int:
        taken.append(fd)
        return real(pidfd, fd)
    monkeypatch.setattr(_xproc, "pidfd_getfd", counting)
    return taken


def test_at_the_closer_cap_a_link_takes_no_more_files(
        owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_PENDING closes pending (exactly at the cap): map_owner takes no file, not even the
    records' (None: every copy through /proc/<pid>/mem) and the initiator declines the proof;
    one below: the announcement is mapped as usual."""
    monkeypatch.setattr(samehost_close, "MAX_PENDING", 2)
    gate = threading.Event()
    for _ in range(2):
        samehost_close._closer.put(lambda: (gate.wait(10), None)[1])
    taken = _count_takes(monkeypatch)
    try:
        assert _wait_until(lambda: samehost_close.pending() == 2)
        owner.announce([owner.row(0)])
        assert owner.map() is None and taken == []
        assert not samehost_close.room()
        with pytest.raises(samehost.SameHostRefused, match="clos"):
            samehost.prove(b"", None, lambda: (-1, 0), lambda link: None)  # type: ignore[arg-type]
        monkeypatch.setattr(samehost_close, "MAX_PENDING", 3)  # one below the cap
        maps = owner.map()
        assert maps is not None and maps.placed(0) == 1 and len(taken) == 2
        maps.close()
    finally:
        gate.set()
        assert samehost_close.idle(2.0)


def test_a_link_stops_taking_files_once_its_refusals_fill_the_closer(
        owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three refused files (pipes whose close blocks) with room for two closes: the records,
    the honest file and two pipes are taken, the third pipe is not."""
    monkeypatch.setattr(samehost_close, "MAX_PENDING", 2)
    pipes = [os.pipe() for _ in range(3)]
    release = threading.Event()
    real = os.close

    def blocking_close(fd: int) -> None:
        if stat.S_ISFIFO(os.fstat(fd).st_mode) and all(fd not in p for p in pipes):
            release.wait(30)
        real(fd)
    taken = _count_takes(monkeypatch)
    monkeypatch.setattr(os, "close", blocking_close)
    try:
        rows = [[1, 0, r, 0, os.fstat(r).st_ino] for r, _w in pipes]
        owner.announce([owner.row(0)] + rows)  # (files are taken in fd order: the honest first)
        assert owner.alloc.fd < pipes[0][0] < pipes[1][0] < pipes[2][0]
        maps = _within(lambda: owner.map())
        assert isinstance(maps, _xproc.PeerMaps) and maps.placed(0) == 1 and maps.placed(1) == 0
        maps.close()
        assert taken[1:] == [owner.alloc.fd, pipes[0][0], pipes[1][0]]  # (taken[0]: the records)
        assert samehost_close.pending() == 2
    finally:
        release.set()
        assert samehost_close.idle(2.0)
        monkeypatch.undo()
        for p in pipes:
            os.close(p[0])
            os.close(p[1])


# ---- files received over the proof's socket (SCM_RIGHTS) --------------------------------------


@pytest.mark.parametrize("refusable", [True, False], ids=["passrights", "older-kernel"])
def test_a_lingering_socket_sent_with_a_hello_does_not_hold_the_endpoint(
        lingering: LingeringSocket, refusable: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A same-uid process without the secret: its hello carries a socket whose last close
    waits LINGER_S.  Where the kernel can refuse files (SO_PASSRIGHTS, Linux >= 6.16) its
    sendmsg fails and the endpoint closes it after its one message as usual; elsewhere (here:
    an endpoint that does not ask the kernel to refuse) the endpoint hands the file to the
    closer at once."""
    if refusable:
        ep = endpoint()
    else:
        monkeypatch.setattr(samehost_endpoint, "refuse_files", lambda sock: None)
        monkeypatch.setattr(samehost_close, "_refusable", False)
        ep = samehost_endpoint.Endpoint()  # (its thread stays, idle, for the process's life)
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(ep.name)
    c.settimeout(DEADLINE_S)
    msg = b"kvdd-samehost/2" + samehost.M_HELLO + b"\0" * 64
    try:
        socket.send_fds(c, [msg], [lingering.fileno()])
    except PermissionError:  # refused by the kernel: nothing of it reached the endpoint (our
        c.sendall(msg)       # own copy stays the last: released by the fixture)
        assert c.recv(64) == b""  # the endpoint refused the hello and closed (not held)
        assert refusable and samehost_close.files_refusable()
    else:
        assert not (refusable and samehost_close.files_refusable())
        lingering.drop_own()
        assert _wait_until(lambda: samehost_close.pending() >= 1)
        time.sleep(0.1)
        assert samehost_close.pending() >= 1  # still lingering there, not here
    finally:
        c.close()


def test_an_extra_file_in_a_proof_message_is_closed_off_the_thread(
        lingering: LingeringSocket) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        samehost_close.accept_files(b)
        r, w = os.pipe()
        socket.send_fds(a, [b"kvdd-samehost/2F\0\0\0\0"], [r, lingering.fileno()])
        os.close(r)
        os.close(w)
        lingering.drop_own()

        def receive() -> str:
            try:
                samehost.recv_message(b, samehost.M_FINAL, 4)
            except samehost.SameHostRefused as exc:
                return str(exc)
            return "accepted"
        assert "unexpected" in str(_within(receive))
        assert samehost_close.pending() >= 1
    finally:
        a.close()
        b.close()


def test_a_refused_lease_table_does_not_hold_the_link_close(
        owner: Owner, lingering: LingeringSocket) -> None:
    """The peer's 'lease table' is a lingering socket: refused (no seals), and the link's close
    (the last reference) returns at once."""
    link = samehost.SameHostLink(os.getpid(), os.getuid(), os.dup(owner.pidfd),
                                 os.dup(lingering.fileno()), 1)
    lingering.drop_own()
    with pytest.raises(samehost.SameHostRefused, match="sealed"):
        _within(lambda: OneSidedPeer(link))
    _within(link.close)
    assert samehost_close.pending() >= 1


def test_a_file_past_the_old_control_buffer_is_received_and_closed_off_the_thread(
        lingering: LingeringSocket) -> None:
    """One message carries 252 pipes and then the lingering socket (253: SCM_MAX_FD): every fd
    fits the control buffer (a file the kernel dropped for want of room would be released on
    the receiving thread, waiting the linger), the message is refused, every fd is closed."""
    assert samehost_close.idle(2.0)  # (earlier tests' closes done: the fd count is ours)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pipes = [os.pipe() for _ in range(126)]
    fds = [fd for pair in pipes for fd in pair]
    try:
        samehost_close.accept_files(b)
        socket.send_fds(a, [b"kvdd-samehost/2F\0\0\0\0"], fds + [lingering.fileno()])
        lingering.drop_own()
        before = _fds()

        def receive() -> str:
            try:
                samehost.recv_message(b, samehost.M_FINAL, 4)
            except samehost.SameHostRefused as exc:
                return str(exc)
            return "accepted"
        assert "unexpected" in str(_within(receive))  # (not "truncated")
        time.sleep(0.1)
        assert samehost_close.pending() == 1  # the pipes closed, the socket's close waiting there
        assert _fds() == before  # all 253 gone from the table (the last one's close waits there)
    finally:
        for fd in fds:
            os.close(fd)
        a.close()
        b.close()


def test_files_received_in_the_proof_are_close_on_exec() -> None:
    """The peer's lease table (held for the link's life) and any file of a proof message are
    close-on-exec: a program the process runs meanwhile never inherits them."""
    import fcntl
    from kvdd.sim.fabric.samehost_path import new_table_fd
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    table = new_table_fd(1)
    got = -1
    try:
        samehost_close.accept_files(b)
        socket.send_fds(a, [b"kvdd-samehost/2F\0\0\0\0"], [table])
        _body, got, _sender = samehost.recv_message(b, samehost.M_FINAL, 4)
        assert got >= 0 and fcntl.fcntl(got, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        for fd in (table, got):
            if fd >= 0:
                os.close(fd)
        a.close()
        b.close()


class _SlowMaps:
    """Stands for a PeerMaps whose unmapping frees an exited owner's memory (~0.2 s per GiB
    measured): its close blocks until released."""

    def __init__(self) -> None:
        self.enabled = True
        self.release = threading.Event()
        self.closed = False

    def close(self) -> None:
        self.release.wait(30)
        self.closed = True


class _Link:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_unmapping_an_exited_owners_memory_does_not_hold_the_link_close() -> None:
    """The reader's release of the link (an unlink, a finalize, or the last copy after them):
    the fds are closed at once, the mapping is unmapped on the unmapper thread and used by no
    copy meanwhile."""
    reader = OneSidedPeer.__new__(OneSidedPeer)
    maps, link = _SlowMaps(), _Link()
    reader.maps = maps  # type: ignore[assignment]
    reader.link = link  # type: ignore[assignment]
    try:
        _within(reader.release_fds)
        assert link.closed and not maps.enabled and not maps.closed
    finally:
        maps.release.set()
    assert samehost_close.unmaps_idle(2.0) and maps.closed


def test_a_peers_large_memfd_is_released_off_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer's memfd whose last reference is ours frees its memory at close (~0.2 s per GiB):
    at most FREE_INLINE bytes held, closed at once; one page more, on the unmapper thread (here
    its close blocks until released)."""
    monkeypatch.setattr(samehost_close, "FREE_INLINE", 8192)
    release = threading.Event()
    real = os.close
    slow: set[int] = set()

    def blocking_close(fd: int) -> None:
        if fd in slow:
            release.wait(30)
        real(fd)
    monkeypatch.setattr(os, "close", blocking_close)
    try:
        for pages, inline in ((2, True), (3, False)):
            fd = os.memfd_create("peer", os.MFD_CLOEXEC)
            os.write(fd, b"\1" * 4096 * pages)  # pages * 4096 bytes held
            assert os.fstat(fd).st_blocks * 512 == 4096 * pages
            if not inline:
                slow.add(fd)
            _within(lambda: samehost_close.close_file(fd))
            assert _closed(fd) == inline
            # the large one waits on the unmapper (not on the closer of files) and counts
            # against the bound on pending closes of peers' files
            assert samehost_close.pending() == (0 if inline else 1)
            assert samehost_close.unmaps_idle(0.0) == inline
        release.set()
        assert samehost_close.unmaps_idle(2.0)
    finally:
        release.set()
        samehost_close.unmaps_idle(2.0)


def _closed(fd: int) -> bool:
    import fcntl
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return True
    return False
