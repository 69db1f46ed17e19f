"""Host memory with guard pages for the property and stress suites.

``GuardedArena`` maps ``guard | size | guard`` bytes of anonymous memory and makes both guards
``PROT_NONE``.  Addresses inside ``[base, base + size)`` are readable and writable; every byte just
around them is not, so a registration that runs off the end of the arena is refused by the
simulator (kvdd rule 4: not memory of this process) and a copy that would stray outside it
crashes loudly instead of corrupting something silently.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np
import numpy.typing as npt

__all__ = ["GuardedArena", "PAGE"]

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE = 0


class GuardedArena:
    """``size`` bytes (rounded up to pages) between two ``guard``-byte PROT_NONE guards."""

    def __init__(self, size: int, guard: int) -> None:
        self.size = -(-size // PAGE) * PAGE
        self.guard = -(-guard // PAGE) * PAGE
        total = self.size + 2 * self.guard
        addr = _libc.mmap(None, total, mmap.PROT_READ | mmap.PROT_WRITE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap failed")
        self._map = int(addr)
        self._total = total
        for start in (self._map, self._map + self.guard + self.size):
            if _libc.mprotect(start, self.guard, _PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect failed")
        self.base = self._map + self.guard
        buf = (ctypes.c_uint8 * self.size).from_address(self.base)
        self.view: npt.NDArray[np.uint8] = np.ctypeslib.as_array(buf)

    def fill(self, seed: int) -> None:
        """A deterministic pseudo-random pattern (every byte distinct enough to see a wrong copy)."""
        rng = np.random.default_rng(seed)
        self.view[:] = rng.integers(0, 256, self.size, dtype=np.uint8)

    def bytes(self) -> bytes:
        return self.view.tobytes()

    def close(self) -> None:
        """Unmap (only when nothing registered on it remains)."""
        if self._map:
            del self.view
            _libc.munmap(self._map, self._total)
            self._map = 0
