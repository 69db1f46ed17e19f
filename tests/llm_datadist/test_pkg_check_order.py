"""Which error comes first when two arguments are wrong, and what passes the Python layer to the
engine, as CANN's Python layer does (PYPKG.md §3.3, §3.4, §4.3, §4.7, §4.8, §4.10, §4.11; upstream
checks argument by argument in a fixed order, each kind of check over all items)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pkg_fake import RecordingWrapper, blocks, contiguous, desc, fake, outcome, started

from kvdd.llm_datadist import (
    BlocksCacheKey,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
)

__all__ = ["fake"]

PI = LLMStatusCode.LLM_PARAM_INVALID
RA_OFF = {"llm.EnableCacheManager": "1"}


class Sync(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


# -- LLMDataDist ---------------------------------------------------------------------------------

def test_link_equal_ranks_pass_python_and_rank_table_none_is_checked_last(fake: RecordingWrapper) -> None:
    dd = started(role=LLMRole.PROMPT, cluster_id=1)
    # ranks need only be sorted (equal ranks reach the engine)
    dd.link("c", {1: 0, 2: 0}, "{}")
    assert fake.last("link")[1] == [(1, 0), (2, 0)]
    # rank_table None passes the Python type check; the count and order rules come first
    assert outcome(fake, lambda: dd.link("c", {1: 0}, None)) == PI  # type: ignore[arg-type]
    assert outcome(fake, lambda: dd.link("c", {1: 1, 2: 0}, None)) == PI  # type: ignore[arg-type]
    assert outcome(fake, lambda: dd.link("c", {1: 0, 2: 1}, None)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: dd.link("c", {1: 0, 2: 1}, 5)) is TypeError  # type: ignore[arg-type]


def test_unlink_clusters_force_none_is_not_forced(fake: RecordingWrapper) -> None:
    dd = started()
    info = LLMClusterInfo()
    info.remote_cluster_id = 9
    dd.unlink_clusters([info], 1000, force=None)
    assert fake.last("unlink_clusters_v2")[2] is False


def test_listen_ip_info_must_be_a_str(fake: RecordingWrapper) -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    assert outcome(fake, lambda: dd.init({**RA_OFF, "llm.listenIpInfo": 26000})) is TypeError  # type: ignore[dict-item]
    started()
    dd2 = LLMDataDist.llm_engine_instance
    assert dd2 is not None
    assert outcome(fake, lambda: dd2.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": 5})) is TypeError  # type: ignore[dict-item]


# -- CacheManager --------------------------------------------------------------------------------

def test_pull_layer_ranges_types_then_steps_then_bounds(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    dst = contiguous(mgr)
    key = CacheKeyByIdAndIndex(1, 1)

    def pull(src: Any, dst_range: Any) -> Callable[[], Any]:
        return lambda: mgr.pull_cache(key, dst, src_layer_range=src, dst_layer_range=dst_range)

    assert outcome(fake, pull(range(-1, 2), "x")) is TypeError  # dst type before src start
    assert outcome(fake, pull(range(2**32, 2**32 + 1), range(0, 4, 2))) == PI  # dst step before src bound
    assert outcome(fake, pull(range(0, 4, 2), range(-1, 1))) == PI
    assert outcome(fake, pull(range(2**32, 2**32 + 1), range(-1, 1))) is ValueError  # src bound, then dst
    assert outcome(fake, pull(range(0, 1), range(2**32, 2**32 + 1))) is ValueError


def test_push_cache_size_is_checked_after_the_layer_arguments(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    src = contiguous(mgr)
    key = CacheKeyByIdAndIndex(1, 1)
    assert outcome(fake, lambda: mgr.push_cache(key, src, size=2**63, tensor_num_per_layer=0)) == PI
    assert outcome(fake, lambda: mgr.push_cache(key, src, size="x", src_layer_range=range(0, 2, 2))) == PI  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.push_cache(key, src, size=2**63, src_layer_range=range(1),
                                                dst_layer_range=range(2))) == PI
    assert outcome(fake, lambda: mgr.push_cache(key, src, size=2**63)) is ValueError
    assert outcome(fake, lambda: mgr.push_cache(key, src, size=3)) == PI


def test_push_blocks_src_blocks_none_is_sent_as_empty(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    src = blocks(mgr)
    mgr.push_blocks(BlocksCacheKey(1, 0), src, None, [0])
    assert fake.last("transfer_cache_v2")[2] == (0, [], [0])


def test_allocate_without_a_pool_is_param_invalid_in_python(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    assert outcome(fake, lambda: mgr.allocate_cache(desc())) == PI
    assert outcome(fake, lambda: mgr.allocate_blocks_cache(desc())) == PI
    assert outcome(fake, lambda: mgr.allocate_cache(desc(placement=Placement.HOST))) == PI


def test_copy_blocks_checks_the_mapping_before_the_cache_kind(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    plain = contiguous(mgr)
    assert outcome(fake, lambda: mgr.copy_blocks(plain, "x")) is TypeError  # type: ignore[arg-type]
    bl = blocks(mgr)
    assert outcome(fake, lambda: mgr.copy_blocks(bl, {0: (1, 2)})) is TypeError  # type: ignore[dict-item]
    assert outcome(fake, lambda: mgr.copy_blocks(plain, {0: [1]})) == PI


def test_swap_blocks_checks_the_cache_kinds_before_the_mapping(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    plain = contiguous(mgr)
    assert outcome(fake, lambda: mgr.swap_blocks(plain, plain, "x")) == PI  # type: ignore[arg-type]


def test_transfer_cache_async_block_list_checks(fake: RecordingWrapper) -> None:
    mgr = started(RA_OFF).cache_manager
    src = contiguous(mgr)
    cfg = TransferConfig(1, [1, 2, 3, 4])

    def tca(**kw: Any) -> Callable[[], Any]:
        return lambda: mgr.transfer_cache_async(src, Sync(), [cfg], **kw)

    # dst_block_indices is checked before src_block_indices
    assert outcome(fake, tca(src_block_indices=[-1], dst_block_indices=["a"])) is TypeError
    assert outcome(fake, tca(src_block_indices=["a"], dst_block_indices=[-1])) is ValueError
    # each list: every item's type, then every value's range
    assert outcome(fake, tca(dst_block_indices=[-1, "a"], dst_block_memory_size=8)) is TypeError
    # an empty src list means "not blocks": no dst list needed
    task = mgr.transfer_cache_async(src, Sync(), [TransferConfig(1, [1, 2, 3, 4])], src_block_indices=[])
    assert task.synchronize(2000) == LLMStatusCode.LLM_SUCCESS
    # an empty dst list with a memory size is refused like a missing one
    assert outcome(fake, tca(dst_block_indices=[], dst_block_memory_size=8)) == PI
    # a blocks source without src_block_indices sending into dst blocks needs the memory size
    bsrc = blocks(mgr)
    assert outcome(fake, lambda: mgr.transfer_cache_async(bsrc, Sync(), [TransferConfig(1, [1, 2, 3, 4])],
                                                          dst_block_indices=[0])) == PI


def test_switch_role_none_fails_on_the_role_name_before_the_options(fake: RecordingWrapper) -> None:
    dd = started()
    # None passes the role's type check (as in the constructor) and fails looking its name up
    assert_raises_key_error = pytest.raises(KeyError)
    with assert_raises_key_error:
        dd.switch_role(None, "not a dict")  # type: ignore[arg-type]
    assert outcome(fake, lambda: dd.switch_role("PROMPT", {})) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: dd.switch_role(LLMRole.PROMPT, "x")) is TypeError  # type: ignore[arg-type]
    assert "switch_role_v2" not in fake.names()


def test_keys_check_required_arguments_before_unknown_keywords() -> None:
    from kvdd.llm_datadist import BlocksCacheKey as BK
    from kvdd.llm_datadist import CacheKey as CK

    # the messages clients match on ("cluster_id is required", "req_id is required", "Unsupported")
    cases: list[tuple[Callable[[], object], str]] = [
                      (lambda: CK(req_idx=1), "cluster_id is required"),
                       (lambda: CK(cluster_id=1, prefix_idx=1), "req_id is required"),
                       (lambda: BK(model_idx=1), "cluster_id is required"),
                       (lambda: CK(1, 2, prefix_idx=1), "Unsupported")]
    for call, text in cases:
        with pytest.raises(LLMException, match=text) as exc:
            call()
        assert exc.value.status_code == PI


def test_swap_blocks_checks_sizes_before_the_mapping_values(fake: RecordingWrapper) -> None:
    mgr = started().cache_manager
    a = mgr.register_blocks_cache(desc(4, (8, 16)), [0x1000 * (i + 1) for i in range(4)])
    b = mgr.register_blocks_cache(desc(4, (4, 16)), [0x9000 * (i + 1) for i in range(4)])  # other block size
    # upstream type-checks the mapping's keys only; a bad value fails after the size rules
    assert outcome(fake, lambda: mgr.swap_blocks(a, b, {0: "x"})) == PI  # type: ignore[dict-item]
    assert outcome(fake, lambda: mgr.swap_blocks(a, b, {"x": 0})) is TypeError  # type: ignore[dict-item]


def test_utils_checks_take_upstreams_positional_arguments() -> None:
    from kvdd.llm_datadist.utils import utils as u

    # check_isinstance(name, value, classes, inner_class=None, extra_fmt="", allow_none=True)
    with pytest.raises(TypeError, match="^pre x"):
        u.check_isinstance("x", [1, "a"], [list, tuple], int, "pre ")
    assert u.check_isinstance("x", None, int) is None
    # list checks go item by item (type and range together) over any iterable
    with pytest.raises(ValueError):
        u.check_list_int32("x", [2**40, "a"])
    with pytest.raises(TypeError):
        u.check_list_uint64("x", ["a", -1])
    u.check_list_int64("x", iter([1, 2]))


def test_pull_cache_checks_the_cache_type_before_the_batch_index(fake: RecordingWrapper) -> None:
    """PYPKG.md §4.5 Python order: ``cache`` is a Cache (TypeError) before ``batch_index`` uint32
    (ValueError)."""
    mgr = started().cache_manager
    key = CacheKeyByIdAndIndex(1, 1)
    dst = contiguous(mgr)
    assert outcome(fake, lambda: mgr.pull_cache(key, "x", batch_index=-1)) is TypeError  # type: ignore[arg-type]
    assert outcome(fake, lambda: mgr.pull_cache(key, dst, batch_index=-1)) is ValueError


def test_pull_cache_checks_the_size_type_before_the_destination_kind(fake: RecordingWrapper) -> None:
    """PYPKG.md §4.5 Python order: ``size`` int64 (ValueError) before a blocks destination
    (LLM_PARAM_INVALID)."""
    mgr = started().cache_manager
    key = CacheKeyByIdAndIndex(1, 1)
    dst = blocks(mgr)
    assert outcome(fake, lambda: mgr.pull_cache(key, dst, size=2**63)) is ValueError
    assert outcome(fake, lambda: mgr.pull_cache(key, dst, size=8)) == PI


def test_pull_cache_checks_tensor_num_per_layer_before_the_key_ids(fake: RecordingWrapper) -> None:
    """PYPKG.md §4.5 Python order: ``tensor_num_per_layer`` uint32 (ValueError) before the CacheKey
    req_id/prefix_id rule (LLM_PARAM_INVALID)."""
    mgr = started(RA_OFF).cache_manager
    dst = contiguous(mgr)
    both_ids = CacheKey(1, req_id=3, prefix_id=4)
    assert outcome(fake, lambda: mgr.pull_cache(both_ids, dst, tensor_num_per_layer=2**32)) is ValueError
    assert outcome(fake, lambda: mgr.pull_cache(both_ids, dst)) == PI


def test_pull_blocks_checks_dst_blocks_empty_before_tensor_num_per_layer(fake: RecordingWrapper) -> None:
    """PYPKG.md §4.6 Python order: empty ``dst_blocks`` (LLM_PARAM_INVALID) before
    ``tensor_num_per_layer`` uint32 (ValueError)."""
    mgr = started().cache_manager
    dst = blocks(mgr)
    key = BlocksCacheKey(1, 0)
    assert outcome(fake, lambda: mgr.pull_blocks(key, dst, [0], [], tensor_num_per_layer=2**32)) == PI
    assert outcome(fake, lambda: mgr.pull_blocks(key, dst, [0], [0], tensor_num_per_layer=2**32)) is ValueError


def test_pull_blocks_checks_the_block_list_types_before_the_destination_kind(fake: RecordingWrapper) -> None:
    """PYPKG.md §4.6 Python order: block lists of int (TypeError) before "destination must be a
    blocks cache" (LLM_PARAM_INVALID)."""
    mgr = started().cache_manager
    plain = contiguous(mgr)
    key = BlocksCacheKey(1, 0)
    assert outcome(fake, lambda: mgr.pull_blocks(key, plain, [0], ["a"])) is TypeError  # type: ignore[list-item]
    assert outcome(fake, lambda: mgr.pull_blocks(key, plain, [0], [0])) == PI


def test_pull_layer_range_start_sign_before_its_uint32_bound(fake: RecordingWrapper) -> None:
    """PYPKG.md §4.7: a negative start (LLM_PARAM_INVALID) is checked before the uint32 bound of
    the same range (ValueError)."""
    mgr = started().cache_manager
    dst = contiguous(mgr)
    key = CacheKeyByIdAndIndex(1, 1)
    assert outcome(fake, lambda: mgr.pull_cache(key, dst, src_layer_range=range(-1, 2**32 + 1),
                                                dst_layer_range=range(0, 1))) == PI


def test_pull_layer_range_ending_at_the_last_uint32_layer_reaches_the_engine(fake: RecordingWrapper) -> None:
    """PYPKG.md §4.7: first/last layer must be uint32 (ValueError beyond); layer 2**32 - 1 itself is
    in range and its tensor indices are passed to the engine."""
    mgr = started().cache_manager
    dst = contiguous(mgr)
    key = CacheKeyByIdAndIndex(1, 1)
    last = range(2**32 - 1, 2**32)
    mgr.pull_cache(key, dst, src_layer_range=last, dst_layer_range=last, tensor_num_per_layer=1)
    param = fake.last("pull_cache_v2")[2]
    assert (param[4], param[5]) == ([2**32 - 1], [2**32 - 1])
    beyond = range(2**32, 2**32 + 1)
    assert outcome(fake, lambda: mgr.pull_cache(key, dst, src_layer_range=beyond, dst_layer_range=beyond,
                                                tensor_num_per_layer=1)) is ValueError
