"""The registration address check (kvdd.sim.memory.first_inaccessible) asks the kernel afresh
per call: PROCMAP_QUERY per VMA where the kernel answers it, else the whole /proc/self/maps.  Both
ways give the same answer for readable+writable, read-only, unmapped and VMA-spanning ranges."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator

import pytest

from kvdd.sim import memory
from shared_support import passes_in_a_forked_child

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@pytest.fixture
def pages() -> Iterator[int]:
    """Six rw pages; page 2 made read-only, page 4 unmapped (VMAs: [0,2) rw, [2,3) r, [3,4) rw,
    hole, [5,6) rw)."""
    mm = mmap.mmap(-1, 6 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert libc.mprotect(base + 2 * PAGE, PAGE, mmap.PROT_READ) == 0
    assert libc.munmap(base + 4 * PAGE, PAGE) == 0
    yield base
    libc.munmap(base, 6 * PAGE)  # mm itself is never closed: its buffer export pins it


def _both(addrs: list[int], nbytes: int, monkeypatch: pytest.MonkeyPatch) -> int:
    fast = memory.first_inaccessible(addrs, nbytes)
    with monkeypatch.context() as m:
        m.setattr(memory, "_maps", lambda: None)
        slow = memory.first_inaccessible(addrs, nbytes)
    assert fast == slow, (addrs, nbytes)
    return fast


def test_procmap_query_answers_here() -> None:
    if memory._maps() is None:
        pytest.skip("this kernel does not answer PROCMAP_QUERY (Linux < 6.11): maps are read")


def test_ranges(pages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    b = pages
    assert _both([b], 2 * PAGE, monkeypatch) == -1  # rw
    assert _both([b + PAGE], PAGE + 1, monkeypatch) == 0  # one byte into the read-only page
    assert _both([b + 3 * PAGE], PAGE, monkeypatch) == -1
    assert _both([b + 3 * PAGE], PAGE + 1, monkeypatch) == 0  # into the hole
    assert _both([b + 5 * PAGE], PAGE, monkeypatch) == -1
    assert _both([b, b + PAGE, b + 2 * PAGE], PAGE, monkeypatch) == 2
    assert _both([b, b, b + 4 * PAGE], 16, monkeypatch) == 2
    assert _both([b + 5 * PAGE, 0], 8, monkeypatch) == 1
    assert _both([b], 0, monkeypatch) == 0
    assert _both([2**64 - PAGE], 2 * PAGE, monkeypatch) == 0
    # rw VMAs that touch: [3,4) made rw again next to [2,3) made rw: one range over both
    assert libc.mprotect(b + 2 * PAGE, PAGE, mmap.PROT_READ | mmap.PROT_WRITE) == 0
    assert _both([b], 4 * PAGE, monkeypatch) == -1
    # unmapped after a check that accepted it: refused now
    assert libc.munmap(b + 5 * PAGE, PAGE) == 0
    assert _both([b + 5 * PAGE], PAGE, monkeypatch) == 0


def test_a_forked_child_asks_about_its_own_memory(pages: int) -> None:
    memory.first_inaccessible([pages], PAGE)  # the parent's fd is open now

    def in_child() -> bool:  # the child unmaps page 0; the parent still has it
        libc.munmap(pages, PAGE)
        return memory.first_inaccessible([pages], PAGE) == 0

    passes_in_a_forked_child(in_child)
    assert memory.first_inaccessible([pages], PAGE) == -1
