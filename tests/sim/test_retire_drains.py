"""A second retire of a cache waits for the first caller's drains.

A drain is how a same-host one-sided reader's copies are revoked and waited for
(kvdd/sim/fabric/samehost_path.py ServedTable.drain).  A second concurrent CacheEntry.retire() (a
second UnregisterKvCache of the same id, or Finalize racing an UnregisterKvCache: Finalize retires
the entries being unregistered too) must not return while the first caller still runs the entry's
drains: such a copy may still read the cache's memory, which the caller may then free or reuse
(SEMANTICS.md §10 rule 5: "a second unregister of the id waits as the first does").  The first
caller sets a "drains done" event after running the drains; every caller waits for it (within its
timeout) before waiting for the leases and before clearing the regions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from kvdd import LlmRole
from kvdd.sim.entries import CacheEntry

from test_fastpath_equivalence import make_side


def _second_returns_during_drain(entry: CacheEntry, first: Callable[[], object],
                                 second: Callable[[], object]) -> bool:
    """`first` (which retires `entry`) runs in a thread until `entry`'s drain (a same-host reader's
    copy still running: revoked, waited for) has started; whether `second`, started then, returns
    within 0.3 s while that drain still runs."""
    entered, finish = threading.Event(), threading.Event()

    def drain() -> None:
        entered.set()
        finish.wait(10)

    assert entry.add_drain(drain)
    t = threading.Thread(target=first, daemon=True)
    t.start()
    done = threading.Event()
    try:
        assert entered.wait(10)

        def run_second() -> None:
            second()
            done.set()

        threading.Thread(target=run_second, daemon=True).start()
        returned_early = done.wait(0.3)
    finally:
        finish.set()
        t.join(10)
        done.wait(10)
    return returned_early


def test_a_second_retire_waits_for_the_first_callers_drains() -> None:
    a = np.zeros(128, np.uint8)
    entry = CacheEntry(3, 2, 64, 4, 1, [a.ctypes.data, a.ctypes.data + 64], (a,))
    assert not _second_returns_during_drain(entry, entry.retire, entry.retire), \
        "a second retire() returned while the first caller's drain still ran"


def test_a_second_unregister_waits_for_a_running_drain() -> None:
    """The same through the engine: two UnregisterKvCache of one id, a drain running."""
    p = make_side(1, LlmRole.PROMPT)
    try:
        rid = p.register(2, (4, 16))
        entry = p.dd.backend.caches[rid]  # type: ignore[attr-defined]
        unregister = lambda: p.dd.unregister_kv_cache(rid)  # noqa: E731
        assert not _second_returns_during_drain(entry, unregister, unregister), \
            "a second UnregisterKvCache returned while a drain still ran"
    finally:
        p.dd.finalize()


def test_finalize_racing_an_unregister_waits_for_its_drain() -> None:
    """Finalize retires the entries being unregistered too; it must not return while the
    unregister's drain (a same-host reader's copy) still runs."""
    p = make_side(1, LlmRole.PROMPT)
    rid = p.register(2, (4, 16))
    entry = p.dd.backend.caches[rid]  # type: ignore[attr-defined]
    assert not _second_returns_during_drain(entry, lambda: p.dd.unregister_kv_cache(rid), p.dd.finalize), \
        "Finalize returned while an unregister's drain still ran"
