"""Value types of the LLM-DataDist C++ API, as immutable validated Python objects.

Each class mirrors the C++ struct or enum of ``llm_datadist/llm_datadist.h`` (docs/spec/VENDOR.md,
docs/spec/API.md "Value types").  Construction checks Python types (``TypeError``) and the C++ field
widths (``ValueError``) only; LLM semantics (e.g. ``num_tensors == 0``, a role of 4) are left to the
call that uses the value, which returns the status docs/spec/SEMANTICS.md gives.

Terms (docs/spec/SEMANTICS.md §2.1): a cache is ``num_tensors`` tensors of one shape; T is the bytes
of one tensor; B = ``shape[0]`` (as uint32) is the number of *rows* (batch rows) of a contiguous
cache, which are the *blocks* of a paged one (the same unit); the *stride* S = T // B is the bytes of
one row or block of one tensor.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, Union

import numpy as np
import numpy.typing as npt

# Re-exported: kvdd.types has always offered them (the binding and users import them from here).
from .dtypes import DataType, element_size, tensor_nbytes
from .widths import INT32, INT64, UINT8, UINT16, UINT32, UINT64, check_int, check_int_seq

__all__ = [
    "LlmRole",
    "CachePlacement",
    "DataType",
    "IpInfo",
    "ClusterInfo",
    "CacheDesc",
    "Cache",
    "CacheIndex",
    "KvCacheExtParam",
    "RegisterCfg",
    "element_size",
    "tensor_nbytes",
    "check_int",
    "check_int_seq",
    "INT32",
    "UINT8",
    "UINT16",
    "UINT32",
    "INT64",
    "UINT64",
]


class LlmRole(enum.IntEnum):
    """``llm_datadist::LlmRole`` (``int32_t``).  Role parameters take any int32 (docs/spec/SEMANTICS.md §3.2)."""

    PROMPT = 1
    DECODER = 2
    MIX = 3


class CachePlacement(enum.IntEnum):
    """``llm_datadist::CachePlacement`` (``uint32_t``); placement fields take any uint32."""

    HOST = 0
    DEVICE = 1


def _check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, not {type(value).__name__}")
    return value


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


# What the constructors accept (API.md): integer fields take int and numpy integers (anything with
# __index__; bool is rejected at run time), sequence fields any sequence of those or an integer
# numpy array.  The attributes are always int / tuple[int, ...].  The dataclasses therefore have
# explicit __init__ methods (init=False) typed with these, then validate in __post_init__.
_IntSeq = Union[Sequence[SupportsIndex], npt.NDArray[np.integer[Any]]]


@dataclass(frozen=True, init=False)
class IpInfo:
    """``llm_datadist::IpInfo``: an address of a cluster (docs/spec/SEMANTICS.md §3.5).

    Parameters
    ----------
    ip : str
        The IP (``AscendString``); links take IPv4 literals only.
    port : int
        ``uint16_t``, default 0.

    Raises
    ------
    TypeError, ValueError
        ``ip`` is not a str; ``port`` is not an integer or outside 0..65535.
    """

    ip: str
    port: int = 0

    def __init__(self, ip: str, port: SupportsIndex = 0) -> None:
        _set(self, "ip", ip)
        _set(self, "port", port)
        self.__post_init__()

    def __post_init__(self) -> None:
        _check_str("IpInfo.ip", self.ip)
        _set(self, "port", check_int("IpInfo.port", self.port, UINT16))


def _check_ip_infos(name: str, value: object) -> tuple[IpInfo, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of IpInfo, not {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, IpInfo):
            raise TypeError(f"{name}[{i}] must be IpInfo, not {type(item).__name__}")
    return tuple(value)


@dataclass(frozen=True, init=False)
class ClusterInfo:
    """``llm_datadist::ClusterInfo``: the peer to link to (docs/spec/SEMANTICS.md §3.5).

    Parameters
    ----------
    remote_cluster_id : int
        The peer's cluster id (uint64).
    remote_role_type : int
        int32, ignored upstream.
    local_ip_infos, remote_ip_infos : Sequence[IpInfo]
        This side's and the peer's addresses (IPv4 only); ``remote_ip_infos[0]`` is where the peer
        listens.

    Raises
    ------
    TypeError, ValueError
        A field of the wrong type or outside its C++ width.
    """

    remote_cluster_id: int = 0
    remote_role_type: int = 0
    local_ip_infos: tuple[IpInfo, ...] = ()
    remote_ip_infos: tuple[IpInfo, ...] = ()

    def __init__(
        self,
        remote_cluster_id: SupportsIndex = 0,
        remote_role_type: SupportsIndex = 0,
        local_ip_infos: Sequence[IpInfo] = (),
        remote_ip_infos: Sequence[IpInfo] = (),
    ) -> None:
        _set(self, "remote_cluster_id", remote_cluster_id)
        _set(self, "remote_role_type", remote_role_type)
        _set(self, "local_ip_infos", local_ip_infos)
        _set(self, "remote_ip_infos", remote_ip_infos)
        self.__post_init__()

    def __post_init__(self) -> None:
        _set(self, "remote_cluster_id",
             check_int("ClusterInfo.remote_cluster_id", self.remote_cluster_id, UINT64))
        _set(self, "remote_role_type",
             check_int("ClusterInfo.remote_role_type", self.remote_role_type, INT32))
        _set(self, "local_ip_infos", _check_ip_infos("ClusterInfo.local_ip_infos", self.local_ip_infos))
        _set(self, "remote_ip_infos",
             _check_ip_infos("ClusterInfo.remote_ip_infos", self.remote_ip_infos))


@dataclass(frozen=True, init=False)
class CacheDesc:
    """``llm_datadist::CacheDesc``: describes the ``num_tensors`` equally shaped tensors of a cache.

    Parameters
    ----------
    num_tensors : int
        uint32, default 0.
    data_type : int
        ``ge::DataType`` (any int32; a :class:`DataType` member when known), default ``DT_UNDEFINED``.
    shape : Sequence[int] or numpy integer array
        int64 dims; the first is B (rows / blocks).
    placement : int
        uint32 (a :class:`CachePlacement` member when known), default ``DEVICE``.

    Raises
    ------
    TypeError, ValueError
        A field of the wrong type or outside its C++ width.

    Notes
    -----
    Derived sizes (docs/spec/SEMANTICS.md §2.1) raise ``ValueError`` when upstream would reject the
    shape or dtype: :attr:`tensor_nbytes` (T), :attr:`batch_size` (B = ``shape[0]`` as uint32) and
    :attr:`stride_nbytes` (S = T // B, bytes per batch row = bytes per block).
    """

    num_tensors: int = 0
    data_type: int = DataType.DT_UNDEFINED
    shape: tuple[int, ...] = ()
    placement: int = CachePlacement.DEVICE

    def __init__(
        self,
        num_tensors: SupportsIndex = 0,
        data_type: SupportsIndex = DataType.DT_UNDEFINED,
        shape: _IntSeq = (),
        placement: SupportsIndex = CachePlacement.DEVICE,
    ) -> None:
        _set(self, "num_tensors", num_tensors)
        _set(self, "data_type", data_type)
        _set(self, "shape", shape)
        _set(self, "placement", placement)
        self.__post_init__()

    def __post_init__(self) -> None:
        _set(self, "num_tensors", check_int("CacheDesc.num_tensors", self.num_tensors, UINT32))
        dt = check_int("CacheDesc.data_type", self.data_type, INT32)
        try:
            dt = DataType(dt)
        except ValueError:
            pass
        _set(self, "data_type", dt)
        _set(self, "shape", check_int_seq("CacheDesc.shape", self.shape, INT64))
        pl = check_int("CacheDesc.placement", self.placement, UINT32)
        try:
            pl = CachePlacement(pl)
        except ValueError:
            pass
        _set(self, "placement", pl)

    @property
    def tensor_nbytes(self) -> int:
        """T: bytes of each tensor (product of dims x element size; sub-byte types rounded up).

        Raises ``ValueError`` where upstream returns PARAM_INVALID (:func:`tensor_nbytes`).
        """
        return tensor_nbytes(self.shape, self.data_type)

    @property
    def batch_size(self) -> int:
        """B: ``shape[0]`` truncated to uint32, the number of rows (= blocks).

        Raises ``ValueError`` for an empty or invalid shape.
        """
        if not self.shape:
            raise ValueError("shape is empty")
        self.tensor_nbytes  # validates the shape
        return self.shape[0] & 0xFFFFFFFF

    @property
    def stride_nbytes(self) -> int:
        """S: ``T // B`` bytes, the size of one row and of one block of one tensor.

        Raises ``ValueError`` for an invalid shape or B = 0.
        """
        b = self.batch_size
        if b == 0:
            raise ValueError("batch size (shape[0] as uint32) is 0")
        return self.tensor_nbytes // b


@dataclass(frozen=True, init=False)
class Cache:
    """``llm_datadist::Cache``: a local cache as transfers name it (docs/spec/SEMANTICS.md §3.10-3.13).

    Parameters
    ----------
    cache_id : int
        int64, default -1; the id RegisterKvCache returned.
    tensor_addrs : Sequence[int] or numpy integer array
        uint64 each (not read by transfers).
    cache_desc : CacheDesc
        Pulls ignore it; pushes read ``placement`` (must be DEVICE) and ``num_tensors`` from it
        (§3.12).

    Raises
    ------
    TypeError, ValueError
        A field of the wrong type or outside its C++ width.
    """

    cache_id: int = -1
    tensor_addrs: tuple[int, ...] = ()
    cache_desc: CacheDesc = field(default_factory=CacheDesc)

    def __init__(
        self,
        cache_id: SupportsIndex = -1,
        tensor_addrs: _IntSeq = (),
        cache_desc: CacheDesc = CacheDesc(),
    ) -> None:
        _set(self, "cache_id", cache_id)
        _set(self, "tensor_addrs", tensor_addrs)
        _set(self, "cache_desc", cache_desc)
        self.__post_init__()

    def __post_init__(self) -> None:
        _set(self, "cache_id", check_int("Cache.cache_id", self.cache_id, INT64))
        _set(self, "tensor_addrs", check_int_seq("Cache.tensor_addrs", self.tensor_addrs, UINT64))
        if not isinstance(self.cache_desc, CacheDesc):
            raise TypeError(f"Cache.cache_desc must be CacheDesc, not {type(self.cache_desc).__name__}")


@dataclass(frozen=True, init=False)
class CacheIndex:
    """``llm_datadist::CacheIndex``: a peer's cache (docs/spec/SEMANTICS.md §3.10-3.13).

    Parameters
    ----------
    cluster_id : int
        The peer's cluster id (uint64).
    cache_id : int
        The id the peer's RegisterKvCache returned (int64).
    batch_index : int
        The remote row (uint32); must be 0 for block transfers.

    Raises
    ------
    TypeError, ValueError
        A field of the wrong type or outside its C++ width.
    """

    cluster_id: int
    cache_id: int
    batch_index: int = 0

    def __init__(
        self, cluster_id: SupportsIndex, cache_id: SupportsIndex, batch_index: SupportsIndex = 0
    ) -> None:
        _set(self, "cluster_id", cluster_id)
        _set(self, "cache_id", cache_id)
        _set(self, "batch_index", batch_index)
        self.__post_init__()

    def __post_init__(self) -> None:
        _set(self, "cluster_id", check_int("CacheIndex.cluster_id", self.cluster_id, UINT64))
        _set(self, "cache_id", check_int("CacheIndex.cache_id", self.cache_id, INT64))
        _set(self, "batch_index", check_int("CacheIndex.batch_index", self.batch_index, UINT32))


def _check_range(name: str, value: object) -> tuple[int, int]:
    if type(value) is tuple and len(value) == 2:  # fast path: a pair of in-range ints
        a, b = value
        if type(a) is int and type(b) is int and INT32[0] <= a <= INT32[1] and INT32[0] <= b <= INT32[1]:
            return a, b
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a pair of integers, not {type(value).__name__}")
    items = check_int_seq(name, value, INT32)
    if len(items) != 2:
        raise ValueError(f"{name} must be a pair (first, last), got {len(items)} items")
    return items[0], items[1]


@dataclass(frozen=True, init=False)
class KvCacheExtParam:
    """``llm_datadist::KvCacheExtParam``: layer ranges of a transfer (docs/spec/SEMANTICS.md §2.5).

    Parameters
    ----------
    src_layer_range, dst_layer_range : pair of int
        **Inclusive** ``(first, last)`` int32 pairs as in C++; ``(-1, -1)`` (the default, or any
        ``first == -1``) means all layers.
    tensor_num_per_layer : int
        uint8, default 2 (K and V): layer L is tensors ``[L*t, (L+1)*t)``.

    Raises
    ------
    TypeError, ValueError
        Not a pair of integers, or a value outside its C++ width.
    """

    src_layer_range: tuple[int, int] = (-1, -1)
    dst_layer_range: tuple[int, int] = (-1, -1)
    tensor_num_per_layer: int = 2

    def __init__(
        self,
        src_layer_range: _IntSeq = (-1, -1),
        dst_layer_range: _IntSeq = (-1, -1),
        tensor_num_per_layer: SupportsIndex = 2,
    ) -> None:
        _set(self, "src_layer_range", src_layer_range)
        _set(self, "dst_layer_range", dst_layer_range)
        _set(self, "tensor_num_per_layer", tensor_num_per_layer)
        self.__post_init__()

    def __post_init__(self) -> None:
        _set(self, "src_layer_range", _check_range("KvCacheExtParam.src_layer_range", self.src_layer_range))
        _set(self, "dst_layer_range", _check_range("KvCacheExtParam.dst_layer_range", self.dst_layer_range))
        _set(self, "tensor_num_per_layer",
             check_int("KvCacheExtParam.tensor_num_per_layer", self.tensor_num_per_layer, UINT8))


@dataclass(frozen=True)
class RegisterCfg:
    """``llm_datadist::RegisterCfg``: reserved, no fields (ignored by RegisterKvCache, §3.7)."""

