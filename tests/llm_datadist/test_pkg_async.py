"""transfer_cache_async, LayerSynchronizer and CacheTask (PYPKG.md §4.10, §5.7; checklist §7.5
item 25) over a recording engine."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from pkg_fake import RecordingWrapper, desc, fake, outcome, started

from kvdd.llm_datadist import (
    BlocksCacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from kvdd.llm_datadist.v2.cache_manager import CacheManager

__all__ = ["fake"]

PI = LLMStatusCode.LLM_PARAM_INVALID
OK = LLMStatusCode.LLM_SUCCESS


class Sync(LayerSynchronizer):
    def __init__(self, answer: Callable[[int], bool] = lambda layer: True,
                 gate: threading.Event | None = None) -> None:
        self.seen: list[tuple[int, int | None]] = []
        self.answer = answer
        self.gate = gate

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        if self.gate is not None:
            self.gate.wait(5)
        self.seen.append((layer_index, timeout_in_millis))
        return self.answer(layer_index)


def mgr(remote_accessible: bool = True) -> CacheManager:
    opts = {"llm.EnableCacheManager": "1", "llm.EnableRemoteCacheAccessible": "1" if remote_accessible else "0"}
    return started(opts).cache_manager


def test_checks_in_order(fake: RecordingWrapper) -> None:
    m = mgr()
    src = m.register_cache(desc(4), [1, 2, 3, 4])
    host = m.register_cache(desc(4, placement=Placement.HOST), [1, 2, 3, 4])
    odd = m.register_cache(desc(3), [1, 2, 3])
    blk = m.register_blocks_cache(desc(4), [1, 2, 3, 4])
    key = CacheKeyByIdAndIndex(9, 1)
    cfg = [TransferWithCacheKeyConfig(key, range(2), range(2))]
    s = Sync()
    run = m.transfer_cache_async
    assert outcome(fake, lambda: run(None, s, cfg)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: run(host, s, cfg)) is PI
    assert outcome(fake, lambda: run(src, s, cfg, src_block_indices={0})) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: run(src, s, cfg, dst_block_indices=[-1])) is ValueError
    assert outcome(fake, lambda: run(src, s, cfg, dst_block_memory_size=-1)) is ValueError
    assert outcome(fake, lambda: run(blk, s, cfg, src_block_indices=[0])) is PI
    assert outcome(fake, lambda: run(blk, s, cfg, src_block_indices=[0], dst_block_indices=[0, 1])) is PI
    assert outcome(fake, lambda: run(src, s, cfg, dst_block_indices=[0])) is PI  # needs a memory size
    assert outcome(fake, lambda: run(src, None, cfg)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: run(src, s, [TransferConfig(9, [1, 2, 3, 4])])) is TypeError
    assert outcome(fake, lambda: run(src, s, cfg, dst_block_memory_size=64)) is PI
    assert outcome(fake, lambda: run(odd, s, cfg)) is PI
    assert outcome(fake, lambda: run(src, s, [TransferWithCacheKeyConfig(key, range(3), range(3))])) is PI
    assert outcome(fake, lambda: run(blk, s, [TransferWithCacheKeyConfig(key, range(1), range(1), 1)],
                                     src_block_indices=[0], dst_block_indices=[1])) is PI


def test_two_sided_mode_takes_transfer_configs(fake: RecordingWrapper) -> None:
    m = mgr(False)
    src = m.register_cache(desc(4), [1, 2, 3, 4])
    s = Sync()
    assert outcome(fake, lambda: m.transfer_cache_async(
        src, s, [TransferWithCacheKeyConfig(BlocksCacheKey(1), range(1), range(1))])) is TypeError
    assert outcome(fake, lambda: m.transfer_cache_async(src, s, [TransferConfig(9, [1, 2, 3])])) is PI
    cfg = TransferConfig(9, [0xA0, 0xA1], src_layer_range=range(1, 2), src_batch_index=3)
    whole = TransferConfig(8, [0xB0, 0xB1, 0xB2, 0xB3])
    task = m.transfer_cache_async(src, s, [cfg, whole], dst_block_indices=[2], dst_block_memory_size=64)
    assert task.synchronize() is OK
    assert whole.src_layer_range == range(0, 2)  # the config object is filled in
    sent = [(a[1], a[2]) for n, a in fake.calls if n == "transfer_cache_v2"]
    block_cfg: tuple[int, list[int], list[int]] = (64, [], [2])
    assert sent == [((src.cache_id, 0, 0, [0xB0, 0xB1], 8, 0, 0, 0, 0, 2), block_cfg),
                    ((src.cache_id, 3, 1, [0xA0, 0xA1], 9, 0, 0, 0, 1, 2), block_cfg),
                    ((src.cache_id, 0, 1, [0xB2, 0xB3], 8, 0, 0, 0, 1, 2), block_cfg)]
    assert s.seen == [(0, None), (1, None)]
    assert task.get_results() == [OK, OK]


def test_keyed_configs_send_one_call_per_layer_and_config(fake: RecordingWrapper) -> None:
    m = mgr()
    src = m.register_blocks_cache(desc(6), [1, 2, 3, 4, 5, 6])
    by_blocks = TransferWithCacheKeyConfig(BlocksCacheKey(7, 2), range(0, 3), range(4, 7))
    by_id = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(8, 5, 1), range(0, 1), range(2, 3))
    s = Sync()
    task = m.transfer_cache_async(src, s, (by_blocks, by_id), [0, 1], [5, 6])
    assert task.synchronize(5000) is OK
    cfgs = [a[1] for n, a in fake.calls if n == "transfer_cache_v2"]
    assert cfgs == [(src.cache_id, 0, 0, [], 7, 2, 0, 1, 4, 2), (src.cache_id, 0, 0, [], 8, 5, 1, 2, 2, 2),
                    (src.cache_id, 0, 1, [], 7, 2, 0, 1, 5, 2), (src.cache_id, 0, 2, [], 7, 2, 0, 1, 6, 2)]
    assert all(a[2] == (0, [0, 1], [5, 6]) for n, a in fake.calls if n == "transfer_cache_v2")
    assert task.get_results() == [OK, OK]


def test_synchronizer_false_marks_param_invalid_and_stops(fake: RecordingWrapper) -> None:
    m = mgr()
    src = m.register_cache(desc(6), [1, 2, 3, 4, 5, 6])
    a = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(7, 1), range(0, 3), range(0, 3))
    b = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(8, 1), range(1, 2), range(0, 1))
    s = Sync(lambda layer: layer != 1)
    task = m.transfer_cache_async(src, s, [a, b])
    assert task.synchronize() is PI
    assert task.get_results() == [PI, PI]
    assert s.seen == [(0, None), (1, None)]  # stopped: layer 2 never asked
    assert [c[1][1][2] for c in fake.calls if c[0] == "transfer_cache_v2"] == [0]


def test_first_engine_failure_is_recorded_and_stops(fake: RecordingWrapper) -> None:
    m = mgr()
    src = m.register_cache(desc(4), [1, 2, 3, 4])
    fake.status["transfer_cache_v2"] = 0x5010B002
    a = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(7, 1), range(0, 2), range(0, 2))
    b = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(8, 1), range(0, 2), range(0, 2))
    task = m.transfer_cache_async(src, Sync(), [a, b])
    assert task.synchronize() is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert task.get_results() == [LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, None]
    assert fake.names().count("transfer_cache_v2") == 1


def test_crashed_worker_counts_as_success(fake: RecordingWrapper) -> None:
    """A source range not starting at 0 indexes dst_layer_range with the absolute layer: IndexError
    in the worker, results never recorded, synchronize() says SUCCESS (upstream's behaviour)."""
    m = mgr()
    src = m.register_cache(desc(6), [1, 2, 3, 4, 5, 6])
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(7, 1), range(2, 3), range(0, 1))
    task = m.transfer_cache_async(src, Sync(), [cfg])
    assert task.synchronize() is OK
    assert task.get_results() == [None]
    assert "transfer_cache_v2" not in fake.names()


def test_timeouts_while_running(fake: RecordingWrapper) -> None:
    m = mgr()
    src = m.register_cache(desc(2), [1, 2])
    gate = threading.Event()
    cfgs = [TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(7, 1), range(1), range(1)),
            TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(8, 1), range(1), range(1))]
    task = m.transfer_cache_async(src, Sync(gate=gate), cfgs)
    assert task.synchronize(0) is LLMStatusCode.LLM_TIMEOUT
    assert task.get_results(1) == [LLMStatusCode.LLM_TIMEOUT] * 2
    with pytest.raises(ValueError):
        task.synchronize(-1)
    gate.set()
    assert task.synchronize(5000) is OK and task.get_results() == [OK, OK]


def test_cache_type_is_checked_before_the_synchronizer(fake: RecordingWrapper) -> None:
    m = mgr()
    with pytest.raises(TypeError):
        m.transfer_cache_async("cache", None, [])  # type: ignore[arg-type]
