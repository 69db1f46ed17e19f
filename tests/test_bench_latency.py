"""kvdd.bench.xproc_small.latency: how many calls it makes and times (each batch's first call is
untimed, for every function alike)."""

from __future__ import annotations

from kvdd.bench.xproc_small import latency


def test_each_batch_starts_with_an_untimed_call() -> None:
    made = {"a": 0, "b": 0}

    def call(name: str) -> None:
        made[name] += 1

    out = latency({"a": lambda: call("a"), "b": lambda: call("b")}, calls=120, batch=50, warmup=20)
    # 20 warm-up calls, then batches of 50, 50, 20 timed calls, each after one untimed call
    assert made == {"a": 20 + 3 + 120, "b": 20 + 3 + 120}
    assert out["a"]["calls"] == out["b"]["calls"] == 120.0
    assert 0 < out["a"]["median_us"] <= out["a"]["p99_us"]


def test_an_absolute_bound_is_reported_as_measured_over_bound() -> None:
    from kvdd.bench.xproc_small import xp_targets
    lat = [{"path": "process_vm", "kind": "pull_64B", "p99_us": 7.5}]
    (t,) = [t for t in xp_targets([], lat) if "p99 <= 10 us" in t["target"]]
    assert t == {"target": "same-host 64 B pull p99 <= 10 us (measured 7.5 us)", "ratio": 0.75,
                 "met": True}
    lat[0]["p99_us"] = 10.5
    (t,) = [t for t in xp_targets([], lat) if "p99 <= 10 us" in t["target"]]
    assert t["ratio"] == 1.05 and not t["met"]
