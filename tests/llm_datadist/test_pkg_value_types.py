"""Small value types as upstream shapes them (PYPKG.md §5.2, §5.4): LLMClusterInfo's IP lists are
the object's own lists (read-only attributes, live values), and KvCache.create_cpu_cache's checks
(legacy type: HOST placement first, a non-empty list, items all ints or all lists, counts equal
to num_tensors)."""

from __future__ import annotations

from pkg_fake import raised

from kvdd.llm_datadist import CacheDesc, DataType, KvCache, LLMClusterInfo, LLMStatusCode, Placement

PI = LLMStatusCode.LLM_PARAM_INVALID


def test_cluster_info_lists_are_live() -> None:
    info = LLMClusterInfo()
    info.append_local_ip_info("1.2.3.4", 5)
    assert info.local_ip_info_list is info.local_ip_info_list
    assert info.local_ip_info_list == [(0x04030201, 5)]
    assert info.remote_ip_info_list is info.remote_ip_info_list


def test_kv_cache_create_cpu_cache_checks() -> None:
    host = CacheDesc(2, [4, 8], DataType.DT_INT8, Placement.HOST)
    device = CacheDesc(2, [4, 8], DataType.DT_INT8)
    assert raised(lambda: KvCache.create_cpu_cache(device, "x")) == PI  # type: ignore[arg-type]  # placement before addrs' type
    assert raised(lambda: KvCache.create_cpu_cache(host, "x")) is TypeError  # type: ignore[arg-type]
    assert raised(lambda: KvCache.create_cpu_cache(host, [])) == PI
    assert raised(lambda: KvCache.create_cpu_cache(host, [1])) == PI  # flat count != num_tensors
    assert raised(lambda: KvCache.create_cpu_cache(host, [[1, 2], [3]])) == PI  # nested count
    assert raised(lambda: KvCache.create_cpu_cache(host, [1, [2, 3]])) == PI  # type: ignore[arg-type]  # mixed kinds
    assert raised(lambda: KvCache.create_cpu_cache(host, [1.0, 2])) is TypeError  # type: ignore[arg-type]
    assert KvCache.create_cpu_cache(host, [1, 2]).per_device_tensor_addrs == [[1, 2]]
    assert KvCache.create_cpu_cache(host, [[1, 2], [3, 4]]).per_device_tensor_addrs == [[1, 2], [3, 4]]
