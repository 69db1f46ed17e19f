"""The native binding never casts an integer that is no ``ge::DataType`` enumerator into the enum
(VENDOR.md: undefined behaviour).  It passes DT_UNDEFINED instead, which the library refuses at the
same step (RegisterKvCache step 8, after the cache id is consumed; SEMANTICS.md §3.7), so callers
get upstream's LLM_PARAM_INVALID in upstream's order.

Runs against kvdd's simulated CANN root, whose library hands the C++ values to a recording
simulator (tests/native/native_support.py): what reached the library is read back there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvdd import CacheDesc, DataType, RegisterCfg, Status
from native.native_support import recorders, skip_unless_test_double

skip_unless_test_double()

from kvdd._native._datadist import NativeBackend  # noqa: E402

__all__ = ["recorders"]

ENUMERATORS = [v for v in range(44) if v != 5]  # 0..4, 6..DT_MAX (43)


@pytest.mark.parametrize("value", [5, 44, 99, -1, 2**31 - 1, -(2**31)])
def test_a_value_that_is_no_enumerator_reaches_the_library_as_dt_undefined(
        recorders: list[Any], value: int) -> None:
    nb = NativeBackend(3, 1)
    assert nb.initialize({"llm.DeviceId": "0"}) == Status.LLM_SUCCESS
    mem = np.zeros(32, np.uint8)
    desc = CacheDesc(num_tensors=1, data_type=value, shape=(4, 8))
    status, cache_id = nb.register_kv_cache(desc, [mem.ctypes.data], RegisterCfg())
    assert (status, cache_id) == (Status.LLM_PARAM_INVALID, -1)
    seen = recorders[-1].last("register_kv_cache").args[0]
    assert seen.data_type == DataType.DT_UNDEFINED
    # the id was consumed at step 7, as for the value itself
    ok = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(4, 8))
    assert nb.register_kv_cache(ok, [mem.ctypes.data], RegisterCfg()) == (Status.LLM_SUCCESS, 2)
    nb.finalize()


@pytest.mark.parametrize("value", ENUMERATORS)
def test_every_enumerator_reaches_the_library_unchanged(recorders: list[Any], value: int) -> None:
    nb = NativeBackend(3, 1)
    assert nb.initialize({"llm.DeviceId": "0"}) == Status.LLM_SUCCESS
    nb.register_kv_cache(CacheDesc(num_tensors=1, data_type=value, shape=(4, 8)), [4096],
                         RegisterCfg())
    assert recorders[-1].last("register_kv_cache").args[0].data_type == value
    nb.finalize()
