"""The Python layer over the simulator's engine in one process (kvdd.sim.pypkg.process_wrapper):
ids, re-init, the after-finalize statuses of a retained CacheManager (PYPKG.md §1.4, §3.2;
checklist §7.5 items 13, 23, 24), and the native checks the Python layer leaves to the engine."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvdd.llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

PI = LLMStatusCode.LLM_PARAM_INVALID
ME = 11


def options() -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = 1000
    return cfg.generate_options()


@pytest.fixture
def dd() -> Iterator[LLMDataDist]:
    if LLMDataDist.llm_engine_instance is not None:  # left by an earlier test: one engine per process
        LLMDataDist.llm_engine_instance.finalize()
    instance = LLMDataDist(LLMRole.DECODER, ME)
    instance.init(options())
    try:
        yield instance
    finally:
        if LLMDataDist.llm_engine_instance is not None:
            LLMDataDist.llm_engine_instance.finalize()


@pytest.fixture
def memory() -> list[np.ndarray]:
    return [np.zeros((4, 16), np.float16) for _ in range(2)]


def addrs(arrays: list[np.ndarray]) -> list[int]:
    return [a.ctypes.data for a in arrays]


def status_of(call: object) -> LLMStatusCode:
    with pytest.raises(LLMException) as exc:
        call()  # type: ignore[operator]
    return exc.value.status_code


def test_ids_start_at_one_failed_registrations_consume_ids_and_reinit_restarts(
        dd: LLMDataDist, memory: list[np.ndarray]) -> None:
    cm = dd.cache_manager
    first = cm.register_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16), addrs(memory), BlocksCacheKey(ME, 0))
    assert first.cache_id == 1 and first.tensor_addrs == addrs(memory)
    assert first.cache_desc.size == 4 * 16 * 2
    assert status_of(lambda: cm.register_blocks_cache(CacheDesc(2, [0, 16], DataType.DT_FLOAT16),
                                                      addrs(memory))) is PI  # a dim <= 0: id 2 consumed
    assert status_of(lambda: cm.register_blocks_cache(CacheDesc(3, [4, 16], DataType.DT_FLOAT16),
                                                      addrs(memory))) is PI  # count: native check
    assert cm.register_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16), addrs(memory)).cache_id == 3
    dd.finalize()
    dd.init(options())
    again = dd.cache_manager.register_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16), addrs(memory))
    assert again.cache_id == 1


def test_retained_cache_manager_after_finalize(dd: LLMDataDist, memory: list[np.ndarray]) -> None:
    cm = dd.cache_manager
    cache = cm.register_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16), addrs(memory))
    dd.finalize()
    assert status_of(lambda: cm.pull_blocks(BlocksCacheKey(3, 0), cache, [0], [0])) is PI
    assert status_of(lambda: cm.register_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16),
                                                      addrs(memory))) is LLMStatusCode.LLM_FAILED
    assert status_of(lambda: cm.unregister_cache(cache.cache_id)) is LLMStatusCode.LLM_FAILED
    with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
        dd.link_clusters([])


def test_pulls_reach_the_native_checks(dd: LLMDataDist, memory: list[np.ndarray]) -> None:
    cm = dd.cache_manager
    cache = cm.register_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16), addrs(memory))
    contiguous = cm.register_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT16), addrs(memory))
    assert status_of(lambda: cm.pull_blocks(BlocksCacheKey(ME, 0), cache, [0], [0])) is PI  # own cluster
    assert status_of(lambda: cm.pull_blocks(BlocksCacheKey(3, 0), cache, [0, 1], [0])) is \
        LLMStatusCode.LLM_NOT_YET_LINK  # link check before the length check
    assert status_of(lambda: cm.pull_cache(CacheKeyByIdAndIndex(3, 1), contiguous)) is LLMStatusCode.LLM_NOT_YET_LINK
    assert memory[0].tobytes() == bytes(128) and memory[1].tobytes() == bytes(128)


def test_push_blocks_with_fewer_tensors_than_a_layer_moves_nothing(dd: LLMDataDist,
                                                                   memory: list[np.ndarray]) -> None:
    cm = dd.cache_manager
    one = cm.register_blocks_cache(CacheDesc(1, [4, 16], DataType.DT_FLOAT16), addrs(memory[:1]))
    cm.push_blocks(BlocksCacheKey(3, 0), one, [0], [0])  # default range is empty: success
    assert status_of(lambda: cm.push_blocks(BlocksCacheKey(3, 0), one, [0], [0],
                                            tensor_num_per_layer=1)) is LLMStatusCode.LLM_NOT_YET_LINK
