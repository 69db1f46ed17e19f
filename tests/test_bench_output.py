"""``kvdd bench`` as people read it: tables no wider than 120 columns, each section printed as it
finishes (Ctrl-C keeps the finished ones), the demo's model names accepted."""

from __future__ import annotations

import pytest

import kvdd.bench
from kvdd.bench import geometry_names
from kvdd.bench.harness import TABLE_WIDTH, print_table
from kvdd.cli import main as cli_main

TINY_MAIN = ["--quick", "--tokens", "128", "--blocks", "8", "--repeats", "1", "--overhead-calls", "10",
             "--no-cross-process"]
TINY_TARGETS = ["--scales", "1", "--target-tokens", "128"]


def test_tables_fit_120_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", *TINY_MAIN, *TINY_TARGETS, "--geometries", "Qwen2.5-7B,synthetic-4096x16k"]) == 0
    out = capsys.readouterr().out
    wide = [line for line in out.splitlines() if len(line) > TABLE_WIDTH]
    assert not wide, wide[0]
    # every transfer row still says everything, split over the groups that start with its names
    assert out.count("qwen2.5-7b  pull_row") >= 2 and "verified" in out and "outside_us" in out
    assert "Kernel targets" in out


def test_print_table_splits_wide_tables_repeating_the_key_columns(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"a": "x", "b": "y", **{f"c{i}": "1" * 20 for i in range(10)}}]
    print_table(rows, width=60)
    lines = capsys.readouterr().out.splitlines()
    headers = [line.split() for line in lines if line.split()[:2] == ["a", "b"]]
    assert [h[2:] for h in headers] == [["c0", "c1"], ["c2", "c3"], ["c4", "c5"], ["c6", "c7"], ["c8", "c9"]]
    assert all(len(line) <= 60 for line in lines)
    print_table(rows, width=1000)
    assert len(capsys.readouterr().out.splitlines()) == 2  # fits: one table


def test_an_interrupted_run_keeps_the_finished_sections(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*args: object, **kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvdd.bench, "measure_targets", interrupted)
    assert cli_main(["bench", *TINY_MAIN, "--geometries", "synthetic-4096x16k", "--kinds", "pull_row"]) == 130
    captured = capsys.readouterr()
    assert captured.out.startswith("# ")  # the machine line, printed before measuring
    assert "Per-call overhead" in captured.out and "synthetic-4096x16k  pull_row" in captured.out
    assert captured.err.splitlines()[-1] == "kvdd: error: interrupted"


@pytest.mark.parametrize("text, names", [
    ("Qwen2.5-7B", ["qwen2.5-7b"]),
    ("qwen2.5-7b,LLAMA-3.1-8B", ["qwen2.5-7b", "llama-3.1-8b"]),
    ("DeepSeek-V3", ["deepseek-v3-latent", "deepseek-v3-rope"]),
    ("GLM-5,glm-5-rope", ["glm-5-rope", "glm-5-indexer"]),
    ("Llama-3.1-70B", ["llama-3.1-70b"]),
])
def test_demo_model_names_are_accepted(text: str, names: list[str]) -> None:
    assert geometry_names(text) == names


@pytest.mark.parametrize("text", ["Qwen3-32B", "qwen", "", "deepseek"])
def test_unknown_names_list_the_choices(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="choose from qwen2.5-7b, .* \\(or a model: Qwen2.5-7B"):
        geometry_names(text)
    assert cli_main(["bench", "--geometries", text or ",", "--no-cross-process", "--no-targets"]) == 2
    assert "unknown geometry" in capsys.readouterr().err
