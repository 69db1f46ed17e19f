"""CANN's ``llm_datadist`` Python package on kvdd's simulator (docs/spec/PYPKG.md).

The same names, values, argument checks and statuses as CANN's package (PYPKG.md §1-§5), over
the simulator's engine.  Code written for CANN imports it as ``llm_datadist`` after
``source DEST/set_env.sh`` of a ``kvdd cann-root DEST`` (or :func:`kvdd.llm_datadist.toplevel.install`);
kvdd's own code imports ``kvdd.llm_datadist``.

Import effects (as upstream): ``AUTO_USE_UC_MEMORY=0`` is set when unset; an ``atexit`` hook
finalizes the live :class:`LLMDataDist`; the logger ``LLM_DATADIST`` logs at the level of
``ASCEND_GLOBAL_LOG_LEVEL``.  ``TensorDesc``, ``Tensor`` and ``KvCacheManager`` belong to CANN's
legacy package ``llm_datadist_v1``, which kvdd does not provide: accessing them raises
``ModuleNotFoundError`` (so ``from llm_datadist import *`` does too, as upstream without it).
"""

from __future__ import annotations

import os
from typing import Any

from .configs import LLMClusterInfo, LLMConfig, LlmConfig, LLMRole
from .data_type import DataType
from .status import LLMException, LLMStatusCode, Status
from .v2.llm_datadist import LEGACY_PACKAGE, LLMDataDist
from .v2.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    KvCache,
    LayerSynchronizer,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

#: the cache-manager ("v2") names, in upstream's order (upstream's tests iterate this list)
v2_list = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig",
    "DataType", "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache",
    "BlocksCacheKey", "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer",
    "TransferConfig", "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
]

_LEGACY_NAMES = ("TensorDesc", "Tensor", "KvCacheManager")

__all__ = [
    "LLMClusterInfo", "LLMStatusCode", "LLMException", "LLMRole", "LlmConfig", "LLMConfig",
    "DataType", "Status", "CacheDesc", "CacheKey", "CacheKeyByIdAndIndex", "KvCache", "Cache",
    "BlocksCacheKey", "LLMDataDist", "Placement", "RegisterMemStatus", "LayerSynchronizer",
    "TransferConfig", "CacheTask", "TransferWithCacheKeyConfig", "Memtype", "MemInfo",
    "TensorDesc", "Tensor", "KvCacheManager",
]  # v2_list + the three legacy names (a literal, so type checkers see the re-exports)


def __getattr__(name: str) -> Any:
    if name in _LEGACY_NAMES:
        raise ModuleNotFoundError(
            f"llm_datadist.{name} comes from CANN's legacy package '{LEGACY_PACKAGE}', which kvdd's "
            "simulator does not provide (use the cache-manager API: CacheManager, Cache).",
            name=LEGACY_PACKAGE)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")
