"""Regression tests for engine bugs the property suite found: the behaviour SEMANTICS.md requires.

Each test states the call, the expected outcome and the clause.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, DataType, Status


def test_push_kv_blocks_with_a_huge_block_index_returns_a_status() -> None:
    """PushKvBlocks with a block index >= 2**63 (valid uint64): §3.13 step 8 — the local cache is
    not registered → LLM_KV_CACHE_NOT_EXIST (and with a registered cache and link, a dst block >=
    R.B → LLM_PARAM_INVALID).  The engine builds an int64 numpy array of the block runs before the
    per-layer checks and raises OverflowError instead."""
    with kvdd.LlmDataDist(1, kvdd.LlmRole.MIX, backend="sim") as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        desc = CacheDesc(num_tensors=2, data_type=DataType.DT_INT32, shape=(4, 16))
        with pytest.raises(kvdd.LLMError) as info:
            dd.push_kv_blocks(Cache(cache_id=5, cache_desc=desc), CacheIndex(2, 1), [0], [2**64 - 1])
        assert info.value.status == Status.LLM_KV_CACHE_NOT_EXIST
        mem = [np.zeros(256, np.uint8) for _ in range(2)]
        cid = dd.register_kv_cache(desc, kvdd.tensor_addrs(mem))
        with pytest.raises(kvdd.LLMError) as info:
            dd.push_kv_blocks(Cache(cache_id=cid, cache_desc=desc), CacheIndex(2, 1), [2**63], [0])
        assert info.value.status == Status.LLM_NOT_YET_LINK


def test_push_with_a_huge_layer_plan_stops_at_the_first_bad_layer() -> None:
    """PushKvCache with ext ((0, 2**31-1), (0, 2**31-1), 2) on 4-tensor caches (2 layers): §3.12
    step 7 runs the plan layer by layer; layers 0 and 1 are written, layer 2 fails check d
    (dst layer >= floor(R.n / t)) → LLM_PARAM_INVALID (partial progress, §7.6).  The same for a
    Cache whose num_tensors is 2**32-1 with the default ext.  The engine builds the whole 2**31-entry
    plan first (MemoryError under a memory limit, otherwise minutes and ~100 GB)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:  # a safety net: 4 GiB more than this process uses now
        limit = int(f.read().split()[0]) * resource.getpagesize() + (4 << 30)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        with kvdd.LlmDataDist(1, kvdd.LlmRole.PROMPT, backend="sim") as p, \
                kvdd.LlmDataDist(2, kvdd.LlmRole.DECODER, backend="sim") as d:
            p.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
            d.initialize({kvdd.OPTION_DEVICE_ID: "0"})
            desc = CacheDesc(num_tensors=4, data_type=DataType.DT_INT32, shape=(4, 16))
            pm = [np.zeros(256, np.uint8) for _ in range(4)]
            dm = [np.full(256, k + 1, np.uint8) for k in range(4)]
            pid = p.register_kv_cache(desc, kvdd.tensor_addrs(pm))
            did = d.register_kv_cache(desc, kvdd.tensor_addrs(dm))
            port = p.listen_port
            assert port is not None
            d.link_llm_clusters([kvdd.ClusterInfo(remote_cluster_id=1, local_ip_infos=(kvdd.IpInfo("127.0.0.1"),),
                                                  remote_ip_infos=(kvdd.IpInfo("127.0.0.1", port),))])
            ext = kvdd.KvCacheExtParam((0, 2**31 - 1), (0, 2**31 - 1), 2)
            with pytest.raises(kvdd.LLMError) as info:
                d.push_kv_cache(Cache(cache_id=did, cache_desc=desc), CacheIndex(1, pid, 1), 1, ext_param=ext)
            assert info.value.status == Status.LLM_PARAM_INVALID
            for k in range(4):  # both layers written: row 1 of every tensor
                assert (pm[k][64:128] == k + 1).all() and not pm[k][:64].any() and not pm[k][128:].any()
            wide = Cache(cache_id=did, cache_desc=CacheDesc(num_tensors=2**32 - 1))
            with pytest.raises(kvdd.LLMError) as info:
                d.push_kv_cache(wide, CacheIndex(1, pid, 2), 2)
            assert info.value.status == Status.LLM_PARAM_INVALID
            assert all((pm[k][128:192] == k + 1).all() for k in range(4))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
