"""``kvdd demo``: a prefill and a decode instance move a real model's KV cache, verified byte for byte.

What runs
---------
Two ``kvdd.LlmDataDist`` instances, *prefill* (cluster 1, ``LlmRole.PROMPT``) and *decode* (cluster 2,
``LlmRole.DECODER``), by default in two OS processes on loopback (the parent runs decode, a
``multiprocessing`` spawn child runs prefill).  Both derive the same cache geometry from a model
(:data:`MODELS` or a Hugging Face ``config.json``) and a workload (requests x tokens, block size).

* Prefill listens (``llm.ListenIpInfo``), allocates a paged cache (``[blocks, block_size, *token]``,
  one tensor per K and V of every layer, or one per layer for each MLA component) and a contiguous
  cache (``[requests, tokens, *token]``), fills both with deterministic position-dependent data
  (:class:`Pattern`: a bijective mix of (cache, tensor, request, token, word)), registers them and
  waits for decode on its control channel.
* Decode allocates its own caches, fills them with *its own* pattern, registers them, links, and runs
  five transfers: a paged block pull (PullKvBlocks, one request's random non-contiguous block table
  into random local blocks), a layer-by-layer pull (one PullKvBlocks per layer and cache, as a
  pipelined prefill streams it), a batch-row pull (PullKvCache of one contiguous row into another
  row), a prefix pull (PullKvCache with ``size`` = the first N tokens' bytes) and a push (prefill
  calls PushKvBlocks into decode's blocks).  After every transfer decode recomputes the expected
  bytes of *all* its cache memory (targets and everything else, guard bytes around every cache
  included) independently of prefill and compares; at the end prefill checks that its source caches
  are intact.  Then both unlink, finalize and exit 0; any error or mismatch exits 1 naming the
  transfer, cache, tensor (layer, K/V), block or row, token and byte, expected vs got.

Control channel
---------------
LLM-DataDist moves bytes; a serving system exchanges metadata (cache ids, block tables, who is ready)
over its own channel.  The demo's is one TCP connection, one JSON object per line, prefill listening
on ``--control-port`` (default: its LLM-DataDist port + 1, or a free port when that port is 0):

==========  =========  ===================================================================
direction   type       content
==========  =========  ===================================================================
D -> P      hello      protocol, geometry, seed, transfer backend, decode cluster id
P -> D      welcome    prefill cluster id, cache ids, the requests' block tables
D -> P      push       decode's cache ids, the request, destination blocks, listen address
P -> D      pushed     calls, bytes, seconds of the PushKvBlocks calls
D -> P      done       ok, error (decode finished: unlinked, about to finalize)
P -> D      bye        source_intact, error (prefill checked its caches; it then finalizes)
either      error      message (the sender gives up)
==========  =========  ===================================================================

Prefill finalizes only after ``done``, so the decode side never reads from a finalized peer.

Modes
-----
default: two processes; ``--role prefill|decode``: one side (two commands, or two hosts);
``--in-process`` (internal, for tests): both sides as two threads of one process.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from . import models as _models
from . import (
    OPTION_DEVICE_ID,
    OPTION_LISTEN_IP_INFO,
    OPTION_SYNC_CACHE_WAIT_TIME,
    OPTION_TRANSFER_BACKEND,
    Cache,
    CacheDesc,
    CacheIndex,
    CachePlacement,
    ClusterInfo,
    DataType,
    BackendUnavailableError,
    IpInfo,
    KvCacheExtParam,
    LLMError,
    LLMLinkFailedError,
    LlmDataDist,
    LlmRole,
    tensor_addrs,
)

__all__ = [
    "MODELS",
    "DTYPES",
    "CacheFamily",
    "ModelSpec",
    "Geometry",
    "ConfigError",
    "DemoError",
    "VerificationError",
    "DemoOptions",
    "DemoReport",
    "TransferResult",
    "Pattern",
    "CacheImage",
    "model_from_hf_config",
    "resolve_model",
    "run_demo",
    "run_prefill",
    "run_decode",
    "render_text",
    "add_demo_arguments",
    "options_from_args",
    "run_from_args",
    "main",
]

PROTOCOL = 1
JSON_SCHEMA = "kvdd.demo/1"
PREFILL_CLUSTER_ID = 1
DECODE_CLUSTER_ID = 2
#: llm.SyncKvCacheWaitTime (ms): per-transfer timeout; generous so that large caches over a slow
#: cross-process or cross-host link do not time out (the upstream default is 1000 ms).
SYNC_WAIT_MS = 60000
LINK_TIMEOUT_MS = 10000

Json = dict[str, Any]


# ---- errors -------------------------------------------------------------------------------------

class ConfigError(ValueError):
    """A model config (or a geometry argument) the demo cannot use."""


class DemoError(Exception):
    """The demo failed: ``transfer`` names the step, ``location`` (verification) where."""

    def __init__(self, message: str, *, transfer: str | None = None,
                 location: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.transfer = transfer
        self.location = dict(location) if location is not None else None

    def to_json(self) -> Json:
        return {"message": self.message, "transfer": self.transfer, "location": self.location}


class VerificationError(DemoError):
    """Bytes in a cache differ from what the verifier recomputed."""


# ---- models -------------------------------------------------------------------------------------

#: --dtype / torch_dtype names -> ge::DataType.
DTYPES: dict[str, DataType] = {"bf16": DataType.DT_BF16, "fp16": DataType.DT_FLOAT16,
                               "fp32": DataType.DT_FLOAT}
_HF_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
              "float32": "fp32", "fp32": "fp32", "float": "fp32"}


@dataclass(frozen=True)
class CacheFamily:
    """One kind of cache of a model: K and V of every layer (``tensors_per_layer`` 2) or one MLA
    component (latent, rope or indexer keys; ``tensors_per_layer`` 1)."""

    name: str
    tensors_per_layer: int
    token_shape: tuple[int, ...]  # elements per token per tensor, e.g. (kv_heads, head_dim)
    parts: tuple[str, ...]  # names of the tensors of one layer, e.g. ("K", "V")

    @property
    def token_elements(self) -> int:
        return math.prod(self.token_shape)


@dataclass(frozen=True)
class ModelSpec:
    """The KV-cache-relevant facts of a model (MODELS.md or a Hugging Face config)."""

    name: str
    layers: int
    attention: str  # "GQA", "MHA", "MQA" or "MLA"
    dtype: str = "bf16"  # a key of DTYPES
    kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0
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
        if self.attention != "MLA":
            return (CacheFamily("kv", 2, (self.kv_heads, self.head_dim), ("K", "V")),)
        fams = [CacheFamily("latent", 1, (self.kv_lora_rank,), ("latent",)),
                CacheFamily("rope", 1, (self.qk_rope_head_dim,), ("rope",))]
        if self.index_head_dim > 0:
            fams.append(CacheFamily("indexer", 1, (self.index_head_dim,), ("indexer",)))
        return tuple(fams)

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
    m.name: ModelSpec(m.name, m.layers, m.attention, kv_heads=m.kv_heads, head_dim=m.head_dim,
                      kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
                      index_head_dim=m.index_head_dim)
    for m in _models.MODELS.values()
}
_MODEL_ALIASES = _models.ALIASES
DEFAULT_MODEL = "Qwen2.5-7B"


def resolve_model(name: str) -> ModelSpec:
    """The built-in model called ``name`` (case-insensitive; e.g. ``deepseek-r1`` is DeepSeek-V3)."""
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
    ``text_config``.  Raises :class:`ConfigError` with the offending key.
    """
    p = str(path)
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
        return ModelSpec(name, layers, "MLA", dtype, kv_lora_rank=rank, qk_rope_head_dim=rope,
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
    return ModelSpec(name, layers, attention, dtype, kv_heads=kv_heads, head_dim=head_dim,
                     source=source, notes=tuple(notes))


# ---- geometry -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """Model x workload: every cache shape and byte count both sides derive from the CLI args.

    Prefill: a paged cache of ``requests x blocks_per_request`` blocks and a contiguous cache of
    ``requests`` rows, per family.  Decode: a paged pool of ``4 x blocks_per_request`` blocks (three
    requests' worth are written, the rest must stay untouched) and a contiguous cache of 3 rows (row
    pull target 1, prefix pull target 2, row 0 untouched).
    """

    model: ModelSpec
    requests: int = 4
    tokens: int = 1024
    block_size: int = 128

    def __post_init__(self) -> None:
        for name in ("requests", "tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name.replace('_', ' ')} must be a positive integer, got {value!r}")

    @property
    def data_type(self) -> DataType:
        return DTYPES[self.model.dtype]

    @property
    def np_dtype(self) -> np.dtype[Any]:
        dt = self.data_type.numpy_dtype
        assert dt is not None
        return dt

    @property
    def itemsize(self) -> int:
        bits = self.data_type.itemsize_bits
        assert bits is not None
        return bits // 8

    @property
    def families(self) -> tuple[CacheFamily, ...]:
        return self.model.families

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def prefill_blocks(self) -> int:
        return self.requests * self.blocks_per_request

    @property
    def decode_blocks(self) -> int:
        return 4 * self.blocks_per_request

    decode_rows = 3

    @property
    def prefix_tokens(self) -> int:
        """Tokens of the prefix pull: about 5/8 of a row, deliberately not block-aligned."""
        return min(self.tokens, max(1, self.tokens * 5 // 8 + 3))

    def num_tensors(self, fam: CacheFamily) -> int:
        return self.model.layers * fam.tensors_per_layer

    def token_bytes(self, fam: CacheFamily) -> int:
        return fam.token_elements * self.itemsize

    def block_bytes(self, fam: CacheFamily) -> int:
        return self.block_size * self.token_bytes(fam)

    def row_bytes(self, fam: CacheFamily) -> int:
        return self.tokens * self.token_bytes(fam)

    def side_bytes(self, side: str) -> int:
        """Registered cache bytes of one side (``"prefill"`` or ``"decode"``)."""
        blocks, rows = ((self.prefill_blocks, self.requests) if side == "prefill"
                        else (self.decode_blocks, self.decode_rows))
        return sum(self.num_tensors(f) * (blocks * self.block_bytes(f) + rows * self.row_bytes(f))
                   for f in self.families)

    def to_json(self) -> Json:
        caches = []
        for f in self.families:
            n = self.num_tensors(f)
            caches.append({
                "family": f.name, "num_tensors": n, "tensor_num_per_layer": f.tensors_per_layer,
                "token_shape": list(f.token_shape), "bytes_per_token_per_tensor": self.token_bytes(f),
                "bytes_per_block_per_tensor": self.block_bytes(f), "bytes_per_row_per_tensor": self.row_bytes(f),
                "paged_shape": {"prefill": [self.prefill_blocks, self.block_size, *f.token_shape],
                                "decode": [self.decode_blocks, self.block_size, *f.token_shape]},
                "contiguous_shape": {"prefill": [self.requests, self.tokens, *f.token_shape],
                                     "decode": [self.decode_rows, self.tokens, *f.token_shape]},
            })
        return {"model": self.model.to_json(), "requests": self.requests, "tokens": self.tokens,
                "block_size": self.block_size, "blocks_per_request": self.blocks_per_request,
                "prefix_tokens": self.prefix_tokens, "data_type": self.data_type.name,
                "caches": caches, "prefill_bytes": self.side_bytes("prefill"),
                "decode_bytes": self.side_bytes("decode")}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Geometry:
        return cls(ModelSpec.from_json(doc["model"]), int(doc["requests"]), int(doc["tokens"]),
                   int(doc["block_size"]))

    def agreement_key(self) -> Json:
        """What both sides must agree on (the model's name and source may differ)."""
        doc = self.to_json()
        doc["model"] = {k: v for k, v in doc["model"].items() if k not in ("name", "source", "notes")}
        return doc


# ---- deterministic data -------------------------------------------------------------------------

_M1 = np.uint64(0x9E3779B97F4A7C15)
_S32 = np.uint64(32)
_U64 = (1 << 64) - 1

# Stream kinds: each (side, family, kind, tensor) is its own stream of words.
K_TOKEN = 0  # prefill: a request's tokens (shared by the paged and contiguous layouts)
K_PAD = 1  # prefill: paged-block slots past the end of a request
K_INIT_PAGED = 2  # a side's own initial data in its paged cache (decode)
K_INIT_CONTIG = 3
K_GUARD = 4  # guard bytes around a cache's memory
SIDE_PREFILL = 0
SIDE_DECODE = 1


def stream_base(side: int, fam_index: int, kind: int, tensor: int) -> int:
    """First input of a stream; positions inside a stream are < 2**40 words."""
    return ((((side * 8 + fam_index) * 8 + kind) << 16) + tensor) << 40


def _mix_int(x: int) -> int:
    x = (x * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _U64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _U64
    return x ^ (x >> 32)


class Pattern:
    """Word ``k`` of a stream starting at ``start`` is ``mix(start + k + key)``: a bijection of 64-bit
    inputs (an odd multiply and an xorshift; ``key`` derives from the seed), truncated to the word
    size.  So two different positions never hold the same 64-bit word, and any byte is recomputable
    from its position alone.  Vectorized in L2-sized chunks (GB/s); not thread-safe (scratch)."""

    CHUNK = 1 << 15

    def __init__(self, seed: int) -> None:
        self.key = _mix_int(seed)
        self._ar = np.arange(self.CHUNK, dtype=np.uint64)
        self._x = np.empty(self.CHUNK, np.uint64)
        self._t = np.empty(self.CHUNK, np.uint64)
        self._ne = np.empty(self.CHUNK, np.bool_)
        self._w: dict[np.dtype[Any], NDArray[Any]] = {}

    def _gen(self, start: int, m: int, out: NDArray[np.uint64] | None = None) -> NDArray[np.uint64]:
        # word(p) = h ^ (h >> 32) with h = (p + key) * M (mod 2**64): each step is a bijection.
        x = self._x[:m] if out is None else out
        t = self._t[:m]
        np.add(self._ar[:m], np.uint64((start + self.key) & _U64), out=x)
        np.multiply(x, _M1, out=x)
        np.right_shift(x, _S32, out=t)
        np.bitwise_xor(x, t, out=x)
        return x

    def _gen_as(self, start: int, m: int, dtype: np.dtype[Any]) -> NDArray[Any]:
        x = self._gen(start, m)
        if dtype == np.uint64:
            return x
        w = self._w.get(dtype)
        if w is None:
            w = self._w[dtype] = np.empty(self.CHUNK, dtype)
        np.copyto(w[:m], x, casting="unsafe")  # keep the low bytes
        return w[:m]

    def fill(self, out: NDArray[Any], start: int) -> None:
        """``out[k] = word(start + k)`` (``out``: a 1-D contiguous view of unsigned words)."""
        direct = out.dtype == np.uint64
        for s in range(0, out.size, self.CHUNK):
            m = min(self.CHUNK, out.size - s)
            if direct:
                self._gen(start + s, m, out[s:s + m])
            else:
                np.copyto(out[s:s + m], self._gen_as(start + s, m, out.dtype), casting="unsafe")

    def expected(self, start: int, count: int, dtype: np.dtype[Any]) -> NDArray[Any]:
        out = np.empty(count, dtype)
        self.fill(out, start)
        return out

    def first_mismatch(self, view: NDArray[Any], start: int) -> int | None:
        """Index of the first word of ``view`` that is not ``word(start + k)``, or None."""
        for s in range(0, view.size, self.CHUNK):
            m = min(self.CHUNK, view.size - s)
            ne = np.not_equal(view[s:s + m], self._gen_as(start + s, m, view.dtype), out=self._ne[:m])
            if ne.any():
                return s + int(np.argmax(ne))
        return None


def _word_dtype(token_bytes: int) -> np.dtype[Any]:
    for size, name in ((8, "uint64"), (4, "uint32"), (2, "uint16")):
        if token_bytes % size == 0:
            return np.dtype(name)
    return np.dtype("uint8")


# ---- cache memory + what it must contain --------------------------------------------------------

Run = tuple[int, int, int]  # (word offset in the unit, words, stream input of the first word)


@dataclass
class UnitExpect:
    """What one block (paged) or row (contiguous) of one tensor must hold, and where it came from."""

    runs: list[Run]
    source: str


class CacheImage:
    """One registered cache of one side: its memory (``GUARD`` bytes, ``n`` tensors back to back,
    ``GUARD`` bytes, in one allocation) and the expected content of every block or row of every
    tensor.  ``units`` are blocks (``layout == "paged"``) or batch rows (``"contiguous"``)."""

    GUARD = 4096

    def __init__(self, side: str, geom: Geometry, fam_index: int, layout: str, units: int,
                 placement: int = CachePlacement.DEVICE) -> None:
        self.side = side
        self.side_code = SIDE_PREFILL if side == "prefill" else SIDE_DECODE
        self.geom = geom
        self.fam_index = fam_index
        self.fam = fam = geom.families[fam_index]
        self.layout = layout
        self.name = f"{fam.name}/{layout}"
        self.units = units
        self.unit_tokens = geom.block_size if layout == "paged" else geom.tokens
        self.n = geom.num_tensors(fam)
        self.token_bytes = geom.token_bytes(fam)
        self.unit_bytes = self.unit_tokens * self.token_bytes
        self.tensor_bytes = units * self.unit_bytes
        self.word = _word_dtype(self.token_bytes)
        self.token_words = self.token_bytes // self.word.itemsize
        self.unit_words = self.unit_bytes // self.word.itemsize
        g = self.GUARD
        self.buf = np.empty(2 * g + self.n * self.tensor_bytes, np.uint8)
        body = self.buf[g:g + self.n * self.tensor_bytes]
        shape = (units, self.unit_tokens, *fam.token_shape)
        self.array = body.view(geom.np_dtype).reshape((self.n, *shape))
        self.words = body.view(self.word).reshape(self.n, units, self.unit_words)
        self.guards = (self.buf[:g], self.buf[g + self.n * self.tensor_bytes:])
        self.desc = CacheDesc(num_tensors=self.n, data_type=geom.data_type, shape=shape, placement=placement)
        self.cache_id = -1
        self.cache = Cache()
        init_kind = K_INIT_PAGED if layout == "paged" else K_INIT_CONTIG
        self.expect: list[list[UnitExpect]] = [
            [UnitExpect([(0, self.unit_words, stream_base(self.side_code, fam_index, init_kind, i)
                          + u * self.unit_words)], f"{side}'s own initial data")
             for u in range(units)]
            for i in range(self.n)]

    @property
    def nbytes(self) -> int:
        return self.n * self.tensor_bytes

    def tensors(self) -> list[NDArray[Any]]:
        return [self.array[i] for i in range(self.n)]

    def _guard_start(self, which: int) -> int:
        return stream_base(self.side_code, self.fam_index, K_GUARD, 2 * (self.layout == "paged") + which)

    def tensor_runs(self, i: int) -> Iterator[tuple[int, int, int, int]]:
        """``(unit, word offset in the tensor, words, stream input)`` of tensor ``i``, adjacent runs of
        one stream merged (so decode's own data and prefill rows are one run per tensor)."""
        cur: list[int] | None = None  # [unit, offset, count, start]
        uw = self.unit_words
        for u, ue in enumerate(self.expect[i]):
            for off, cnt, start in ue.runs:
                pos = u * uw + off
                if cur is not None and cur[1] + cur[2] == pos and cur[3] + cur[2] == start:
                    cur[2] += cnt
                    continue
                if cur is not None:
                    yield cur[0], cur[1], cur[2], cur[3]
                cur = [u, pos, cnt, start]
        if cur is not None:
            yield cur[0], cur[1], cur[2], cur[3]

    def fill(self, pattern: Pattern) -> None:
        for which, guard in enumerate(self.guards):
            pattern.fill(guard, self._guard_start(which))
        flat = self.words.reshape(self.n, -1)
        for i in range(self.n):
            for _u, pos, cnt, start in self.tensor_runs(i):
                pattern.fill(flat[i, pos:pos + cnt], start)

    def registered(self, cache_id: int, addrs: Sequence[int]) -> None:
        self.cache_id = cache_id
        self.cache = Cache(cache_id=cache_id, tensor_addrs=tuple(addrs), cache_desc=self.desc)

    def tensor_label(self, i: int) -> str:
        t = self.fam.tensors_per_layer
        return f"tensor {i} (layer {i // t} {self.fam.parts[i % t]})"

    def unit_label(self, u: int) -> str:
        return f"block {u}" if self.layout == "paged" else f"row {u}"

    def verify(self, pattern: Pattern, targets: set[tuple[str, int, int]], step: str) -> int:
        """Compare all memory (guards included) with the expectation; raise on the first mismatch.

        ``targets``: ``(cache name, tensor, unit)`` the step wrote (for the message).  Returns bytes
        checked.
        """
        for which, guard in enumerate(self.guards):
            k = pattern.first_mismatch(guard, self._guard_start(which))
            if k is not None:
                got = bytes(guard[k:k + 8])
                exp = bytes(pattern.expected(self._guard_start(which) + k, 8, np.dtype(np.uint8)))
                where = "before" if which == 0 else "after"
                raise VerificationError(
                    f"{step}: {self.side} cache '{self.name}' (id {self.cache_id}): guard byte {k} "
                    f"{where} the cache memory changed (expected {exp.hex()}, got {got.hex()}): "
                    "something wrote outside the registered tensors",
                    transfer=step, location={"side": self.side, "cache": self.name, "cache_id": self.cache_id,
                                             "guard": where, "byte": k, "expected": exp.hex(), "got": got.hex()})
        flat = self.words.reshape(self.n, -1)
        uw = self.unit_words
        for i in range(self.n):
            for _u, pos, cnt, start in self.tensor_runs(i):
                k = pattern.first_mismatch(flat[i, pos:pos + cnt], start)
                if k is not None:
                    # locate the unit run holding word pos + k and report from there
                    word = pos + k
                    u = word // uw
                    for off, rcnt, rstart in self.expect[i][u].runs:
                        if off <= word - u * uw < off + rcnt:
                            self._raise_mismatch(pattern, i, u, off, rcnt, rstart, word - u * uw - off,
                                                 targets, step)
                    raise AssertionError("unreachable: mismatch outside every run")
        return self.nbytes + 2 * self.GUARD

    def _raise_mismatch(self, pattern: Pattern, i: int, u: int, off: int, cnt: int, start: int,
                        k: int, targets: set[tuple[str, int, int]], step: str) -> None:
        view = self.words[i, u]
        exp_run = pattern.expected(start, cnt, self.word)
        got_run = view[off:off + cnt]
        differing = int(np.count_nonzero(exp_run.view(np.uint8) != got_run.view(np.uint8)))
        w = self.word.itemsize
        first = int(np.argmax(exp_run[k:k + 1].view(np.uint8) != got_run[k:k + 1].view(np.uint8)))
        byte_in_unit = (off + k) * w + first  # the first differing byte
        token = byte_in_unit // self.token_bytes
        elem = (byte_in_unit % self.token_bytes) // self.geom.itemsize
        exp_b = exp_run.view(np.uint8)[k * w + first:k * w + first + 8].tobytes()
        got_b = got_run.view(np.uint8)[k * w + first:k * w + first + 8].tobytes()
        in_target = (self.name, i, u) in targets
        src = self.expect[i][u].source
        if in_target:
            what = f"a target of this step, should hold {src}"
        else:
            what = f"outside this step's targets, should still hold {src}"
        loc = {"side": self.side, "cache": self.name, "cache_id": self.cache_id, "tensor": i,
               "layer": i // self.fam.tensors_per_layer, "part": self.fam.parts[i % self.fam.tensors_per_layer],
               "block" if self.layout == "paged" else "row": u, "token": token, "element": elem,
               "byte_in_tensor": u * self.unit_bytes + byte_in_unit, "expected": exp_b.hex(),
               "got": got_b.hex(), "differing_bytes_in_unit": differing, "in_target": in_target,
               "should_hold": src}
        raise VerificationError(
            f"{step}: {self.side} cache '{self.name}' (id {self.cache_id}) {self.tensor_label(i)} "
            f"{self.unit_label(u)}, token {token} element {elem} (byte {u * self.unit_bytes + byte_in_unit} "
            f"of the tensor): expected {exp_b.hex()} got {got_b.hex()}; {differing} of {self.unit_bytes} "
            f"bytes of this {'block' if self.layout == 'paged' else 'row'} differ; it is {what}",
            transfer=step, location=loc)


def _prefill_block_expect(geom: Geometry, fam_index: int, i: int, p: int,
                          owner: Mapping[int, tuple[int, int]], token_words: int) -> UnitExpect:
    r, j = owner[p]
    bs = geom.block_size
    valid = min(bs, geom.tokens - j * bs)
    runs: list[Run] = [(0, valid * token_words,
                        stream_base(SIDE_PREFILL, fam_index, K_TOKEN, i) + (r * geom.tokens + j * bs) * token_words)]
    if valid < bs:
        runs.append((valid * token_words, (bs - valid) * token_words,
                     stream_base(SIDE_PREFILL, fam_index, K_PAD, i) + (p * bs + valid) * token_words))
    return UnitExpect(runs, f"prefill block {p} (request {r} tokens {j * bs}-{j * bs + valid - 1})")


def _prefill_row_expect(geom: Geometry, fam_index: int, i: int, r: int, token_words: int,
                        tokens: int | None = None) -> list[Run]:
    n = geom.tokens if tokens is None else tokens
    return [(0, n * token_words, stream_base(SIDE_PREFILL, fam_index, K_TOKEN, i) + r * geom.tokens * token_words)]


def _owner_map(block_tables: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    return {int(p): (r, j) for r, table in enumerate(block_tables) for j, p in enumerate(table)}


# ---- progress -----------------------------------------------------------------------------------

class Progress:
    """Step lines on stderr (``kvdd demo [decode] ...``) when enabled."""

    def __init__(self, enabled: bool, role: str, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.role = role
        self.stream = stream

    def __call__(self, message: str) -> None:
        if self.enabled:
            out = self.stream or sys.stderr
            print(f"kvdd demo [{self.role}] {message}", file=out, flush=True)

    @contextmanager
    def step(self, message: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self(f"{message} ...")
        yield
        self(f"{message}: done in {time.perf_counter() - t0:.2f} s")


# ---- options ------------------------------------------------------------------------------------

Address = tuple[str, int]


@dataclass(frozen=True)
class DemoOptions:
    """Everything one run needs (both sides derive the same geometry from the same options)."""

    geometry: Geometry
    backend: str = "sim"  # "sim", "native" or "auto" (API.md's backend=None rule)
    transfer_backend: str = "comm"  # "comm" (HCCL, default) or "hixl"
    seed: int = 0
    timeout: float = 60.0  # seconds one side waits for the other
    listen: Address = ("127.0.0.1", 0)  # prefill's llm.ListenIpInfo
    control_port: int | None = None  # prefill's control port; None: listen port + 1 (0 when that is 0)
    connect: Address | None = None  # decode: the prefill's LLM-DataDist address
    decode_listen: Address | None = None  # decode's llm.ListenIpInfo (hixl); None: its control-socket IP, port 0
    progress: bool = False

    @property
    def backend_arg(self) -> str | None:
        return None if self.backend == "auto" else self.backend

    def prefill_control_port(self) -> int:
        if self.control_port is not None:
            return self.control_port
        return self.listen[1] + 1 if self.listen[1] else 0

    def decode_control_address(self) -> Address:
        assert self.connect is not None
        if self.control_port is not None:
            return (self.connect[0], self.control_port)
        if not self.connect[1]:
            raise DemoError("--connect needs the prefill's real port (not 0)")
        return (self.connect[0], self.connect[1] + 1)


def _datadist_options(listen: Address | None, transfer_backend: str) -> dict[str, str]:
    opts = {OPTION_DEVICE_ID: "0", OPTION_SYNC_CACHE_WAIT_TIME: str(SYNC_WAIT_MS)}
    if listen is not None:
        host = f"[{listen[0]}]" if ":" in listen[0] else listen[0]
        opts[OPTION_LISTEN_IP_INFO] = f"{host}:{listen[1]}"
    if transfer_backend == "hixl":
        opts[OPTION_TRANSFER_BACKEND] = "hixl"
    return opts


def _placement(dd: LlmDataDist) -> int:
    # The simulator keeps caches in host memory whatever the placement says.  On a real node the
    # demo's numpy arrays are host memory, so it registers them as HOST there.
    return CachePlacement.HOST if dd.backend_name == "native" else CachePlacement.DEVICE


def _ipv4(host: str) -> str:
    """An IPv4 literal for ``host`` (ClusterInfo takes IPv4 literals only, SEMANTICS.md §3.5)."""
    try:
        socket.inet_pton(socket.AF_INET, host)
        return host
    except OSError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        raise DemoError(f"cannot resolve {host!r} to an IPv4 address (LLM-DataDist links need IPv4)") from None


def _allocate(side: str, dd: LlmDataDist, geom: Geometry) -> tuple[list[CacheImage], list[CacheImage]]:
    """Allocate, fill and register one side's paged and contiguous caches (all before any link:
    a cache registered after a link is not visible over it, SEMANTICS.md §2.4)."""
    placement = _placement(dd)
    blocks, rows = ((geom.prefill_blocks, geom.requests) if side == "prefill"
                    else (geom.decode_blocks, geom.decode_rows))
    paged = [CacheImage(side, geom, f, "paged", blocks, placement) for f in range(len(geom.families))]
    contig = [CacheImage(side, geom, f, "contiguous", rows, placement) for f in range(len(geom.families))]
    return paged, contig


def _fill_and_register(dd: LlmDataDist, images: Sequence[CacheImage], pattern: Pattern, log: Progress) -> None:
    total = sum(img.nbytes for img in images)
    with log.step(f"filling {len(images)} caches, {_mib(total)}"):
        for img in images:
            img.fill(pattern)
    for img in images:
        addrs = tensor_addrs(img.tensors())
        img.registered(dd.register_kv_cache(img.desc, addrs), addrs)
    log(f"registered {', '.join(f'{img.name}=id {img.cache_id}' for img in images)}")


# ---- control channel ----------------------------------------------------------------------------

class Control:
    """One line-delimited JSON connection between the two sides."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        sock.settimeout(timeout)
        self._r = sock.makefile("rb")

    def send(self, msg: Json) -> None:
        try:
            self.sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        except OSError as exc:
            raise DemoError(f"lost the control connection to the {self.peer} side ({exc})") from None

    def recv(self, *expected: str) -> Json:
        try:
            line = self._r.readline()
        except socket.timeout:
            raise DemoError(f"the {self.peer} side did not answer within {self.timeout:g} s "
                            "(control channel)") from None
        except OSError as exc:
            raise DemoError(f"lost the control connection to the {self.peer} side ({exc})") from None
        if not line:
            raise DemoError(f"the {self.peer} side closed the control connection unexpectedly "
                            "(see its output for why)")
        try:
            msg = json.loads(line)
        except ValueError:
            raise DemoError(f"the {self.peer} side sent a malformed control message: {line[:80]!r}") from None
        if not isinstance(msg, dict):
            raise DemoError(f"the {self.peer} side sent a malformed control message: {line[:80]!r}")
        kind = msg.get("type")
        if kind == "error":
            raise DemoError(f"{self.peer} side failed: {msg.get('message')}")
        if kind not in expected:
            raise DemoError(f"control protocol: expected {' or '.join(expected)} from the {self.peer} "
                            f"side, got {kind!r}")
        return msg

    def close(self) -> None:
        try:
            self._r.close()
            self.sock.close()
        except OSError:
            pass


def _send_error(ctl: Control | None, exc: BaseException) -> None:
    if ctl is None:
        return
    try:
        ctl.send({"type": "error", "message": str(exc)})
    except DemoError:
        pass


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _mib(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


# ---- prefill ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReadyInfo:
    """Where a running prefill side can be reached."""

    listen: Address
    control: Address

    def to_json(self) -> Json:
        return {"listen": f"{self.listen[0]}:{self.listen[1]}", "control": f"{self.control[0]}:{self.control[1]}"}


def run_prefill(opts: DemoOptions, on_ready: Callable[[ReadyInfo], None] | None = None,
                log: Progress | None = None, cancel: threading.Event | None = None) -> Json:
    """The prefill side: listen, register and fill, serve one decode side; return a summary.

    ``on_ready`` is called once the caches are registered and both the LLM-DataDist listener and the
    control channel accept connections; setting ``cancel`` stops waiting for a decode side.  Raises
    :class:`DemoError` (or ``LLMError``) on failure, after telling the decode side when it is
    connected.
    """
    log = log or Progress(False, "prefill")
    geom = opts.geometry
    pattern = Pattern(opts.seed)
    rng = np.random.default_rng([opts.seed, 1])
    ctl: Control | None = None
    server: socket.socket | None = None
    result: Json = {"role": "prefill", "cluster_id": PREFILL_CLUSTER_ID}
    try:
        with LlmDataDist(PREFILL_CLUSTER_ID, LlmRole.PROMPT, backend=opts.backend_arg) as dd:
            dd.initialize(_datadist_options(opts.listen, opts.transfer_backend))
            port = dd.listen_port
            assert port is not None
            listen = (opts.listen[0], port)
            paged, contig = _allocate("prefill", dd, geom)
            # Each request's block table: random, non-contiguous physical blocks of the pool.
            tables = rng.permutation(geom.prefill_blocks).reshape(geom.requests, geom.blocks_per_request)
            block_tables = [[int(b) for b in row] for row in tables]
            owner = _owner_map(block_tables)
            for img in paged:
                for i in range(img.n):
                    for p in range(img.units):
                        img.expect[i][p] = _prefill_block_expect(geom, img.fam_index, i, p, owner, img.token_words)
            for img in contig:
                for i in range(img.n):
                    for r in range(img.units):
                        img.expect[i][r] = UnitExpect(_prefill_row_expect(geom, img.fam_index, i, r, img.token_words),
                                                      f"prefill row {r} (request {r})")
            t0 = time.perf_counter()
            _fill_and_register(dd, [*paged, *contig], pattern, log)
            result["setup_seconds"] = time.perf_counter() - t0

            family = socket.AF_INET6 if ":" in opts.listen[0] else socket.AF_INET
            server = socket.socket(family, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind((opts.listen[0], opts.prefill_control_port()))
            except OSError as exc:
                raise DemoError(f"cannot listen for the control channel on {opts.listen[0]}:"
                                f"{opts.prefill_control_port()}: {exc.strerror or exc} (choose --control-port)") from None
            server.listen(1)
            ready = ReadyInfo(listen, (opts.listen[0], server.getsockname()[1]))
            result.update(ready.to_json())
            log(f"LLM-DataDist listening on {ready.to_json()['listen']}, control channel on "
                f"{ready.to_json()['control']}; waiting for decode")
            if on_ready is not None:
                on_ready(ready)
            conn, peer_addr = _accept(server, opts.timeout, cancel)
            server.close()
            server = None
            ctl = Control(conn, "decode", opts.timeout)
            hello = ctl.recv("hello")
            if hello.get("protocol") != PROTOCOL:
                raise DemoError(f"decode speaks control protocol {hello.get('protocol')}, prefill {PROTOCOL}")
            theirs = Geometry.from_json(hello["geometry"])
            if theirs.agreement_key() != geom.agreement_key() or hello.get("seed") != opts.seed:
                raise DemoError(_disagreement(geom, theirs, opts.seed, hello.get("seed")))
            if hello.get("transfer_backend") != opts.transfer_backend:
                raise DemoError(f"decode uses transfer backend {hello.get('transfer_backend')}, "
                                f"prefill {opts.transfer_backend}: pass the same --transfer-backend to both")
            decode_id = int(hello["cluster_id"])
            log(f"decode cluster {decode_id} connected from {peer_addr[0]}")
            ctl.send({"type": "welcome", "cluster_id": PREFILL_CLUSTER_ID,
                      "caches": {img.fam.name: {"paged": paged[k].cache_id, "contiguous": contig[k].cache_id}
                                 for k, img in enumerate(paged)},
                      "block_tables": block_tables})
            while True:
                msg = ctl.recv("push", "done")
                if msg["type"] == "done":
                    break
                result["push"] = _serve_push(dd, opts, paged, block_tables, msg, log)
                ctl.send({"type": "pushed", **result["push"]})
            result["decode_ok"] = bool(msg.get("ok"))
            result["decode_error"] = msg.get("error")
            # Pulls only read the source and the push reads it too: it must be exactly as filled.
            step = "prefill source check"
            intact = True
            error: str | None = None
            try:
                with log.step("checking the source caches are intact"):
                    for img in (*paged, *contig):
                        img.verify(pattern, set(), step)
            except VerificationError as exc:
                intact = False
                error = exc.message
            result["source_intact"] = intact
            try:
                ctl.send({"type": "bye", "source_intact": intact, "error": error})
            except DemoError:
                if result["decode_ok"]:
                    raise  # a failed decode side may have gone already
            if error is not None:
                raise VerificationError(error, transfer=step)
            if not result["decode_ok"]:
                raise DemoError(f"decode side failed: {result['decode_error']}")
        log("finalized")
        return result
    except BaseException as exc:
        _send_error(ctl, exc)
        raise
    finally:
        if server is not None:
            server.close()
        if ctl is not None:
            ctl.close()


def _accept(server: socket.socket, timeout: float, cancel: threading.Event | None) -> tuple[socket.socket, Any]:
    deadline = time.monotonic() + timeout
    server.settimeout(0.2)
    while True:
        try:
            conn, addr = server.accept()
            conn.settimeout(None)
            return conn, addr
        except socket.timeout:
            pass
        if cancel is not None and cancel.is_set():
            raise DemoError("the decode side gave up before connecting")
        if time.monotonic() >= deadline:
            raise DemoError(f"no decode side connected within {timeout:g} s")


def _serve_push(dd: LlmDataDist, opts: DemoOptions, paged: Sequence[CacheImage],
                block_tables: Sequence[Sequence[int]], msg: Mapping[str, Any], log: Progress) -> Json:
    """PushKvBlocks one request's blocks into the decode blocks named in ``msg``."""
    decode_id = int(msg["cluster_id"])
    req = int(msg["request"])
    src = list(block_tables[req])
    dst = [int(b) for b in msg["dst_blocks"]]
    linked: ClusterInfo | None = None
    if opts.transfer_backend == "hixl":
        # hixl links are one-way (SEMANTICS.md §2.3): to write into decode, prefill links to it.
        host, port = str(msg["listen"][0]), int(msg["listen"][1])
        linked = ClusterInfo(remote_cluster_id=decode_id, remote_role_type=LlmRole.DECODER,
                             local_ip_infos=(IpInfo(_ipv4(opts.listen[0])),), remote_ip_infos=(IpInfo(host, port),))
        dd.link_llm_clusters([linked], timeout_ms=LINK_TIMEOUT_MS)
        log(f"linked to decode at {host}:{port} for the push (hixl links are one-way)")
    calls = 0
    nbytes = 0
    t0 = time.perf_counter()
    for img in paged:
        dst_id = int(msg["caches"][img.fam.name])
        # Push reads num_tensors and placement from the src Cache struct (§3.12); upstream requires
        # DEVICE there whatever the registration said.
        src_cache = Cache(cache_id=img.cache_id, tensor_addrs=img.cache.tensor_addrs,
                          cache_desc=replace(img.desc, placement=CachePlacement.DEVICE))
        # All layers, but with this cache's tensors per layer: the default ext_param assumes K,V
        # pairs (2), which rejects (or mis-plans) a one-tensor-per-layer MLA cache (§3.12 step 6).
        ext = KvCacheExtParam(tensor_num_per_layer=img.fam.tensors_per_layer)
        dd.push_kv_blocks(src_cache, CacheIndex(decode_id, dst_id), src, dst, ext)
        calls += 1
        nbytes += img.n * len(src) * img.unit_bytes
    seconds = time.perf_counter() - t0
    if linked is not None:
        dd.unlink_llm_clusters([linked], timeout_ms=LINK_TIMEOUT_MS)
    log(f"pushed request {req}: {_mib(nbytes)} in {seconds * 1e3:.1f} ms")
    return {"calls": calls, "bytes": nbytes, "seconds": seconds, "src_blocks": src, "dst_blocks": dst}


def _disagreement(mine: Geometry, theirs: Geometry, my_seed: int, their_seed: object) -> str:
    a, b = mine.agreement_key(), theirs.agreement_key()
    diffs = []
    for key in ("requests", "tokens", "block_size"):
        if a[key] != b[key]:
            diffs.append(f"{key} prefill={a[key]} decode={b[key]}")
    for key in sorted(set(a["model"]) | set(b["model"])):
        if a["model"].get(key) != b["model"].get(key):
            diffs.append(f"model {key} prefill={a['model'].get(key)} decode={b['model'].get(key)}")
    if my_seed != their_seed:
        diffs.append(f"seed prefill={my_seed} decode={their_seed}")
    return ("the two sides disagree on the geometry (pass the same --model/--model-config, --requests, "
            "--tokens, --block-size, --dtype, --seed or --quick to both): " + "; ".join(diffs or ["?"]))


# ---- decode -------------------------------------------------------------------------------------

@dataclass
class TransferResult:
    """One row of the report."""

    name: str
    api: str
    what: str
    calls: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    verified: bool = False
    checked_bytes: int = 0
    error: str | None = None

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and self.bytes else None

    def to_json(self) -> Json:
        return {"name": self.name, "api": self.api, "what": self.what, "calls": self.calls,
                "tensors": self.tensors, "bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps,
                "verified": self.verified, "checked_bytes": self.checked_bytes, "error": self.error}


@dataclass
class DemoReport:
    """The outcome of a run (or of the decode side of one)."""

    options: DemoOptions
    mode: str  # "processes", "threads" or "decode" (--role decode)
    backend_name: str = ""
    transfers: list[TransferResult] = field(default_factory=list)
    error: DemoError | None = None
    source_intact: bool | None = None
    prefill: Json = field(default_factory=dict)
    setup_seconds: float = 0.0
    wall_seconds: float = 0.0
    prefill_address: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and all(t.verified for t in self.transfers) and bool(self.transfers) \
            and self.source_intact is True

    def to_json(self) -> Json:
        moved = sum(t.bytes for t in self.transfers)
        return {
            "schema": JSON_SCHEMA,
            "ok": self.ok,
            "mode": self.mode,
            "backend": self.backend_name or self.options.backend,
            "transfer_backend": self.options.transfer_backend,
            "seed": self.options.seed,
            "geometry": self.options.geometry.to_json(),
            "prefill": {"cluster_id": PREFILL_CLUSTER_ID, "address": self.prefill_address, **{
                k: v for k, v in self.prefill.items() if k in ("setup_seconds", "push", "source_intact")}},
            "decode": {"cluster_id": DECODE_CLUSTER_ID, "setup_seconds": self.setup_seconds},
            "transfers": [t.to_json() for t in self.transfers],
            "summary": {"transfers": len(self.transfers), "verified": sum(t.verified for t in self.transfers),
                        "bytes": moved, "transfer_seconds": sum(t.seconds for t in self.transfers),
                        "checked_bytes": sum(t.checked_bytes for t in self.transfers),
                        "source_intact": self.source_intact, "wall_seconds": self.wall_seconds},
            "error": None if self.error is None else self.error.to_json(),
        }


class _Decode:
    """The decode side's state during a run."""

    def __init__(self, opts: DemoOptions, dd: LlmDataDist, report: DemoReport, log: Progress) -> None:
        self.opts = opts
        self.geom = opts.geometry
        self.dd = dd
        self.report = report
        self.log = log
        self.pattern = Pattern(opts.seed)
        self.paged, self.contig = _allocate("decode", dd, self.geom)
        rng = np.random.default_rng([opts.seed, 2])
        bpr = self.geom.blocks_per_request
        # Decode's block allocations for the three block transfers: random, non-contiguous ids of
        # its own pool (a request's blocks rarely land on the same ids as on prefill).
        picks = rng.permutation(self.geom.decode_blocks)[:3 * bpr]
        self.alloc = [[int(b) for b in picks[k * bpr:(k + 1) * bpr]] for k in range(3)]
        self.ctl: Control | None = None
        self.prefill_id = 0
        self.remote_ids: dict[str, dict[str, int]] = {}
        self.block_tables: list[list[int]] = []
        self.owner: dict[int, tuple[int, int]] = {}

    def attach(self, ctl: Control, welcome: Json) -> None:
        """Take the prefill's cluster id, cache ids and block tables from its welcome message."""
        self.ctl = ctl
        self.prefill_id = int(welcome["cluster_id"])
        self.remote_ids = {str(k): {"paged": int(v["paged"]), "contiguous": int(v["contiguous"])}
                           for k, v in welcome["caches"].items()}
        self.block_tables = [[int(b) for b in row] for row in welcome["block_tables"]]
        if (len(self.block_tables) != self.geom.requests
                or any(len(t) != self.geom.blocks_per_request for t in self.block_tables)
                or set(self.remote_ids) != {f.name for f in self.geom.families}):
            raise DemoError("the prefill's caches or block tables do not match the geometry")
        self.owner = _owner_map(self.block_tables)

    @property
    def images(self) -> list[CacheImage]:
        return [*self.paged, *self.contig]

    def _remote(self, img: CacheImage, batch_index: int = 0) -> CacheIndex:
        return CacheIndex(self.prefill_id, self.remote_ids[img.fam.name][img.layout], batch_index)

    def _request(self, k: int) -> int:
        return k % self.geom.requests

    def _verify(self, result: TransferResult, targets: set[tuple[str, int, int]]) -> None:
        checked = 0
        for img in self.images:
            checked += img.verify(self.pattern, targets, result.name)
        result.checked_bytes = checked
        result.verified = True

    @contextmanager
    def transfer(self, result: TransferResult) -> Iterator[None]:
        self.report.transfers.append(result)
        self.log(f"{result.name}: {result.what} ...")
        try:
            yield
        except LLMError as exc:
            result.error = str(exc)
            raise DemoError(f"{result.name} ({result.api}) failed: {exc}", transfer=result.name) from exc
        except DemoError as exc:
            result.error = exc.message
            if exc.transfer is None:
                raise type(exc)(f"{result.name} ({result.api}): {exc.message}", transfer=result.name,
                                location=exc.location) from exc
            raise
        rate = f", {result.gbps:.2f} GB/s" if result.gbps else ""
        self.log(f"{result.name}: {_mib(result.bytes)} in {result.seconds * 1e3:.1f} ms{rate}, "
                 f"verified {_mib(result.checked_bytes)}")

    def _blocks_expect(self, req: int, dst: Sequence[int], layers: range | None = None) -> set[tuple[str, int, int]]:
        targets = set()
        src = self.block_tables[req]
        for img in self.paged:
            t = img.fam.tensors_per_layer
            tensors = range(img.n) if layers is None else range(layers.start * t, layers.stop * t)
            for i in tensors:
                for s, d in zip(src, dst):
                    img.expect[i][d] = _prefill_block_expect(self.geom, img.fam_index, i, s, self.owner, img.token_words)
                    targets.add((img.name, i, d))
        return targets

    def block_pull(self) -> None:
        req, dst = self._request(0), self.alloc[0]
        src = self.block_tables[req]
        r = TransferResult("paged block pull", "PullKvBlocks",
                           f"request {req}: {len(src)} blocks, random ids -> random ids")
        with self.transfer(r):
            t0 = time.perf_counter()
            for img in self.paged:
                ext = KvCacheExtParam(tensor_num_per_layer=img.fam.tensors_per_layer)  # all layers
                self.dd.pull_kv_blocks(self._remote(img), img.cache, src, dst, ext)
                r.calls += 1
                r.tensors += img.n
                r.bytes += img.n * len(src) * img.unit_bytes
            r.seconds = time.perf_counter() - t0
            self._verify(r, self._blocks_expect(req, dst))

    def layer_pull(self) -> None:
        req, dst = self._request(1), self.alloc[1]
        src = self.block_tables[req]
        layers = self.geom.model.layers
        r = TransferResult("layer-by-layer pull", "PullKvBlocks",
                           f"request {req}: {layers} layers x {len(src)} blocks")
        with self.transfer(r):
            t0 = time.perf_counter()
            for layer in range(layers):  # as a pipelined prefill streams it: layer 0 first
                for img in self.paged:
                    t = img.fam.tensors_per_layer
                    ext = KvCacheExtParam((layer, layer), (layer, layer), t)
                    self.dd.pull_kv_blocks(self._remote(img), img.cache, src, dst, ext)
                    r.calls += 1
                    r.bytes += t * len(src) * img.unit_bytes
            r.seconds = time.perf_counter() - t0
            r.tensors = sum(img.n for img in self.paged)
            self._verify(r, self._blocks_expect(req, dst, range(layers)))

    def _row_expect(self, req: int, row: int, tokens: int | None) -> set[tuple[str, int, int]]:
        targets = set()
        for img in self.contig:
            for i in range(img.n):
                runs = _prefill_row_expect(self.geom, img.fam_index, i, req, img.token_words, tokens)
                if tokens is None:
                    src = f"prefill row {req} (request {req})"
                else:
                    init = img.expect[i][row].runs[0]
                    done = tokens * img.token_words
                    runs.append((done, img.unit_words - done, init[2] + done - init[0]))
                    src = (f"prefill row {req} tokens 0-{tokens - 1}, then decode's own data "
                           f"from token {tokens}")
                img.expect[i][row] = UnitExpect(runs, src)
                targets.add((img.name, i, row))
        return targets

    def row_pull(self) -> None:
        req, row = self._request(2), 1
        r = TransferResult("batch-row pull", "PullKvCache", f"row {req} -> row {row}, contiguous layout")
        with self.transfer(r):
            t0 = time.perf_counter()
            for img in self.contig:
                ext = KvCacheExtParam(tensor_num_per_layer=img.fam.tensors_per_layer)
                self.dd.pull_kv_cache(self._remote(img, req), img.cache, batch_index=row, ext_param=ext)
                r.calls += 1
                r.tensors += img.n
                r.bytes += img.n * img.unit_bytes
            r.seconds = time.perf_counter() - t0
            self._verify(r, self._row_expect(req, row, None))

    def prefix_pull(self) -> None:
        req, row, n = self._request(3), 2, self.geom.prefix_tokens
        r = TransferResult("prefix pull", "PullKvCache",
                           f"row {req} -> row {row}, first {n} of {self.geom.tokens} tokens (size)")
        with self.transfer(r):
            t0 = time.perf_counter()
            for img in self.contig:
                size = n * img.token_bytes  # bytes per tensor from the start of the row
                ext = KvCacheExtParam(tensor_num_per_layer=img.fam.tensors_per_layer)
                self.dd.pull_kv_cache(self._remote(img, req), img.cache, batch_index=row, size=size, ext_param=ext)
                r.calls += 1
                r.tensors += img.n
                r.bytes += img.n * size
            r.seconds = time.perf_counter() - t0
            # The initial run of the row must be read before it is replaced.
            self._verify(r, self._row_expect(req, row, n))

    def push(self, decode_listen: Address | None) -> None:
        req, dst = self._request(4), self.alloc[2]
        src = self.block_tables[req]
        r = TransferResult("push prefill -> decode", "PushKvBlocks",
                           f"request {req}: {len(src)} blocks into decode-chosen ids")
        assert self.ctl is not None
        with self.transfer(r):
            self.ctl.send({"type": "push", "cluster_id": DECODE_CLUSTER_ID, "request": req, "dst_blocks": dst,
                           "caches": {img.fam.name: img.cache_id for img in self.paged},
                           "listen": list(decode_listen) if decode_listen else None})
            msg = self.ctl.recv("pushed")
            r.calls = int(msg["calls"])
            r.bytes = int(msg["bytes"])
            r.seconds = float(msg["seconds"])
            r.tensors = sum(img.n for img in self.paged)
            self._verify(r, self._blocks_expect(req, dst))


def run_decode(opts: DemoOptions, prefill: Address, control: Address, log: Progress | None = None,
               mode: str = "decode") -> DemoReport:
    """The decode side: register, connect, link, run and verify the five transfers, unlink.

    ``prefill`` is the prefill's LLM-DataDist address, ``control`` its control channel.  Never raises
    for a demo failure: the report's ``error`` says what failed (``report.ok``).
    """
    return _run_decode(opts, prefill[0], lambda: ReadyInfo(prefill, control), log, mode)


def _local_ip_towards(host: str) -> str:
    """This host's IPv4 address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((_ipv4(host), 9))
            return str(s.getsockname()[0])
    except (OSError, DemoError):
        return "127.0.0.1"


def _run_decode(opts: DemoOptions, prefill_host: str, locate: Callable[[], ReadyInfo],
                log: Progress | None, mode: str) -> DemoReport:
    # Local setup (initialize, allocate, fill, register) comes first so that it overlaps with the
    # prefill's; ``locate`` then blocks until the prefill side is ready.
    log = log or Progress(False, "decode")
    report = DemoReport(opts, mode)
    t_start = time.perf_counter()
    ctl: Control | None = None
    try:
        local_ip = _local_ip_towards(prefill_host)
        decode_listen: Address | None = None
        if opts.transfer_backend == "hixl":  # hixl: every instance listens (§3.2 step 8)
            decode_listen = opts.decode_listen or (local_ip, 0)
        with LlmDataDist(DECODE_CLUSTER_ID, LlmRole.DECODER, backend=opts.backend_arg) as dd:
            report.backend_name = dd.backend_name
            dd.initialize(_datadist_options(decode_listen, opts.transfer_backend))
            if decode_listen is not None:
                decode_listen = (decode_listen[0], dd.listen_port or 0)
            state = _Decode(opts, dd, report, log)
            t0 = time.perf_counter()
            _fill_and_register(dd, state.images, state.pattern, log)
            report.setup_seconds = time.perf_counter() - t0
            ready = locate()
            prefill = ready.listen
            report.prefill_address = f"{prefill[0]}:{prefill[1]}"
            ctl = _connect_control(ready.control, opts.timeout)
            ctl.send({"type": "hello", "protocol": PROTOCOL, "geometry": opts.geometry.to_json(),
                      "seed": opts.seed, "transfer_backend": opts.transfer_backend,
                      "cluster_id": DECODE_CLUSTER_ID})
            state.attach(ctl, ctl.recv("welcome"))
            prefill_ip = _ipv4(prefill[0])
            cluster = ClusterInfo(remote_cluster_id=state.prefill_id, remote_role_type=LlmRole.PROMPT,
                                  local_ip_infos=(IpInfo(_ipv4(local_ip)),),
                                  remote_ip_infos=(IpInfo(prefill_ip, prefill[1]),))
            try:
                dd.link_llm_clusters([cluster], timeout_ms=LINK_TIMEOUT_MS)
            except LLMLinkFailedError as exc:
                hint = ""
                if mode == "decode":
                    hint = " (is the prefill side still running, and is that port reachable from here?)"
                raise DemoError(f"LinkLlmClusters to prefill at {prefill_ip}:{prefill[1]} failed: {exc}{hint}",
                                transfer="link") from exc
            log(f"linked to prefill cluster {state.prefill_id} at {prefill_ip}:{prefill[1]}")
            state.block_pull()
            state.layer_pull()
            state.row_pull()
            state.prefix_pull()
            state.push(decode_listen)
            dd.unlink_llm_clusters([cluster], timeout_ms=LINK_TIMEOUT_MS)
            log("unlinked")
            ctl.send({"type": "done", "ok": True, "error": None})
            bye = ctl.recv("bye")
            report.source_intact = bool(bye.get("source_intact"))
            report.prefill["source_intact"] = report.source_intact
            if not report.source_intact:
                raise VerificationError(f"prefill source check: {bye.get('error')}", transfer="prefill source check")
        log("finalized")
    except DemoError as exc:
        report.error = exc
    except LLMError as exc:
        report.error = DemoError(f"{type(exc).__name__}: {exc}")
    except MemoryError:
        report.error = DemoError("out of memory for the caches; lower --requests or --tokens")
    except BackendUnavailableError as exc:
        report.error = DemoError(f"backend unavailable: {exc}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        report.error = DemoError(f"{type(exc).__name__}: {exc}")
    finally:
        if report.error is not None and ctl is not None:
            try:
                ctl.send({"type": "done", "ok": False, "error": report.error.message})
            except DemoError:
                pass
        if ctl is not None:
            ctl.close()
        report.wall_seconds = time.perf_counter() - t_start
    return report


def _connect_control(address: Address, timeout: float) -> Control:
    """Connect to the prefill's control channel, retrying while it is not up yet."""
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            return Control(sock, "prefill", timeout)
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise DemoError(f"cannot reach the prefill's control channel at {address[0]}:{address[1]} within "
                            f"{timeout:g} s ({last}); is `kvdd demo --role prefill` running there? Use the decode "
                            "command it prints: with --listen ...:0 its control port is not PORT+1, pass "
                            "--control-port")
        time.sleep(0.1)


# ---- running both sides ---------------------------------------------------------------------------

def run_demo(opts: DemoOptions, *, in_process: bool = False) -> DemoReport:
    """Run both sides: two OS processes (default; parent = decode, spawned child = prefill) or, with
    ``in_process``, two threads of this process.  Never raises for a demo failure (see ``ok``)."""
    return _run_threads(opts) if in_process else _run_processes(opts)


def _merge_prefill(report: DemoReport, prefill: Json | None, prefill_error: str | None) -> None:
    if prefill:
        report.prefill.update(prefill)
    if prefill_error and report.error is None:
        report.error = DemoError(f"prefill side failed: {prefill_error}")


def _connectable(ready: ReadyInfo) -> ReadyInfo:
    """Where a decode on this host reaches a prefill that listens on ``ready`` (wildcards: loopback)."""
    def fix(a: Address) -> Address:
        return ("127.0.0.1", a[1]) if a[0] in ("0.0.0.0", "") else a
    return ReadyInfo(fix(ready.listen), fix(ready.control))


def _run_threads(opts: DemoOptions) -> DemoReport:
    ready_q: queue.Queue[ReadyInfo | BaseException] = queue.Queue()
    out: dict[str, Any] = {}

    cancel = threading.Event()

    def prefill_main() -> None:
        try:
            out["result"] = run_prefill(opts, ready_q.put, Progress(opts.progress, "prefill"), cancel)
        except BaseException as exc:  # reported by the main thread
            out["error"] = exc
            ready_q.put(exc)

    def locate() -> ReadyInfo:
        try:
            first = ready_q.get(timeout=opts.timeout + 60)
        except queue.Empty:
            raise DemoError("the prefill side did not become ready") from None
        if isinstance(first, BaseException):
            raise DemoError(f"prefill side failed: {_describe(first)}")
        return _connectable(first)

    thread = threading.Thread(target=prefill_main, name="kvdd-demo-prefill", daemon=True)
    t0 = time.perf_counter()
    thread.start()
    report = _run_decode(opts, _connectable(ReadyInfo(opts.listen, opts.listen)).listen[0], locate,
                         Progress(opts.progress, "decode"), "threads")
    if report.error is not None:
        cancel.set()  # the prefill may still wait for a decode that never connected
    thread.join(opts.timeout + 10)
    err = out.get("error")
    _merge_prefill(report, out.get("result"), None if err is None else _describe(err))
    report.wall_seconds = time.perf_counter() - t0
    return report


def _describe(exc: BaseException) -> str:
    return exc.message if isinstance(exc, DemoError) else f"{type(exc).__name__}: {exc}"


def _prefill_child(opts: DemoOptions, conn: Any) -> None:
    """Entry point of the spawned prefill process: ready info and the result go back over ``conn``."""
    try:
        result = run_prefill(opts, lambda ready: conn.send(("ready", ready)), Progress(opts.progress, "prefill"))
        conn.send(("result", result))
    except BaseException as exc:
        try:
            conn.send(("error", _describe(exc)))
        except OSError:
            pass
        sys.exit(1)
    finally:
        conn.close()


def _run_processes(opts: DemoOptions) -> DemoReport:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = ctx.Process(target=_prefill_child, args=(opts, child), name="kvdd-demo-prefill", daemon=True)
    proc.start()
    child.close()

    def recv(deadline: float) -> tuple[str, Any]:
        while True:
            if parent.poll(0.1):
                try:
                    kind, payload = parent.recv()
                    return str(kind), payload
                except EOFError:
                    return "error", f"the prefill process exited with code {proc.exitcode} without a word"
            if not proc.is_alive() and not parent.poll(0.2):
                proc.join(1)
                return "error", f"the prefill process exited with code {proc.exitcode}"
            if time.monotonic() > deadline:
                return "error", "the prefill process did not answer in time"

    def locate() -> ReadyInfo:
        kind, payload = recv(time.monotonic() + opts.timeout + 60)
        if kind != "ready":
            raise DemoError(f"prefill side failed: {payload}")
        assert isinstance(payload, ReadyInfo)
        return _connectable(payload)

    try:
        report = _run_decode(opts, _connectable(ReadyInfo(opts.listen, opts.listen)).listen[0], locate,
                             Progress(opts.progress, "decode"), "processes")
        prefill_result: Json | None = None
        prefill_error: str | None = None
        if proc.is_alive() or parent.poll(0):
            # After a decode failure the prefill may wait for a decode that never connected: give
            # it a moment to report (it checks its source after a `done`), then stop it.
            grace = opts.timeout if report.error is None else min(opts.timeout, 10.0)
            kind, payload = recv(time.monotonic() + grace)
            if kind == "result":
                prefill_result = payload
            elif report.error is None or "prefill" not in report.error.message:
                prefill_error = str(payload)
        proc.join(10 if report.error is None else 1)
        if proc.is_alive():
            proc.terminate()  # our child, stuck waiting for a decode side that is gone
            proc.join(5)
        if proc.exitcode not in (0, None) and prefill_error is None and report.error is None:
            prefill_error = f"the prefill process exited with code {proc.exitcode}"
        _merge_prefill(report, prefill_result, prefill_error)
        report.prefill["pid"] = proc.pid
        report.wall_seconds = time.perf_counter() - t0
        return report
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        parent.close()


# ---- output -------------------------------------------------------------------------------------

def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


def render_geometry(opts: DemoOptions, mode: str, out: IO[str]) -> None:
    geom = opts.geometry
    m = geom.model
    w = out.write
    col = max(10, *(len(f.name) + 8 for f in geom.families))
    src = "built-in" if m.source == "built-in" else f"from {m.source}"
    w(f"kvdd demo: {m.name} KV cache, prefill -> decode, every byte verified\n")
    w(f"  {'model':<{col}}{m.name} ({src}): {m.describe()}\n")
    for note in m.notes:
        w(f"  {'':<{col}}note: {note}\n")
    w(f"  {'workload':<{col}}{geom.requests} request{'s' if geom.requests != 1 else ''} x {geom.tokens} tokens, "
      f"{geom.block_size}-token blocks ({geom.blocks_per_request} per request)\n")
    pad = " " * (2 + col)
    dtype = m.dtype
    for f in geom.families:
        n = geom.num_tensors(f)
        parts = ",".join(f.parts)
        tok = ", ".join(map(str, f.token_shape))
        w(f"  {f.name + '/paged':<{col}}{n} tensors ({parts} x {m.layers} layers), each [blocks, "
          f"{geom.block_size}, {tok}] {dtype}\n")
        w(f"{pad}{_mib(geom.block_bytes(f))} per block per tensor; prefill "
          f"{_plural(geom.prefill_blocks, 'block')} = {_mib(n * geom.prefill_blocks * geom.block_bytes(f))}, "
          f"decode {_plural(geom.decode_blocks, 'block')} = {_mib(n * geom.decode_blocks * geom.block_bytes(f))}\n")
        w(f"  {f.name + '/contig':<{col}}{n} tensors, each [rows, {geom.tokens}, {tok}] {dtype}\n")
        w(f"{pad}{_mib(geom.row_bytes(f))} per row per tensor; prefill {_plural(geom.requests, 'row')} = "
          f"{_mib(n * geom.requests * geom.row_bytes(f))}, decode {_plural(geom.decode_rows, 'row')} = "
          f"{_mib(n * geom.decode_rows * geom.row_bytes(f))}\n")
    where = {"processes": "two processes", "threads": "two threads of one process",
             "decode": "decode side of a two-command run"}.get(mode, mode)
    w(f"  {'total':<{col}}prefill {_mib(geom.side_bytes('prefill'))}, decode {_mib(geom.side_bytes('decode'))} "
      f"registered; {opts.backend} backend, {opts.transfer_backend} transfer backend, {where}\n")


def render_text(report: DemoReport, out: IO[str]) -> None:
    """The human report: geometry, one table row per transfer, a one-line summary."""
    opts = report.options
    render_geometry(opts, report.mode, out)
    w = out.write
    w("\n")
    header = f"  {'#':<2} {'transfer':<22} {'API':<13} {'calls':>5} {'tensors':>7} {'bytes':>10} " \
             f"{'time':>9} {'GB/s':>7}  {'verified':<8}  what\n"
    w(header)
    for k, t in enumerate(report.transfers, 1):
        gbps = f"{t.gbps:.2f}" if t.gbps else "-"
        status = "yes" if t.verified else "FAILED"
        w(f"  {k:<2} {t.name:<22} {t.api:<13} {t.calls:>5} {t.tensors:>7} {_mib(t.bytes):>10} "
          f"{_fmt_seconds(t.seconds):>9} {gbps:>7}  {status:<8}  {t.what}\n")
    if not report.transfers:
        w("  (no transfer ran)\n")
    w("\n")
    moved = sum(t.bytes for t in report.transfers)
    if report.ok:
        w(f"OK: {len(report.transfers)} transfers moved {_mib(moved)}; after each one all "
          f"{_mib(opts.geometry.side_bytes('decode'))} of decode cache memory matched the expected bytes, "
          f"and the prefill source stayed intact ({report.wall_seconds:.1f} s in all)\n")
    else:
        msg = report.error.message if report.error else "verification incomplete"
        w(f"FAILED: {msg}\n")


# ---- command line -------------------------------------------------------------------------------

def _address(text: str) -> Address:
    text = text.strip()
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _pos(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvdd demo`` options (``kvdd.cli`` adds the subparser and calls :func:`run_from_args`)."""
    g = parser.add_argument_group("geometry (both sides must pass the same values)")
    g.add_argument("--model", metavar="NAME",
                   help=f"a built-in model: {', '.join(MODELS)} (default {DEFAULT_MODEL})")
    g.add_argument("--model-config", metavar="PATH",
                   help="derive the geometry from a Hugging Face config.json (layers, KV heads, head_dim "
                        "or MLA ranks, torch_dtype)")
    g.add_argument("--requests", type=_pos, help="requests held by prefill (default 4)")
    g.add_argument("--tokens", type=_pos, help="tokens per request (default 1024)")
    g.add_argument("--block-size", type=_pos, default=128, help="tokens per block (default 128)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="override the model's dtype")
    g.add_argument("--quick", action="store_true", help="1 request of 256 tokens (CI)")
    g.add_argument("--seed", type=int, default=0, help="seed of the data and of the block choices (default 0)")
    r = parser.add_argument_group("processes and links")
    r.add_argument("--role", choices=("prefill", "decode"),
                   help="run one side only (two commands or two hosts); default: both, as two processes")
    r.add_argument("--listen", type=_address, metavar="HOST:PORT",
                   help="LLM-DataDist listen address: prefill's (default 127.0.0.1:0 = a free port); with "
                        "--role decode and --transfer-backend hixl, decode's (default: its IP on the route "
                        "to the prefill, port 0)")
    r.add_argument("--connect", type=_address, metavar="HOST:PORT",
                   help="--role decode: the prefill's LLM-DataDist address")
    r.add_argument("--control-port", type=int, metavar="PORT",
                   help="prefill's control-channel port (default: its LLM-DataDist port + 1, or a free port "
                        "when that is 0; prefill prints it)")
    r.add_argument("--backend", choices=("sim", "native", "auto"), default="sim",
                   help="kvdd backend (default sim; auto applies kvdd's selection rule)")
    r.add_argument("--transfer-backend", choices=("comm", "hixl"), default="comm",
                   help="llm.TransferBackend: comm (HCCL, default, bidirectional links) or hixl "
                        "(one-way links: for the push, decode listens and prefill links to it)")
    r.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="how long one side waits for the other (default 60; 600 for --role prefill, "
                        "which waits for a decode command to be started)")
    r.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON document (schema kvdd.demo/1)")
    o.add_argument("--progress", action="store_true", default=None,
                   help="progress lines on stderr (default: when stderr is a terminal)")
    o.add_argument("--no-progress", action="store_false", dest="progress", help="no progress lines")


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Build :class:`DemoOptions` from parsed ``kvdd demo`` arguments; ``ConfigError`` on misuse."""
    if args.model and args.model_config:
        raise ConfigError("pass either --model or --model-config, not both")
    model = model_from_hf_config(args.model_config) if args.model_config else resolve_model(args.model or DEFAULT_MODEL)
    if args.dtype:
        model = replace(model, dtype=args.dtype, notes=tuple(n for n in model.notes if "torch_dtype" not in n))
    requests = args.requests if args.requests is not None else (1 if args.quick else 4)
    tokens = args.tokens if args.tokens is not None else (256 if args.quick else 1024)
    geom = Geometry(model, requests, tokens, args.block_size)
    if args.role != "decode" and args.connect is not None:
        raise ConfigError("--connect is for --role decode")
    if args.role == "decode" and args.connect is None:
        raise ConfigError("--role decode needs --connect HOST:PORT (the prefill's LLM-DataDist address)")
    if args.in_process and args.role:
        raise ConfigError("--in-process runs both sides; it cannot be combined with --role")
    timeout = args.timeout if args.timeout is not None else (600.0 if args.role == "prefill" else 60.0)
    if timeout <= 0:
        raise ConfigError("--timeout must be positive")
    if args.control_port is not None and not 0 <= args.control_port <= 65535:
        raise ConfigError("--control-port must be in 0..65535")
    listen: Address = ("127.0.0.1", 0)
    decode_listen: Address | None = None
    if args.role == "decode":
        decode_listen = args.listen
    elif args.listen is not None:
        listen = args.listen
    if listen[1] == 65535 and args.control_port is None:
        raise ConfigError("pass --control-port (the default, the listen port + 1, does not exist)")
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    return DemoOptions(geometry=geom, backend=args.backend, transfer_backend=args.transfer_backend,
                       seed=args.seed, timeout=timeout, listen=listen, control_port=args.control_port,
                       connect=args.connect, decode_listen=decode_listen, progress=progress)


def _check_backend(backend: str | None) -> None:
    from .backend import backend_problem, resolve_backend_name

    try:
        problem = backend_problem(resolve_backend_name(backend))
    except (ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from None
    if problem is not None:
        raise ConfigError(f"--backend {backend}: {problem}")


def _check_memory(opts: DemoOptions, both: bool) -> None:
    geom = opts.geometry
    need = geom.side_bytes("prefill") + geom.side_bytes("decode") if both else geom.side_bytes(
        "prefill" if opts.connect is None else "decode")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if need > avail * 0.9:
        raise ConfigError(f"this geometry needs {_mib(need)} of cache memory here but only {_mib(avail)} is "
                          "available; lower --requests or --tokens, or run the sides on two hosts (--role)")


def _print_json(doc: Json, out: IO[str]) -> None:
    out.write(json.dumps(doc, indent=2) + "\n")
    out.flush()


def run_from_args(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    """``kvdd demo``: 0 when every transfer verified, 1 on any failure, 2 on bad arguments."""
    out = out or sys.stdout
    try:
        opts = options_from_args(args)
        _check_backend(opts.backend_arg)
        _check_memory(opts, args.role is None)
    except ConfigError as exc:
        print(f"kvdd demo: error: {exc}", file=sys.stderr)
        return 2
    if args.role == "prefill":
        return _run_prefill_cli(opts, args.json, out)
    if args.role == "decode":
        assert opts.connect is not None
        try:
            control = opts.decode_control_address()
        except DemoError as exc:
            print(f"kvdd demo: error: {exc.message}", file=sys.stderr)
            return 2
        report = run_decode(opts, opts.connect, control, Progress(opts.progress, "decode"))
    else:
        report = run_demo(opts, in_process=bool(args.in_process))
    try:
        if args.json:
            _print_json(report.to_json(), out)
        else:
            render_text(report, out)
            out.flush()
    except BrokenPipeError:  # `kvdd demo | head`: the reader left; stop writing quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        except (OSError, ValueError):
            pass
    if not report.ok:
        msg = report.error.message if report.error else "not every transfer was verified"
        print(f"kvdd demo: FAILED: {msg}", file=sys.stderr)
        return 1
    return 0


def _run_prefill_cli(opts: DemoOptions, as_json: bool, out: IO[str]) -> int:
    def ready(info: ReadyInfo) -> None:
        if as_json:
            out.write(json.dumps({"schema": JSON_SCHEMA, "event": "ready", **info.to_json()}) + "\n")
        else:
            host, port = info.listen
            cport = info.control[1]
            extra = "" if opts.control_port is None and port and cport == port + 1 else f" --control-port {cport}"
            shown = host if host not in ("0.0.0.0", "::") else "<this host's address>"
            out.write(f"prefill ready: LLM-DataDist on {host}:{port}, control channel on {host}:{cport}\n"
                      f"run the decode side with the same geometry options:\n"
                      f"  kvdd demo --role decode --connect {shown}:{port}{extra}{_geometry_args(opts)}\n")
        out.flush()

    t0 = time.perf_counter()
    try:
        result = run_prefill(opts, ready, Progress(opts.progress, "prefill"))
        error: str | None = None
    except (DemoError, LLMError, OSError, BackendUnavailableError) as exc:
        result = {"role": "prefill"}
        error = exc.message if isinstance(exc, DemoError) else f"{type(exc).__name__}: {exc}"
    if as_json:
        _print_json({"schema": JSON_SCHEMA, "event": "result", "ok": error is None, "mode": "prefill",
                     "geometry": opts.geometry.to_json(), "prefill": result,
                     "wall_seconds": time.perf_counter() - t0, "error": error}, out)
    elif error is None:
        push = result.get("push", {})
        out.write(f"prefill done: served decode (push {_mib(push.get('bytes', 0))} in "
                  f"{_fmt_seconds(push.get('seconds', 0.0))}), source caches intact\n")
    if error is not None:
        print(f"kvdd demo: FAILED: {error}", file=sys.stderr)
        return 1
    return 0


def _geometry_args(opts: DemoOptions) -> str:
    geom = opts.geometry
    parts = []
    if geom.model.source == "built-in":
        if geom.model.name != DEFAULT_MODEL:
            parts.append(f"--model {geom.model.name}")
    else:
        parts.append(f"--model-config {geom.model.source}")
    if (geom.requests, geom.tokens) == (1, 256):
        parts.append("--quick")
    elif geom.requests != 4 or geom.tokens != 1024:
        parts.append(f"--requests {geom.requests} --tokens {geom.tokens}")
    if geom.block_size != 128:
        parts.append(f"--block-size {geom.block_size}")
    if geom.model.source != "built-in" or geom.model.dtype != MODELS.get(geom.model.name, geom.model).dtype:
        parts.append(f"--dtype {geom.model.dtype}")
    if opts.seed:
        parts.append(f"--seed {opts.seed}")
    if opts.transfer_backend != "comm":
        parts.append(f"--transfer-backend {opts.transfer_backend}")
    if opts.backend != "sim":
        parts.append(f"--backend {opts.backend}")
    return "".join(" " + p for p in parts)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvdd.demo`` (same as ``kvdd demo``)."""
    parser = argparse.ArgumentParser(prog="kvdd demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_demo_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
