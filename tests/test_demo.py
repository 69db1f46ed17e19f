"""``kvdd demo``'s runs: the quick demo end to end (threads, two processes), the verifier catching
corrupted transfers and writes outside the targets, failing transfers and sides named, a decode
that fails before it connects or finds no prefill, and the default run's time."""

from __future__ import annotations

import io
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import kvdd
from kvdd.demo import (
    DEFAULT_MODEL,
    DemoOptions,
    Geometry,
    Pattern,
    Progress,
    VerificationError,
    model_from_hf_config,
    resolve_model,
    run_decode,
    run_demo,
    run_prefill,
)
from kvdd.sim.engine import SimBackend

from demo_support import (KiB, assert_ok, closed_port, corrupt_first_block_pull, cross_process_problem,
                          needs_cross_process, poke, quick, write_config)


# ---- both sides in one process ---------------------------------------------------------------------

def test_quick_demo_threads() -> None:
    report = run_demo(quick(), in_process=True)
    assert_ok(report)
    by = {t.name: t for t in report.transfers}
    block = 128 * KiB
    assert [t.api for t in report.transfers] == ["PullKvBlocks", "PullKvBlocks", "PullKvCache",
                                                  "PullKvCache", "PushKvBlocks"]
    assert by["paged block pull"].bytes == 56 * 2 * block and by["paged block pull"].calls == 1
    assert by["layer-by-layer pull"].calls == 28 and by["layer-by-layer pull"].bytes == 56 * 2 * block
    assert by["batch-row pull"].bytes == 56 * 256 * KiB
    assert by["prefix pull"].bytes == 56 * report.options.geometry.prefix_tokens * KiB
    assert by["push prefill -> decode"].bytes == 56 * 2 * block
    # after every transfer all of decode's cache memory (and its guard bytes) was checked
    decode = report.options.geometry.side_bytes("decode")
    assert all(t.checked_bytes >= decode for t in report.transfers)


def test_quick_demo_threads_hixl() -> None:
    # hixl links are one-way: decode listens too, and prefill links to it for the push.
    assert_ok(run_demo(quick(transfer_backend="hixl"), in_process=True))


def test_demo_from_tiny_mla_config_threads(tmp_path: Path) -> None:
    # Two one-tensor-per-layer caches, 6-byte tokens (2-byte verification words), a ragged last
    # block (20 tokens in blocks of 8) and three requests.
    path = write_config(tmp_path, {"num_hidden_layers": 3, "kv_lora_rank": 8, "qk_rope_head_dim": 3,
                            "torch_dtype": "float16"})
    geom = Geometry(model_from_hf_config(path), requests=3, tokens=20, block_size=8)
    assert geom.blocks_per_request == 3 and geom.token_bytes(geom.families[1]) == 6
    assert_ok(run_demo(quick(geometry=geom), in_process=True))


def test_corrupted_transfer_is_detected(corrupt_first_block_pull: list[tuple[int, int, int]]) -> None:
    report = run_demo(quick(), in_process=True)
    assert not report.ok
    err = report.error
    assert isinstance(err, VerificationError)
    assert err.transfer == "paged block pull"
    (_, tensor, block), = corrupt_first_block_pull
    loc = err.location
    assert loc is not None
    assert (loc["side"], loc["cache"], loc["tensor"], loc["layer"], loc["part"], loc["block"]) == \
        ("decode", "kv/paged", tensor, 2, "V", block)
    assert loc["in_target"] is True and loc["byte_in_tensor"] == block * 128 * KiB + 1000
    assert loc["differing_bytes_in_unit"] == 1  # one byte flipped
    assert loc["expected"] != loc["got"]
    assert f"tensor 5 (layer 2 V) block {block}" in err.message and "expected" in err.message
    assert [t.verified for t in report.transfers] == [False]  # it stopped at the first transfer


def test_write_outside_the_targets_is_detected(monkeypatch: pytest.MonkeyPatch, python_path_only: None) -> None:
    # A row pull that also scribbles on row 0 of decode's contiguous cache (not a target).
    original = SimBackend.pull_kv_cache

    def pull(self: SimBackend, idx: kvdd.CacheIndex, dst: kvdd.Cache, batch_index: int, size: int,
             ext: kvdd.KvCacheExtParam) -> int:
        status = original(self, idx, dst, batch_index, size, ext)
        if status == 0 and size == -1:
            entry = self.caches[dst.cache_id]
            poke(entry.addrs[0] + 4096)  # row 0, token 4
        return status

    monkeypatch.setattr(SimBackend, "pull_kv_cache", pull)
    report = run_demo(quick(), in_process=True)
    err = report.error
    assert isinstance(err, VerificationError) and err.transfer == "batch-row pull"
    assert err.location is not None
    assert (err.location["cache"], err.location["row"], err.location["token"]) == ("kv/contiguous", 0, 4)
    assert err.location["in_target"] is False
    assert "outside this step's targets" in err.message
    assert [t.verified for t in report.transfers] == [True, True, False]


def test_verifier_checks_guard_bytes() -> None:
    from kvdd.demo import CacheImage

    geom = Geometry(resolve_model(DEFAULT_MODEL), 1, 16, 8)
    pattern = Pattern(3)
    img = CacheImage("decode", geom, 0, "paged", 2)
    img.fill(pattern)
    assert img.verify(pattern, set(), "check") == img.nbytes + 2 * CacheImage.GUARD
    img.buf[-1] ^= 1  # the byte after the last tensor
    with pytest.raises(VerificationError, match="guard byte .* after the cache memory"):
        img.verify(pattern, set(), "check")


def test_transfer_error_names_the_transfer() -> None:
    from kvdd.sim import faults

    with faults.inject("pull_kv_cache", status=kvdd.Status.LLM_TIMEOUT, count=1):
        report = run_demo(quick(), in_process=True)
    assert not report.ok and report.error is not None
    assert report.error.transfer == "batch-row pull"
    assert "batch-row pull (PullKvCache) failed" in report.error.message
    assert "LLM_TIMEOUT" in report.error.message
    assert [t.verified for t in report.transfers] == [True, True, False]


@pytest.mark.parametrize("in_process", [True, False], ids=["threads", "processes"])
def test_decode_failing_before_it_connects_does_not_hang(in_process: bool) -> None:
    # hixl makes decode listen; an address of no local interface makes its Initialize fail, so the
    # prefill waits for a decode that never connects and must be stopped promptly.
    t0 = time.perf_counter()
    report = run_demo(quick(transfer_backend="hixl", decode_listen=("192.0.2.1", 0)), in_process=in_process)
    assert time.perf_counter() - t0 < 20
    assert not report.ok and report.error is not None
    assert "Initialize" in report.error.message and report.transfers == []


def test_decode_against_a_closed_port_fails_fast_with_a_progress_line() -> None:
    # `kvdd demo --role decode --connect HOST:PORT` at an address where nothing listens: the
    # refused connection is retried briefly (saying so), not for the whole --timeout.
    port = closed_port()
    lines = io.StringIO()
    t0 = time.perf_counter()
    opts = replace(quick(), timeout=120.0)
    report = run_decode(opts, ("127.0.0.1", port), ("127.0.0.1", port),
                        Progress(True, "decode", lines))
    assert time.perf_counter() - t0 < 60  # not the 120 s --timeout
    assert report.error is not None and not report.ok and report.transfers == []
    assert f"control channel at 127.0.0.1:{port} within 5 s" in report.error.message
    assert "kvdd demo --role prefill" in report.error.message
    assert f"kvdd demo [decode] the prefill's control channel at 127.0.0.1:{port} refused the " \
           "connection; retrying for 5 s" in lines.getvalue().splitlines()
    assert report.setup_seconds == 0.0  # it gave up before allocating its caches
    assert not report.connected


def test_geometry_disagreement_is_reported() -> None:
    mine = quick()
    theirs = quick(geometry=Geometry(resolve_model(DEFAULT_MODEL), 1, 128))
    out: dict[str, BaseException] = {}
    ready: list[Any] = []
    event = threading.Event()
    cancel = threading.Event()

    def on_ready(info: Any) -> None:
        ready.append(info)
        event.set()

    def prefill() -> None:
        try:
            run_prefill(mine, on_ready, cancel=cancel)
        except BaseException as exc:
            out["error"] = exc
            event.set()

    thread = threading.Thread(target=prefill)
    thread.start()
    assert event.wait(30) and ready
    report = run_decode(theirs, ready[0].listen, ready[0].control)
    assert report.error is not None
    assert "disagree" in report.error.message and "tokens prefill=256 decode=128" in report.error.message
    assert thread.is_alive() and not out  # refused; the prefill side waits for a matching decode side
    cancel.set()
    thread.join(30)
    assert "gave up" in str(out["error"])


# ---- two processes --------------------------------------------------------------------------------

@pytest.mark.parametrize("transfer_backend", ["comm", "hixl"])
def test_quick_demo_two_processes(transfer_backend: str) -> None:
    needs_cross_process()
    report = run_demo(quick(transfer_backend=transfer_backend))
    assert_ok(report)
    assert report.mode == "processes" and report.prefill.get("pid") not in (None, os.getpid())


# ---- the default run (what the README's first command does) ---------------------------------------

@pytest.mark.slow
def test_default_demo_is_fast() -> None:
    t0 = time.perf_counter()
    report = run_demo(DemoOptions(Geometry(resolve_model(DEFAULT_MODEL))), in_process=cross_process_problem() is not None)
    assert_ok(report)
    assert time.perf_counter() - t0 < 60
