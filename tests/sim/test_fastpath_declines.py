"""review4: defects found around the compiled transfer path (F1: kvdd/sim/_fastpath.pyx; F2:
kvdd/sim/entries.py CacheEntry.retire). Each test failed on the code it was written against (main at
15fd041, and main merged at 03:11); the integrator fixed both in main 4758c4e, where they pass and
now guard the fixes. The line numbers below are those of the code before the fix.

F1 (low): the compiled path converts CacheIndex / KvCacheExtParam fields to C int64 without
declining when they do not fit, so it raises OverflowError out of the facade where the Python path
returns the call's LLM status. The public constructors keep the fields inside their C++ widths, so
only a value set past the frozen dataclass's validation (``object.__setattr__``) reaches it, but the
module's contract ("anything else ... it declines having done nothing; statuses and exceptions come
from the Python path alone") is broken. Fix: kvdd/sim/_fastpath.pyx lines 79-83 (_ext), 254, 319,
370, 414 and 423 (as merged at 03:11): read the fields as Python objects and decline unless
``type(v) is int`` and the value is inside the C type (as _u32 does), or catch OverflowError
around the conversions and return ``self._no()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvdd import Cache, CacheIndex, KvCacheExtParam, LlmRole
from kvdd.sim.entries import CacheEntry

from fastpath_support import both_ways
from test_review4_equivalence import Side, link, make_side


@pytest.fixture
def pd() -> Iterator[tuple[Side, Side, int, int]]:
    p, d = make_side(1, LlmRole.PROMPT), make_side(2, LlmRole.DECODER)
    try:
        rid = p.register(4, (8, 32))
        lid = d.register(4, (8, 32))
        link(d, p)
        yield p, d, rid, lid
    finally:
        d.dd.finalize()
        p.dd.finalize()


def _calls(d: Side, lid: int, idx: CacheIndex, ext: KvCacheExtParam | None) -> list[Callable[[], None]]:
    return [
        lambda: d.dd.pull_kv_cache(idx, Cache(lid), 0, -1, ext),
        lambda: d.dd.pull_kv_blocks(idx, Cache(lid), [0], [0], ext),
        lambda: d.dd.push_kv_cache(d.cache(lid), idx, 0, -1, ext),
        lambda: d.dd.push_kv_blocks(d.cache(lid), idx, [0], [0], ext),
    ]


@pytest.mark.parametrize("field, value", [("cache_id", 2**63), ("cache_id", 2**64 + 5), ("batch_index", 2**64)])
def test_F1_index_fields_past_int64_are_declined_not_raised(pd: tuple[Side, Side, int, int], field: str,
                                                             value: int) -> None:
    """F1: pull_kv_cache(CacheIndex with cache_id 2**63 set past validation) raises OverflowError
    with the compiled path on, LLMKvCacheNotExistError with it off."""
    p, d, rid, lid = pd
    idx = CacheIndex(1, rid, 0)
    object.__setattr__(idx, field, value)
    for call in _calls(d, lid, idx, None):
        both_ways((p, d), call)


def test_F1_ext_fields_past_int64_are_declined_not_raised(pd: tuple[Side, Side, int, int]) -> None:
    """F1: tensor_num_per_layer = 2**64 (set past validation): OverflowError compiled,
    LLMParamInvalidError from the Python path."""
    p, d, rid, lid = pd
    ext = KvCacheExtParam((0, 0), (0, 0), 2)
    object.__setattr__(ext, "tensor_num_per_layer", 2**64)
    for call in _calls(d, lid, CacheIndex(1, rid, 0), ext):
        both_ways((p, d), call)


# ---- F2 ----------------------------------------------------------------------------------------------
# F2 (medium): a second concurrent CacheEntry.retire() (a second UnregisterKvCache of the same id,
# or Finalize racing an UnregisterKvCache: Finalize retires the entries being unregistered too)
# returns as soon as the lease count is 0, while the first caller is still running the entry's
# drains (kvdd/sim/entries.py:78-83: the first caller takes the drain list, the others find it
# empty). A drain is how a same-host one-sided reader's copies are revoked and waited for
# (kvdd/sim/fabric/samehost_path.py ServedTable.drain): the second unregister returns while such a
# copy may still read the cache's memory, which the caller may then free or reuse (§10 rule 5:
# "a second unregister of the id waits as the first does", entries.py's own docstring).
# Fix (entries.py retire): the first caller creates a "drains done" Event under self._lock and sets
# it after running the drains; every caller waits for it (within its timeout) before waiting for
# the leases and before clearing regions/table.

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


def test_F2_a_second_retire_waits_for_the_first_callers_drains() -> None:
    a = np.zeros(128, np.uint8)
    entry = CacheEntry(3, 2, 64, 4, 1, [a.ctypes.data, a.ctypes.data + 64], (a,))
    assert not _second_returns_during_drain(entry, entry.retire, entry.retire), \
        "a second retire() returned while the first caller's drain still ran"


def test_F2_a_second_unregister_waits_for_a_running_drain() -> None:
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


def test_F2_finalize_racing_an_unregister_waits_for_its_drain() -> None:
    """Finalize retires the entries being unregistered too; it must not return while the
    unregister's drain (a same-host reader's copy) still runs."""
    p = make_side(1, LlmRole.PROMPT)
    rid = p.register(2, (4, 16))
    entry = p.dd.backend.caches[rid]  # type: ignore[attr-defined]
    assert not _second_returns_during_drain(entry, lambda: p.dd.unregister_kv_cache(rid), p.dd.finalize), \
        "Finalize returned while an unregister's drain still ran"
