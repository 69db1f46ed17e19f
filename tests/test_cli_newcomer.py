"""The ``kvdd`` command line as a newcomer meets it: ``--version``, ``-v`` on either side of the
subcommand, a malformed ``KVDD_SIM_FAULTS`` (one line, exit 2, ``--help`` unaffected), backend lines
that name what the user chose."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

import pytest

import kvdd
from kvdd.cli import main
from kvdd.demo import cli as demo_cli
from kvdd.demo.errors import ConfigError

BAD_FAULTS = "link:stauts=LLM_FAILED"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvdd {kvdd.__version__}\n"


@pytest.mark.parametrize("argv, level", [
    (["doctor"], None),
    (["-v", "doctor"], logging.INFO),
    (["doctor", "-v"], logging.INFO),
    (["doctor", "-vv"], logging.DEBUG),
    (["-v", "doctor", "-v"], logging.DEBUG),
    (["fabric-secret", "--verbose"], logging.INFO),
])
def test_verbose_before_or_after_the_subcommand(argv: list[str], level: int | None,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: seen.append(kw))
    assert main(argv) == 0
    capsys.readouterr()
    assert [kw["level"] for kw in seen] == ([] if level is None else [level])


@pytest.mark.parametrize("argv", [["demo", "--quick"], ["bench", "--quick"], ["-v", "demo", "--in-process"]])
def test_malformed_sim_faults_is_one_line_and_exit_2(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVDD_SIM_FAULTS", BAD_FAULTS)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(f"kvdd: error: KVDD_SIM_FAULTS={BAD_FAULTS!r}: fault #1 ") and "stauts" in line
    assert line.endswith("(see docs/faults.md for the syntax)")


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_malformed_sim_faults_leaves_help_alone(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVDD_SIM_FAULTS", BAD_FAULTS)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage: kvdd" in capsys.readouterr().out


def test_malformed_sim_faults_leaves_doctor_alone(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVDD_SIM_FAULTS", BAD_FAULTS)
    assert main(["doctor"]) == 0
    assert "backend sim: usable" in capsys.readouterr().out


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KVDD_SIM_FAULTS=BAD_FAULTS)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_the_variable_is_read_when_the_first_instance_is_created() -> None:
    # importing kvdd and its simulator reads nothing; creating the first instance raises
    out = _child("import kvdd, kvdd.sim, kvdd.sim.faults\n"
                 "print('imported')\n"
                 "try:\n"
                 "    kvdd.LlmDataDist(1, 1, backend='sim')\n"
                 "except kvdd.sim.faults.FaultSpecError as exc:\n"
                 "    print(type(exc).__mro__[1].__name__, exc)\n")
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == "imported"
    assert second.startswith(f"ValueError KVDD_SIM_FAULTS={BAD_FAULTS!r}: fault #1") and "stauts" in second


def test_doctor_names_why_the_default_backend_is_what_it_is(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVDD_BACKEND", "sim")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "default backend (backend=None, --backend auto): sim ($KVDD_BACKEND=sim)\n" in out
    assert "backend=None selects" not in out
    if kvdd.backend.backend_problem("native") is not None:
        monkeypatch.setenv("KVDD_BACKEND", "native")
        assert main(["doctor"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("default backend"))
        assert line.endswith(": native ($KVDD_BACKEND=native), which is unusable here (see 'backend native' "
                             "above)")


def test_demo_backend_auto_is_named_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvdd.backend as backend

    monkeypatch.setattr(backend, "resolve_backend_name", lambda name: "native")
    monkeypatch.setattr(backend, "backend_problem", lambda name: "not built here")
    with pytest.raises(ConfigError) as err:
        demo_cli._check_backend(None)
    assert str(err.value) == "--backend auto selects native, which is unusable: not built here"
    with pytest.raises(ConfigError) as err:
        demo_cli._check_backend("native")
    assert str(err.value) == "--backend native: not built here"


def test_native_reason_speaks_of_build_time() -> None:
    problem = kvdd.backend.backend_problem("native")
    if problem is None or "no CANN root" not in problem:
        pytest.skip("the native backend was built, or not for want of a CANN root")
    assert "$ASCEND_HOME_PATH is empty" not in problem and "at build time" in problem


def test_verbose_demo_logs_both_processes(tmp_path: Any) -> None:
    """``kvdd demo -vv`` logs the calls of the spawned prefill process too, its lines marked."""
    out = subprocess.run([sys.executable, "-m", "kvdd", "demo", "--quick", "-vv"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    prefill = [ln for ln in lines if ln.startswith("[prefill] ")]
    decode_calls = [ln for ln in lines if ln.startswith("kvdd.calls: DEBUG: ")]
    assert any("[prefill] kvdd.calls: DEBUG: RegisterKvCache " in ln for ln in prefill), prefill[:5]
    assert any("PullKvBlocks " in ln for ln in decode_calls)
    assert not any("PullKvBlocks " in ln for ln in prefill)  # decode pulls; prefill only serves
