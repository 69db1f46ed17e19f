"""``kvdd demo``: the quick demo end to end (threads; two processes and two commands once the
simulator links across processes), Hugging Face config parsing, the verifier catching corrupted
transfers, failure exit codes, and the ``--json`` schema."""

from __future__ import annotations

import ctypes
import io
import json
import os
import pty
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import kvdd
from kvdd import ClusterInfo, IpInfo, LlmRole
from kvdd.cli import main as cli_main
from kvdd.demo import (
    DEFAULT_MODEL,
    MODELS,
    ConfigError,
    DemoOptions,
    DemoReport,
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

KiB = 1024
TRANSFERS = ["paged block pull", "layer-by-layer pull", "batch-row pull", "prefix pull",
             "push prefill -> decode"]


def quick(**kw: Any) -> DemoOptions:
    geom = kw.pop("geometry", None) or Geometry(resolve_model(DEFAULT_MODEL), 1, 256)
    return DemoOptions(geometry=geom, timeout=30.0, **kw)


def assert_ok(report: DemoReport) -> None:
    assert report.error is None, report.error.message
    assert report.ok
    assert [t.name for t in report.transfers] == TRANSFERS
    assert all(t.verified and t.checked_bytes > 0 for t in report.transfers)
    assert report.source_intact is True
    assert report.connected


# ---- environment -------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    """Environment for child processes: import the same kvdd as this test process."""
    env = dict(os.environ)
    root = str(Path(kvdd.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("KVDD_SIM_FAULTS", None)
    return env


_PEER = textwrap.dedent("""
    import sys, kvdd
    dd = kvdd.LlmDataDist(7, kvdd.LlmRole.PROMPT, backend="sim")
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    print(dd.listen_port, flush=True)
    sys.stdin.readline()
    dd.finalize()
""")
_cross: list[str | None] = []


def cross_process_problem() -> str | None:
    """None when this build's simulator links instances in two processes; else why not (found out
    by trying: a peer process listens, this process links to it)."""
    if _cross:
        return _cross[0]
    proc = subprocess.Popen([sys.executable, "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env())
    problem: str | None = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        with kvdd.LlmDataDist(8, LlmRole.DECODER, backend="sim") as dd:
            dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
            cluster = ClusterInfo(7, LlmRole.PROMPT, local_ip_infos=(IpInfo("127.0.0.1"),),
                                  remote_ip_infos=(IpInfo("127.0.0.1", port),))
            try:
                dd.link_llm_clusters([cluster], timeout_ms=5000)
                dd.unlink_llm_clusters([cluster], timeout_ms=5000)
            except kvdd.LLMError as exc:
                problem = ("cross-process links are not available in this build's simulator "
                           f"({type(exc).__name__})")
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _cross.append(problem)
    return problem


def needs_cross_process() -> None:
    problem = cross_process_problem()
    if problem is not None:
        pytest.skip(problem)


# ---- geometry and Hugging Face configs -----------------------------------------------------------

def test_builtin_geometries_match_models_md() -> None:
    # MODELS.md: bytes per 128-token block per tensor
    def block(model: str, family: str) -> int:
        g = Geometry(resolve_model(model))
        return g.block_bytes(next(f for f in g.families if f.name == family))

    assert block("Qwen2.5-7B", "kv") == 128 * KiB
    for m in ("Llama-3.1-8B", "Qwen3-32B", "Llama-3.1-70B"):
        assert block(m, "kv") == 256 * KiB
    assert block("DeepSeek-V3", "latent") == 128 * KiB
    assert block("deepseek-r1", "rope") == 16 * KiB
    assert block("GLM-5", "indexer") == 32 * KiB
    g = Geometry(resolve_model("Qwen2.5-7B"))  # the default run: 4 x 1024 tokens
    assert g.num_tensors(g.families[0]) == 56
    assert g.side_bytes("prefill") == 2 * 4 * 1024 * 56 * KiB  # paged + contiguous, 224 MiB each
    assert {f.tensors_per_layer for f in Geometry(MODELS["DeepSeek-V3"]).families} == {1}
    with pytest.raises(ConfigError, match="unknown model"):
        resolve_model("gpt-5")


def write(tmp_path: Path, doc: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_hf_config_gqa(tmp_path: Path) -> None:
    # Qwen2.5-7B-Instruct's config.json (the fields that matter): head_dim = hidden / heads.
    path = write(tmp_path, {"_name_or_path": "Qwen/Qwen2.5-7B-Instruct", "architectures": ["Qwen2ForCausalLM"],
                            "hidden_size": 3584, "num_attention_heads": 28, "num_hidden_layers": 28,
                            "num_key_value_heads": 4, "torch_dtype": "bfloat16", "model_type": "qwen2",
                            "sliding_window": 131072, "use_sliding_window": False})
    m = model_from_hf_config(path)
    assert (m.name, m.layers, m.attention, m.kv_heads, m.head_dim, m.dtype) == \
        ("Qwen2.5-7B-Instruct", 28, "GQA", 4, 128, "bf16")
    assert Geometry(m).to_json()["caches"] == Geometry(MODELS["Qwen2.5-7B"]).to_json()["caches"]
    # An explicit head_dim wins over hidden / heads (Qwen3-32B: 5120 / 64 = 80, head_dim 128).
    m = model_from_hf_config(write(tmp_path, {"hidden_size": 5120, "num_attention_heads": 64,
                                              "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 64,
                                              "torch_dtype": "float16"}, "q3.json"))
    assert (m.kv_heads, m.head_dim, m.layers, m.dtype) == (8, 128, 64, "fp16")
    assert m.name == tmp_path.name  # no _name_or_path: the directory name
    # No num_key_value_heads: multi-head attention.
    m = model_from_hf_config(write(tmp_path, {"hidden_size": 256, "num_attention_heads": 4,
                                              "num_hidden_layers": 2, "torch_dtype": "float32"}, "mha.json"))
    assert (m.attention, m.kv_heads, m.head_dim, m.dtype) == ("MHA", 4, 64, "fp32")


def test_hf_config_mla(tmp_path: Path) -> None:
    # DeepSeek-V3's config.json: num_key_value_heads is present but MLA caches the latent + rope.
    path = write(tmp_path, {"_name_or_path": "deepseek-ai/DeepSeek-V3", "num_hidden_layers": 61,
                            "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
                            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
                            "qk_rope_head_dim": 64, "v_head_dim": 128, "torch_dtype": "bfloat16"})
    m = model_from_hf_config(path)
    assert (m.attention, m.layers, m.kv_lora_rank, m.qk_rope_head_dim, m.index_head_dim) == ("MLA", 61, 512, 64, 0)
    g = Geometry(m)
    assert [(f.name, f.tensors_per_layer, f.token_shape) for f in g.families] == \
        [("latent", 1, (512,)), ("rope", 1, (64,))]
    assert [g.block_bytes(f) for f in g.families] == [128 * KiB, 16 * KiB]
    assert [g.num_tensors(f) for f in g.families] == [61, 61]
    # With DSA indexer keys (DeepSeek-V3.2 / GLM-5 style): a third cache.
    doc = json.loads(path.read_text()) | {"index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}
    g = Geometry(model_from_hf_config(write(tmp_path, doc, "v32.json")))
    assert [f.name for f in g.families] == ["latent", "rope", "indexer"]
    assert g.block_bytes(g.families[2]) == 32 * KiB


def test_hf_config_dtype_nesting_and_errors(tmp_path: Path) -> None:
    base = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4}
    m = model_from_hf_config(write(tmp_path, base, "nodtype.json"))
    assert m.dtype == "bf16" and any("torch_dtype" in n for n in m.notes)
    m = model_from_hf_config(write(tmp_path, base | {"torch_dtype": "torch.float16"}, "t.json"))
    assert m.dtype == "fp16"
    # Multimodal configs hold the language model under text_config.
    m = model_from_hf_config(write(tmp_path, {"model_type": "vlm", "torch_dtype": "bfloat16",
                                              "text_config": base}, "vlm.json"))
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype) == (4, 2, 64, "bf16")
    bad: list[tuple[Any, str]] = [
        (base | {"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
        ({"hidden_size": 512, "num_attention_heads": 8}, "num_hidden_layers"),
        (base | {"num_hidden_layers": 0}, "num_hidden_layers"),
        (base | {"hidden_size": 500}, "hidden_size 500"),
        (base | {"num_key_value_heads": 3}, "num_key_value_heads 3"),
        ({"num_hidden_layers": 2, "kv_lora_rank": 64}, "qk_rope_head_dim"),
        ([1, 2], "JSON object"),
    ]
    for k, (doc, match) in enumerate(bad):
        with pytest.raises(ConfigError, match=match):
            model_from_hf_config(write(tmp_path, doc, f"bad{k}.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        model_from_hf_config(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="cannot read"):
        model_from_hf_config(tmp_path / "missing.json")


# ---- the demo, both sides in one process ---------------------------------------------------------

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
    path = write(tmp_path, {"num_hidden_layers": 3, "kv_lora_rank": 8, "qk_rope_head_dim": 3,
                            "torch_dtype": "float16"})
    geom = Geometry(model_from_hf_config(path), requests=3, tokens=20, block_size=8)
    assert geom.blocks_per_request == 3 and geom.token_bytes(geom.families[1]) == 6
    assert_ok(run_demo(quick(geometry=geom), in_process=True))


def _poke(addr: int) -> None:
    """Flip one byte of registered memory (what a faulty transport would do)."""
    old = ctypes.string_at(addr, 1)[0]
    ctypes.memset(addr, old ^ 0xFF, 1)


@pytest.fixture
def corrupt_first_block_pull(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int, int]]]:
    """The first PullKvBlocks of each run also flips byte 1000 of tensor 5 of its first dst block."""
    done: list[tuple[int, int, int]] = []
    original = SimBackend.pull_kv_blocks

    def pull(self: SimBackend, idx: kvdd.CacheIndex, dst: kvdd.Cache, src_blocks: Sequence[int],
             dst_blocks: Sequence[int], ext: kvdd.KvCacheExtParam) -> int:
        status = original(self, idx, dst, src_blocks, dst_blocks, ext)
        if status == 0 and not done:
            entry = self.caches[dst.cache_id]
            _poke(entry.addrs[5] + dst_blocks[0] * entry.S + 1000)
            done.append((dst.cache_id, 5, dst_blocks[0]))
        return status

    monkeypatch.setattr(SimBackend, "pull_kv_blocks", pull)
    yield done


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


def test_write_outside_the_targets_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    # A row pull that also scribbles on row 0 of decode's contiguous cache (not a target).
    original = SimBackend.pull_kv_cache

    def pull(self: SimBackend, idx: kvdd.CacheIndex, dst: kvdd.Cache, batch_index: int, size: int,
             ext: kvdd.KvCacheExtParam) -> int:
        status = original(self, idx, dst, batch_index, size, ext)
        if status == 0 and size == -1:
            entry = self.caches[dst.cache_id]
            _poke(entry.addrs[0] + 4096)  # row 0, token 4
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


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once closed


def test_decode_against_a_closed_port_fails_fast_with_a_progress_line() -> None:
    # `kvdd demo --role decode --connect HOST:PORT` at an address where nothing listens: the
    # refused connection is retried briefly (saying so), not for the whole --timeout.
    port = _closed_port()
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


def test_model_config_accepts_a_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "Qwen2.5-7B-Instruct"
    model_dir.mkdir()
    write(model_dir, {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                      "hidden_size": 3584, "torch_dtype": "bfloat16"})
    from_dir = model_from_hf_config(model_dir)
    assert from_dir == model_from_hf_config(model_dir / "config.json")
    assert from_dir.source == str(model_dir / "config.json") and from_dir.name == "Qwen2.5-7B-Instruct"
    assert (from_dir.layers, from_dir.kv_heads, from_dir.head_dim) == (28, 4, 128)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="directory without a config.json"):
        model_from_hf_config(empty)
    assert cli_main(["demo", "--model-config", str(empty)]) == 2
    assert "directory without a config.json" in capsys.readouterr().err


def _drain(fd: int, chunks: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO once the slave side is closed
            return
        if not data:
            return
        chunks.append(data)


def _terminal_output(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """``kvdd ARGV`` with stdout and stderr on one terminal (as in an interactive shell)."""
    master, slave = pty.openpty()
    term = os.fdopen(slave, "w", buffering=1)
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(master, chunks), daemon=True)
    reader.start()
    try:
        monkeypatch.setattr(sys, "stdout", term)
        monkeypatch.setattr(sys, "stderr", term)
        rc = cli_main(argv)
    finally:
        term.close()
        reader.join(10)
        os.close(master)
    return rc, b"".join(chunks).decode()


def test_one_failed_line_on_a_terminal(corrupt_first_block_pull: list[tuple[int, int, int]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # stdout and stderr on one terminal (as in an interactive shell): the report's FAILED line
    # is not repeated on stderr.
    rc, text = _terminal_output(["demo", "--quick", "--in-process", "--no-progress"], monkeypatch)
    assert rc == 1
    assert text.count("FAILED: ") == 1, text
    assert "FAILED: paged block pull" in text


def test_geometry_disagreement_is_reported() -> None:
    mine = quick()
    theirs = quick(geometry=Geometry(resolve_model(DEFAULT_MODEL), 1, 128))
    out: dict[str, BaseException] = {}
    ready: list[Any] = []
    event = threading.Event()

    def on_ready(info: Any) -> None:
        ready.append(info)
        event.set()

    def prefill() -> None:
        try:
            run_prefill(mine, on_ready)
        except BaseException as exc:
            out["error"] = exc
            event.set()

    thread = threading.Thread(target=prefill)
    thread.start()
    assert event.wait(30) and ready
    report = run_decode(theirs, ready[0].listen, ready[0].control)
    thread.join(30)
    assert report.error is not None
    assert "disagree" in report.error.message and "tokens prefill=256 decode=128" in report.error.message
    assert "disagree" in str(out["error"])


# ---- command line --------------------------------------------------------------------------------

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


def test_cli_decode_that_reaches_no_prefill_prints_the_error_alone(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens there: no run to report (no geometry header, no empty transfer table), only
    # the error, on stderr, as a failed `--role prefill` reports it.
    port = _closed_port()
    argv = ["demo", "--role", "decode", "--quick", "--no-progress", "--connect", f"127.0.0.1:{port}",
            "--control-port", str(port), "--timeout", "2"]
    assert cli_main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"kvdd demo: FAILED: cannot reach the prefill's control channel at 127.0.0.1:{port}")
    rc, text = _terminal_output(argv, monkeypatch)
    assert rc == 1
    assert text.splitlines() == [line], text


def test_cli_decode_that_reached_the_prefill_reports_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    # Once connected, a failure comes with the report: the geometry, the transfers (none ran), FAILED.
    ready: list[Any] = []
    event = threading.Event()
    errors: list[BaseException] = []

    def on_ready(info: Any) -> None:
        ready.append(info)
        event.set()

    def prefill() -> None:
        try:
            run_prefill(quick(), on_ready)
        except BaseException as exc:  # the geometry disagreement, checked below
            errors.append(exc)
            event.set()

    thread = threading.Thread(target=prefill)
    thread.start()
    assert event.wait(30) and ready
    host, port = ready[0].listen
    rc = cli_main(["demo", "--role", "decode", "--quick", "--tokens", "128", "--no-progress",
                   "--connect", f"{host}:{port}", "--control-port", str(ready[0].control[1])])
    thread.join(30)
    captured = capsys.readouterr()
    assert rc == 1
    lines = captured.out.splitlines()
    assert lines[0] == "kvdd demo: Qwen2.5-7B KV cache, prefill -> decode, every byte verified"
    assert "  (no transfer ran)" in lines
    assert lines[-1].startswith("FAILED: prefill side failed: the two sides disagree on the geometry")
    assert captured.err.splitlines() == ["kvdd demo: " + lines[-1]]  # stdout is no terminal here
    assert len(errors) == 1 and "disagree" in str(errors[0])


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


# ---- two processes --------------------------------------------------------------------------------

@pytest.mark.parametrize("transfer_backend", ["comm", "hixl"])
def test_quick_demo_two_processes(transfer_backend: str) -> None:
    needs_cross_process()
    report = run_demo(quick(transfer_backend=transfer_backend))
    assert_ok(report)
    assert report.mode == "processes" and report.prefill.get("pid") not in (None, os.getpid())


@pytest.mark.parametrize("transfer_backend", ["comm", "hixl"])
def test_quick_demo_two_commands(transfer_backend: str) -> None:
    """`--role prefill` and `--role decode` as two commands, as on two hosts."""
    needs_cross_process()
    cmd = [sys.executable, "-m", "kvdd", "demo", "--quick", "--json", "--timeout", "30",
           "--transfer-backend", transfer_backend]
    prefill = subprocess.Popen([*cmd, "--role", "prefill", "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert prefill.stdout is not None
        ready = json.loads(prefill.stdout.readline())
        assert ready["event"] == "ready"
        control_port = ready["control"].rsplit(":", 1)[1]
        decode = subprocess.run([*cmd, "--role", "decode", "--connect", ready["listen"], "--control-port",
                                 control_port], capture_output=True, text=True, env=_env(), timeout=120)
        assert decode.returncode == 0, decode.stderr
        doc = json.loads(decode.stdout)
        assert doc["ok"] is True and doc["mode"] == "decode"
        assert [t["name"] for t in doc["transfers"]] == TRANSFERS
        out, err = prefill.communicate(timeout=60)
        assert prefill.returncode == 0, err
        result = json.loads(out)
        assert result["event"] == "result" and result["ok"] is True
        assert result["prefill"]["source_intact"] is True
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()


# ---- the default run (what the README's first command does) ---------------------------------------

@pytest.mark.slow
def test_default_demo_is_fast() -> None:
    t0 = time.perf_counter()
    report = run_demo(DemoOptions(Geometry(resolve_model(DEFAULT_MODEL))), in_process=cross_process_problem() is not None)
    assert_ok(report)
    assert time.perf_counter() - t0 < 60
