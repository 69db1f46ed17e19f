"""Python-level argument checks at exact boundaries (API.md; SEMANTICS.md §2.1 and §3.6)."""

from __future__ import annotations

import numpy as np
import pytest

import kvdd
from kvdd import CacheDesc, ClusterInfo, DataType


@pytest.mark.parametrize("backend", kvdd.available_backends())
def test_tensor_one_byte_smaller_than_the_descriptor_is_refused(backend: str) -> None:
    # A TensorAddrs tensor must hold T bytes: T - 1 is a ValueError before any LLM call.
    desc = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=(4, 16))  # T = 64
    ok, short = np.zeros(64, np.uint8), np.zeros(63, np.uint8)
    with kvdd.LlmDataDist(1, kvdd.LlmRole.MIX, backend=backend) as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        with pytest.raises(ValueError, match="tensor 1 holds 63 bytes but cache_desc needs 64"):
            dd.register_kv_cache(desc, kvdd.tensor_addrs([ok, short]))
        assert dd.register_kv_cache(desc, kvdd.tensor_addrs([ok, np.zeros(64, np.uint8)])) == 1


@pytest.mark.parametrize("backend", kvdd.available_backends())
@pytest.mark.parametrize("force", [1, 0, "yes", None])
def test_unlink_force_must_be_a_bool(backend: str, force: object) -> None:
    # §3.6: force_flag is a C++ bool; an int is a TypeError, not a silent truth value.
    with kvdd.LlmDataDist(1, kvdd.LlmRole.MIX, backend=backend) as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        with pytest.raises(TypeError, match="force must be bool"):
            dd.unlink_llm_clusters([ClusterInfo(remote_cluster_id=2)], force=force)  # type: ignore[arg-type]
        assert dd.unlink_llm_clusters([ClusterInfo(remote_cluster_id=2)], force=True) == [kvdd.Status.LLM_SUCCESS]


@pytest.mark.parametrize("b,expected", [(2**31 + 1, 2**31 + 1), (2**32 - 1, 2**32 - 1), (2**32 + 5, 5)])
def test_batch_size_is_shape0_as_uint32(b: int, expected: int) -> None:
    # §2.1: B is shape[0] as uint32 (not int32: 2**31 + 1 stays positive).
    assert CacheDesc(1, DataType.DT_INT8, (b,)).batch_size == expected
