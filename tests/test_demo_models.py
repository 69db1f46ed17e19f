"""``kvdd demo``'s geometry: the built-in models (MODELS.md) and Hugging Face ``config.json`` files
(GQA, MLA, DSA indexer keys, dtypes, nested text configs, model directories, bad configs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvdd.cli import main as cli_main
from kvdd.demo import MODELS, ConfigError, Geometry, model_from_hf_config, resolve_model

from demo_support import KiB, write_config


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


def test_hf_config_gqa(tmp_path: Path) -> None:
    # Qwen2.5-7B-Instruct's config.json (the fields that matter): head_dim = hidden / heads.
    path = write_config(tmp_path, {"_name_or_path": "Qwen/Qwen2.5-7B-Instruct", "architectures": ["Qwen2ForCausalLM"],
                            "hidden_size": 3584, "num_attention_heads": 28, "num_hidden_layers": 28,
                            "num_key_value_heads": 4, "torch_dtype": "bfloat16", "model_type": "qwen2",
                            "sliding_window": 131072, "use_sliding_window": False})
    m = model_from_hf_config(path)
    assert (m.name, m.layers, m.attention, m.kv_heads, m.head_dim, m.dtype) == \
        ("Qwen2.5-7B-Instruct", 28, "GQA", 4, 128, "bf16")
    assert Geometry(m).to_json()["caches"] == Geometry(MODELS["Qwen2.5-7B"]).to_json()["caches"]
    # An explicit head_dim wins over hidden / heads (Qwen3-32B: 5120 / 64 = 80, head_dim 128).
    m = model_from_hf_config(write_config(tmp_path, {"hidden_size": 5120, "num_attention_heads": 64,
                                              "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 64,
                                              "torch_dtype": "float16"}, "q3.json"))
    assert (m.kv_heads, m.head_dim, m.layers, m.dtype) == (8, 128, 64, "fp16")
    assert m.name == tmp_path.name  # no _name_or_path: the directory name
    # No num_key_value_heads: multi-head attention.
    m = model_from_hf_config(write_config(tmp_path, {"hidden_size": 256, "num_attention_heads": 4,
                                              "num_hidden_layers": 2, "torch_dtype": "float32"}, "mha.json"))
    assert (m.attention, m.kv_heads, m.head_dim, m.dtype) == ("MHA", 4, 64, "fp32")


def test_hf_config_mla(tmp_path: Path) -> None:
    # DeepSeek-V3's config.json: num_key_value_heads is present but MLA caches the latent + rope.
    path = write_config(tmp_path, {"_name_or_path": "deepseek-ai/DeepSeek-V3", "num_hidden_layers": 61,
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
    g = Geometry(model_from_hf_config(write_config(tmp_path, doc, "v32.json")))
    assert [f.name for f in g.families] == ["latent", "rope", "indexer"]
    assert g.block_bytes(g.families[2]) == 32 * KiB


def test_hf_config_dtype_nesting_and_errors(tmp_path: Path) -> None:
    base = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4}
    m = model_from_hf_config(write_config(tmp_path, base, "nodtype.json"))
    assert m.dtype == "bf16" and any("torch_dtype" in n for n in m.notes)
    m = model_from_hf_config(write_config(tmp_path, base | {"torch_dtype": "torch.float16"}, "t.json"))
    assert m.dtype == "fp16"
    # Multimodal configs hold the language model under text_config.
    m = model_from_hf_config(write_config(tmp_path, {"model_type": "vlm", "torch_dtype": "bfloat16",
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
            model_from_hf_config(write_config(tmp_path, doc, f"bad{k}.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        model_from_hf_config(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="cannot read"):
        model_from_hf_config(tmp_path / "missing.json")


def test_model_config_accepts_a_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "Qwen2.5-7B-Instruct"
    model_dir.mkdir()
    write_config(model_dir, {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
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
