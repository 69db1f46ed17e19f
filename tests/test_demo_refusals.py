"""The demo's prefill side refuses a decode side that does not match it (geometry, seed, transfer
backend) as it refuses one without the secret: it tells that side why and keeps waiting, so the
next, matching decode side is served."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdd.demo import DEFAULT_MODEL, DemoOptions, Geometry, control, resolve_model, run_decode
from kvdd.demo.control import ReadyInfo
from kvdd.secret import ENV_AUTH, ENV_SECRET, ENV_SECRET_FILE

from demo_support import PrefillThread, prefill_thread


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (ENV_SECRET, ENV_SECRET_FILE, ENV_AUTH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV_SECRET, os.urandom(32).hex())
    monkeypatch.setattr(control, "AUTH_TIMEOUT_S", 1.0)


def quick(tokens: int = 256, seed: int = 0) -> DemoOptions:
    return DemoOptions(geometry=Geometry(resolve_model(DEFAULT_MODEL), 1, tokens), timeout=30.0, seed=seed)


@pytest.fixture
def prefill() -> Iterator[PrefillThread]:
    yield from prefill_thread(quick())


def test_mismatched_decodes_are_refused_and_the_matching_one_is_served(
        prefill: tuple[ReadyInfo, dict[str, Any], threading.Thread], capsys: pytest.CaptureFixture[str]) -> None:
    ready, out, thread = prefill
    # another geometry (512 tokens instead of 256), then another seed: each refused with why
    for opts, why in ((quick(tokens=512), "tokens prefill=256 decode=512"), (quick(seed=7), "seed prefill=0 decode=7")):
        wrong = run_decode(opts, ready.listen, ready.control)
        assert wrong.error is not None and not wrong.ok and not wrong.transfers
        assert wrong.error.message.startswith("the prefill side refused this one: the two sides disagree")
        assert why in wrong.error.message
        assert thread.is_alive() and "error" not in out  # prefill still waits
    report = run_decode(quick(), ready.listen, ready.control)
    assert report.error is None, report.error.message
    assert report.ok and report.source_intact is True and len(report.transfers) == 5
    thread.join(60)
    assert "error" not in out, out.get("error")
    assert out["result"]["refused_control"] == 2
    err = capsys.readouterr().err
    assert err.count("kvdd demo [prefill] warning: refused decode from 127.0.0.1: the two sides disagree") == 2, err
    assert err.count("still waiting for decode") == 2
