"""The compiled transfer path (kvdd/sim/_fastpath.pyx) declines, having done nothing, what does not
fit its C types: CacheIndex / KvCacheExtParam fields set past the frozen dataclasses' validation
(``object.__setattr__``) to values outside int64.  The public constructors keep the fields inside
their C++ widths, so only such a value reaches it; the Python path then returns the call's LLM
status, exactly as with the compiled path off (the module's contract: "anything else ... it
declines having done nothing; statuses and exceptions come from the Python path alone").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvdd import Cache, CacheIndex, KvCacheExtParam, LlmRole

from fastpath_support import both_ways
from test_fastpath_equivalence import Side, link, make_side


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
def test_index_fields_past_int64_are_declined_not_raised(pd: tuple[Side, Side, int, int], field: str,
                                                             value: int) -> None:
    """pull_kv_cache(CacheIndex with cache_id 2**63 set past validation) gives the Python path's
    LLMKvCacheNotExistError with the compiled path on and off (never an OverflowError)."""
    p, d, rid, lid = pd
    idx = CacheIndex(1, rid, 0)
    object.__setattr__(idx, field, value)
    for call in _calls(d, lid, idx, None):
        both_ways((p, d), call)


def test_ext_fields_past_int64_are_declined_not_raised(pd: tuple[Side, Side, int, int]) -> None:
    """tensor_num_per_layer = 2**64 (set past validation): the Python path's LLMParamInvalidError
    with the compiled path on and off (never an OverflowError)."""
    p, d, rid, lid = pd
    ext = KvCacheExtParam((0, 0), (0, 0), 2)
    object.__setattr__(ext, "tensor_num_per_layer", 2**64)
    for call in _calls(d, lid, CacheIndex(1, rid, 0), ext):
        both_ways((p, d), call)
