"""vllm-ascend's LLMDataDistCMgrConnector shape (PYPKG.md §7.1 (a)) in two processes: rank-table
link polled with ``query_register_mem_status``, MHA and MLA blocks caches keyed by model id,
``pull_blocks`` with no ranges and the default ``tensor_num_per_layer``; every byte verified by the
harness (it exits 1 on a wrong byte)."""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent / "clients"))
from client_launch import run  # noqa: E402


def test_mha_one_blocks_cache_over_a_rank_table_link() -> None:
    procs = run("vllm_cmgr.py", [("prefill", ["mha"]), ("decode", ["mha"])])
    p, d = procs["prefill"].result, procs["decode"].result
    assert p["comm_id"] == d["comm_id"] == 1  # the first comm id of each engine
    assert p["cache_ids"] == d["cache_ids"] == [1]
    # 8 tensors (4 layers x K, V) of 20 blocks x 16 tokens x 2 heads x 8 dims x 2 bytes
    assert d["checked"] == 8 * 20 * 16 * 2 * 8 * 2
    assert p["checked"] == 8 * 12 * 16 * 2 * 8 * 2


def test_mla_two_caches_with_one_tensor_per_layer_and_the_default_t() -> None:
    # 3 layers: each MLA cache has an odd tensor count, pulled with no ranges and t = 2 (§4.7)
    procs = run("vllm_cmgr.py", [("prefill", ["mla"]), ("decode", ["mla"])])
    d = procs["decode"].result
    assert d["cache_ids"] == [1, 2]
    assert d["checked"] == 3 * 20 * 16 * 2 * (32 + 8)


def test_sparse_attention_three_caches_with_model_ids_0_1_2() -> None:
    procs = run("vllm_cmgr.py", [("prefill", ["sparse"]), ("decode", ["sparse"])])
    d = procs["decode"].result
    assert d["cache_ids"] == [1, 2, 3]
    assert d["checked"] == 3 * 20 * 16 * 2 * (32 + 8 + 16)
