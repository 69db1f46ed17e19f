"""Argument checks at the exact bound each one documents (API.md "Errors"; SEMANTICS.md §2.1).

Each test sits on a boundary: the last accepted value and the first refused one, so weakening
the check by one (or dropping it) fails a test here.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, DataType, LlmRole, Status
from kvdd.widths import UINT32, check_int_seq


@pytest.mark.parametrize("shape", [(), (2, 2), (1, 2, 1)])
def test_block_array_that_is_not_1d_is_a_value_error(shape: tuple[int, ...]) -> None:
    # a numpy array of ints with the wrong number of dimensions: ValueError "must be 1-D"
    # (TypeError is for what is not a sequence of integers at all)
    with pytest.raises(ValueError, match="src_blocks must be 1-D"):
        check_int_seq("src_blocks", np.zeros(shape, np.int64), UINT32)


def test_1d_block_array_is_accepted() -> None:
    assert check_int_seq("src_blocks", np.array([0, 2**32 - 1], np.uint64), UINT32) == (0, 2**32 - 1)
    with pytest.raises(ValueError):
        check_int_seq("src_blocks", np.array([0, 2**32], np.uint64), UINT32)


@pytest.mark.parametrize("backend", kvdd.available_backends())
def test_block_array_that_is_not_1d_is_refused_by_pull_kv_blocks(backend: str) -> None:
    desc = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(4, 16))
    mem = np.zeros(64, np.uint8)
    with kvdd.LlmDataDist(1, LlmRole.MIX, backend=backend) as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        cache = Cache(dd.register_kv_cache(desc, kvdd.tensor_addrs([mem])), cache_desc=desc)
        with pytest.raises(ValueError, match="1-D"):
            dd.pull_kv_blocks(CacheIndex(2, 1), cache, np.zeros((1, 1), np.int64), [0])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="1-D"):
            dd.pull_kv_blocks(CacheIndex(2, 1), cache, [0], np.array(0, np.int64))  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", kvdd.available_backends())
def test_pull_kv_cache_batch_index_is_a_uint32(backend: str) -> None:
    # 2**32 - 1 reaches the library (which refuses it as a status); 2**32 is a ValueError
    # raised before any call, and so is -1.
    desc = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(4, 16))
    mem = np.zeros(64, np.uint8)
    with kvdd.LlmDataDist(1, LlmRole.MIX, backend=backend) as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
        cache = Cache(dd.register_kv_cache(desc, kvdd.tensor_addrs([mem])), cache_desc=desc)
        for bad in (2**32, -1):
            with pytest.raises(ValueError, match="batch_index"):
                dd.pull_kv_cache(CacheIndex(2, 1), cache, batch_index=bad)
        with pytest.raises(kvdd.LLMError) as info:
            dd.pull_kv_cache(CacheIndex(2, 1), cache, batch_index=2**32 - 1)
        assert info.value.status == Status.LLM_PARAM_INVALID  # §3.11: batch_index >= B
    assert not mem.any()


@pytest.mark.parametrize("value,ok", [(np.uint32(0), True), (np.uint64(2**32 - 1), True),
                                      (np.int64(-1), False), (np.uint64(2**32), False)])
def test_numpy_integers_at_the_uint32_bounds(value: object, ok: bool) -> None:
    # numpy integers take the general path (not the plain-int fast one): the same inclusive bounds
    from kvdd.widths import check_int
    if ok:
        assert check_int("batch_index", value, UINT32) == int(value)  # type: ignore[call-overload]
    else:
        with pytest.raises(ValueError, match="does not fit the C\\+\\+ field"):
            check_int("batch_index", value, UINT32)


@pytest.mark.parametrize("value,message", [
    (np.array([1.0, 2.0]), "must hold integers, got dtype float64"),
    ("01", "must be a sequence of integers, not str"),
    (b"\x00\x01", "must be a sequence of integers, not bytes"),
    ({0, 1}, "must be a sequence of integers, not set"),
])
def test_what_is_not_a_sequence_of_integers_is_a_type_error(value: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        check_int_seq("src_blocks", value, UINT32)


def test_a_list_is_checked_and_returned_as_one_tuple() -> None:
    assert check_int_seq("src_blocks", [3, 1], UINT32) == (3, 1)
    assert type(check_int_seq("src_blocks", [3, 1], UINT32)) is tuple
