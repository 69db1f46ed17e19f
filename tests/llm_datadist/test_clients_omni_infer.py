"""omni-infer's LLMDataDistManager shape (PYPKG.md §7.1 (b)) in separate processes: rank-table links
in batches, ``pull_blocks`` tried up to three times for the statuses of its retry set, which
injected faults (``KVDD_SIM_FAULTS`` of the decode process) drive; every byte verified by the
harness, including that a pull that failed moved nothing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "clients"))
from client_launch import run  # noqa: E402

PULLS_PER_PREFILL = 2  # one pull_blocks per model (K/V caches of model 0 and 1)
DECODE_BYTES = 2 * 4 * 10 * 256  # 2 models x 4 tensors x 10 blocks x 256 bytes


def test_two_prefills_linked_in_a_batch_and_pulled() -> None:
    procs = run("omni_infer.py", [("prefill0", ["0"]), ("prefill1", ["1"]), ("decode", ["2"])])
    d = procs["decode"].result
    assert d == {"role": "decode", "tries": [1] * 2 * PULLS_PER_PREFILL, "status": "LLM_SUCCESS",
                 "checked": DECODE_BYTES}
    assert {procs[p].result["cluster_id"] for p in ("prefill0", "prefill1")} == {10, 11}


def test_statuses_of_the_retry_set_are_retried_until_the_pull_succeeds() -> None:
    # injections are consulted in order and the first that fires decides: busy, then processing link
    faults = {"decode": "pull_blocks:status=LLM_LINK_BUSY:count=1;pull_blocks:status=LLM_PROCESSING_LINK:count=1"}
    procs = run("omni_infer.py", [("prefill0", ["0"]), ("decode", ["1"])], faults)
    d = procs["decode"].result
    assert d["tries"] == [3, 1]  # model 0: busy, processing link, then through; model 1 at once
    assert d["status"] == "LLM_SUCCESS"


def test_three_failures_end_the_pull_and_move_nothing() -> None:
    faults = {"decode": "pull_blocks:status=LLM_DEVICE_OUT_OF_MEMORY:count=3"}
    procs = run("omni_infer.py", [("prefill0", ["0"]), ("decode", ["1", "expect-failure"])], faults)
    d = procs["decode"].result
    assert d["tries"] == [3]
    assert d["status"] == "LLM_DEVICE_OUT_OF_MEMORY"
    assert d["checked"] == DECODE_BYTES  # untouched everywhere


def test_a_status_outside_the_retry_set_is_not_retried() -> None:
    faults = {"decode": "pull_blocks:status=LLM_KV_CACHE_NOT_EXIST:count=1"}
    procs = run("omni_infer.py", [("prefill0", ["0"]), ("decode", ["1", "expect-failure"])], faults)
    d = procs["decode"].result
    assert d["tries"] == [1]
    assert d["status"] == "LLM_KV_CACHE_NOT_EXIST"


def test_a_lost_prefill_times_out_every_try_and_the_pull_is_given_up() -> None:
    # the prefill (cluster 10) is lost once the link is up: every pull over the link times out
    faults = {"decode": "peer_loss:peer=10:after=1"}
    procs = run("omni_infer.py", [("prefill0", ["0"]), ("decode", ["1", "expect-failure"])], faults)
    d = procs["decode"].result
    assert d["tries"] == [3]  # LLM_TIMEOUT is in the retry set; three tries, then the manager gives up
    assert d["status"] == "LLM_TIMEOUT"
    assert d["checked"] == DECODE_BYTES  # nothing moved
