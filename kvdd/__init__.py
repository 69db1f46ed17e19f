"""kvdd: a typed Python SDK for Huawei LLM-DataDist (KV-cache transfer between prefill and decode).

The public API mirrors the C++ ``llm_datadist::LlmDataDist`` V2 class (docs/spec/API.md; the
behaviour of every call is docs/spec/SEMANTICS.md).  Two backends implement it: ``"native"`` (the
real library on an Atlas node) and ``"sim"`` (a byte-exact simulator on host memory that runs
anywhere).
"""

from __future__ import annotations

from ._checkout import compiled_problem as _compiled_problem

if (_problem := _compiled_problem()) is not None:  # a source checkout: no compiled modules
    raise ImportError(_problem, name="kvdd")  # name: `python -m kvdd` prints it as one line

from ._version import __version__  # noqa: E402
from .backend import Backend, available_backends
from .datadist import LlmDataDist
from .memory import TensorAddrs, tensor_addrs
from .shm import empty
from .options import (
    OPTION_BUF_POOL_CFG,
    OPTION_DEVICE_ID,
    OPTION_ENABLE_SET_ROLE,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LISTEN_IP_INFO,
    OPTION_LOCAL_COMM_RES,
    OPTION_SYNC_CACHE_WAIT_TIME,
    OPTION_TRANSFER_BACKEND,
)
from .status import *  # noqa: F403  (Status, LLMError and its subclasses, BackendUnavailableError)
from .status import __all__ as _status_all
from .types import (
    Cache,
    CacheDesc,
    CacheIndex,
    CachePlacement,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmRole,
    RegisterCfg,
)

__all__ = [
    "__version__",
    "Backend",
    "available_backends",
    "LlmDataDist",
    "TensorAddrs",
    "tensor_addrs",
    "empty",
    "OPTION_BUF_POOL_CFG",
    "OPTION_DEVICE_ID",
    "OPTION_ENABLE_SET_ROLE",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OPTION_LISTEN_IP_INFO",
    "OPTION_LOCAL_COMM_RES",
    "OPTION_SYNC_CACHE_WAIT_TIME",
    "OPTION_TRANSFER_BACKEND",
    "Cache",
    "CacheDesc",
    "CacheIndex",
    "CachePlacement",
    "ClusterInfo",
    "DataType",
    "IpInfo",
    "KvCacheExtParam",
    "LlmRole",
    "RegisterCfg",
    *[n for n in _status_all if n not in ("status_name", "raise_for_status")],
]
