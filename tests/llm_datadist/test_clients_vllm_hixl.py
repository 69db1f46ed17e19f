"""vllm-ascend's HIXL connector shape (PYPKG.md §7.1 (d)) in two processes: ``local_comm_res=""``,
``transfer_backend="hixl"``, both sides listening, ``link_clusters`` then ``unlink_clusters(force=
True)`` + ``finalize``, ``remote_accessible=True`` registrations with unique model ids, pulls with
``src_layer_range`` / ``dst_layer_range`` keywords and ``tensor_num_per_layer=1`` for the Mamba
caches; every byte verified by the harness."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "clients"))
from client_launch import run  # noqa: E402


def test_attention_and_mamba_groups_pulled_with_layer_ranges() -> None:
    procs = run("vllm_hixl.py", [("prefill", []), ("decode", [])])
    p, d = procs["prefill"].result, procs["decode"].result
    assert p["model_ids"] == {"attention": 0, "mamba_conv": 1, "mamba_ssm": 2}
    block_bytes = {"attention": 8 * 2 * 16 * 2, "mamba_conv": 4 * 32 * 2, "mamba_ssm": 2 * 16 * 16 * 4}
    tensors = {"attention": 6, "mamba_conv": 3, "mamba_ssm": 3}
    assert d["checked"] == sum(tensors[g] * 14 * block_bytes[g] for g in tensors)
