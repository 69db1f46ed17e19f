"""CacheManager's Python layer over a recording engine (PYPKG.md §4; checklist §7.5 items 11, 13,
15, 19/20 (index conversion), 22, 23, 24 (Python parts)): the checks in upstream's order, all
before any engine call, and the exact tuples sent."""

from __future__ import annotations

from typing import Any

import pytest
from pkg_fake import PARAM_INVALID, RecordingWrapper, blocks, contiguous, desc, fake, outcome, started

from kvdd.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMDataDist,
    LLMException,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
)
from kvdd.llm_datadist.v2.cache_manager import CacheManager

__all__ = ["fake"]

PI = LLMStatusCode.LLM_PARAM_INVALID
NONE_ID = 2**64 - 1
RA_OFF = {"llm.EnableCacheManager": "1"}


def cm(options: dict[str, str] | None = None) -> CacheManager:
    return started(options).cache_manager


# -- registration --------------------------------------------------------------------------------


def test_register_cache_checks_in_order(fake: RecordingWrapper) -> None:
    mgr = cm()
    d = desc(2)
    assert outcome(fake, lambda: mgr.register_cache(None, [1, 2])) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.register_cache(d, (1, 2))) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.register_cache(d, [1, "2"])) is TypeError  # type: ignore[list-item]
    assert outcome(fake, lambda: mgr.register_cache(d, [1, 2], [BlocksCacheKey(1)])) is TypeError  # type: ignore[list-item]
    assert outcome(fake, lambda: mgr.register_cache(d, [1, 2], remote_accessible=1)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.register_cache(d, [])) is PI
    assert outcome(fake, lambda: mgr.register_cache(d, [1])) is PI
    assert outcome(fake, lambda: mgr.register_cache(d, [1, 0])) is PI
    assert outcome(fake, lambda: mgr.register_cache(d, [1, -1])) is TypeError  # not a uint64
    # order: addrs type before keys, empty before count
    assert outcome(fake, lambda: mgr.register_cache(d, (1,), [1])) is TypeError  # type: ignore[arg-type, list-item]
    assert outcome(fake, lambda: mgr.register_cache(desc(0), [])) is PI


def test_register_cache_sends_desc_keys_and_flag(fake: RecordingWrapper) -> None:
    mgr = cm()
    d = CacheDesc(2, [4, 8], DataType.DT_BF16, seq_len_dim_index=1)
    keys = [CacheKey(9, 5), CacheKey(9, NONE_ID, 1, 7)]
    cache = mgr.register_cache(d, [0x10, 0x20], keys)
    assert fake.last("register_cache") == ((2, 27, 1, [4, 8], 1, False), [0x10, 0x20],
                                           [(9, -1, 0, 5, NONE_ID, 0, False), (9, -1, 0, NONE_ID, 7, 1, False)],
                                           True)
    assert (cache.cache_id, cache.tensor_addrs, cache.is_blocks_cache, cache.cache_desc) == (1, [0x10, 0x20], False, d)
    assert cache._is_registered and cache._cache_manager is mgr
    assert mgr.register_cache(d, [0x30, 0x40], ()).cache_id == 2


def test_register_blocks_cache_no_count_check_and_mutates_desc(fake: RecordingWrapper) -> None:
    mgr = cm()
    d = desc(4)
    assert outcome(fake, lambda: mgr.register_blocks_cache(d, [])) is PI
    assert outcome(fake, lambda: mgr.register_blocks_cache(d, (1,))) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.register_blocks_cache(d, [1], CacheKey(1, 1))) is TypeError  # type: ignore[arg-type]
    assert not d._is_blocks
    cache = mgr.register_blocks_cache(d, [0x10, 0], BlocksCacheKey(prompt_cluster_id=3, model_id=2))
    assert fake.last("register_cache") == ((4, 1, -1, [8, 16], 1, True), [0x10, 0],
                                           [(3, -1, 0, NONE_ID, NONE_ID, 2, True)], True)
    assert cache.is_blocks_cache and d._is_blocks
    mgr.register_blocks_cache(desc(1), [0x10])
    assert fake.last("register_cache")[2] == []
    # the descriptor stays blocks: register_cache with it registers a BLOCKS entry natively
    again = mgr.register_cache(d, [1, 2, 3, 4])
    assert fake.last("register_cache")[0][5] is True and again.is_blocks_cache is False
    with pytest.raises(TypeError):
        mgr.register_blocks_cache(desc(1), [1], BlocksCacheKey(1, -1))  # out of uint64 when packed


def test_remote_accessible_defaults_and_the_after_link_rule(fake: RecordingWrapper) -> None:
    dd = started()
    mgr = dd.cache_manager
    host = desc(1, placement=Placement.HOST)
    mgr.register_cache(desc(1), [1])
    assert fake.last("register_cache")[3] is True  # DEVICE
    mgr.register_cache(host, [1])
    assert fake.last("register_cache")[3] is False  # HOST
    mgr.register_cache(host, [1], remote_accessible=True)
    assert fake.last("register_cache")[3] is True
    mgr.register_blocks_cache(desc(1), [1], remote_accessible=False)
    assert fake.last("register_cache")[3] is False
    dd.link("c", {2: 0, 3: 1}, "{}")
    assert outcome(fake, lambda: mgr.register_blocks_cache(desc(1), [1], remote_accessible=True)) is PI
    assert outcome(fake, lambda: mgr.register_cache(desc(1), [1], remote_accessible=True)) is PI
    mgr.register_blocks_cache(desc(1), [1])
    assert fake.last("register_cache")[3] is False
    mgr.register_cache(desc(1), [1], remote_accessible=False)
    assert fake.last("register_cache")[3] is False


def test_registration_failure_raises_the_engine_code(fake: RecordingWrapper) -> None:
    mgr = cm()
    fake.status["register_cache"] = PARAM_INVALID
    fake.detail = "a dim <= 0"
    with pytest.raises(LLMException) as exc:
        mgr.register_blocks_cache(desc(2), [1])
    assert exc.value.status_code is PI and "a dim <= 0" in str(exc.value)
    assert str(exc.value).startswith("register_blocks_cache failed, error code is LLMStatusCode.LLM_PARAM_INVALID")


def test_unregister_cache(fake: RecordingWrapper) -> None:
    mgr = cm()
    assert outcome(fake, lambda: mgr.unregister_cache("1")) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.unregister_cache(2**63)) is ValueError
    mgr.unregister_cache(-5)
    assert fake.last("unregister_cache") == (-5,)
    fake.status["unregister_cache"] = 0xFFFFFFFF
    with pytest.raises(LLMException) as exc:
        mgr.unregister_cache(1)
    assert exc.value.status_code is LLMStatusCode.LLM_FAILED


# -- pull_cache ----------------------------------------------------------------------------------


def test_pull_cache_checks_remote_accessible_mode(fake: RecordingWrapper) -> None:
    mgr = cm()
    c = contiguous(mgr)
    b = blocks(mgr)
    key = CacheKeyByIdAndIndex(1, 3, 2)
    assert outcome(fake, lambda: mgr.pull_cache(CacheKey(1, 1), c)) is TypeError
    assert outcome(fake, lambda: mgr.pull_cache(BlocksCacheKey(1), c)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.pull_cache(key, None)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.pull_cache(key, c, 2**32)) is ValueError
    assert outcome(fake, lambda: mgr.pull_cache(key, c, 0, 2**63)) is ValueError
    assert outcome(fake, lambda: mgr.pull_cache(key, b)) is PI
    assert outcome(fake, lambda: mgr.pull_cache(key, c, 0, 0)) is PI
    assert outcome(fake, lambda: mgr.pull_cache(key, c, 0, -2)) is PI
    assert outcome(fake, lambda: mgr.pull_cache(key, c, tensor_num_per_layer=0)) is PI
    assert outcome(fake, lambda: mgr.pull_cache(key, c, tensor_num_per_layer=-1)) is ValueError
    assert outcome(fake, lambda: mgr.pull_cache(key, c, src_layer_range=range(0, 4, 2))) is PI
    assert outcome(fake, lambda: mgr.pull_cache(key, c, dst_layer_range=(0, 1))) is TypeError
    # order: blocks destination before size, size before t
    assert outcome(fake, lambda: mgr.pull_cache(key, b, 0, 0, tensor_num_per_layer=0)) is PI
    mgr.pull_cache(key, c, 5, 64, src_layer_range=range(1, 2), dst_layer_range=range(0, 1), whatever=1)
    assert fake.last("pull_cache_v2") == (c.cache_id, (1, 3, 2, NONE_ID, NONE_ID, 0, False),
                                          (64, 5, [], [], [2, 3], [0, 1], -1, -1, 2))
    mgr.pull_cache(key, c)
    assert fake.last("pull_cache_v2")[2] == (-1, 0, [], [], [], [], -1, -1, 2)


def test_pull_cache_by_cache_key_in_two_sided_mode(fake: RecordingWrapper) -> None:
    mgr = cm(RA_OFF)
    c = contiguous(mgr)
    for bad in (CacheKey(1, NONE_ID), CacheKey(1, 3, prefix_id=4)):  # not exactly one valid id
        assert outcome(fake, lambda: mgr.pull_cache(bad, c)) is PI
    mgr.pull_cache(CacheKey(1, NONE_ID, 2, 6), c, tensor_num_per_layer=1, src_layer_range=range(3))
    assert fake.last("pull_cache_v2") == (c.cache_id, (1, -1, 0, NONE_ID, 6, 2, False),
                                          (-1, 0, [], [], [0, 1, 2], [], -1, -1, 1))


def test_pull_cache_failure_raises(fake: RecordingWrapper) -> None:
    mgr = cm()
    c = contiguous(mgr)
    fake.status["pull_cache_v2"] = 0x5010B01A
    with pytest.raises(LLMException) as exc:
        mgr.pull_cache(CacheKeyByIdAndIndex(1, 1), c)
    assert exc.value.status_code is LLMStatusCode.LLM_TIMEOUT


# -- pull_blocks and layer ranges ---------------------------------------------------------------


def test_pull_blocks_checks(fake: RecordingWrapper) -> None:
    mgr = cm()
    b = blocks(mgr)
    c = contiguous(mgr)
    bk = BlocksCacheKey(1, 0)
    assert outcome(fake, lambda: mgr.pull_blocks(None, b, [0], [0])) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.pull_blocks(bk, None, [0], [0])) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, {0}, [0])) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, [0], [0.5])) is TypeError  # type: ignore[list-item]
    assert outcome(fake, lambda: mgr.pull_blocks(bk, c, [0], [0])) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, [0], [])) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, [0], [0], tensor_num_per_layer=0)) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, [], [0])) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(CacheKeyByIdAndIndex(1, 1), b, [0], [0])) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(CacheKey(1, 1), b, [0], [0])) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(CacheKey(1, NONE_ID), b, [], [0])) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, [0], [0], src_layer_range=range(0, 4, 2))) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, [0], [0], src_layer_range=range(-1, 1))) is PI
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, [0], [0], dst_layer_range=range(2**32, 2**32 + 1))) is ValueError
    assert outcome(fake, lambda: mgr.pull_blocks(bk, b, [-1], [0])) is TypeError
    # order: destination kind before the empty dst list, which is before the src-list rule
    assert outcome(fake, lambda: mgr.pull_blocks(bk, c, [], [])) is PI


def test_pull_blocks_three_key_forms_and_unequal_lengths_reach_the_engine(fake: RecordingWrapper) -> None:
    mgr = cm()
    b = blocks(mgr)
    mgr.pull_blocks(BlocksCacheKey(prompt_cluster_id=1, model_id=3), b, [0, 1, 4], (1, 2))
    assert fake.last("pull_cache_v2") == (b.cache_id, (1, -1, 0, NONE_ID, NONE_ID, 3, True),
                                          (-1, 0, [0, 1, 4], [1, 2], [], [], -1, -1, 2))
    mgr.pull_blocks(CacheKeyByIdAndIndex(1, 7, 3), b, dst_blocks=[2, 0])
    assert fake.last("pull_cache_v2") == (b.cache_id, (1, 7, 3, NONE_ID, NONE_ID, 0, False),
                                          (-1, 0, [], [2, 0], [], [], -1, -1, 2))
    mgr.pull_blocks(CacheKey(1, 9, 2), b, (), [3])
    assert fake.last("pull_cache_v2")[1] == (1, -1, 0, 9, NONE_ID, 2, False)


@pytest.mark.parametrize("src, dst, t, expected", [
    (range(1, 3), range(0, 2), 2, ([2, 3, 4, 5], [0, 1, 2, 3])),
    (range(0), None, 2, ([], [])),  # empty = all
    (None, range(2, 3), 1, ([], [2])),
    (range(1, 2), None, 3, ([3, 4, 5], [])),
    (range(0, 1), range(0, 0), 2, ([0, 1], [])),
])
def test_layer_ranges_become_half_open_tensor_indices(fake: RecordingWrapper, src: range | None,
                                                      dst: range | None, t: int,
                                                      expected: tuple[list[int], list[int]]) -> None:
    mgr = cm()
    b = blocks(mgr, 6)
    mgr.pull_blocks(BlocksCacheKey(1), b, [0], [0], src_layer_range=src, dst_layer_range=dst, tensor_num_per_layer=t)
    param = fake.last("pull_cache_v2")[2]
    assert (param[4], param[5], param[8]) == (*expected, t)


def test_no_range_leniency_is_left_to_the_engine(fake: RecordingWrapper) -> None:
    """An MLA-style 3-tensor cache with the default t=2 and no ranges passes the Python layer."""
    mgr = cm()
    b = blocks(mgr, 3)
    mgr.pull_blocks(BlocksCacheKey(1), b, [0], [0])
    assert fake.last("pull_cache_v2")[2] == (-1, 0, [0], [0], [], [], -1, -1, 2)


# -- push ----------------------------------------------------------------------------------------


def test_push_needs_remote_accessible_mode_first(fake: RecordingWrapper) -> None:
    mgr = cm(RA_OFF)
    b = blocks(mgr)
    c = contiguous(mgr)
    assert outcome(fake, lambda: mgr.push_blocks(None, b, [0], [0])) is PI  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.push_cache(None, c)) is PI  # type: ignore[arg-type]


def test_push_blocks_checks_and_per_layer_calls(fake: RecordingWrapper) -> None:
    mgr = cm()
    b = blocks(mgr, 6)
    c = contiguous(mgr)
    key = BlocksCacheKey(5, 2)
    assert outcome(fake, lambda: mgr.push_blocks(CacheKeyByIdAndIndex(5, 1), b, [0], [0])) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.push_blocks(key, None, [0], [0])) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.push_blocks(key, c, [0], [0])) is PI
    assert outcome(fake, lambda: mgr.push_blocks(key, b, [0], [])) is PI
    assert outcome(fake, lambda: mgr.push_blocks(key, b, [0], [0], tensor_num_per_layer=0)) is PI
    assert outcome(fake, lambda: mgr.push_blocks(key, b, [0], [0], src_layer_range=range(0))) is PI
    assert outcome(fake, lambda: mgr.push_blocks(key, b, [0], [0], src_layer_range=range(2),
                                                 dst_layer_range=range(1))) is PI
    mgr.push_blocks(key, b, [0, 1], [3, 4], dst_layer_range=range(3, 6))
    transfers = [a for n, a in fake.calls if n == "transfer_cache_v2"]
    assert [(cfg, block_cfg) for _, cfg, block_cfg in transfers] == [
        ((b.cache_id, 0, ls, [], 5, 2, 0, 1, ld, 2), (0, [0, 1], [3, 4])) for ls, ld in ((0, 3), (1, 4), (2, 5))]
    assert len({task for task, _, _ in transfers}) == 1
    # empty src_blocks goes to the engine (its PARAM_INVALID)
    fake.status["transfer_cache_v2"] = PARAM_INVALID
    with pytest.raises(LLMException) as exc:
        mgr.push_blocks(key, b, [], [0])
    assert exc.value.status_code is PI


def test_push_default_range_empty_is_silent_success(fake: RecordingWrapper) -> None:
    mgr = cm()
    one = mgr.register_blocks_cache(desc(1), [1])
    mgr.push_blocks(BlocksCacheKey(5), one, [0], [0])
    assert "transfer_cache_v2" not in fake.names()


def test_push_first_failing_layer_raises_and_stops(fake: RecordingWrapper) -> None:
    mgr = cm()
    c = contiguous(mgr, 8)
    results = iter([0, 0, 0x5010B002, 0])
    fake.status = _StatusSeq(results)
    with pytest.raises(LLMException) as exc:
        mgr.push_cache(CacheKeyByIdAndIndex(5, 3, 1), c, 1)
    assert exc.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    cfgs = [a[1] for n, a in fake.calls if n == "transfer_cache_v2"]
    assert cfgs == [(c.cache_id, 1, layer, [], 5, 3, 1, 2, layer, 2) for layer in range(3)]


class _StatusSeq(dict[str, int]):
    def __init__(self, seq: Any) -> None:
        super().__init__()
        self._seq = seq

    def get(self, key: str, default: Any = 0) -> Any:
        return next(self._seq) if key == "transfer_cache_v2" else default


def test_push_cache_checks(fake: RecordingWrapper) -> None:
    mgr = cm()
    c = contiguous(mgr)
    b = blocks(mgr)
    key = CacheKeyByIdAndIndex(5, 1)
    assert outcome(fake, lambda: mgr.push_cache(BlocksCacheKey(5), c)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.push_cache(key, c, -1)) is ValueError
    assert outcome(fake, lambda: mgr.push_cache(key, b)) is PI
    assert outcome(fake, lambda: mgr.push_cache(key, c, size=64)) is PI
    assert outcome(fake, lambda: mgr.push_cache(key, c, size=2**63)) is ValueError
    assert outcome(fake, lambda: mgr.push_cache(key, c, tensor_num_per_layer=2**32)) is ValueError
    mgr.push_cache(key, c, src_layer_range=range(1, 2), dst_layer_range=range(0, 1), tensor_num_per_layer=2)
    assert fake.last("transfer_cache_v2")[1:] == ((c.cache_id, 0, 1, [], 5, 1, 0, 2, 0, 2), (0, [], []))


# -- allocation, copies, swap, remap ----------------------------------------------------------


def test_allocate_and_deallocate(fake: RecordingWrapper) -> None:
    mgr = cm({**RA_OFF, "llm.MemPoolConfig": '{"memory_size": 1024}'})
    assert outcome(fake, lambda: mgr.allocate_cache(desc(0))) is PI
    assert outcome(fake, lambda: mgr.allocate_cache(desc(1, placement=Placement.HOST))) is PI
    assert outcome(fake, lambda: mgr.allocate_cache(desc(1), [BlocksCacheKey(1)])) is TypeError  # type: ignore[list-item]
    cache = mgr.allocate_cache(desc(2), [CacheKey(1, 2)])
    assert fake.last("allocate_cache_v2") == ((2, 1, -1, [8, 16], 1, False), [(1, -1, 0, 2, NONE_ID, 0, False)])
    assert cache.tensor_addrs == [0x1000, 0x2000] and not cache._is_registered
    bc = mgr.allocate_blocks_cache(desc(1), BlocksCacheKey(1, 4))
    assert bc.is_blocks_cache and fake.last("allocate_cache_v2")[0][5] is True
    assert outcome(fake, lambda: mgr.deallocate_cache(bc)) is PI
    assert outcome(fake, lambda: mgr.deallocate_blocks_cache(cache)) is PI
    mgr.deallocate_cache(cache)
    assert fake.last("deallocate_cache_v2") == (cache.cache_id,) and cache.tensor_addrs == []
    mgr.deallocate_blocks_cache(bc)
    assert outcome(fake, lambda: mgr.remove_cache_key(BlocksCacheKey(1))) is TypeError  # type: ignore[arg-type]
    mgr.remove_cache_key(CacheKey(1, 2, 3))
    assert fake.last("remove_cache_key_v2") == ((1, -1, 0, 2, NONE_ID, 3, False),)


def test_allocate_without_any_pool_is_refused_before_the_engine(fake: RecordingWrapper) -> None:
    # upstream's Python requires a pool matching the placement whether or not any pool is
    # configured, so the engine's FEATURE_NOT_ENABLED is not reached through the package
    mgr = cm()
    assert outcome(fake, lambda: mgr.allocate_cache(desc(1, placement=Placement.HOST))) is PI


def test_copy_cache_and_copy_blocks(fake: RecordingWrapper) -> None:
    mgr = cm()
    a, c = contiguous(mgr), contiguous(mgr)
    b = blocks(mgr)
    assert outcome(fake, lambda: mgr.copy_cache(a, None)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.copy_cache(a, c, -1)) is ValueError
    assert outcome(fake, lambda: mgr.copy_cache(a, c, offset=-1)) is ValueError
    assert outcome(fake, lambda: mgr.copy_cache(a, b)) is PI
    assert outcome(fake, lambda: mgr.copy_cache(a, c, size=0)) is PI
    assert outcome(fake, lambda: mgr.copy_cache(a, c, req_id=-1)) is ValueError
    mgr.copy_cache(a, c, 1, 2, 3, 4, req_id=5)
    assert fake.last("copy_cache_v2") == ((c.cache_id, a.cache_id, 2, 1, 3, 4, 5),)
    mgr.copy_cache(a, c)
    assert fake.last("copy_cache_v2") == ((c.cache_id, a.cache_id, 0, 0, 0, -1, NONE_ID),)
    assert outcome(fake, lambda: mgr.copy_blocks(a, {0: [1]})) is PI
    assert outcome(fake, lambda: mgr.copy_blocks(b, {0: 1})) is TypeError  # type: ignore[dict-item]
    assert outcome(fake, lambda: mgr.copy_blocks(b, {0: [1, "2"]})) is TypeError  # type: ignore[list-item]
    mgr.copy_blocks(b, {0: [1, 2], 3: [0]})
    assert fake.last("copy_blocks_v2") == (b.cache_id, [(0, 1), (0, 2), (3, 0)])


def test_swap_blocks(fake: RecordingWrapper) -> None:
    mgr = cm()
    fake.tensor_size = 8 * 256
    dev = blocks(mgr, 2)  # shape [8, 16]: 8 blocks of 256 bytes
    plain = contiguous(mgr, 2)
    host = Cache.create_cpu_cache(CacheDesc(2, [8, 16], DataType.DT_FLOAT16, placement=Placement.HOST),
                                  [0x10, 0x20])
    small = Cache.create_cpu_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16, placement=Placement.HOST), [1, 2])
    three = Cache.create_cpu_cache(CacheDesc(3, [8, 16], DataType.DT_FLOAT16, placement=Placement.HOST), [1, 2, 3])
    assert outcome(fake, lambda: mgr.swap_blocks(host, plain, {0: 0})) is PI
    assert outcome(fake, lambda: mgr.swap_blocks(small, dev, {0: 0})) is PI  # block sizes differ
    assert outcome(fake, lambda: mgr.swap_blocks(three, dev, {0: 0})) is PI  # tensor counts differ
    assert outcome(fake, lambda: mgr.swap_blocks(host, dev, {0: 8})) is PI
    assert outcome(fake, lambda: mgr.swap_blocks(host, dev, {-1: 0})) is PI
    assert outcome(fake, lambda: mgr.swap_blocks(host, dev, [(0, 0)])) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.swap_blocks(dev, dev, {0: 1})) is PI  # both DEVICE
    mgr.swap_blocks(host, dev, {0: 7, 3: 1})
    # the package sends both sides as address-only views (id -1), even a registered cache
    assert fake.last("swap_blocks_v2") == ((-1, [[0x10, 0x20]]), (-1, [[0x1000, 0x2000]]), 256, 0,
                                           [(0, 7), (3, 1)])
    mgr.swap_blocks(dev, host, {7: 0})
    assert fake.last("swap_blocks_v2")[2:4] == (256, 1)  # swap out


def test_remap_registered_memory(fake: RecordingWrapper) -> None:
    mgr = cm()
    dev = Memtype.MEM_TYPE_DEVICE
    for bad in ([MemInfo(Memtype.MEM_TYPE_HOST, 1, 1)], MemInfo(dev, 0, 1), [MemInfo(dev, 1, 0)], [1], (MemInfo(dev, 1, 1),)):
        assert outcome(fake, lambda: mgr.remap_registered_memory(bad)) is PI  # type: ignore[arg-type]
    mgr.remap_registered_memory(MemInfo(dev, 0x100, 64))
    assert fake.last("remap_registered_memory") == ([(0, 0x100, 64)],)


def test_check_cache_key_static() -> None:
    CacheManager.check_cache_key(CacheKey(1, 2))
    CacheManager.check_cache_key(BlocksCacheKey(1))
    with pytest.raises(LLMException):
        CacheManager.check_cache_key(CacheKey(1, 2, prefix_id=3))


def test_retained_cache_manager_after_finalize_reaches_the_engine(fake: RecordingWrapper) -> None:
    dd: LLMDataDist = started()
    mgr = dd.cache_manager
    b = blocks(mgr)
    dd.finalize()
    fake.status["pull_cache_v2"] = PARAM_INVALID
    with pytest.raises(LLMException) as exc:
        mgr.pull_blocks(BlocksCacheKey(1), b, [0], [0])
    assert exc.value.status_code is PI and fake.names()[-1] == "pull_cache_v2"


def test_documented_hardware_limits_are_logged_once_not_enforced(fake: RecordingWrapper,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from kvdd.llm_datadist.v2 import doc_limits

    doc_limits.reset_warnings()
    mgr = cm()
    aligned = [doc_limits.DEVICE_ALIGNMENT * (i + 1) for i in range(120)]
    with caplog.at_level("WARNING", logger="LLM_DATADIST"):
        first = mgr.register_cache(desc(120), aligned)
        mgr.register_blocks_cache(desc(120), aligned)  # exactly 240: no warning
        assert caplog.records == []
        mgr.register_cache(desc(1), [aligned[0]])  # 241
        assert [r.getMessage() for r in caplog.records] == [
            "kvdd does not enforce this hardware limit of CANN's documentation: at most 240 registered "
            "addresses per process (now 241)"]
        mgr.unregister_cache(first.cache_id)
        mgr.register_cache(desc(120), aligned)
        mgr.register_cache(desc(1), [aligned[0] + 64])  # unaligned device address
        mgr.register_cache(desc(1, placement=Placement.HOST), [64])  # host memory needs no alignment
        mgr.register_cache(desc(1), [aligned[0] + 128])
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "2 MiB-aligned" in messages[1]
    assert all(r.levelname == "WARNING" for r in caplog.records)
    assert LLMDataDist.llm_engine_instance is not None
    LLMDataDist.llm_engine_instance.finalize()
    mgr = cm()  # a new engine counts from zero
    fake.tensor_size = doc_limits.MAX_DEVICE_BYTES // 2
    with caplog.at_level("WARNING", logger="LLM_DATADIST"):
        mgr.register_cache(desc(2), aligned[:2])  # exactly 50 GiB
        assert len(caplog.records) == 2
        mgr.register_cache(desc(1, placement=Placement.HOST), [64])
        assert len(caplog.records) == 2  # host bytes are counted apart
        mgr.register_cache(desc(1), aligned[:1])
    assert "50 GB" in caplog.records[-1].getMessage()
    doc_limits.reset_warnings()
