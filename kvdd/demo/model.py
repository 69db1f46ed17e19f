"""Model facts for the demo: the built-in models of :mod:`kvdd.models` plus a dtype, and the
geometry read from a Hugging Face ``config.json`` (file or model directory)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .. import models as _models
from ..models import CacheGeometry, KvModel
from ..types import DataType
from .errors import ConfigError, Json

__all__ = ["CacheFamily", "DEFAULT_MODEL", "DTYPES", "MODELS", "ModelSpec", "model_from_hf_config",
           "resolve_model"]


#: --dtype / torch_dtype names -> ge::DataType.
DTYPES: dict[str, DataType] = {"bf16": DataType.DT_BF16, "fp16": DataType.DT_FLOAT16,
                               "fp32": DataType.DT_FLOAT}
_HF_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
              "float32": "fp32", "fp32": "fp32", "float": "fp32"}


#: One kind of cache of a model (K and V of every layer, or one MLA component): the table's type.
CacheFamily = CacheGeometry


@dataclass(frozen=True)
class ModelSpec(KvModel):
    """A model of :mod:`kvdd.models` (or read from a Hugging Face config) with the dtype the demo
    uses, where it came from and notes about how it was read.

    Raises
    ------
    ConfigError
        For a dtype outside :data:`DTYPES` or sizes that are not positive.
    """

    dtype: str = "bf16"  # a key of DTYPES
    source: str = "built-in"
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.layers <= 0:
            raise ConfigError(f"{self.name}: number of layers must be positive, got {self.layers}")
        if self.attention == "MLA":
            if self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0:
                raise ConfigError(f"{self.name}: MLA needs positive kv_lora_rank and qk_rope_head_dim")
        elif self.kv_heads <= 0 or self.head_dim <= 0:
            raise ConfigError(f"{self.name}: needs positive KV heads and head_dim "
                              f"(got {self.kv_heads} x {self.head_dim})")

    @property
    def families(self) -> tuple[CacheFamily, ...]:
        """The model's caches (:attr:`kvdd.models.KvModel.caches`)."""
        return self.caches

    def describe(self) -> str:
        if self.attention == "MLA":
            text = (f"{self.layers} layers, MLA latent {self.kv_lora_rank} + rope {self.qk_rope_head_dim}"
                    + (f" + indexer {self.index_head_dim}" if self.index_head_dim else ""))
        else:
            text = (f"{self.layers} layers, {self.attention} {self.kv_heads} KV head"
                    f"{'s' if self.kv_heads != 1 else ''} x head_dim {self.head_dim}")
        return f"{text}, {self.dtype}"

    def to_json(self) -> Json:
        out: Json = {"name": self.name, "source": self.source, "layers": self.layers,
                     "attention": self.attention, "dtype": self.dtype}
        if self.attention == "MLA":
            out.update(kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim,
                       index_head_dim=self.index_head_dim)
        else:
            out.update(kv_heads=self.kv_heads, head_dim=self.head_dim)
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ModelSpec:
        return cls(name=str(doc["name"]), layers=int(doc["layers"]), attention=str(doc["attention"]),
                   dtype=str(doc["dtype"]), kv_heads=int(doc.get("kv_heads", 0)),
                   head_dim=int(doc.get("head_dim", 0)), kv_lora_rank=int(doc.get("kv_lora_rank", 0)),
                   qk_rope_head_dim=int(doc.get("qk_rope_head_dim", 0)),
                   index_head_dim=int(doc.get("index_head_dim", 0)), source=str(doc.get("source", "")),
                   notes=tuple(doc.get("notes", ())))


#: Real geometries from MODELS.md (published configs; the table is :data:`kvdd.models.MODELS`).
#: ``--model`` takes these names (any case).
MODELS: dict[str, ModelSpec] = {
    m.name: ModelSpec(**{f.name: getattr(m, f.name) for f in fields(KvModel)})
    for m in _models.MODELS.values()
}
_MODEL_ALIASES = _models.ALIASES
DEFAULT_MODEL = "Qwen2.5-7B"


def resolve_model(name: str) -> ModelSpec:
    """The built-in model called ``name``.

    Parameters
    ----------
    name : str
        A key of :data:`MODELS` or an alias of :data:`kvdd.models.ALIASES`, any case
        (``deepseek-r1`` is DeepSeek-V3).

    Returns
    -------
    ModelSpec

    Raises
    ------
    ConfigError
        For an unknown name, listing the known ones.
    """
    wanted = name.strip().lower()
    wanted = _MODEL_ALIASES.get(wanted, wanted).lower()
    for key, spec in MODELS.items():
        if key.lower() == wanted:
            return spec
    raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} "
                      "or pass --model-config path/to/config.json")


def _positive_int(cfg: Mapping[str, Any], keys: Sequence[str], what: str, path: str) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{path}: {key}={value!r} is not a positive integer ({what})")
        return value
    return None


def model_from_hf_config(path: str | os.PathLike[str]) -> ModelSpec:
    """Derive the KV-cache geometry from a Hugging Face ``config.json``.

    Layers from ``num_hidden_layers``; MLA models (``kv_lora_rank`` set) give a latent cache of
    ``kv_lora_rank`` and a rope cache of ``qk_rope_head_dim`` elements per token (plus an indexer-key
    cache of ``index_head_dim`` when present, as in DeepSeek-V3.2 / GLM-5); other models give K and V
    of ``num_key_value_heads`` (default ``num_attention_heads``) x ``head_dim`` (default
    ``hidden_size / num_attention_heads``).  The dtype comes from ``torch_dtype`` (or ``dtype``):
    bfloat16, float16 or float32; bf16 when absent.  Multimodal configs are read through their
    ``text_config``.

    Parameters
    ----------
    path : str or os.PathLike
        A ``config.json`` file, or a model directory in the Hugging Face layout
        (``DIR/config.json``).

    Returns
    -------
    ModelSpec
        The model, with ``source`` the config file read.

    Raises
    ------
    ConfigError
        When the file cannot be read or lacks what the geometry needs (naming the key).
    """
    p = str(path)
    if os.path.isdir(p):
        candidate = os.path.join(p, "config.json")
        if not os.path.isfile(candidate):
            raise ConfigError(f"{p} is a directory without a config.json (a Hugging Face model "
                              "directory holds one); pass the config file or that directory")
        p = candidate
    try:
        with open(p, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{p} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: a config.json holds a JSON object, not {type(raw).__name__}")
    cfg: dict[str, Any] = raw
    for sub in ("text_config", "language_config", "llm_config"):
        if "num_hidden_layers" not in raw and isinstance(raw.get(sub), dict):
            cfg = raw[sub]
            break
    notes: list[str] = []
    layers = _positive_int(cfg, ("num_hidden_layers", "num_layers", "n_layer", "n_layers"), "layers", p)
    if layers is None:
        raise ConfigError(f"{p}: no num_hidden_layers (is this a transformer config.json?)")
    dtype_raw = cfg.get("torch_dtype") or cfg.get("dtype") or raw.get("torch_dtype") or raw.get("dtype")
    if dtype_raw is None:
        dtype = "bf16"
        notes.append("config has no torch_dtype; bf16 assumed")
    else:
        key = str(dtype_raw).lower().removeprefix("torch.")
        if key not in _HF_DTYPES:
            raise ConfigError(f"{p}: torch_dtype {dtype_raw!r} is not supported "
                              "(bfloat16, float16 or float32; override with --dtype)")
        dtype = _HF_DTYPES[key]
    name = str(raw.get("_name_or_path") or "").rstrip("/").split("/")[-1]
    if not name:
        parent = Path(p).resolve().parent.name
        name = parent or str(cfg.get("model_type") or "custom")
    source = p
    if cfg.get("kv_lora_rank"):
        rank = _positive_int(cfg, ("kv_lora_rank",), "MLA latent rank", p)
        rope = _positive_int(cfg, ("qk_rope_head_dim",), "MLA rope head dim", p)
        if rope is None:
            raise ConfigError(f"{p}: MLA config (kv_lora_rank set) without qk_rope_head_dim")
        index = _positive_int(cfg, ("index_head_dim",), "indexer key head dim", p) or 0
        assert rank is not None
        return ModelSpec(name, layers, "MLA", dtype=dtype, kv_lora_rank=rank, qk_rope_head_dim=rope,
                         index_head_dim=index, source=source, notes=tuple(notes))
    heads = _positive_int(cfg, ("num_attention_heads", "n_head", "num_heads"), "attention heads", p)
    kv_heads = _positive_int(cfg, ("num_key_value_heads", "multi_query_group_num", "n_head_kv"),
                             "KV heads", p)
    if kv_heads is None:
        if heads is None:
            raise ConfigError(f"{p}: neither num_key_value_heads nor num_attention_heads")
        kv_heads = 1 if cfg.get("multi_query") else heads
    head_dim = _positive_int(cfg, ("head_dim", "kv_channels"), "head dim", p)
    if head_dim is None:
        hidden = _positive_int(cfg, ("hidden_size", "n_embd", "d_model"), "hidden size", p)
        if hidden is None or heads is None:
            raise ConfigError(f"{p}: no head_dim, and hidden_size / num_attention_heads is not available")
        if hidden % heads:
            raise ConfigError(f"{p}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    if heads is not None and heads % kv_heads:
        raise ConfigError(f"{p}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    attention = "MHA" if heads == kv_heads else ("MQA" if kv_heads == 1 else "GQA")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window"):
        notes.append("sliding-window layers are treated as full attention")
    return ModelSpec(name, layers, attention, dtype=dtype, kv_heads=kv_heads, head_dim=head_dim,
                     source=source, notes=tuple(notes))
