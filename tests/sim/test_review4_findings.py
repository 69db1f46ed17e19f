"""review4: defects found in the compiled transfer path (kvdd/sim/_fastpath.pyx). Each test FAILS
on the code it was written against (main at 15fd041) and passes once the defect is fixed.

F1 (low): the compiled path converts CacheIndex / KvCacheExtParam fields to C int64 without
declining when they do not fit, so it raises OverflowError out of the facade where the Python path
returns the call's LLM status. The public constructors keep the fields inside their C++ widths, so
only a value set past the frozen dataclass's validation (``object.__setattr__``) reaches it, but the
module's contract ("anything else ... it declines having done nothing; statuses and exceptions come
from the Python path alone") is broken. Fix: kvdd/sim/_fastpath.pyx lines 79-83 (_ext), 251, 316,
367, 411 and 420: read the fields as Python objects and decline unless ``type(v) is int`` and the
value is inside the C type (as _u32 does), or catch OverflowError around the conversions and
return ``self._no()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvdd import Cache, CacheIndex, KvCacheExtParam, LlmRole

from test_review4_equivalence import Side, both_ways, link, make_side


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
