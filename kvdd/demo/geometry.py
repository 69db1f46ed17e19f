"""Model x workload: every cache shape and byte count both sides derive from the options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..types import DataType
from .errors import ConfigError, Json
from .model import DTYPES, CacheFamily, ModelSpec

__all__ = ["Geometry"]


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
