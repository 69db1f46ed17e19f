"""KV-cache geometries of real models: the one table the demo, the benchmarks and the docs use.

The facts come from the models' published configs (``docs/spec/MODELS.md`` describes the same table
for people; ``tests/test_models.py`` checks that it agrees with this module).

Terms: a *cache family* is one kind of cache of a model, all of whose tensors have one shape: K and V
of every layer (GQA/MHA: ``tensors_per_layer`` 2, tensor order K0, V0, K1, V1, ...) or one MLA
component (the latent, the rope part, or DSA indexer keys: ``tensors_per_layer`` 1).  A *token* of a
tensor is ``token_shape`` elements; a *block* is :data:`BLOCK_TOKENS` tokens (the Ascend paged layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ALIASES", "BLOCK_TOKENS", "MODELS", "CacheGeometry", "KvModel", "lookup"]

#: Tokens per block of the paged layout on Ascend (vllm-ascend).
BLOCK_TOKENS = 128


@dataclass(frozen=True)
class CacheGeometry:
    """One cache family of a model.

    Attributes
    ----------
    name : str
        ``"kv"``, ``"latent"``, ``"rope"`` or ``"indexer"``.
    layers : int
        Layers of the model.
    tensors_per_layer : int
        2 (K, V) or 1 (one MLA component).
    token_shape : tuple of int
        Elements per token per tensor, e.g. ``(kv_heads, head_dim)``.
    parts : tuple of str
        Names of the tensors of one layer, e.g. ``("K", "V")``.
    """

    name: str
    layers: int
    tensors_per_layer: int
    token_shape: tuple[int, ...]
    parts: tuple[str, ...]

    @property
    def tensors(self) -> int:
        """Tensors of the cache (``layers x tensors_per_layer``)."""
        return self.layers * self.tensors_per_layer

    @property
    def token_elements(self) -> int:
        """Elements per token per tensor."""
        return math.prod(self.token_shape)

    def block_bytes(self, itemsize: int = 2) -> int:
        """Bytes of one :data:`BLOCK_TOKENS`-token block of one tensor (bf16 by default)."""
        return self.token_elements * itemsize * BLOCK_TOKENS


@dataclass(frozen=True)
class KvModel:
    """The KV-cache-relevant facts of one model (elements, not bytes: the dtype is the serving
    engine's choice; the published configs use bf16).

    Attributes
    ----------
    name : str
        The model's usual name, e.g. ``"Qwen2.5-7B"``.
    layers : int
        ``num_hidden_layers``.
    attention : str
        ``"GQA"``, ``"MHA"``, ``"MQA"`` or ``"MLA"``.
    kv_heads, head_dim : int
        ``num_key_value_heads`` and the head dimension (0 for MLA).
    kv_lora_rank, qk_rope_head_dim : int
        The MLA latent and rope widths (0 otherwise).
    index_head_dim : int
        The DSA indexer key width (0 when the model has none).
    """

    name: str
    layers: int
    attention: str
    kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0

    @property
    def caches(self) -> tuple[CacheGeometry, ...]:
        """The model's cache families (one for K/V models; latent, rope and maybe indexer for MLA)."""
        if self.attention != "MLA":
            return (CacheGeometry("kv", self.layers, 2, (self.kv_heads, self.head_dim), ("K", "V")),)
        fams = [CacheGeometry("latent", self.layers, 1, (self.kv_lora_rank,), ("latent",)),
                CacheGeometry("rope", self.layers, 1, (self.qk_rope_head_dim,), ("rope",))]
        if self.index_head_dim > 0:
            fams.append(CacheGeometry("indexer", self.layers, 1, (self.index_head_dim,), ("indexer",)))
        return tuple(fams)

    def cache(self, name: str) -> CacheGeometry:
        """The cache family called `name`; raises ``KeyError`` when the model has none."""
        for fam in self.caches:
            if fam.name == name:
                return fam
        raise KeyError(f"{self.name} has no {name!r} cache")


#: The built-in models (MODELS.md), by name.
MODELS: dict[str, KvModel] = {m.name: m for m in (
    KvModel("Qwen2.5-7B", 28, "GQA", kv_heads=4, head_dim=128),
    KvModel("Llama-3.1-8B", 32, "GQA", kv_heads=8, head_dim=128),
    KvModel("Qwen3-32B", 64, "GQA", kv_heads=8, head_dim=128),
    KvModel("Llama-3.1-70B", 80, "GQA", kv_heads=8, head_dim=128),
    KvModel("DeepSeek-V3", 61, "MLA", kv_lora_rank=512, qk_rope_head_dim=64),
    KvModel("GLM-5", 78, "MLA", kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128),
)}

#: Other names of the same geometries (lower case) -> a key of :data:`MODELS`.
ALIASES: dict[str, str] = {"qwen2.5-7b-instruct": "Qwen2.5-7B", "llama-3.1-8b-instruct": "Llama-3.1-8B",
                           "llama-3.1-70b-instruct": "Llama-3.1-70B", "deepseek-r1": "DeepSeek-V3"}


def lookup(name: str) -> KvModel | None:
    """The built-in model called `name` (case-insensitive, :data:`ALIASES` included), or None."""
    wanted = name.strip().lower()
    wanted = ALIASES.get(wanted, wanted).lower()
    for key, model in MODELS.items():
        if key.lower() == wanted:
            return model
    return None
