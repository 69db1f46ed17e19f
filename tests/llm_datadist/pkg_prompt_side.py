"""The prompt side of test_pkg_xproc, run in a peer process: one LLMDataDist listening on a port
and caches whose byte (tensor t, row or block b) is ``pattern(t, b)``."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvdd.llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole

ROWS, ROW_BYTES = 8, 32

_state: dict[str, Any] = {}


def pattern(tensor: int, row: int, base: int = 0) -> int:
    """The byte value of a tensor's row (block)."""
    return (base + 16 * tensor + row) & 0xFF


def filled(num_tensors: int, base: int) -> list[np.ndarray]:
    """``num_tensors`` arrays of ROWS x ROW_BYTES bytes holding :func:`pattern`."""
    return [np.ascontiguousarray(np.array([[pattern(t, r, base)] * ROW_BYTES for r in range(ROWS)],
                                          dtype=np.uint8)) for t in range(num_tensors)]


def start(cluster_id: int, port: int) -> None:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.sync_kv_timeout = 3000
    dd = LLMDataDist(LLMRole.PROMPT, cluster_id)
    dd.init(cfg.generate_options())
    _state.update(dd=dd, memory=[])


def register(num_tensors: int, base: int, model_id: int | None) -> int:
    """A blocks cache (model_id given) or a contiguous cache (None); returns its id."""
    memory = filled(num_tensors, base)
    _state["memory"].append(memory)
    desc = CacheDesc(num_tensors, [ROWS, ROW_BYTES], DataType.DT_UINT8)
    cm = _state["dd"].cache_manager
    addrs = [a.ctypes.data for a in memory]
    if model_id is None:
        return int(cm.register_cache(desc, addrs).cache_id)
    return int(cm.register_blocks_cache(desc, addrs, BlocksCacheKey(cluster_id=_state["dd"].cluster_id,
                                                                     model_id=model_id)).cache_id)


def stop() -> None:
    dd = _state.pop("dd", None)
    if dd is not None:
        dd.finalize()
    _state.clear()
