"""An owner that changes its memory's seals around the reader's checks, or announces records at
the integer limits (kvdd._native._xproc.PeerMaps, kvdd.sim.fabric.samehost_shm.map_owner).

* ``F_SEAL_WRITE`` / ``F_SEAL_FUTURE_WRITE`` before the reader maps: the read-write shared mapping
  is refused by the kernel (EPERM), the file is not mapped (its tensors go through
  /proc/<pid>/mem), nothing is raised past ``map_owner``;
* ``F_SEAL_WRITE`` after the reader mapped: the kernel refuses the seal (EBUSY: a writable shared
  mapping exists), so a push can never fault on a write-sealed page;
* ``F_SEAL_FUTURE_WRITE`` after the reader mapped: the reader's mapping stays writable, a push
  through it lands (no SIGBUS);
* a push through /proc/<pid>/mem into a write-sealed file the owner mapped read-only fails with
  EFAULT (``FOLL_FORCE`` does not reach a shared mapping that may not be written), nothing moved;
* records whose slot, tensor, fd or offset are 2**64 - 1 (or one past the last valid value) place
  nothing and raise nothing.

The owner is this very process, as in test_samehost_shm_checks.py.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import samehost

from hostile.test_samehost_shm_checks import N, Owner, _memfd

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

SHRINK_GROW = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
F_SEAL_FUTURE_WRITE = 0x0010  # (Linux >= 5.1; not in Python 3.11's fcntl)
TOP = (1 << 64) - 1


@pytest.fixture
def owner() -> Iterator[Owner]:
    o = Owner()
    yield o
    o.close()


@pytest.mark.parametrize("seal", [fcntl.F_SEAL_WRITE, F_SEAL_FUTURE_WRITE],
                         ids=["write", "future-write"])
def test_a_write_sealed_file_is_not_mapped(owner: Owner, seal: int) -> None:
    fd = owner.keep(_memfd(N, SHRINK_GROW | seal))
    ino = os.fstat(fd).st_ino
    maps = _xproc.PeerMaps(2)
    before = _xproc.peer_map_totals()
    try:
        with pytest.raises(ValueError, match="mmap failed"):
            maps.add(fd, ino)
        assert len(maps) == 0 and _xproc.peer_map_totals() == before  # the reservation undone
    finally:
        maps.close()
    owner.announce([owner.row(0), [1, 0, fd, 0, ino]])
    got = owner.map()  # the honest file mapped, the sealed one not (slot 1: /proc/<pid>/mem)
    assert got is not None and len(got) == 1 and got.placed(0) == 1 and got.placed(1) == 0
    got.close()


def _push(owner: Owner, maps: _xproc.PeerMaps | None, remote: int, src: np.ndarray) -> int:
    mem = _xproc.mem_open(os.getpid(), owner.pidfd)
    z, ln = np.array([0], np.int64), np.array([src.nbytes], np.int64)
    try:
        return _xproc.pvm_copy(os.getpid(), [Region(int(src.ctypes.data), src.nbytes, src)],
                               [remote], src.nbytes, z, z, ln, True, pidfd=owner.pidfd,
                               leases=owner.table, slot=0, mem_fd=mem, maps=maps,
                               map_tensors=(0,))
    finally:
        os.close(mem)


def test_seals_added_after_the_reader_mapped_never_fault_a_push(owner: Owner) -> None:
    fd = owner.keep(_memfd(N, SHRINK_GROW))
    owner.announce([[0, 0, fd, 0, os.fstat(fd).st_ino]])
    maps = owner.map()
    assert maps is not None and maps.placed(0) == 1
    with pytest.raises(OSError) as err:  # a writable shared mapping exists: refused
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert err.value.errno == errno.EBUSY
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)  # allowed: new writers only
    src = np.full(N, 0x5A, np.uint8)
    uses = maps.uses
    assert _push(owner, maps, 0x10000, src) == N  # (the remote address is not used: mapped)
    assert maps.uses == uses + 1 and os.pread(fd, N, 0) == src.tobytes()
    maps.close()


def test_a_push_into_a_write_sealed_read_only_mapping_fails_cleanly(owner: Owner) -> None:
    fd = owner.keep(_memfd(N, SHRINK_GROW | fcntl.F_SEAL_WRITE))
    ro = mmap.mmap(fd, N, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        view = np.frombuffer(ro, np.uint8)
        src = np.full(N, 0xA5, np.uint8)
        with pytest.raises(OSError, match="after 0 bytes") as err:
            _push(owner, None, int(view.ctypes.data), src)
        assert err.value.errno == errno.EFAULT
        assert not view.any()
        del view
    finally:
        ro.close()


def test_records_at_the_integer_limits_place_nothing(owner: Owner) -> None:
    size, fd, ino = owner.alloc.size, owner.alloc.fd, owner.alloc.ino
    owner.announce([
        [TOP, 0, fd, 0, ino], [2, 0, fd, 0, ino],            # slot: 2**64 - 1, one past (2 slots)
        [0, TOP, fd, 0, ino], [0, 1 << 20, fd, 0, ino],      # tensor
        [1, 0, fd, TOP, ino], [1, 0, fd, size, ino],         # offset
        [1, 1, TOP, 0, ino], [1, 1, 0x80000000, 0, ino],     # fd number
        [1, 1, fd, 0, TOP],                                  # inode
    ])
    maps = owner.map()
    assert maps is not None and len(maps) == 1  # (the one valid file, named by refused rows)
    assert maps.placed(0) == 0 and maps.placed(1) == 0
    maps.close()
