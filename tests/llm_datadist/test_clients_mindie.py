"""MindIE-LLM's SeparateDeploymentEngine shape (PYPKG.md §7.1 (c)) in two processes: PROMPT and MIX
roles, K and V caches as models 0 and 1, ``link_total_time`` / ``link_retry_count`` and raw RDMA
keys in the options, rank-table link with its query window, and the retry paths of a failed link
and a failed pull driven by injected faults; every byte verified by the harness."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "clients"))
from client_launch import run  # noqa: E402

DECODE_BYTES = 2 * 3 * 12 * 64  # K and V models x 3 layers x 12 blocks x 64 bytes


@pytest.mark.parametrize("prefill_role", ["prefill", "mix"])
def test_pull_of_k_and_v_models(prefill_role: str) -> None:
    procs = run("mindie.py", [("prefill", [prefill_role]), ("decode", [])])
    d = procs["decode"].result
    assert d["link_attempts"] == 1 and procs["prefill"].result["link_attempts"] == 1
    assert d["statuses"] == ["pull:LLM_SUCCESS", "pull:LLM_SUCCESS"]
    assert d["pulls"] == 1
    assert d["checked"] == DECODE_BYTES


def test_a_failed_link_is_requested_again() -> None:
    procs = run("mindie.py", [("prefill", []), ("decode", [])], {"decode": "link:status=LLM_LINK_FAILED:count=1"})
    d = procs["decode"].result
    assert d["link_attempts"] == 2
    assert d["statuses"][0] == "link:LLM_LINK_FAILED"


def test_a_failed_pull_is_logged_with_its_status_and_the_request_retried() -> None:
    procs = run("mindie.py", [("prefill", []), ("decode", [])],
                {"decode": "pull_blocks:status=LLM_LINK_BUSY:count=1:after=1"})
    d = procs["decode"].result
    # model 0 through, model 1 busy: the request fails and is pulled again (both models)
    assert d["statuses"] == ["pull:LLM_SUCCESS", "pull:LLM_LINK_BUSY", "pull:LLM_SUCCESS", "pull:LLM_SUCCESS"]
    assert d["pulls"] == 2
    assert d["checked"] == DECODE_BYTES
