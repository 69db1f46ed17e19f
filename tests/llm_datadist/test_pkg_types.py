"""The types of PYPKG.md §5: CacheDesc check order and repr, Cache, KvCache, keys, MemInfo,
transfer configs, layer-range checks."""

from __future__ import annotations

from typing import Any

import pytest
from pkg_fake import RecordingWrapper, desc, fake

from kvdd.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LLMException,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from kvdd.llm_datadist.v2.llm_types import check_layer_range

__all__ = ["fake"]

PI = LLMStatusCode.LLM_PARAM_INVALID
F16 = DataType.DT_FLOAT16


def raised(call: Any) -> Any:
    with pytest.raises((TypeError, ValueError, LLMException)) as exc:
        call()
    value = exc.value
    return value.status_code if isinstance(value, LLMException) else type(value)


def test_cache_desc_check_order() -> None:
    assert raised(lambda: CacheDesc(-1, [1], F16)) is ValueError
    assert raised(lambda: CacheDesc(2**32, [1], F16)) is ValueError
    assert raised(lambda: CacheDesc(1.0, [1], F16)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: CacheDesc(1, 5, F16)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: CacheDesc(1, [1.0], F16)) is TypeError  # type: ignore[list-item]
    assert raised(lambda: CacheDesc(1, [1], 1)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: CacheDesc(1, [1], F16, placement=1)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: CacheDesc(1, [1], F16, batch_dim_index=None)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: CacheDesc(1, [1], F16, seq_len_dim_index=2**31)) is ValueError
    assert raised(lambda: CacheDesc(1, [1], F16, kv_tensor_format=1)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: CacheDesc(1, [], F16)) is PI  # empty shape fails the batch dim check
    assert raised(lambda: CacheDesc(1, [2, 3], F16, batch_dim_index=2)) is PI
    assert raised(lambda: CacheDesc(1, [2, 3], F16, batch_dim_index=-1)) is PI
    assert raised(lambda: CacheDesc(1, [2, 3], F16, seq_len_dim_index=2)) is PI
    assert raised(lambda: CacheDesc(1, [2, 3], F16, seq_len_dim_index=-2)) is PI
    assert raised(lambda: CacheDesc(1, [2, 2**63], F16)) is ValueError
    # type errors come before the range errors of earlier arguments' dims
    assert raised(lambda: CacheDesc(1, [], 1)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: CacheDesc(1, [2**63], F16, batch_dim_index=3)) is PI
    # num_tensors 0 and non-positive dims pass here
    CacheDesc(0, [0, -1], F16, seq_len_dim_index=1)


def test_cache_desc_fields_repr_and_update_dim(fake: RecordingWrapper) -> None:
    shape = [4, 16, 8]
    d = CacheDesc(num_tensors=2, shape=shape, data_type=DataType.DT_BF16, placement=Placement.HOST,
                  batch_dim_index=1, seq_len_dim_index=2, kv_tensor_format="BSH")
    assert (d.num_tensors, d.shape, d.data_type, d.placement, d.batch_dim, d.batch_size,
            d.seq_len_dim_index, d.kv_tensor_format) == (2, shape, DataType.DT_BF16, Placement.HOST, 1, 16, 2, "BSH")
    assert repr(d) == (f"CacheDesc(num_tensors=2, shape=[4, 16, 8], data_type=DataType.DT_BF16, "
                       f"placement={Placement.HOST}, batch_dim_index=1, seq_len_dim_index=2,kv_tensor_format=BSH)")
    fake.tensor_size = 1024
    assert d.size == 1024 and d.size == 1024
    assert fake.calls == [("calc_tensor_size", ([4, 16, 8], 27))]  # cached
    d.update_dim(1, 32)
    assert d.shape == [4, 32, 8] and d.batch_size == 16  # batch size is not updated
    assert d.size == 1024 and len(fake.calls) == 2  # size recomputed
    t = CacheDesc(1, (2, 3), F16)
    assert t.shape == (2, 3)
    with pytest.raises(TypeError):
        t.update_dim(0, 1)  # a tuple shape cannot be updated


def test_cache_desc_size_failure_is_llm_exception_with_success_code(fake: RecordingWrapper) -> None:
    with pytest.raises(LLMException) as exc:
        _ = CacheDesc(1, [0, 4], F16).size
    assert exc.value.status_code is LLMStatusCode.LLM_SUCCESS


def test_cache_and_create_cpu_cache() -> None:
    host = CacheDesc(2, [4, 8], F16, placement=Placement.HOST)
    cpu = Cache.create_cpu_cache(host, [0x10, 0x20])
    assert (cpu.cache_id, cpu.tensor_addrs, cpu.is_blocks_cache, cpu.cache_desc) == (-1, [0x10, 0x20], True, host)
    assert str(cpu) == "Cache(cache_id = -1, device_tensor_addrs = 2, is_blocks_cache = True)"
    assert raised(lambda: Cache.create_cpu_cache(desc(2), [1, 2])) is PI  # DEVICE placement
    assert raised(lambda: Cache.create_cpu_cache(host, [1])) is PI
    assert raised(lambda: Cache.create_cpu_cache(host, (1, 2))) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: Cache.create_cpu_cache(host, [1, "2"])) is TypeError  # type: ignore[list-item]
    assert raised(lambda: Cache(2**63, host, [])) is ValueError
    kv = KvCache.create_cpu_cache(host, [[1, 2], [3, 4]])
    assert kv.per_device_tensor_addrs == [[1, 2], [3, 4]] and kv.cache_id == -1
    assert KvCache.create_cpu_cache(host, [1, 2]).per_device_tensor_addrs == [[1, 2]]


def test_blocks_cache_key_arguments() -> None:
    k = BlocksCacheKey(3, 1)
    assert (k.cluster_id, k.prompt_cluster_id, k.model_id) == (3, 3, 1)
    assert repr(k) == "BlocksCacheKey(cluster_id=3, model_id=1)"
    k = BlocksCacheKey(prompt_cluster_id=4)
    assert (k.cluster_id, k.model_id) == (4, 0) and repr(k) == "BlocksCacheKey(prompt_cluster_id=4, model_id=0)"
    assert BlocksCacheKey(cluster_id=5, prompt_cluster_id=6).cluster_id == 5  # cluster_id wins
    assert BlocksCacheKey(-1, -2).model_id == -2  # no range check here
    assert raised(lambda: BlocksCacheKey(1, 2, 3)) is PI
    assert raised(lambda: BlocksCacheKey(1, model_id=2, prompt_cluster_id=3)) is PI
    assert raised(lambda: BlocksCacheKey(model_id=2)) is PI
    assert raised(lambda: BlocksCacheKey()) is PI
    assert raised(lambda: BlocksCacheKey(1, req_id=2)) is PI
    with pytest.raises(TypeError, match="The first param"):
        BlocksCacheKey("1")
    with pytest.raises(TypeError, match="The second param"):
        BlocksCacheKey(1, model_id=1.0)


def test_cache_key_arguments() -> None:
    k = CacheKey(1, 2)
    assert (k.cluster_id, k.prompt_cluster_id, k.req_id, k.model_id, k.prefix_id) == (1, 1, 2, 0, 2**64 - 1)
    k = CacheKey(prompt_cluster_id=1, req_id=2, model_id=3, prefix_id=4)
    assert (k.cluster_id, k.req_id, k.model_id, k.prefix_id) == (1, 2, 3, 4)
    assert CacheKey(1, 2, 3, 4).prefix_id == 4
    assert raised(lambda: CacheKey(1)) is PI  # req_id required
    assert raised(lambda: CacheKey(req_id=1)) is PI
    assert raised(lambda: CacheKey(1, 2, 3, 4, 5)) is PI
    assert raised(lambda: CacheKey(1, 2, foo=3)) is PI
    assert raised(lambda: CacheKey(-1, 2)) is ValueError
    assert raised(lambda: CacheKey(1, 2**64)) is ValueError
    assert raised(lambda: CacheKey(1, 2, prefix_id=-1)) is ValueError
    assert raised(lambda: CacheKey(1, "2")) is TypeError
    CacheKey(1, 2**64 - 1, prefix_id=2**64 - 1)  # validity is checked at pull time only


def test_cache_key_by_id_and_index() -> None:
    k = CacheKeyByIdAndIndex(1, -3)
    assert (k.cluster_id, k.cache_id, k.batch_index) == (1, -3, 0)
    assert raised(lambda: CacheKeyByIdAndIndex(-1, 1)) is ValueError
    assert raised(lambda: CacheKeyByIdAndIndex(1, 2**63)) is ValueError
    assert raised(lambda: CacheKeyByIdAndIndex(1, 1, 2**32)) is ValueError
    assert raised(lambda: CacheKeyByIdAndIndex(1, 1, -1)) is ValueError
    assert raised(lambda: CacheKeyByIdAndIndex(1, None)) is TypeError  # type: ignore[arg-type]


def test_mem_info_checks_types_only() -> None:
    m = MemInfo(Memtype.MEM_TYPE_HOST, 0, -5)
    assert (m.mem_type, m.addr, m.size) == (Memtype.MEM_TYPE_HOST, 0, -5)
    assert raised(lambda: MemInfo(0, 1, 1)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: MemInfo(Memtype.MEM_TYPE_DEVICE, "1", 1)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: MemInfo(Memtype.MEM_TYPE_DEVICE, 1, None)) is TypeError  # type: ignore[arg-type]


def test_check_layer_range() -> None:
    check_layer_range("r", None)
    check_layer_range("r", range(0, 1))
    for bad in (range(0), range(2, 2), range(0, 4, 2), range(-1, 2), range(3, 1)):
        assert raised(lambda: check_layer_range("r", bad)) is PI
    assert raised(lambda: check_layer_range("r", [0, 1])) is TypeError  # type: ignore[arg-type]


def test_transfer_config() -> None:
    c = TransferConfig(2**64 - 1, (1, 2), range(1, 2), 2**32 - 1)
    assert (c.dst_cluster_id, c.dst_addrs, c.src_layer_range, c.src_batch_index, c.dst_layer_range) == (
        2**64 - 1, (1, 2), range(1, 2), 2**32 - 1, None)
    assert raised(lambda: TransferConfig(-1, [1])) is ValueError
    assert raised(lambda: TransferConfig(1, None)) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: TransferConfig(1, [-1])) is ValueError
    assert raised(lambda: TransferConfig(1, [1], range(0, 2, 2))) is PI
    assert raised(lambda: TransferConfig(1, [1], None, -1)) is ValueError
    with pytest.raises(ValueError):
        c.src_batch_index = 2**32
    with pytest.raises(LLMException):
        c.src_layer_range = range(0)
    c.src_layer_range = None


def test_transfer_with_cache_key_config() -> None:
    key = BlocksCacheKey(7, 1)
    c = TransferWithCacheKeyConfig(key, range(0, 2), range(2, 4))
    assert (c.cache_key, c.src_layer_range, c.dst_layer_range, c.src_batch_index, c.dst_cluster_id) == (
        key, range(0, 2), range(2, 4), 0, 7)
    assert raised(lambda: TransferWithCacheKeyConfig(None, range(1), range(1))) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: TransferWithCacheKeyConfig(CacheKey(1, 2), range(1), range(1))) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: TransferWithCacheKeyConfig(key, None, range(1))) is TypeError
    assert raised(lambda: TransferWithCacheKeyConfig(key, range(1))) is TypeError
    assert raised(lambda: TransferWithCacheKeyConfig(key, range(2), range(1))) is PI
    assert raised(lambda: TransferWithCacheKeyConfig(key, range(1), range(1), 1)) is PI
    by_id = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(8, 3, 1), range(1), range(1), 5)
    assert by_id.src_batch_index == 5 and by_id.dst_cluster_id == 8
    by_id.cache_key = BlocksCacheKey(9)
    assert by_id.dst_cluster_id == 8  # set once
    by_id.cache_key = None
    by_id.src_layer_range = None
    assert by_id.cache_key is None and by_id.src_layer_range is None
