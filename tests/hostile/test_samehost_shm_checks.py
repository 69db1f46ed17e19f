"""The reader's checks of an owner's shareable-memory announcement, one at a time, at their bounds
(kvdd.sim.fabric.samehost_shm.map_owner, kvdd._native._xproc.shm_check / PeerMaps).

The "owner" here is this very process (pidfd_getfd works on one's own pidfd): a hand-made lease
table announces hand-made records, and each check is driven exactly to its bound and one past.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import shm
from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import samehost, samehost_shm
from kvdd.sim.fabric.samehost_path import new_table_fd
from shared_support import in_a_forked_child

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
IMMUTABLE = SEALS | fcntl.F_SEAL_WRITE
N = 8192


def _memfd(size: int, seals: int = SEALS, data: bytes = b"") -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if data:
        os.pwrite(fd, data, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


class Owner:
    """This process as the owner: a table of ``slots`` slots and the fds made for it."""

    def __init__(self, slots: int = 2) -> None:
        self.pidfd = _xproc.pidfd_open(os.getpid())
        self.table_fd = new_table_fd(slots)
        self.table = _xproc.LeaseTable(self.table_fd, slots, True)
        self.fds: list[int] = []
        self.arena = kvdd.empty(N, np.uint8)
        self.arena[:] = np.arange(N) % 249
        alloc, _ = shm.lookup(int(self.arena.ctypes.data), N) or (None, 0)
        assert alloc is not None
        self.alloc = alloc

    def keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def announce(self, rows: list[list[int]], seals: int = IMMUTABLE, extra: bytes = b"",
                 ino: int | None = None, word: int | None = None) -> None:
        data = np.array(rows, dtype="<u8").reshape(-1, 5).tobytes() + extra
        fd = self.keep(_memfd(max(len(data), 0), seals=0, data=data))
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        self.table.store_header(3, fd + 1 if word is None else word)
        self.table.store_header(4, os.fstat(fd).st_ino if ino is None else ino)

    def row(self, slot: int = 0, tensor: int = 0, offset: int = 0) -> list[int]:
        return [slot, tensor, self.alloc.fd, offset, self.alloc.ino]

    def map(self) -> _xproc.PeerMaps | None:
        return samehost_shm.map_owner(self.pidfd, self.table)

    def close(self) -> None:
        for fd in self.fds + [self.pidfd, self.table_fd]:
            os.close(fd)


@pytest.fixture
def owner() -> Iterator[Owner]:
    o = Owner()
    yield o
    o.close()


def test_the_honest_announcement_is_mapped(owner: Owner) -> None:
    owner.announce([owner.row(0), owner.row(1)])
    maps = owner.map()
    assert maps is not None and len(maps) == 1 and maps.placed(0) == 1 and maps.placed(1) == 1


def test_no_announcement_maps_nothing(owner: Owner) -> None:
    assert owner.map() is None


def test_mapped_copies_can_be_switched_off(owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    owner.announce([owner.row()])
    monkeypatch.setenv(samehost_shm.ENV_MAPPED, "0")
    assert owner.map() is None
    monkeypatch.setenv(samehost_shm.ENV_MAPPED, "1")
    assert owner.map() is not None


def test_an_announced_fd_past_any_fd_number_is_refused(owner: Owner) -> None:
    owner.announce([owner.row()], word=0x7FFFFFFF + 2)
    assert owner.map() is None
    owner.announce([owner.row()], word=0x7FFFFFFF + 1)  # fd 0x7FFFFFFF: a valid number, no fd
    assert owner.map() is None


def test_records_must_be_sealed_against_writes(owner: Owner) -> None:
    owner.announce([owner.row()], seals=SEALS)
    assert owner.map() is None


def test_records_of_another_inode_are_refused(owner: Owner) -> None:
    owner.announce([owner.row()], ino=1)
    assert owner.map() is None


def test_records_must_be_whole(owner: Owner) -> None:
    owner.announce([owner.row()], extra=b"\0")
    assert owner.map() is None


def test_at_most_max_records(owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(samehost_shm, "MAX_RECORDS", 3)
    owner.announce([owner.row(0, t) for t in range(3)])
    assert owner.map() is not None
    owner.announce([owner.row(0, t) for t in range(4)])
    assert owner.map() is None


def test_records_out_of_range_are_not_placed(owner: Owner) -> None:
    size = owner.alloc.size
    owner.announce([owner.row(2, 0), owner.row(1, 1), owner.row(0, 0, size)])
    maps = owner.map()  # slot 2 of 2 slots; tensor 1 of a slot with 1 record; offset == size
    assert maps is not None and maps.placed(0) == 0 and maps.placed(1) == 0
    owner.announce([owner.row(0, 0, size - 1), owner.row(1, 0)])
    maps = owner.map()
    assert maps is not None and maps.placed(0) == 1 and maps.placed(1) == 1


def test_files_beyond_the_record_count_cannot_be(owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(samehost_shm, "MAX_LINK_MAPS", 1)
    other = owner.keep(_memfd(N))
    ino = os.fstat(other).st_ino
    owner.announce([owner.row(0), owner.row(1)])  # 1 file: at the cap
    assert owner.map() is not None
    owner.announce([owner.row(0), [1, 0, other, 0, ino]])  # 2 files: one past
    assert owner.map() is None


def test_at_most_max_link_map_bytes(owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    other = owner.keep(_memfd(N))
    ino = os.fstat(other).st_ino
    rows = [owner.row(0), [1, 0, other, 0, ino]]
    monkeypatch.setattr(samehost_shm, "MAX_LINK_MAP_BYTES", owner.alloc.size + N)
    owner.announce(rows)
    maps = owner.map()
    assert maps is not None and len(maps) == 2 and maps.placed(1) == 1
    monkeypatch.setattr(samehost_shm, "MAX_LINK_MAP_BYTES", owner.alloc.size + N - 1)
    maps = owner.map()  # (whichever file comes first fits; the other does not)
    assert maps is not None and len(maps) == 1 and maps.placed(0) + maps.placed(1) == 1


def test_mapped_copies_stay_inside_the_registered_bytes(owner: Owner) -> None:
    """A tensor is copied through the mapping only when its registered bytes fit the file from
    its offset: exactly at the end yes, one byte past no (then /proc/<pid>/mem: here, our own)."""
    size = owner.alloc.size
    owner.announce([owner.row(0, 0, size - N), owner.row(1, 0, size - N + 1)])
    maps = owner.map()
    assert maps is not None
    mem = _xproc.mem_open(os.getpid(), owner.pidfd)
    dst = np.zeros(N, np.uint8)
    z, ln = np.array([0], np.int64), np.array([N], np.int64)
    try:
        for slot, used in ((0, 1), (1, 0)):
            before = maps.uses
            _xproc.pvm_copy(os.getpid(), [Region(int(dst.ctypes.data), N, dst)],
                            [int(owner.arena.ctypes.data)], N, z, z, ln, False, pidfd=owner.pidfd,
                            leases=owner.table, slot=slot, mem_fd=mem, maps=maps,
                            map_tensors=(0,))
            assert maps.uses == before + used
            np.testing.assert_array_equal(dst, owner.arena)  # (the arena is the whole file)
    finally:
        os.close(mem)


# ---- shm_check: each refusal ----------------------------------------------------------------


def _check(fd: int, ino: int | None = None) -> str:
    try:
        _xproc.shm_check(fd, os.fstat(fd).st_ino if ino is None else ino)
    except ValueError as exc:
        return str(exc)
    return "ok"


def test_shm_check_accepts_a_sealed_memfd_and_refuses_the_rest(tmp_path: object) -> None:
    fds = []
    try:
        good = _memfd(4096)
        fds.append(good)
        assert _check(good) == "ok"
        assert "inode" in _check(good, os.fstat(good).st_ino + 1)
        only_grow = _memfd(4096, seals=fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        fds.append(only_grow)
        assert "shrinking" in _check(only_grow)
        shrink_only = _memfd(4096, seals=fcntl.F_SEAL_SHRINK)
        fds.append(shrink_only)
        assert _check(shrink_only) == "ok"  # the one seal the mapping needs
        empty = _memfd(0)
        fds.append(empty)
        assert "size" in _check(empty)
        at_cap = _memfd(_xproc.SHM_MAX_BYTES)
        fds.append(at_cap)
        assert _check(at_cap) == "ok"
        past = _memfd(_xproc.SHM_MAX_BYTES + 1)
        fds.append(past)
        assert "size" in _check(past)
        d = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY)  # tmpfs, not a regular file
        fds.append(d)
        assert "no seals" in _check(d)  # (F_GET_SEALS first: it asks no file system)
        r, w = os.pipe()
        fds += [r, w]
        assert "no seals" in _check(r)
        disk = os.open(os.path.join(str(tmp_path), "f"), os.O_RDWR | os.O_CREAT, 0o600)
        fds.append(disk)
        assert _check(disk) != "ok"  # ("tmpfs", or "shrinking" where tmp_path is a tmpfs)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_forked_child_does_not_inherit_the_mappings(owner: Owner) -> None:
    """MADV_DONTFORK: the peer's memory is mapped in the reader only, never in its children."""
    owner.announce([owner.row()])
    maps = owner.map()
    assert maps is not None

    def count() -> int:
        with open("/proc/self/maps") as f:
            return sum("memfd:kvdd-cache" in line for line in f)

    here = count()  # our own kvdd.empty arenas (inherited) and the reader's mapping
    there = in_a_forked_child(count)
    assert here >= 2 and there == here - 1
    maps.close()
    assert count() == here - 1


def test_peer_maps_place_only_inside_its_slots_tensors_and_mappings(owner: Owner) -> None:
    maps = _xproc.PeerMaps(2)
    try:
        i = maps.add(owner.alloc.fd, owner.alloc.ino)
        size = owner.alloc.size
        assert not maps.place(2, 0, i, 0) and not maps.place(-1, 0, i, 0)  # slots [0, 2)
        assert not maps.place(0, -1, i, 0) and not maps.place(0, 1 << 20, i, 0)
        assert not maps.place(0, 0, i + 1, 0) and not maps.place(0, 0, -1, 0)
        assert not maps.place(0, 0, i, size)
        assert maps.placed(0) == 0 and maps.placed(1) == 0
        assert maps.place(1, (1 << 20) - 1, i, size - 1) and maps.place(0, 0, i, 0)
        assert maps.placed(0) == 1 and maps.placed(1) == 1
    finally:
        maps.close()


def test_a_mapped_copy_checks_the_deadline_and_the_abort_before_copying(owner: Owner) -> None:
    owner.announce([owner.row()])
    maps = owner.map()
    assert maps is not None
    mem = _xproc.mem_open(os.getpid(), owner.pidfd)
    dst = np.zeros(N, np.uint8)
    z, ln = np.array([0], np.int64), np.array([N], np.int64)

    def copy(timeout_ms: int, chunk: int) -> int:  # (N / 4096 full windows, or one partial)
        return _xproc.pvm_copy(os.getpid(), [Region(int(dst.ctypes.data), N, dst)],
                               [int(owner.arena.ctypes.data)], N, z, z, ln, False,
                               timeout_ms=timeout_ms, chunk=chunk, pidfd=owner.pidfd,
                               leases=owner.table, slot=0, mem_fd=mem, maps=maps, map_tensors=(0,))
    try:
        for chunk in (4096, 1 << 20):
            with pytest.raises(TimeoutError, match="after 0 bytes"):
                copy(0, chunk)
            owner.table.revoke(0, _xproc.LEASE_ABORT)
            with pytest.raises(ConnectionAbortedError, match="after 0 bytes"):
                copy(5000, chunk)
            owner.table.revoke(0, 0)
        assert not dst.any() and maps.uses == 4
        assert copy(5000, 4096) == N
        np.testing.assert_array_equal(dst, owner.arena)
    finally:
        os.close(mem)


def test_a_close_that_fails_on_a_file_taken_from_the_owner_is_not_raised(
        owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() of a file taken from the owner reports the file's flush (a FUSE file's FLUSH
    answered with EIO by the owner): the fd is gone all the same, and map_owner, which never
    raises for what the owner sent, maps the rest as usual."""
    import errno

    real = os.close

    def failing_close(fd: int) -> None:
        real(fd)
        raise OSError(errno.EIO, "flush failed")

    owner.announce([owner.row()])
    monkeypatch.setattr(os, "close", failing_close)
    try:
        maps = owner.map()
    finally:
        monkeypatch.undo()
    assert maps is not None and maps.placed(0) == 1
    maps.close()
