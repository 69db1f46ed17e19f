"""Packing Python values into the seam's tuples, and the argument conversions shared by
``LLMDataDist`` and ``CacheManager`` (PYPKG.md §1.4, §2.2, §4.7).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._seam import CacheDescTuple, CacheKeyTuple, MemInfoTuple
from ..status import raise_if_false
from ..utils.utils import UINT32_MAX, UINT64_MAX, check_isinstance
from .llm_keys import INVALID_ID, BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from .llm_types import CacheDesc, MemInfo

__all__ = [
    "pack_cache_desc",
    "pack_cache_key",
    "pack_uint64_list",
    "layer_range_to_tensor_indices",
    "parse_listen_ip_info",
    "check_cache_key_ids",
    "is_valid_id",
    "is_invalid_id",
    "pack_cache_key_by_id",
    "pack_block_cache_key",
    "pack_mem_info",
]


def _native_uint64(name: str, value: int) -> int:
    # what pybind11 does when an out-of-range int is passed where the C++ takes uint64_t
    if not 0 <= value <= UINT64_MAX:
        raise TypeError(f"{name}={value} cannot be passed to the engine as uint64.")
    return value


def pack_uint64_list(name: str, values: Sequence[int]) -> list[int]:
    """A list of uint64 for the engine (``TypeError`` for a value out of range, as the native
    binding does)."""
    packed = list(values)
    if packed and (min(packed) < 0 or max(packed) > UINT64_MAX):
        bad = next(v for v in packed if not 0 <= v <= UINT64_MAX)
        raise TypeError(f"{name} holds {bad}, which cannot be passed to the engine as uint64.")
    return packed


def pack_cache_desc(desc: CacheDesc) -> CacheDescTuple:
    """CacheDescTuple ``(num_tensors, dtype, seq_len_dim_index, shape, placement, is_blocks)``."""
    return (desc.num_tensors, desc.data_type.value, desc.seq_len_dim_index, list(desc.shape),
            int(desc.placement), desc._is_blocks)


def pack_cache_key(key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> CacheKeyTuple:
    """CacheKeyTuple ``(cluster_id, cache_id, batch_index, req_id, prefix_id, model_id,
    is_blocks_key)`` (PYPKG.md §1.4)."""
    if isinstance(key, CacheKey):
        return (key.cluster_id, -1, 0, key.req_id, key.prefix_id, key.model_id, False)
    if isinstance(key, CacheKeyByIdAndIndex):
        return (key.cluster_id, key.cache_id, key.batch_index, INVALID_ID, INVALID_ID, 0, False)
    return (_native_uint64("cluster_id", key.cluster_id), -1, 0, INVALID_ID, INVALID_ID,
            _native_uint64("model_id", key.model_id), True)


def is_valid_id(value: int) -> bool:
    """A req/prefix id is valid when in [0, 2**64 - 1)."""
    return 0 <= value < INVALID_ID


def is_invalid_id(value: int) -> bool:
    """Negative or 2**64 - 1 (upstream's test; the opposite of :func:`is_valid_id` for uint64s)."""
    return value < 0 or value == INVALID_ID


def pack_cache_key_by_id(key: CacheKeyByIdAndIndex) -> CacheKeyTuple:
    """Upstream's name for :func:`pack_cache_key` of a ``CacheKeyByIdAndIndex``."""
    return pack_cache_key(key)


def pack_block_cache_key(key: BlocksCacheKey) -> CacheKeyTuple:
    """Upstream's name for :func:`pack_cache_key` of a ``BlocksCacheKey``."""
    return pack_cache_key(key)


def pack_mem_info(mem_info: MemInfo) -> MemInfoTuple:
    """``(mem_type value, addr, size)``."""
    return (mem_info.mem_type.value, mem_info.addr, mem_info.size)


def check_cache_key_ids(key: object) -> None:
    """A ``CacheKey`` used for a pull must have exactly one of ``req_id`` / ``prefix_id`` valid
    (LLM_PARAM_INVALID, PYPKG.md §4.5); other keys pass."""
    if isinstance(key, CacheKey):
        raise_if_false(is_valid_id(key.req_id) != is_valid_id(key.prefix_id),
                       f"exactly one of req_id and prefix_id must be valid in {key!r}.")


def _range_to_indices(name: str, layer_range: range | None, tensor_num_per_layer: int) -> list[int]:
    # types and steps were checked by the caller (both ranges, before any bound)
    if layer_range is None or len(layer_range) == 0:
        return []
    first, last = layer_range[0], layer_range[-1]
    raise_if_false(first >= 0, f"{name} must start at >= 0, but got {layer_range!r}.")
    if not (first <= UINT32_MAX and 0 <= last <= UINT32_MAX):
        raise ValueError(f"{name} must be in range of uint32, but got {layer_range!r}.")
    return list(range(first * tensor_num_per_layer, (last + 1) * tensor_num_per_layer))


def layer_range_to_tensor_indices(src_layer_range: Any, dst_layer_range: Any,
                                  tensor_num_per_layer: int = 2) -> tuple[list[int], list[int]]:
    """Half-open layer ``range``s -> tensor indices ``[a*t, b*t)`` (PYPKG.md §4.7).

    None or an empty range means "all" (an empty list).  In upstream's order: both types
    (not a ``range`` -> ``TypeError``), both steps (!= 1 -> LLM_PARAM_INVALID), then the source's
    bounds and the destination's (a negative start -> LLM_PARAM_INVALID, beyond uint32 ->
    ``ValueError``).  The count rules are the engine's."""
    check_isinstance("src_layer_range", src_layer_range, range)
    check_isinstance("dst_layer_range", dst_layer_range, range)
    for name, layer_range in (("src_layer_range", src_layer_range), ("dst_layer_range", dst_layer_range)):
        raise_if_false(layer_range is None or layer_range.step == 1,
                       f"{name} step must be 1, but got {layer_range!r}.")
    return (_range_to_indices("src_layer_range", src_layer_range, tensor_num_per_layer),
            _range_to_indices("dst_layer_range", dst_layer_range, tensor_num_per_layer))


def parse_listen_ip_info(listen_ip_info: str) -> tuple[str, int]:
    """``"ip:port"`` -> ``(ip, int(port))`` (PYPKG.md §2.2 step 6; ``init`` stores
    ``str(port)`` as ``llm.ListenPort``).

    Not a str -> ``TypeError``; not exactly two ``:``-separated parts -> LLM_PARAM_INVALID; a
    non-numeric port -> ``ValueError``. The IP is not validated (so IPv6 literals cannot be used)."""
    check_isinstance("listen_ip_info", listen_ip_info, str, allow_none=False)
    parts = listen_ip_info.split(":")
    raise_if_false(len(parts) == 2, f"llm.listenIpInfo must be 'ip:port', but got '{listen_ip_info}'.")
    try:
        port = int(parts[1])
    except ValueError as exc:  # int()'s ValueError, as upstream, naming the option
        raise ValueError(f"{exc} (the port of llm.listenIpInfo '{listen_ip_info}')") from None
    return parts[0], port
