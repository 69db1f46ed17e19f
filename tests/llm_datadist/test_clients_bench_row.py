"""``kvdd bench --package``: the façade's ``pull_blocks`` against kvdd's ``pull_kv_blocks`` of the
same request from the same peer process, both checked against the peer's bytes before timing.
Speed is reported, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from demo_support import child_env


def test_the_package_rows() -> None:
    r = subprocess.run([sys.executable, "-m", "kvdd", "bench", "--package", "--quick", "--json", "--tokens", "256",
                        "--repeats", "1"], capture_output=True, text=True, env=child_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    assert doc["command"] == "kvdd bench --quick --json --package --tokens 256 --repeats 1"
    assert doc["overhead"] == [] and doc["transfers"] == [] and doc["cross_process"] is None
    section = doc["package"]
    assert section["errors"] == {}
    assert (section["tokens"], section["blocks"], section["goal"]) == (256, 2, 1.1)
    rows = {(row["path"], row["kind"]): row for row in section["rows"]}
    kinds = ("pull_blocks", "pull_blocks per layer", "pull_blocks 1 block 1 layer")
    assert set(rows) == {(p, k) for p in ("process_vm", "tcp") for k in kinds}
    for (path, kind), row in rows.items():
        assert row["verified"] is True  # both APIs moved exactly the peer's blocks, nothing else
        # 56 tensors x 2 blocks x 128 KiB; one block of K and V of one layer
        assert row["bytes"] == (2 * 128 * 1024 if kind == kinds[2] else 56 * 2 * 128 * 1024)
        assert row["calls"] == (28 if kind == kinds[1] else 1)
        assert row["ratio"] == pytest.approx(row["package_ms"] / row["kvdd_ms"])
        if kind == kinds[2]:  # the fixed cost of a call: reported, not judged
            assert row["goal"] is None and row["met"] is None
        else:
            assert row["goal"] == 1.1 and row["met"] is (row["ratio"] <= 1.1)
    judged = [row["ratio"] for (_, kind), row in rows.items() if kind != kinds[2]]
    assert section["worst_ratio"] == max(judged)
