"""Every transfer across dtypes (int32, bf16, int8, a sub-byte type) and shapes (1-D, 2-D, 4-D paged
``[blocks, block_size, heads, head_dim]``), on both transfer backends, bytes checked against the
reference model (SEMANTICS.md §2.1, §3.10-§3.13, §5)."""

from __future__ import annotations

import pytest

from kvdd import DataType

from . import reference as ref
from .checked import (
    pull_blocks_checked,
    pull_cache_checked,
    push_blocks_checked,
    push_cache_checked,
)
from .harness import (
    Spec,
    World,
    ext,
    linked,
)

SPECS = {
    "int32-2d": Spec(n=4, dtype=DataType.DT_INT32, shape=(4, 16)),  # T=256, S=64
    "bf16-1d": Spec(n=4, dtype=DataType.DT_BF16, shape=(8,)),  # T=16, S=2
    "int8-4d-paged": Spec(n=4, dtype=DataType.DT_INT8, shape=(4, 4, 2, 8)),  # T=256, S=64
    "int4-2d": Spec(n=4, dtype=DataType.DT_INT4, shape=(4, 16)),  # T=32, S=8
    "fp16-3d": Spec(n=4, dtype=DataType.DT_FLOAT16, shape=(6, 3, 5)),  # T=180, S=30
}

EXPECTED_GEOM = {"int32-2d": (256, 4, 64), "bf16-1d": (16, 8, 2), "int8-4d-paged": (256, 4, 64),
                 "int4-2d": (32, 4, 8), "fp16-3d": (180, 6, 30)}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_reference_geometry(name: str) -> None:
    s = SPECS[name]
    g = ref.geom(s.n, s.dtype, s.shape)
    assert (g.T, g.B, g.S) == EXPECTED_GEOM[name]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_pull_cache_dtypes(world: World, transfer: str, name: str) -> None:
    d, p, dh, ph = linked(world, transfer, SPECS[name], SPECS[name])
    pull_cache_checked(world, d, ph, dh, src_batch=1, batch_index=3)
    pull_cache_checked(world, d, ph, dh, src_batch=2, batch_index=0, size=1,
                       ext_param=ext((1, 1), (0, 0)))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_pull_blocks_dtypes(world: World, transfer: str, name: str) -> None:
    d, p, dh, ph = linked(world, transfer, SPECS[name], SPECS[name])
    pull_blocks_checked(world, d, ph, dh, [0, 1, 3], [2, 3, 0])
    pull_blocks_checked(world, d, ph, dh, [2], [1], ext_param=ext((0, 0), (1, 1)))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_push_cache_dtypes(world: World, transfer: str, name: str) -> None:
    d, p, dh, ph = linked(world, transfer, SPECS[name], SPECS[name])
    push_cache_checked(world, d, dh, ph, src_batch_index=1, dst_batch=3)
    push_cache_checked(world, d, dh, ph, src_batch_index=3, dst_batch=0,
                       ext_param=ext((0, 0), (1, 1)))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_push_blocks_dtypes(world: World, transfer: str, name: str) -> None:
    d, p, dh, ph = linked(world, transfer, SPECS[name], SPECS[name])
    push_blocks_checked(world, d, dh, ph, [0, 2], [1, 3])
    push_blocks_checked(world, d, dh, ph, [3, 2, 1], [0, 1, 2], ext_param=ext((1, 1), (0, 0)))


def test_mixed_dtypes_same_bytes(world: World, transfer: str) -> None:
    # Data types are never compared; a bf16 {4,32} and an int8 {4,64} cache have the same bytes.
    d, p, dh, ph = linked(world, transfer, Spec(n=2, dtype=DataType.DT_INT8, shape=(4, 64)),
                          Spec(n=2, dtype=DataType.DT_BF16, shape=(4, 32)))
    pull_cache_checked(world, d, ph, dh, src_batch=1, batch_index=2)
    push_blocks_checked(world, d, dh, ph, [0, 1], [2, 3])
