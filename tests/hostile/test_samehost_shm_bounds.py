"""Process-wide properties of the same-host path's mapped copies (kvdd._native._xproc.PeerMaps,
kvdd.sim.fabric.samehost_shm.map_owner) that one link's checks cannot give:

* a forked child of the reader holds none of the peer's memory (MADV_DONTFORK), and the range
  where it was mapped may hold the child's own memory since: a copy in the child never goes
  through the parent's mappings (it uses /proc/<pid>/mem), and closing them there unmaps nothing;
* the mappings of all links together stay within MAX_PROCESS_MAPS mappings and
  MAX_PROCESS_MAP_BYTES bytes (a peer holds up to MAX_LINKS links to a listener: 1024 mappings or
  1 TiB per link would exhaust vm.max_map_count or the address space of the whole process).

The owner is this very process, as in test_samehost_shm_checks.py.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import samehost, samehost_shm

from hostile.test_samehost_shm_checks import N, Owner, _memfd
from shared_support import passes_in_a_forked_child

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

_MAP_FIXED_NOREPLACE = 0x100000


@pytest.fixture
def owner() -> Iterator[Owner]:
    o = Owner()
    yield o
    o.close()


def _kvdd_ranges(ino: int | None = None) -> set[tuple[int, int]]:
    """The ranges of this process's mappings of kvdd's cache files (of the file ``ino`` only,
    when given: another test's objects freed meanwhile may map or unmap others)."""
    with open("/proc/self/maps") as f:
        return {tuple(int(x, 16) for x in line.split()[0].split("-"))  # type: ignore[misc]
                for line in f if "memfd:kvdd-cache" in line
                and (ino is None or int(line.split()[4]) == ino)}


def test_a_forked_child_never_copies_through_the_parents_mappings(owner: Owner) -> None:
    owner.announce([owner.row()])
    ino = owner.alloc.ino
    before = _kvdd_ranges(ino)  # (the owner's own mapping of its file)
    maps = owner.map()
    assert maps is not None
    (lo, hi), = _kvdd_ranges(ino) - before  # the reader's mapping of the owner's file
    mem = _xproc.mem_open(os.getpid(), owner.pidfd)  # the parent's memory, as a link opens it
    src = np.full(N, 0xC3, np.uint8)
    z, ln = np.array([0], np.int64), np.array([N], np.int64)

    def in_child() -> bool:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        p = libc.mmap(lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0)
        assert p == lo, os.strerror(ctypes.get_errno())  # the child's own memory there
        mine = np.ctypeslib.as_array((ctypes.c_ubyte * (hi - lo)).from_address(lo))
        mine[:] = 0x5A
        uses = maps.uses
        _xproc.pvm_copy(os.getppid(), [Region(int(src.ctypes.data), N, src)],
                        [int(owner.arena.ctypes.data)], N, z, z, ln, True,
                        pidfd=owner.pidfd, leases=owner.table, slot=0, mem_fd=mem,
                        maps=maps, map_tensors=(0,))
        ok = maps.uses == uses and bool((mine == 0x5A).all())
        ok = ok and bool((owner.arena == 0xC3).all())  # (MAP_SHARED: the parent's bytes)
        maps.close()
        return ok and bool((mine == 0x5A).all())  # still mapped: nothing unmapped here

    passes_in_a_forked_child(in_child)
    os.close(mem)
    assert (owner.arena == 0xC3).all()
    assert _kvdd_ranges(ino) - before == {(lo, hi)}  # the parent's mapping is untouched
    maps.close()


def test_a_forked_child_maps_nothing_with_its_parents_peer_maps(owner: Owner) -> None:
    maps = _xproc.PeerMaps(1)

    def in_child() -> bool:
        with pytest.raises(ValueError):
            maps.add(owner.alloc.fd, owner.alloc.ino)
        return True

    passes_in_a_forked_child(in_child)
    maps.close()


@pytest.fixture
def files(owner: Owner) -> list[tuple[int, int]]:
    """Three more sealed memfds of N bytes (fd, inode), kept open by ``owner``."""
    out = []
    for _ in range(3):
        fd = owner.keep(_memfd(N))
        out.append((fd, os.fstat(fd).st_ino))
    return out


def test_the_process_maps_at_most_max_process_maps_files(
        owner: Owner, files: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    held = _xproc.peer_map_totals()[0]
    monkeypatch.setattr(samehost_shm, "MAX_PROCESS_MAPS", held + 3)
    rows = [[0, 0, fd, 0, ino] for fd, ino in files[:2]]
    owner.announce(rows)
    first = owner.map()  # two links of two files each: 4 > 3
    second = owner.map()
    assert first is not None and second is not None
    assert len(first) == 2 and len(second) == 1  # exactly at the bound, then one past: none
    assert _xproc.peer_map_totals()[0] == held + 3
    third = owner.map()
    assert third is None
    second.close()
    assert _xproc.peer_map_totals()[0] == held + 2
    again = owner.map()
    assert again is not None and len(again) == 1
    for m in (first, again):
        m.close()
    assert _xproc.peer_map_totals()[0] == held


def test_the_process_maps_at_most_max_process_map_bytes(
        owner: Owner, files: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    held = _xproc.peer_map_totals()[1]
    monkeypatch.setattr(samehost_shm, "MAX_PROCESS_MAP_BYTES", held + 3 * N)
    owner.announce([[0, 0, fd, 0, ino] for fd, ino in files[:2]])
    first = owner.map()
    second = owner.map()
    assert first is not None and len(first) == 2
    assert second is not None and len(second) == 1  # 3 N exactly; the fourth file is one past
    assert _xproc.peer_map_totals()[1] == held + 3 * N
    first.close()
    second.close()
    assert _xproc.peer_map_totals()[1] == held


def test_peer_maps_add_counts_against_the_process_bounds(owner: Owner) -> None:
    maps = _xproc.PeerMaps(1)
    try:
        held_maps, held_bytes = _xproc.peer_map_totals()
        size = owner.alloc.size
        with pytest.raises(ValueError, match="bounds"):
            maps.add(owner.alloc.fd, owner.alloc.ino, process_maps=held_maps)
        with pytest.raises(ValueError, match="bounds"):
            maps.add(owner.alloc.fd, owner.alloc.ino, process_bytes=held_bytes + size - 1)
        assert maps.add(owner.alloc.fd, owner.alloc.ino, process_maps=held_maps + 1,
                        process_bytes=held_bytes + size) == 0
        assert _xproc.peer_map_totals() == (held_maps + 1, held_bytes + size)
    finally:
        maps.close()
    assert _xproc.peer_map_totals() == (held_maps, held_bytes)


def test_place_rows_places_as_place_does_row_by_row(owner: Owner) -> None:
    """The one C loop map_owner places the records with: the same as :meth:`place` per row, in
    order, at every bound (slot, tensor, mapping index, offset) and one past."""
    size = owner.alloc.size
    rng = np.random.default_rng(7)
    slots, big = 3, (1 << 20)
    rows = np.zeros((400, 5), np.uint64)
    def pick(values: list[int]) -> np.ndarray:
        return np.array(values, np.uint64)[rng.integers(0, len(values), 400)]

    rows[:, 0] = pick([0, 1, slots - 1, slots, 2**63])
    rows[:, 1] = pick([0, 1, 5, big - 1, big, 2**64 - 1])
    rows[:, 3] = pick([0, 1, size - 1, size, 2**64 - 1])
    index = rng.choice([-1, 0, 1, 2], 400).astype(np.int64)  # 2: one past the mappings
    one, bulk = _xproc.PeerMaps(slots), _xproc.PeerMaps(slots)
    try:
        for m in (one, bulk):
            for _ in range(2):
                m.add(owner.alloc.fd, owner.alloc.ino)
        want = sum(one.place(int(r[0]) if r[0] < 2**62 else 2**62, int(r[1]) if r[1] < 2**62
                             else 2**62, int(i), int(r[3])) for r, i in zip(rows, index))
        assert bulk.place_rows(rows, index) == want > 0
        for s in range(slots):
            assert bulk.placed(s) == one.placed(s)
    finally:
        one.close()
        bulk.close()


def test_the_process_holds_at_most_max_process_places(
        owner: Owner, monkeypatch: pytest.MonkeyPatch) -> None:
    """2**18 records per link hold about 40 MiB of places: over all links at most
    MAX_PROCESS_PLACES entries (a tensor not placed is copied through /proc/<pid>/mem)."""
    held = _xproc.peer_placed_total()
    monkeypatch.setattr(samehost_shm, "MAX_PROCESS_PLACES", held + 4)
    owner.announce([owner.row(0, 0), owner.row(0, 1), owner.row(1, 0)])
    first = owner.map()
    assert first is not None and first.placed(0) == 2 and first.placed(1) == 1
    assert _xproc.peer_placed_total() == held + 3
    second = owner.map()  # one entry left: (0, 0) exactly at the bound, the next one past
    assert second is not None and second.placed(0) == 1 and second.placed(1) == 0
    assert _xproc.peer_placed_total() == held + 4
    first.close()
    assert _xproc.peer_placed_total() == held + 1
    second.close()
    assert _xproc.peer_placed_total() == held


def test_peer_maps_collected_with_cyclic_garbage_unmaps_and_gives_its_share_back(
        owner: Owner) -> None:
    """A reader's PeerMaps is held by a cycle (OneSidedPeer <-> its SameHostMover): when the
    garbage collector frees that cycle, the mappings are unmapped and the process-wide counts
    given back, whatever order the collector clears the cycle's objects in (a cleared PeerMaps
    kept them: every such link took its files and places from every later link for good)."""
    import gc

    class Reader:
        maps: object
        me: object

    gc.collect()  # earlier tests' garbage goes before the counts are read
    held, placed = _xproc.peer_map_totals(), _xproc.peer_placed_total()
    for first in (True, False):  # the PeerMaps before or after the cycle's other objects
        gc.collect()  # earlier tests' garbage (kvdd.empty arrays) goes now, not in the check below
        before = _kvdd_ranges()
        maps = _xproc.PeerMaps(2)
        maps.add(owner.alloc.fd, owner.alloc.ino)
        assert maps.place_rows(np.array([owner.row(1, 0)], np.uint64),
                               np.array([0], np.int64)) == 1
        assert len(_kvdd_ranges() - before) == 1
        reader = Reader()
        reader.maps = [maps, reader] if first else [reader, maps]
        reader.me = reader
        del maps, reader
        gc.collect()
        assert _xproc.peer_map_totals() == held
        assert _xproc.peer_placed_total() == placed
        assert _kvdd_ranges() == before  # the reader's mapping is gone


def test_a_forked_childs_bounds_count_only_its_own_mappings(owner: Owner) -> None:
    """A forked child holds none of its parent's mappings (MADV_DONTFORK): they do not count
    against the child's MAX_PROCESS_MAPS / MAX_PROCESS_MAP_BYTES (the child's links were refused
    as if it held them), and closing the inherited PeerMaps there lowers no count."""
    parent = _xproc.PeerMaps(1)
    parent.add(owner.alloc.fd, owner.alloc.ino)
    held = _xproc.peer_map_totals()
    size = owner.alloc.size

    def in_child() -> bool:
        ok = _xproc.peer_map_totals() == (0, 0)
        mine = _xproc.PeerMaps(1)
        ok = ok and mine.add(owner.alloc.fd, owner.alloc.ino, process_maps=1,
                             process_bytes=size) == 0  # exactly at both bounds
        ok = ok and _xproc.peer_map_totals() == (1, size)
        parent.close()  # the inherited one: nothing of it counted here
        ok = ok and _xproc.peer_map_totals() == (1, size)
        mine.close()
        return ok and _xproc.peer_map_totals() == (0, 0)

    passes_in_a_forked_child(in_child)
    assert _xproc.peer_map_totals() == held
    parent.close()
    assert _xproc.peer_map_totals() == (held[0] - 1, held[1] - size)
