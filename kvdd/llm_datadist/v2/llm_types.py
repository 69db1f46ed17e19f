"""Types of the cache-manager layer (PYPKG.md §1.2, §5.1-§5.7).

``CacheDesc``, ``Cache``, ``KvCache``, the keys (from :mod:`.llm_keys`), ``MemInfo``, the transfer
configs, ``LayerSynchronizer`` and ``CacheTask``; the enums ``Placement``, ``RegisterMemStatus``,
``Memtype``, ``PushType``; :func:`check_layer_range`.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

from .. import llm_datadist_wrapper as _native_module
from ..data_type import DataType
from ..status import LLMException, LLMStatusCode, raise_if_false
from ..utils.utils import (
    check_int32,
    check_int64,
    check_isinstance,
    check_list_of,
    check_uint32,
    check_uint64,
)
from .llm_keys import INVALID_ID, BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex

if TYPE_CHECKING:
    from .cache_manager import CacheManager

__all__ = [
    "PushType", "RegisterMemStatus", "Memtype", "MemInfo", "Placement", "CacheDesc", "Cache",
    "KvCache", "CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "LayerSynchronizer",
    "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask", "check_layer_range",
    "int_to_mem_status_dict", "INVALID_ID",
]


class PushType(Enum):
    """How ``transfer_cache_v2`` addresses the destination (internal)."""

    NO_CACHE_KEY = 0
    BLOCKS_CACHE_KEY = 1
    CACHE_KEY_BY_ID = 2


class RegisterMemStatus(Enum):
    """State of a rank-table link's memory exchange (``query_register_mem_status``, §3.3)."""

    OK = 0
    PREPARING = 1
    FAILED = 2


#: engine int -> RegisterMemStatus (anything else is FAILED, PYPKG.md §5.5)
int_to_mem_status_dict: dict[int, RegisterMemStatus] = {
    0: RegisterMemStatus.OK, 1: RegisterMemStatus.PREPARING, 2: RegisterMemStatus.FAILED,
}


class Memtype(Enum):
    """Memory kind of a :class:`MemInfo`."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class Placement(IntEnum):
    """Where a cache's tensors live; ``str()`` (and so ``CacheDesc``'s repr) gives
    ``Placement.DEVICE``, not the int."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"


class MemInfo:
    """A memory range for ``remap_registered_memory``: ``(mem_type, addr, size)`` (types checked
    only, ``TypeError``; PYPKG.md §5.6)."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype, allow_none=False)
        check_isinstance("addr", addr, int, allow_none=False)
        check_isinstance("size", size, int, allow_none=False)
        self._mem_type = mem_type
        self._addr = addr
        self._size = size

    @property
    def mem_type(self) -> Memtype:
        """Memory kind."""
        return self._mem_type

    @property
    def addr(self) -> int:
        """Start address."""
        return self._addr

    @property
    def size(self) -> int:
        """Length in bytes."""
        return self._size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"


class CacheDesc:
    """A cache: ``num_tensors`` tensors of one ``shape`` and ``data_type`` (PYPKG.md §5.1).

    Parameters
    ----------
    num_tensors
        Number of tensors (uint32), typically 2 x layers (K, V, K, V, ...).
    shape
        Dims of every tensor (list/tuple of int64); ``shape[0]`` is the batch size of a cache and
        the number of blocks of a blocks cache.
    data_type
        :class:`DataType`.
    placement
        :class:`Placement` (default DEVICE).
    batch_dim_index, seq_len_dim_index, kv_tensor_format
        Kept for upstream compatibility; the engine uses ``shape[0]``.

    Raises
    ------
    TypeError, ValueError
        Argument types and C ranges.
    LLMException
        LLM_PARAM_INVALID: ``batch_dim_index`` not a dim of ``shape`` (so an empty shape fails),
        ``seq_len_dim_index`` neither -1 nor a dim.
    """

    def __init__(self, num_tensors: int, shape: list[int] | tuple[int, ...], data_type: DataType,
                 placement: Placement = Placement.DEVICE, batch_dim_index: int = 0,
                 seq_len_dim_index: int = -1, kv_tensor_format: str | None = None) -> None:
        check_uint32("num_tensors", num_tensors)
        check_list_of("shape", shape, int)
        check_isinstance("data_type", data_type, DataType, allow_none=False)
        check_isinstance("placement", placement, Placement, allow_none=False)
        check_isinstance("batch_dim_index", batch_dim_index, int, allow_none=False)
        check_int32("seq_len_dim_index", seq_len_dim_index)
        check_isinstance("kv_tensor_format", kv_tensor_format, str)
        raise_if_false(0 <= batch_dim_index < len(shape),
                       f"batch_dim_index {batch_dim_index} is not a dim of shape {shape}.")
        raise_if_false(seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
                       f"seq_len_dim_index {seq_len_dim_index} is neither -1 nor a dim of shape {shape}.")
        for dim in shape:
            check_int64("shape dim", dim)
        self._num_tensors = num_tensors
        self._shape = shape
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = batch_dim_index
        self._batch_size: int = shape[batch_dim_index]
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format
        self._size: int | None = None
        self._is_blocks = False

    @property
    def num_tensors(self) -> int:
        """Number of tensors."""
        return self._num_tensors

    @property
    def shape(self) -> list[int] | tuple[int, ...]:
        """Dims of each tensor (the object given)."""
        return self._shape

    @property
    def data_type(self) -> DataType:
        """Element type."""
        return self._data_type

    @property
    def placement(self) -> Placement:
        """HOST or DEVICE."""
        return self._placement

    @property
    def batch_dim(self) -> int:
        """``batch_dim_index``."""
        return self._batch_dim_index

    @property
    def batch_dim_index(self) -> int:
        """``batch_dim_index``."""
        return self._batch_dim_index

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim_index]`` as at construction (``update_dim`` does not change it)."""
        return self._batch_size

    @property
    def seq_len_dim_index(self) -> int:
        """Sequence-length dim (-1 = none; unused by cache-manager transfers)."""
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        """Free-form format string."""
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of **one** tensor (engine ``calc_tensor_size``, cached).

        Raises ``LLMException`` (status LLM_SUCCESS, as upstream) when the engine cannot size it
        (a dim <= 0, overflow, an unsupported data type)."""
        if self._size is None:
            size = _native_module.calc_tensor_size(list(self._shape), self._data_type.value)
            if size < 0:
                raise LLMException(f"failed to calculate the tensor size of {self!r}")
            self._size = size
        return self._size

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set ``shape[dim_index] = dim_value`` (the shape must be a list) and forget the size."""
        self._shape[dim_index] = dim_value  # type: ignore[index]
        self._size = None

    def __repr__(self) -> str:
        return (f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
                f"data_type={self._data_type}, placement={self._placement}, "
                f"batch_dim_index={self._batch_dim_index}, seq_len_dim_index={self._seq_len_dim_index},"
                f"kv_tensor_format={self._kv_tensor_format})")


class Cache:
    """A registered or allocated cache (PYPKG.md §5.2); made by ``CacheManager``.

    ``tensor_addrs`` are the caller's addresses (registered) or pool addresses (allocated).
    """

    def __init__(self, cache_id: int, cache_desc: CacheDesc, tensor_addrs: list[int],
                 cache_manager: CacheManager | None = None, is_registered: bool = False,
                 is_blocks_cache: bool = False) -> None:
        check_int64("cache_id", cache_id)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = tensor_addrs
        self._cache_manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache
        self._valid = True

    @property
    def cache_id(self) -> int:
        """The engine's id (1, 2, ... per engine; -1 for a CPU view)."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """The descriptor it was made from."""
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        """One address per tensor."""
        return self._tensor_addrs

    @property
    def is_blocks_cache(self) -> bool:
        """Registered/allocated as a blocks cache."""
        return self._is_blocks_cache

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """An unregistered, blocks-flagged HOST view for ``swap_blocks`` (id -1).

        Raises ``TypeError``; LLM_PARAM_INVALID when the placement is not HOST or
        ``len(addrs) != num_tensors`` (PYPKG.md §5.2)."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_list_of("addrs", addrs, int, list)
        raise_if_false(cache_desc.placement == Placement.HOST, "cpu cache placement must be HOST.")
        raise_if_false(len(addrs) == cache_desc.num_tensors,
                       f"len(addrs)={len(addrs)} != num_tensors={cache_desc.num_tensors}.")
        return cls(-1, cache_desc, addrs, None, False, True)

    def __str__(self) -> str:
        return (f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = {len(self._tensor_addrs)}, "
                f"is_blocks_cache = {self._is_blocks_cache})")

    __repr__ = __str__


class KvCache:
    """The legacy (``KvCacheManager``) cache type (PYPKG.md §5.2); kvdd has no legacy engine, so
    this is only a value holder."""

    def __init__(self, cache_id: int, cache_desc: CacheDesc,
                 per_device_tensor_addrs: list[list[int]], kv_cache_manager: Any = None) -> None:
        check_int64("cache_id", cache_id)
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._kv_cache_manager = kv_cache_manager

    @property
    def cache_id(self) -> int:
        """Cache id."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """Descriptor."""
        return self._cache_desc

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        """Addresses per device."""
        return self._per_device_tensor_addrs

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int] | list[list[int]]) -> KvCache:
        """A HOST view from a flat list (one device) or a list of per-device lists, checked in
        upstream's order: placement HOST, ``addrs`` a non-empty list, every item an int or a
        list of int of ``num_tensors`` items, all items of one kind, a flat list of
        ``num_tensors`` items (``TypeError`` / LLM_PARAM_INVALID)."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        raise_if_false(cache_desc.placement == Placement.HOST, "cpu cache placement must be HOST.")
        check_isinstance("addrs", addrs, list, allow_none=False)
        raise_if_false(len(addrs) > 0, "addrs must not be empty.")
        kind: type = type(addrs[0])
        for item in addrs:
            check_isinstance("the item of addrs", item, (list, int), allow_none=False)
            if isinstance(item, list):
                check_isinstance("the item of addrs", item, list, inner_class=int)
                raise_if_false(len(item) == cache_desc.num_tensors,
                               f"an item of addrs holds {len(item)} addresses, not num_tensors="
                               f"{cache_desc.num_tensors}.")
            raise_if_false(isinstance(item, kind), "the items of addrs must all be ints or all lists.")
            kind = type(item)
        if kind is int:
            raise_if_false(len(addrs) == cache_desc.num_tensors,
                           f"len(addrs)={len(addrs)} != num_tensors={cache_desc.num_tensors}.")
            return cls(-1, cache_desc, [list(addrs)])  # type: ignore[arg-type]
        return cls(-1, cache_desc, [list(a) for a in addrs if isinstance(a, list)])

    def __str__(self) -> str:
        return f"KvCache(cache_id = {self._cache_id}, num_devices = {len(self._per_device_tensor_addrs)})"

    __repr__ = __str__


def check_layer_range(name: str, layer_range: range | None, allow_none: bool = True) -> None:
    """A push / async-transfer layer range (upstream's signature): None when allowed, else a
    ``range`` (``TypeError``) with step 1 and ``0 <= start < stop`` (else LLM_PARAM_INVALID;
    PYPKG.md §4.8)."""
    if allow_none and layer_range is None:
        return
    check_isinstance(name, layer_range, range, allow_none=False)
    assert layer_range is not None
    raise_if_false(layer_range.step == 1, f"{name} step must be 1, but got {layer_range!r}.")
    raise_if_false(0 <= layer_range.start < layer_range.stop,
                   f"{name} must satisfy 0 <= start < stop, but got {layer_range!r}.")


class LayerSynchronizer(ABC):
    """Tells ``transfer_cache_async`` when a layer is ready to send (PYPKG.md §5.7)."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """Wait until layer ``layer_index`` is computed; False aborts the task (the package
        always passes ``timeout_in_millis=None``)."""


class TransferConfig:
    """A destination of ``transfer_cache_async`` by raw addresses (non-remote-accessible mode,
    PYPKG.md §5.7): ``dst_cluster_id`` uint64, ``dst_addrs`` list/tuple of uint64 (two per layer),
    ``src_layer_range`` (None = all layers), ``src_batch_index`` uint32."""

    def __init__(self, dst_cluster_id: int, dst_addrs: list[int] | tuple[int, ...],
                 src_layer_range: range | None = None, src_batch_index: int = 0) -> None:
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = dst_addrs
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    @property
    def dst_cluster_id(self) -> int:
        """Destination cluster id (uint64)."""
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, value: int) -> None:
        check_uint64("dst_cluster_id", value)
        self._dst_cluster_id = value

    @property
    def dst_addrs(self) -> list[int] | tuple[int, ...]:
        """Destination addresses, two per layer (K, V)."""
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, value: list[int] | tuple[int, ...]) -> None:
        check_list_of("dst_addrs", value, int)
        for addr in value:
            check_uint64("dst_addrs item", addr)
        self._dst_addrs = value

    @property
    def src_layer_range(self) -> range | None:
        """Source layers (None = all)."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range | None) -> None:
        check_layer_range("src_layer_range", value)
        self._src_layer_range = value

    @property
    def src_batch_index(self) -> int:
        """Source batch row (uint32)."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        check_uint32("src_batch_index", value)
        self._src_batch_index = value

    def __repr__(self) -> str:
        return (f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, dst_addrs={self._dst_addrs}, "
                f"src_layer_range={self._src_layer_range}, src_batch_index={self._src_batch_index})")


class TransferWithCacheKeyConfig:
    """A destination of ``transfer_cache_async`` by key (remote-accessible mode, PYPKG.md §5.7).

    ``cache_key`` is a ``BlocksCacheKey`` or ``CacheKeyByIdAndIndex``; both layer ranges are
    required (``TypeError`` for None) and of equal length (LLM_PARAM_INVALID); ``src_batch_index``
    (uint32) must be 0 for a ``BlocksCacheKey``. ``dst_cluster_id`` is set once from the key.
    """

    def __init__(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
                 src_layer_range: range | None = None, dst_layer_range: range | None = None,
                 src_batch_index: int = 0) -> None:
        check_isinstance("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex), allow_none=False)
        # each range fully (type, step, bounds) in turn, as upstream
        check_isinstance("src_layer_range", src_layer_range, range, allow_none=False)
        check_layer_range("src_layer_range", src_layer_range)
        check_isinstance("dst_layer_range", dst_layer_range, range, allow_none=False)
        check_layer_range("dst_layer_range", dst_layer_range)
        assert src_layer_range is not None and dst_layer_range is not None
        raise_if_false(len(src_layer_range) == len(dst_layer_range),
                       "src_layer_range and dst_layer_range must have the same length.")
        check_uint32("src_batch_index", src_batch_index)
        raise_if_false(not (isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0),
                       "src_batch_index must be 0 for a BlocksCacheKey.")
        self._cache_key: BlocksCacheKey | CacheKeyByIdAndIndex | None = cache_key
        self._src_layer_range: range | None = src_layer_range
        self._dst_layer_range: range | None = dst_layer_range
        self._src_batch_index = src_batch_index
        self.dst_cluster_id: int = cache_key.cluster_id

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex | None:
        """The destination key (the setter does not update ``dst_cluster_id``)."""
        return self._cache_key

    @cache_key.setter
    def cache_key(self, value: BlocksCacheKey | CacheKeyByIdAndIndex | None) -> None:
        check_isinstance("cache_key", value, (BlocksCacheKey, CacheKeyByIdAndIndex))
        self._cache_key = value

    @property
    def src_layer_range(self) -> range | None:
        """Source layers."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range | None) -> None:
        check_layer_range("src_layer_range", value)
        self._src_layer_range = value

    @property
    def dst_layer_range(self) -> range | None:
        """Destination layers."""
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, value: range | None) -> None:
        check_layer_range("dst_layer_range", value)
        self._dst_layer_range = value

    @property
    def src_batch_index(self) -> int:
        """Source batch row."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        raise_if_false(not (isinstance(self._cache_key, BlocksCacheKey) and value != 0),
                       "src_batch_index must be 0 for a BlocksCacheKey.")
        check_uint32("src_batch_index", value)
        self._src_batch_index = value

    def __repr__(self) -> str:
        return (f"TransferWithCacheKeyConfig(cache_key={self._cache_key!r}, "
                f"src_layer_range={self._src_layer_range}, dst_layer_range={self._dst_layer_range}, "
                f"src_batch_index={self._src_batch_index})")


class CacheTask:
    """The handle ``transfer_cache_async`` returns (PYPKG.md §4.10)."""

    def __init__(self, thread: threading.Thread, results: dict[int, LLMStatusCode],
                 configs: list[TransferConfig] | list[TransferWithCacheKeyConfig]) -> None:
        self._thread = thread
        self._results = results
        self._configs = configs

    def _wait(self, timeout_in_millis: int | None) -> bool:
        check_uint32("timeout_in_millis", timeout_in_millis, allow_none=True)
        self._thread.join(None if timeout_in_millis is None else timeout_in_millis / 1000.0)
        return not self._thread.is_alive()

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait (milliseconds; None = forever) and return the task's status: LLM_TIMEOUT while
        still running, else the first recorded failure, else LLM_SUCCESS (a result that was never
        recorded, e.g. a crashed worker, counts as success — upstream's behaviour)."""
        if not self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        for config in self._configs:
            code = self._results.get(config.dst_cluster_id)
            if code is not None and code != LLMStatusCode.LLM_SUCCESS:
                return code
        return LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Per config its recorded status or None; ``[LLM_TIMEOUT] * n`` while still running."""
        if not self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._configs)
        return [self._results.get(config.dst_cluster_id) for config in self._configs]

