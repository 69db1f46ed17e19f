"""Peer-side steps of the link tests that go through CANN's Python API (``kvdd.llm_datadist``) with
numpy memory; each peer process holds one ``LLMDataDist`` and its caches here."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvdd.llm_datadist import (BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig,
                               LLMDataDist, LLMException, LLMRole)

BLOCKS, BLOCK_BYTES = 8, 64

_state: dict[str, Any] = {}


def start(role: str, cluster_id: int, remote_accessible: bool = True,
          listen_port: int | None = None, link_total_time: int | None = None) -> None:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = remote_accessible
    if listen_port is not None:
        cfg.listen_ip_info = f"127.0.0.1:{listen_port}"
    if link_total_time is not None:
        cfg.link_total_time = link_total_time
    dd = LLMDataDist(LLMRole[role], cluster_id)
    dd.init(cfg.generate_options())
    _state.clear()
    _state.update(dd=dd, cluster_id=cluster_id, caches={}, memory={})


def stop() -> None:
    dd = _state.get("dd")
    if dd is not None:
        dd.finalize()
    _state.clear()


def register(name: str, model_id: int, fill: int, remote_accessible: bool | None = None) -> int:
    """A blocks cache of BLOCKS blocks of BLOCK_BYTES bytes, block b filled with ``fill + b``."""
    mem = (np.arange(BLOCKS, dtype=np.uint8)[:, None] + fill).repeat(BLOCK_BYTES, axis=1)
    mem = np.ascontiguousarray(mem)
    desc = CacheDesc(num_tensors=1, shape=[BLOCKS, BLOCK_BYTES], data_type=DataType.DT_UINT8)
    key = BlocksCacheKey(cluster_id=_state["cluster_id"], model_id=model_id)
    cache = _state["dd"].cache_manager.register_blocks_cache(desc, [mem.ctypes.data], key,
                                                             remote_accessible=remote_accessible)
    _state["caches"][name], _state["memory"][name] = cache, mem
    return int(cache.cache_id)


def register_status(name: str, model_id: int, fill: int,
                    remote_accessible: bool | None = None) -> str:
    """:func:`register`'s outcome: ``"OK"`` or the status name it raised."""
    try:
        register(name, model_id, fill, remote_accessible)
    except LLMException as exc:
        return exc.status_code.name
    return "OK"


def block(name: str, b: int) -> list[int]:
    return sorted(set(_state["memory"][name][b].tolist()))


def pull(src_cluster: int, model_id: int, dst: str, src_blocks: list[int],
         dst_blocks: list[int]) -> str:
    """``pull_blocks``: ``"OK"`` or the status name it raised."""
    cm = _state["dd"].cache_manager
    try:
        cm.pull_blocks(BlocksCacheKey(cluster_id=src_cluster, model_id=model_id),
                       _state["caches"][dst], src_blocks, dst_blocks)
    except LLMException as exc:
        return exc.status_code.name
    return "OK"


def link(comm_name: str, members: dict[int, int], rank_table: str) -> int:
    return int(_state["dd"].link(comm_name, members, rank_table))


def query(comm_id: int) -> str:
    return str(_state["dd"].query_register_mem_status(comm_id).name)


def unlink(comm_id: int) -> None:
    _state["dd"].unlink(comm_id)


def link_clusters(remote_cluster: int, port: int) -> tuple[str, list[str]]:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    status, rets = _state["dd"].link_clusters([info], 2000)
    return status.name, [r.name for r in rets]


def wrapper_register_after_link(model_id: int, fill: int) -> int:
    """A remote-accessible blocks cache registered through the engine directly (the Python layer
    refuses ``remote_accessible=True`` after ``link()``): the snapshot rule alone decides."""
    from kvdd.sim.pypkg import process_wrapper
    mem = np.full((BLOCKS, BLOCK_BYTES), fill, dtype=np.uint8)
    _state["memory"][f"late{model_id}"] = mem
    status, (cache_id, _) = process_wrapper().register_cache(
        (1, DataType.DT_UINT8.value, -1, [BLOCKS, BLOCK_BYTES], 1, True), [mem.ctypes.data],
        [(_state["cluster_id"], -1, 0, 2**64 - 1, 2**64 - 1, model_id, True)], True)
    assert status == 0
    return int(cache_id)
