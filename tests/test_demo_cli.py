"""``kvdd demo`` on the command line: the ``--json`` schema, the text report, exit codes and where
the FAILED line goes (once on a terminal; the error alone when decode never reached a prefill),
usage errors, and ``--role prefill`` / ``--role decode`` as two commands."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest

import kvdd
from kvdd.cli import main as cli_main
from kvdd.demo import run_prefill

from demo_support import (KiB, TRANSFERS, child_env, closed_port, corrupt_first_block_pull, needs_cross_process,
                          quick, terminal_output)


def test_cli_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["demo", "--quick", "--in-process", "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.err == ""
    doc = json.loads(captured.out)
    assert doc["schema"] == "kvdd.demo/1" and doc["ok"] is True and doc["error"] is None
    assert doc["mode"] == "threads" and doc["backend"] == "sim" and doc["transfer_backend"] == "comm"
    geom = doc["geometry"]
    assert (geom["model"]["name"], geom["requests"], geom["tokens"], geom["block_size"]) == ("Qwen2.5-7B", 1, 256, 128)
    assert geom["data_type"] == "DT_BF16" and geom["model"]["layers"] == 28
    (cache,) = geom["caches"]
    assert cache["bytes_per_block_per_tensor"] == 128 * KiB and cache["num_tensors"] == 56
    assert isinstance(geom["prefill_bytes"], int) and isinstance(geom["decode_bytes"], int)
    assert [t["name"] for t in doc["transfers"]] == TRANSFERS
    for t in doc["transfers"]:
        assert set(t) == {"name", "api", "what", "calls", "tensors", "bytes", "seconds", "gbps", "verified",
                          "checked_bytes", "error"}
        assert t["verified"] is True and t["error"] is None and t["bytes"] > 0 and t["seconds"] >= 0
        assert t["gbps"] is None or t["gbps"] > 0
    s = doc["summary"]
    assert s["transfers"] == s["verified"] == 5 and s["source_intact"] is True
    assert s["bytes"] == sum(t["bytes"] for t in doc["transfers"])
    assert doc["prefill"]["source_intact"] is True and doc["prefill"]["push"]["bytes"] > 0


def test_cli_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["demo", "--quick", "--in-process", "--model", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V3 (built-in): 61 layers, MLA latent 512 + rope 64, bf16" in out
    assert "latent/paged" in out and "rope/contig" in out and "16.0 KiB per block per tensor" in out
    for name in TRANSFERS:
        assert name in out
    assert out.strip().splitlines()[-1].startswith("OK: 5 transfers")


def test_cli_failure_exit_code(corrupt_first_block_pull: list[tuple[int, int, int]],
                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["demo", "--quick", "--in-process", "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "kvdd demo: FAILED: paged block pull" in captured.err
    doc = json.loads(captured.out)
    assert doc["ok"] is False and doc["error"]["transfer"] == "paged block pull"
    assert doc["error"]["location"]["cache"] == "kv/paged"


def test_one_failed_line_on_a_terminal(corrupt_first_block_pull: list[tuple[int, int, int]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # stdout and stderr on one terminal (as in an interactive shell): the report's FAILED line
    # is not repeated on stderr.
    rc, text = terminal_output(["demo", "--quick", "--in-process", "--no-progress"], monkeypatch)
    assert rc == 1
    assert text.count("FAILED: ") == 1, text
    assert "FAILED: paged block pull" in text


def test_cli_decode_that_reaches_no_prefill_prints_the_error_alone(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens there: no run to report (no geometry header, no empty transfer table), only
    # the error, on stderr, as a failed `--role prefill` reports it.
    port = closed_port()
    argv = ["demo", "--role", "decode", "--quick", "--no-progress", "--connect", f"127.0.0.1:{port}",
            "--control-port", str(port), "--timeout", "2"]
    assert cli_main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"kvdd demo: FAILED: cannot reach the prefill's control channel at 127.0.0.1:{port}")
    rc, text = terminal_output(argv, monkeypatch)
    assert rc == 1
    assert text.splitlines() == [line], text


def test_cli_decode_that_reached_the_prefill_reports_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    # Once connected, a failure comes with the report: the geometry, the transfers (none ran), FAILED.
    ready: list[Any] = []
    event = threading.Event()
    errors: list[BaseException] = []
    cancel = threading.Event()

    def on_ready(info: Any) -> None:
        ready.append(info)
        event.set()

    def prefill() -> None:
        try:
            run_prefill(quick(), on_ready, cancel=cancel)
        except BaseException as exc:  # stopped by cancel: it refused the mismatched decode side
            errors.append(exc)
            event.set()

    thread = threading.Thread(target=prefill)
    thread.start()
    assert event.wait(30) and ready
    host, port = ready[0].listen
    rc = cli_main(["demo", "--role", "decode", "--quick", "--tokens", "128", "--no-progress",
                   "--connect", f"{host}:{port}", "--control-port", str(ready[0].control[1])])
    assert thread.is_alive()  # the prefill side refused that decode side and keeps waiting
    cancel.set()
    thread.join(30)
    captured = capsys.readouterr()
    assert rc == 1
    lines = captured.out.splitlines()
    assert lines[0] == "kvdd demo: Qwen2.5-7B KV cache, prefill -> decode; verifies every byte"
    assert "  (no transfer ran)" in lines
    assert lines[-1].startswith("FAILED: the prefill side refused this one: the two sides disagree on the geometry")
    # stdout is no terminal here; the prefill side (a thread of this process) warns on stderr too
    err = captured.err.splitlines()
    assert [x for x in err if not x.startswith("kvdd demo [prefill] warning: refused decode")] == [
        "kvdd demo: " + lines[-1]]
    assert len(errors) == 1 and "gave up" in str(errors[0])


@pytest.mark.parametrize("argv, match", [
    (["--role", "decode"], "needs --connect"),
    (["--connect", "127.0.0.1:5"], "--connect is for --role decode"),
    (["--model", "nope"], "unknown model"),
    (["--model", "Qwen3-32B", "--model-config", "x.json"], "either --model or --model-config"),
    (["--in-process", "--role", "prefill"], "cannot be combined"),
])
def test_cli_usage_errors(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["demo", *argv]) == 2
    assert match in capsys.readouterr().err


def test_cli_unavailable_backend(capsys: pytest.CaptureFixture[str]) -> None:
    if "native" in kvdd.available_backends():
        pytest.skip("the native backend is usable here")
    assert cli_main(["demo", "--quick", "--in-process", "--backend", "native"]) == 2
    assert "--backend native: the native backend" in capsys.readouterr().err


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["demo", "--tokens", "0"])
    assert info.value.code == 2
    assert "not positive" in capsys.readouterr().err


@pytest.mark.parametrize("transfer_backend", ["comm", "hixl"])
def test_quick_demo_two_commands(transfer_backend: str) -> None:
    """`--role prefill` and `--role decode` as two commands, as on two hosts."""
    needs_cross_process()
    cmd = [sys.executable, "-m", "kvdd", "demo", "--quick", "--json", "--timeout", "30",
           "--transfer-backend", transfer_backend]
    prefill = subprocess.Popen([*cmd, "--role", "prefill", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        assert prefill.stdout is not None
        ready = json.loads(prefill.stdout.readline())
        assert ready["event"] == "ready"
        control_port = ready["control"].rsplit(":", 1)[1]
        decode = subprocess.run([*cmd, "--role", "decode", "--connect", ready["listen"], "--control-port",
                                 control_port], capture_output=True, text=True, env=child_env(), timeout=120)
        assert decode.returncode == 0, decode.stderr
        doc = json.loads(decode.stdout)
        assert doc["ok"] is True and doc["mode"] == "decode"
        assert [t["name"] for t in doc["transfers"]] == TRANSFERS
        out, err = prefill.communicate(timeout=60)
        assert prefill.returncode == 0, err
        assert out.count("\n") == 1  # the ready line was read above; the result is one line too
        result = json.loads(out)
        assert result["event"] == "result" and result["ok"] is True
        assert result["prefill"]["source_intact"] is True
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()
