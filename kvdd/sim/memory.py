"""Host memory of the simulator: registered regions and the checks every copy relies on.

A registered cache tensor becomes a :class:`kvdd._native._copy.Region` (address, size, keep-alive
owner).  Copies only ever run between Regions, and the copy kernels re-check every run against
the Regions' bounds, so no byte outside a registered tensor is touched (SEMANTICS.md §10 rule 1).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

try:
    from .._native._copy import Region, RegionTable, copy_runs
except ImportError as _exc:  # pragma: no cover - depends on how kvdd was started
    import os as _os

    raise ImportError(
        f"kvdd's compiled copy kernels are missing ({_exc}). kvdd is being imported from "
        f"{_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))}: if that is a source "
        "checkout, Python found it before the installed package (the current directory comes "
        "first on sys.path for `python script.py` and `python -m`); run from another directory, "
        "use the `kvdd` command, or install in editable mode (pip install --no-build-isolation -e .)."
    ) from _exc

__all__ = ["Region", "RegionTable", "copy_runs", "first_inaccessible"]

def _read_rw_spans() -> tuple[list[int], list[int]]:
    # /proc/self/maps as sorted, merged [start, end) spans of readable+writable memory.
    starts: list[int] = []
    ends: list[int] = []
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            fields = line.split(None, 2)
            if len(fields) < 2 or not fields[1].startswith(b"rw"):
                continue
            lo_s, hi_s = fields[0].split(b"-")
            lo, hi = int(lo_s, 16), int(hi_s, 16)
            if ends and ends[-1] == lo:
                ends[-1] = hi
            else:
                starts.append(lo)
                ends.append(hi)
    return starts, ends


def first_inaccessible(addrs: Sequence[int], nbytes: int) -> int:
    """Index of the first ``[addr, addr + nbytes)`` in ``addrs`` that is not readable and writable
    memory of this process, or -1 when all are.

    Used at registration (SEMANTICS.md §10 rule 4): ``/proc/self/maps`` is read afresh once per
    call (about a hundred microseconds), so memory unmapped since an earlier check is never
    accepted; each distinct address is checked once.  On systems without ``/proc`` every non-null
    range is accepted.
    """
    spans: tuple[list[int], list[int]] | None
    try:
        spans = _read_rw_spans()
    except OSError:
        spans = None
    seen: set[int] = set()
    for i, addr in enumerate(addrs):
        if addr in seen:
            continue
        if nbytes <= 0 or addr <= 0 or addr + nbytes > 2**64:
            return i
        if spans is not None:
            j = bisect.bisect_right(spans[0], addr) - 1
            if j < 0 or spans[1][j] < addr + nbytes:
                return i
        seen.add(addr)
    return -1
