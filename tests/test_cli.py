"""The ``kvdd`` command line: plain-text help, doctor, user errors without tracebacks."""

from __future__ import annotations

import sys

import pytest

from kvdd.cli import DOCTOR_LINES, build_parser, main


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["demo", "--help"], ["bench", "--help"], ["doctor", "--help"],
                 ["cann-root", "--help"], ["fabric-secret", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "usage: kvdd" in out
        assert "``" not in out and ":func:" not in out and ":class:" not in out, argv


def test_doctor_says_each_thing_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # every subject in order, each line starting with its label ("label: ..." or, for a subject
    # with several lines, "label (which): ...")
    labels = [label for label, _ in DOCTOR_LINES]
    owners = [next(label for label in labels if line.startswith(label)) for line in lines]
    assert sorted(set(owners), key=owners.index) == labels
    assert "backend sim: usable" in lines
    native = next(line for line in lines if line.startswith("backend native: "))
    # the reason the native backend is missing appears once, not restated by the build line
    assert native.count("not built") <= 1
    build = next(line for line in lines if line.startswith("build: "))
    assert "not built" not in build or "native built" in build


def test_a_job_that_cannot_load_exits_2_without_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "kvdd.demo", None)  # the next import raises ImportError
    monkeypatch.delenv("KVDD_TRACEBACK", raising=False)
    assert main(["demo", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvdd: error: ") and "Traceback" not in err
    assert err.count("\n") == 1
    # the other commands still work
    assert main(["doctor"]) == 0


def test_parser_lists_every_command() -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["nope"])


def test_interrupt_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted() -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr("kvdd.cli.DOCTOR_LINES", [("x", interrupted)])
    assert main(["doctor"]) == 130
    assert capsys.readouterr().err == "kvdd: error: interrupted\n"
