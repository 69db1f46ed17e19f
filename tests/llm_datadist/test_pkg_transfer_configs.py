"""Layer ranges of pushes and transfer configs, and what transfer_cache_async sends per layer
(PYPKG.md §4.8 ``check_layer_range``, §4.10, §5.7): a value that is not a ``range`` is a
TypeError (upstream's check_layer_range type-checks first), the constructor checks each range
fully in turn, the ``src_batch_index`` setter keeps the BlocksCacheKey rule, and a blocks
destination is always sent source batch 0."""

from __future__ import annotations

import pytest
from pkg_fake import RecordingWrapper, desc, fake, raised, started

from kvdd.llm_datadist import (
    BlocksCacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    LLMStatusCode,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from kvdd.llm_datadist.v2.llm_types import check_layer_range

__all__ = ["fake"]

PI = LLMStatusCode.LLM_PARAM_INVALID


class Sync(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def test_a_layer_range_that_is_not_a_range_is_a_type_error() -> None:
    assert raised(lambda: check_layer_range("r", [0, 1])) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: TransferConfig(1, [1, 2], (0, 1))) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: TransferWithCacheKeyConfig(BlocksCacheKey(1), [0], range(1))) is TypeError  # type: ignore[arg-type]


def test_push_layer_range_that_is_not_a_range_is_a_type_error(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    src = mgr.register_cache(desc(4), [0x1000 * (i + 1) for i in range(4)])
    before = len(fake.names())
    with pytest.raises(TypeError):
        mgr.push_cache(CacheKeyByIdAndIndex(1, 1), src, src_layer_range=[0, 1])  # type: ignore[arg-type]
    assert len(fake.names()) == before


def test_keyed_config_checks_the_source_range_fully_before_the_destination() -> None:
    key = BlocksCacheKey(1)
    assert raised(lambda: TransferWithCacheKeyConfig(key, range(0, 4, 2), None)) == PI
    assert raised(lambda: TransferWithCacheKeyConfig(key, range(2, 1), "x")) == PI  # type: ignore[arg-type]
    assert raised(lambda: TransferWithCacheKeyConfig(key, range(1), None)) is TypeError


def test_keyed_config_src_batch_index_setter_keeps_the_blocks_rule() -> None:
    cfg = TransferWithCacheKeyConfig(BlocksCacheKey(1), range(1), range(1))
    assert raised(lambda: setattr(cfg, "src_batch_index", 1)) == PI
    assert raised(lambda: setattr(cfg, "src_batch_index", -1)) == PI  # the rule comes before uint32
    by_id = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 1), range(1), range(1))
    assert raised(lambda: setattr(by_id, "src_batch_index", -1)) is ValueError
    by_id.src_batch_index = 3
    assert by_id.src_batch_index == 3


def test_worker_sends_batch_zero_to_blocks_and_the_same_layer_without_a_dst_range(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    src = mgr.register_cache(desc(4), [0x1000 * (i + 1) for i in range(4)])
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 5, 0), range(0, 2), range(0, 2), 3)
    cfg.cache_key = BlocksCacheKey(1, 7)  # the key changes kind after the batch index was set
    cfg.dst_layer_range = None
    task = mgr.transfer_cache_async(src, Sync(), [cfg])
    assert task.synchronize(2000) == LLMStatusCode.LLM_SUCCESS
    sent = [a[1] for n, a in fake.calls if n == "transfer_cache_v2"]
    # (src_id, src_batch, src_layer, addrs, cluster, model, dst_batch, type 1, dst_layer, t)
    assert [(c[1], c[2], c[5], c[7], c[8]) for c in sent] == [(0, 0, 7, 1, 0), (0, 1, 7, 1, 1)]
