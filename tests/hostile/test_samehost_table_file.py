"""The peer's lease table must be a sealed tmpfs memfd (kvdd.sim.fabric.samehost_path.check_table_fd).

A hugetlbfs memfd takes the same seals and, at a size of whole huge pages (2 MiB: 32767 slots),
passes the seal and size checks.  Mapped by the reader, its pages can be missing at fault time:
where the host has huge pages configured, the peer punches the table's page out and takes the
free one elsewhere, and the reader's next lease (a load from the table) is SIGBUS: the process
dies (measured with vm.nr_hugepages=1: exit status 135).  The reader refuses it before mapping it,
as it refuses a hugetlbfs memory file (shm_check); so is every table that is not a tmpfs memfd.
"""

from __future__ import annotations

import fcntl
import os

import pytest

from kvdd._native import _xproc
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.samehost_path import check_table_fd, new_table_fd

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
HUGE_SLOTS = ((2 << 20) - _xproc.LEASE_HEADER) // _xproc.LEASE_SLOT  # a 2 MiB table


def _size(slots: int) -> int:
    return int(_xproc.LEASE_HEADER + slots * _xproc.LEASE_SLOT)


def test_a_hugetlbfs_table_is_refused() -> None:
    assert _size(HUGE_SLOTS) == 2 << 20 and HUGE_SLOTS <= _xproc.LEASE_MAX_SLOTS
    try:
        fd = os.memfd_create("table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as exc:
        pytest.skip(f"no hugetlbfs memfd here: {exc}")
    try:
        try:
            os.ftruncate(fd, 2 << 20)
        except OSError as exc:
            pytest.skip(f"a hugetlbfs memfd cannot be sized here: {exc}")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        with pytest.raises(samehost.SameHostRefused, match="tmpfs"):
            check_table_fd(fd, HUGE_SLOTS, _size(HUGE_SLOTS))
    finally:
        os.close(fd)


def test_the_honest_table_passes_and_other_files_are_refused(tmp_path: object) -> None:
    fd = new_table_fd(3)
    try:
        check_table_fd(fd, 3, _size(3))  # exactly the size for 3 slots
        with pytest.raises(samehost.SameHostRefused):
            check_table_fd(fd, 4, _size(4))  # one slot more than the file holds
    finally:
        os.close(fd)
    r, w = os.pipe()
    disk = os.open(os.path.join(str(tmp_path), "t"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(disk, _size(1))
        for bad in (r, disk):
            with pytest.raises(samehost.SameHostRefused, match="tmpfs|sealed"):
                check_table_fd(bad, 1, _size(1))
    finally:
        for fd in (r, w, disk):
            os.close(fd)


@pytest.mark.parametrize("seals", [
    SEALS & ~fcntl.F_SEAL_SHRINK,  # the peer could shrink it under the reader: SIGBUS
    SEALS & ~fcntl.F_SEAL_GROW,
    SEALS & ~fcntl.F_SEAL_SEAL,  # it could still add F_SEAL_WRITE, or any other seal, later
    SEALS | fcntl.F_SEAL_WRITE,  # the reader could not map it writable
    0,
], ids=["no-shrink-seal", "no-grow-seal", "no-seal-seal", "write-sealed", "unsealed"])
def test_a_table_without_exactly_the_resize_seals_is_refused(seals: int) -> None:
    fd = os.memfd_create("table", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, _size(3))
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        with pytest.raises(samehost.SameHostRefused, match="not sealed"):
            check_table_fd(fd, 3, _size(3))
    finally:
        os.close(fd)
