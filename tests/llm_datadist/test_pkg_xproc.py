"""The Python layer end to end across two processes (prompt in a peer process, decode here), bytes
checked: layer ranges as half-open ranges (checklist §7.5 items 19, 20), the MLA no-range leniency,
pull_cache by CacheKeyByIdAndIndex (item 22), and the Python-level refusals on a live link."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest
from peer import Peer
from pkg_prompt_side import ROW_BYTES, ROWS, pattern

from kvdd.llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

P, D = 101, 102
PI = LLMStatusCode.LLM_PARAM_INVALID


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[LLMDataDist, dict[str, int], int]]:
    port = free_port()
    with Peer() as prompt:
        prompt.call("pkg_prompt_side.start", P, port)
        ids = {"six": prompt.call("pkg_prompt_side.register", 6, 0, 0),
               "mla": prompt.call("pkg_prompt_side.register", 3, 100, 1),
               "contiguous": prompt.call("pkg_prompt_side.register", 2, 200, None)}
        if LLMDataDist.llm_engine_instance is not None:
            LLMDataDist.llm_engine_instance.finalize()
        cfg = LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
        cfg.sync_kv_timeout = 3000
        dd = LLMDataDist(LLMRole.DECODER, D)
        dd.init(cfg.generate_options())
        try:
            yield dd, ids, port
        finally:
            dd.finalize()
            prompt.call("pkg_prompt_side.stop")


def link(dd: LLMDataDist, port: int) -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = P
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    ret, rets = dd.link_clusters([info], timeout=5000)
    assert (ret, rets) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])


def zeros(num_tensors: int) -> list[np.ndarray]:
    return [np.zeros((ROWS, ROW_BYTES), np.uint8) for _ in range(num_tensors)]


def test_layer_ranges_blocks_and_mla_leniency(world: tuple[LLMDataDist, dict[str, int], int]) -> None:
    dd, ids, port = world
    cm = dd.cache_manager
    dst = zeros(4)
    cache = cm.register_blocks_cache(CacheDesc(4, [ROWS, ROW_BYTES], DataType.DT_UINT8), [a.ctypes.data for a in dst])
    mla_dst = zeros(3)
    mla = cm.register_blocks_cache(CacheDesc(3, [ROWS, ROW_BYTES], DataType.DT_UINT8), [a.ctypes.data for a in mla_dst])
    flat = zeros(2)
    contiguous = cm.register_cache(CacheDesc(2, [ROWS, ROW_BYTES], DataType.DT_UINT8), [a.ctypes.data for a in flat])
    link(dd, port)

    # src layers 1..2 (tensors 2..5 of the peer) into dst layers 0..1 (tensors 0..3), blocks 0,1 -> 2,3
    cm.pull_blocks(BlocksCacheKey(prompt_cluster_id=P, model_id=0), cache, [0, 1], [2, 3],
                   src_layer_range=range(1, 3), dst_layer_range=range(0, 2))
    for k in range(4):
        expected = np.zeros((ROWS, ROW_BYTES), np.uint8)
        expected[2] = pattern(k + 2, 0)
        expected[3] = pattern(k + 2, 1)
        assert np.array_equal(dst[k], expected), k
    with pytest.raises(LLMException) as exc:
        cm.pull_blocks(BlocksCacheKey(P, 0), cache, [0], [0], src_layer_range=range(0, 4, 2))
    assert exc.value.status_code is PI
    assert not dst[0][0].any()

    # a 3-tensor (MLA-style) cache, default tensor_num_per_layer=2, no ranges: all 3 tensors
    cm.pull_blocks(BlocksCacheKey(P, 1), mla, [5], [0])
    for k in range(3):
        assert (mla_dst[k][0] == pattern(k, 5, 100)).all() and not mla_dst[k][1:].any()
    with pytest.raises(LLMException) as exc:  # a range needs n % t == 0
        cm.pull_blocks(BlocksCacheKey(P, 1), mla, [5], [1], src_layer_range=range(1))
    assert exc.value.status_code is PI
    assert not mla_dst[0][1].any()

    # pull_cache: row 1 of every remote tensor into row 2
    with pytest.raises(TypeError):
        cm.pull_cache(CacheKey(P, 1), contiguous)  # remote-accessible mode: a TypeError
    cm.pull_cache(CacheKeyByIdAndIndex(P, ids["contiguous"], 1), contiguous, 2)
    for k in range(2):
        expected = np.zeros((ROWS, ROW_BYTES), np.uint8)
        expected[2] = pattern(k, 1, 200)
        assert np.array_equal(flat[k], expected)
    with pytest.raises(LLMException) as exc:
        cm.pull_cache(CacheKeyByIdAndIndex(P, ids["contiguous"], 1), contiguous, 3, size=ROW_BYTES + 1)
    assert exc.value.status_code is PI
    assert not flat[0][3].any()

