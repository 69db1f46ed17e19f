"""Engine bugs found by the property suite, pinned until fixed.

Each test states the call, what SEMANTICS.md requires and which clause; it is a strict xfail, so
when the engine is fixed it XPASSes, the run fails, and the entry (and its generator workaround
in ``KNOWN_ENGINE_BUGS`` of test_sim_vs_model.py) must be removed.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, DataType, Status

from .test_sim_vs_model import KNOWN_ENGINE_BUGS


@pytest.mark.xfail("push_kv_blocks_huge_block_index" in KNOWN_ENGINE_BUGS, strict=True,
                   reason="engine: OverflowError for a uint64 block index >= 2**63")
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
