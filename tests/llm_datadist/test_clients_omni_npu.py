"""omni-npu's DatadistEngine shape (PYPKG.md §7.1 (e)) in two processes: no ``enable_cache_manager``
(``local_comm_res`` implies it), random 64-bit cluster ids, registration after linking, relink when
a pull fails (a cache the peer registered after our snapshot, or an injected fault), and
sleep/wake-up as unregister + finalize / init again; every byte verified by the harness."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "clients"))
from client_launch import run  # noqa: E402


def test_relink_after_a_late_registration_and_sleep_wakeup() -> None:
    d = run("omni_npu.py", [("prefill", []), ("decode", [])])["decode"].result
    assert d["first_ids"] == [1, 2]
    assert d["ids_after_wakeup"] == [1, 2]  # a fresh engine numbers caches from 1 again
    assert d["failures"] == ["LLM_KV_CACHE_NOT_EXIST"]  # model 1 is not in the first snapshot
    assert d["relinks"] == 1 and d["total_relinks"] == 1
    assert d["checked"] == 2 * 4 * 9 * 128


def test_an_injected_timeout_is_survived_by_relinking() -> None:
    d = run("omni_npu.py", [("prefill", []), ("decode", [])],
            {"decode": "pull_blocks:status=LLM_TIMEOUT:count=1"})["decode"].result
    assert d["failures"] == ["LLM_TIMEOUT", "LLM_KV_CACHE_NOT_EXIST"]
    assert d["total_relinks"] == 2
