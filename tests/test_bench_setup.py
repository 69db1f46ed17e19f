"""The set-up rows of ``kvdd bench --cross-process`` (kvdd/bench/xproc_setup.py): their targets
and their tables (the measurement itself is a benchmark, not a test)."""

from __future__ import annotations

import io

from kvdd.bench.xproc_setup import print_setup, setup_targets


def _link(caches: int, link_ms: float, path: str = "process_vm") -> dict[str, object]:
    return {"kind": "link_unlink", "peer_caches": caches, "local_caches": 4, "data_path": path,
            "link_median_ms": link_ms, "link_min_ms": link_ms, "unlink_median_ms": 1.0,
            "median_ms": link_ms + 1.0, "min_ms": link_ms + 1.0, "samples": 3}


def test_link_targets_are_on_the_link_median_over_the_same_host_path() -> None:
    t = setup_targets([_link(4, 1.5), _link(1004, 12.01)], [])
    assert [x["met"] for x in t] == [True, False]  # exactly at the bound; just past it
    assert t[0]["ratio"] == 1.0 and "4 caches" in t[0]["target"] and "1004 caches" in t[1]["target"]
    tcp = setup_targets([_link(4, 0.5, "tcp")], [])
    assert tcp[0]["met"] is False  # fast, but not the same-host path


def test_register_targets_grow_half_a_microsecond_per_tensor() -> None:
    rows = [{"kind": "register", "tensors": 2, "median_us": 61.0, "min_us": 1.0, "samples": 3},
            {"kind": "register", "tensors": 256, "median_us": 188.5, "min_us": 1.0, "samples": 3}]
    t = setup_targets([], rows)
    assert [x["met"] for x in t] == [True, False]  # 60 + 0.5 x 2 = 61 (at it); 188 for 256
    assert "<= 61 us" in t[0]["target"] and "<= 188 us" in t[1]["target"]


def test_the_tables_show_every_row() -> None:
    out = io.StringIO()
    print_setup({"links": [_link(4, 1.2)], "registers": [
        {"kind": "register", "tensors": 16, "median_us": 20.0, "min_us": 18.0, "samples": 3}]}, out)
    text = out.getvalue()
    assert "link_unlink" in text and "process_vm" in text and "register" in text and "16" in text
    print_setup(None, out)  # a document without the section prints nothing more
    assert out.getvalue() == text
