"""The on/off comparison of the compiled in-process path (kvdd.sim._fastpath), shared by
test_fastpath*.py and test_region_leases.py: a call runs with the path on, then off, from the same
bytes, and must give equal outcomes and equal memory on every side."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

import kvdd
from kvdd import LlmDataDist
from kvdd.sim import _fastpath


class Filled(Protocol):
    """An instance whose cache memory a comparison fills and reads back."""

    dd: LlmDataDist

    def fill(self, seed: int) -> None: ...

    def memory(self) -> list[np.ndarray]: ...


def fast(side: Filled) -> _fastpath.FastTransfers:
    """The instance's compiled path (its counters)."""
    f = side.dd.backend.fast_transfers  # type: ignore[attr-defined]
    assert isinstance(f, _fastpath.FastTransfers)
    return f


def outcome(call: Callable[[], None]) -> tuple[str, str]:
    """``("ok", "")`` or the exception's type name and message."""
    try:
        call()
    except (kvdd.LLMError, TypeError, ValueError, OverflowError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def both_ways(sides: Sequence[Filled], call: Callable[[], None], seed: int = 7) -> tuple[bool, tuple[str, str]]:
    """`call` with the compiled path on, then off, from the same bytes (side ``i`` filled from
    ``seed + i``): equal outcomes and equal bytes of every side. Returns (taken by the compiled
    path, outcome)."""
    results = []
    taken = 0
    for on in (True, False):
        for i, s in enumerate(sides):
            s.fill(seed + i)
        before = sum(fast(s).taken for s in sides)
        prev = _fastpath.set_enabled(on)
        try:
            out = outcome(call)
        finally:
            _fastpath.set_enabled(prev)
        if on:
            taken = sum(fast(s).taken for s in sides) - before
        results.append((out, [m for s in sides for m in s.memory()]))
    (out_on, mem_on), (out_off, mem_off) = results
    assert out_on == out_off
    assert len(mem_on) == len(mem_off)
    for a, b in zip(mem_on, mem_off):
        np.testing.assert_array_equal(a, b)
    assert taken in (0, 1) and (taken == 0 or out_on[0] == "ok")
    return taken == 1, out_on
