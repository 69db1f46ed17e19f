"""``kvdd.models`` is the one table of model geometries: docs/spec/MODELS.md, the demo's built-in models
and the bench's geometries all agree with it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvdd import demo
from kvdd.bench import GEOMETRIES
from kvdd.models import ALIASES, BLOCK_TOKENS, MODELS, KvModel, lookup

KiB = 1024
DOC = Path(__file__).resolve().parent.parent / "docs" / "spec" / "MODELS.md"


def _doc_rows() -> dict[str, list[str]]:
    """The geometry table of MODELS.md: model name -> its cells."""
    rows: dict[str, list[str]] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].isdigit():
            rows[cells[0]] = cells
    return rows


def _model(doc_name: str) -> KvModel:
    """The model a MODELS.md row names ("Qwen2.5-7B-Instruct", "DeepSeek-V3 / R1")."""
    for name in doc_name.split("/"):
        name = name.strip()
        found = lookup(name) or lookup(doc_name.split()[0] + "-" + name)  # "DeepSeek-V3 / R1" -> DeepSeek-R1
        if found is not None:
            return found
    raise AssertionError(f"MODELS.md names {doc_name!r}, which kvdd.models does not have")


def test_every_model_of_the_doc_is_in_the_table_and_back() -> None:
    rows = _doc_rows()
    assert len(rows) >= 6
    assert {_model(name).name for name in rows} == set(MODELS)


@pytest.mark.parametrize("doc_name", sorted(_doc_rows()))
def test_doc_row_matches_the_table(doc_name: str) -> None:
    cells = _doc_rows()[doc_name]
    model = _model(doc_name)
    assert int(cells[1]) == model.layers
    layout = cells[2]
    if model.attention == "MLA":
        assert layout.startswith("MLA")
        like = MODELS["DeepSeek-V3"] if "like DeepSeek" in layout else model  # GLM-5's row
        assert (like.kv_lora_rank, like.qk_rope_head_dim) == (model.kv_lora_rank, model.qk_rope_head_dim)
        if like is model:
            assert f"kv_lora_rank {model.kv_lora_rank}" in layout
            assert f"qk_rope_head_dim {model.qk_rope_head_dim}" in layout
        if model.index_head_dim:
            assert f"index_head_dim {model.index_head_dim}" in layout
        per_token = cells[3]
        assert f"latent {model.kv_lora_rank * 2 // KiB} KiB" in per_token
        assert f"rope {model.qk_rope_head_dim * 2} B" in per_token
        if model.index_head_dim:
            assert f"indexer {model.index_head_dim * 2} B" in per_token
        else:
            assert "indexer" not in per_token
        assert cells[4].startswith("1 ")
    else:
        m = re.match(r"(\w+), (\d+) KV heads x (?:head_dim )?(\d+)", layout)
        assert m is not None, layout
        assert (m.group(1), int(m.group(2)), int(m.group(3))) == (model.attention, model.kv_heads, model.head_dim)
        kib = model.kv_heads * model.head_dim * 2 // KiB
        assert cells[3].startswith(f"K {kib} KiB + V {kib} KiB")
        assert cells[4].startswith("2")


def test_block_bytes_line_of_the_doc() -> None:
    # "Qwen2.5-7B K or V 128 KiB; Llama-3.1-8B / Qwen3-32B / Llama-3.1-70B K or V 256 KiB; DeepSeek
    # latent 128 KiB, rope 16 KiB; GLM-5 indexer 32 KiB."
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    m = re.search(r"Bytes per 128-token block per tensor: (.*?)\. \*", text)
    assert m is not None and BLOCK_TOKENS == 128
    checked = 0
    for entry in m.group(1).split(";"):
        names, facts = re.match(r"\s*(.*?) ((?:K or V|latent|rope|indexer) .*)", entry).groups()  # type: ignore[union-attr]
        for name in names.split(" / "):
            model = lookup(name) or lookup(name + "-V3")
            assert model is not None, name
            for part, kib in re.findall(r"(K or V|latent|rope|indexer) (\d+) KiB", facts):
                fam = model.cache("kv" if part == "K or V" else part)
                assert fam.block_bytes() == int(kib) * KiB, (name, part)
                checked += 1
    assert checked >= 7


def test_the_demo_uses_the_table() -> None:
    assert list(demo.MODELS) == list(MODELS)
    for name, spec in demo.MODELS.items():
        model = MODELS[name]
        assert (spec.layers, spec.attention) == (model.layers, model.attention)
        assert [(f.name, f.tensors_per_layer, f.token_shape) for f in spec.families] == \
            [(f.name, f.tensors_per_layer, f.token_shape) for f in model.caches]
    for alias, name in ALIASES.items():
        assert demo.resolve_model(alias) is demo.MODELS[name]


def test_the_bench_uses_the_table() -> None:
    for geom in GEOMETRIES.values():
        if geom.name.startswith("synthetic-"):
            continue
        model = lookup(geom.name.rsplit("-", 1)[0]) or lookup(geom.name)
        assert model is not None, geom.name
        fam = next(f for f in model.caches if f.tensors == geom.tensors and f.token_shape == geom.token_shape)
        assert geom.per_layer == fam.tensors_per_layer
        assert geom.block_bytes == fam.block_bytes()
