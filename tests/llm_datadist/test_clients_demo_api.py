"""``kvdd demo --api llm_datadist``: the demo's job through the calls of CANN's Python package
(register_blocks_cache / register_cache, link_clusters, pull_blocks of all layers and per layer,
pull_cache, push_blocks) in two processes, every byte verified by the demo's own verifier."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from demo_support import child_env

KVDD = [sys.executable, "-m", "kvdd"]


def _kvdd(*args: str, faults: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVDD, *args], capture_output=True, text=True, env=child_env(faults), timeout=240)


def _doc(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


@pytest.mark.parametrize("extra", [[], ["--transfer-backend", "hixl"], ["--model", "deepseek-v3", "--link", "rank-table"]],
                         ids=["link_clusters", "hixl", "mla-rank-table"])
def test_the_demo_through_the_package(extra: list[str]) -> None:
    r = _kvdd("demo", "--quick", "--api", "llm_datadist", "--json", *extra)
    assert r.returncode == 0, r.stderr
    doc = _doc(r)
    assert doc["ok"] is True and doc["api"] == "llm_datadist" and doc["mode"] == "processes"
    assert [t["api"] for t in doc["transfers"]] == ["pull_blocks", "pull_blocks", "pull_cache", "pull_cache",
                                                    "push_blocks"]
    layers = doc["geometry"]["model"]["layers"]
    families = len(doc["geometry"]["caches"])
    assert doc["transfers"][1]["calls"] == layers * families  # one pull_blocks per layer and cache
    decode_bytes = doc["geometry"]["decode_bytes"]
    guards = 2 * 4096 * 2 * families  # the guard bytes around each cache are checked too
    for t in doc["transfers"]:
        assert t["verified"] is True and t["checked_bytes"] == decode_bytes + guards
    assert doc["summary"]["source_intact"] is True


def test_the_default_api_is_kvdd_and_says_nothing_of_the_package() -> None:
    r = _kvdd("demo", "--quick", "--json")
    assert r.returncode == 0, r.stderr
    doc = _doc(r)
    assert "api" not in doc
    assert [t["api"] for t in doc["transfers"]] == ["PullKvBlocks", "PullKvBlocks", "PullKvCache", "PullKvCache",
                                                    "PushKvBlocks"]


def test_a_failing_pull_is_reported_with_its_status_and_transfer() -> None:
    r = _kvdd("demo", "--quick", "--api", "llm_datadist", "--json", faults="pull_blocks:status=LLM_TIMEOUT:count=1")
    assert r.returncode == 1
    doc = _doc(r)
    assert doc["ok"] is False
    first = doc["transfers"][0]
    assert first["name"] == "paged block pull" and first["verified"] is False
    assert "LLM_TIMEOUT" in first["error"]
    assert "paged block pull (pull_blocks) failed" in doc["error"]["message"]


@pytest.mark.parametrize("args, says", [
    (["--in-process"], "needs two processes"),
    (["--backend", "native"], "use --backend sim"),
    (["--link", "rank-table", "--transfer-backend", "hixl"], "needs the comm transfer backend"),
])
def test_what_the_package_api_cannot_do_is_refused(args: list[str], says: str) -> None:
    r = _kvdd("demo", "--quick", "--api", "llm_datadist", *args)
    assert r.returncode == 2
    assert says in r.stderr


def test_a_rank_table_link_needs_the_package_api() -> None:
    r = _kvdd("demo", "--quick", "--link", "rank-table")
    assert r.returncode == 2
    assert "add --api llm_datadist" in r.stderr
