"""``examples/python/``: every prefill/decode program of CANN's ``llm_datadist`` package runs as
its processes against kvdd's simulator (``run_pairs.py --sim``) and verifies every byte."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvdd

RUNNER = Path(__file__).resolve().parents[2] / "examples" / "python" / "run_pairs.py"
PAIRS = ("pull_blocks", "pull_cache", "push", "switch_role", "many_prefills", "rank_table")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    root = str(Path(kvdd.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("KVDD_SIM_FAULTS", None)
    return subprocess.run([sys.executable, str(RUNNER), "--sim", *args], capture_output=True, text=True,
                          env=env, timeout=900)


def test_every_example_pair_passes() -> None:
    r = _run("--timeout", "150")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in PAIRS:
        assert f"examples/python: {name}: passed" in r.stdout
    assert f"{len(PAIRS)} of {len(PAIRS)} passed" in r.stdout


def test_a_failing_pair_fails_the_run_and_shows_its_output() -> None:
    # A fault the example does not expect: its first pull fails, decode exits 1, the runner says so.
    env = dict(os.environ)
    root = str(Path(kvdd.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["KVDD_SIM_FAULTS"] = "pull_blocks:status=LLM_LINK_BUSY:count=1"
    r = subprocess.run([sys.executable, str(RUNNER), "--sim", "--only", "pull_blocks", "--timeout", "60"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 1
    assert "examples/python: pull_blocks: FAILED" in r.stdout
    assert "LLM_LINK_BUSY" in r.stdout
    assert "0 of 1 passed" in r.stdout
