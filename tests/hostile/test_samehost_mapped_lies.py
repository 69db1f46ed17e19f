"""A linked same-host peer whose cache lives in ``kvdd.empty`` memory (so the reader copies it
through a mapping of the owner's file) and that lies in its hello about the cache's addresses and
size (kvdd.sim._fastpath + kvdd._native._xproc.SameHostMover and PeerMaps, and the Python path's
``pvm_copy``).

A mapped copy does not use the announced address, only the tensor's place in the owner's file, so
the lie must reach the owner's file and nothing else: a size that fits the file from the tensor's
place is copied through the mapping (a row past the real cache reads or writes the owner's own
file there), one byte more goes through ``/proc/<pid>/mem`` at the announced address (the owner's
memory, as in test_samehost_lying_peer.py).  Both paths answer alike, every byte of both processes
alike; our guards and our page at FIXED never change (``_both_paths`` asserts it).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterator

import pytest

from kvdd import Status
from kvdd._native import _xproc
from kvdd.sim.fabric import samehost

import hostile.test_samehost_lying_peer as lying
from hostile.test_samehost_lying_peer import FIXED, GUARD, N, OPS, PAGE, World, _both_paths

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])


# The owner's arena is a kvdd.empty file of N + 2 * G bytes with a page of the owner's own right
# above it, BEYOND (0xBE, reset with the rest; its digest is the third of "sum"): a row past the
# file at the announced address reads or writes that page, never memory the owner's interpreter
# uses (which changes as it runs, and which a write could corrupt).  The page is made by mapping
# N + 2 * G + N bytes and unmapping all but the top N: the file's mapping, placed top-down, takes
# the hole below it (checked; tried again elsewhere if something else took it).
_ARENA = """\
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
kept = []
for _ in range(64):
    hole = libc.mmap(None, N + 2 * G + N, 3, 0x22, -1, 0)
    assert hole not in (None, ctypes.c_void_p(-1).value) and libc.munmap(hole, N + 2 * G) == 0
    arena = kvdd.empty(N + 2 * G, np.uint8)
    if int(arena.ctypes.data) == hole:
        break
    kept.append(arena)
else:
    raise SystemExit("no arena with a page of ours above it")
beyond = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(hole + N + 2 * G))
"""
_PLACED = (
    ("arena = np.empty(N + 2 * G, np.uint8)\n", _ARENA),
    ("    arena[:] = 0x77\n", "    arena[:] = 0x77\n    beyond[:] = 0xBE\n"),
    ("hashlib.sha256(fixed.tobytes()).hexdigest()[:16], flush=True)",
     "hashlib.sha256(fixed.tobytes()).hexdigest()[:16],\n"
     "              hashlib.sha256(beyond.tobytes()).hexdigest()[:16], flush=True)"),
)


def _digest(data: bytes) -> str:
    """As the owner's "sum" shows a region."""
    return hashlib.sha256(data).hexdigest()[:16]


@pytest.fixture(scope="module")
def world(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[World]:
    owner = lying._OWNER
    for honest, placed in _PLACED:
        assert honest in owner
        owner = owner.replace(honest, placed)
    monkeypatch_module.setattr(lying, "_OWNER", owner)
    _unmap_fixed()  # (a World of test_samehost_lying_peer.py in this process keeps it mapped)
    w = World()
    yield w
    w.close()
    _unmap_fixed()


def _unmap_fixed() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    assert libc.munmap(FIXED, PAGE) == 0


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _maps(w: World) -> _xproc.PeerMaps:
    maps = w.peer._path._reader.maps  # type: ignore[union-attr]
    assert isinstance(maps, _xproc.PeerMaps) and maps.placed(0) == 1
    return maps


@pytest.mark.parametrize("op", OPS)
def test_size_lies_reach_only_the_owners_file_or_memory(world: World, op: str) -> None:
    """The tensor sits GUARD bytes into a file of N + 2 * GUARD bytes: a claimed size up to the
    file's end is copied through the mapping by both paths (whatever address was announced); one
    byte more, or 2**40, or 2**62 - 1, through /proc/<pid>/mem at the announced address."""
    maps = _maps(world)
    avail = maps.mapped_bytes - GUARD
    assert avail == N + GUARD
    for nbytes, mapped in ((N, True), (avail, True), (avail + 1, False), (1 << 40, False),
                           ((1 << 62) - 1, False)):
        for addrs in (None, (FIXED,), (1 << 63,)):
            world.lie(addrs=addrs, tensor_nbytes=nbytes, batch_size=1 << 20, stride_nbytes=N)
            try:
                for row in (0, 1, 2):
                    uses = maps.uses
                    st, state, got, taken = _both_paths(world, op, row)
                    fits = (row + 1) * N <= nbytes
                    if not fits:  # (a block's tail run of nbytes % N bytes: the §3.11 quirk)
                        assert st in (Status.LLM_PARAM_INVALID, Status.LLM_SUCCESS,
                                      Status.LLM_FAILED), (nbytes, addrs, row)
                        continue
                    if mapped:  # both paths through the mapping, whatever the address said
                        assert (st, taken, maps.uses - uses) == (Status.LLM_SUCCESS, 1, 2)
                        if op.startswith("pull"):
                            assert got == (b"\x0a" if row == 0 else b"\x77") * N
                    else:
                        assert maps.uses == uses, (nbytes, addrs, row)
                        if addrs == (FIXED,) and st == Status.LLM_SUCCESS and op == "pull":
                            assert got == b"\xc1" * N  # the owner's page at FIXED, not ours
                        if addrs is None and row == 2:  # past the file: the owner's BEYOND
                            assert st == Status.LLM_SUCCESS, (nbytes, op)
                            if op.startswith("push"):  # (a push has no remainder rule: §3.13)
                                assert state[2].split()[2] == _digest(b"\x33" * N)
                            else:  # a pulled block group copies R.T % L.S bytes when not 0 (§3.11)
                                moved = nbytes % N if op == "pull_blocks" and nbytes % N else N
                                assert got == b"\xbe" * moved + b"\x33" * (N - moved)
            finally:
                world.lie()
