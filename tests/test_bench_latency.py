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
