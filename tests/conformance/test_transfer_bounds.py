"""Index bounds that no other rule catches first: SEMANTICS.md §3.12 step 7e and §3.10 step 10
(also §3.11 step 6) with ``tensor_num_per_layer=1``."""

from __future__ import annotations

from kvdd import DataType

from . import reference as ref
from .checked import (
    pull_blocks_checked,
    pull_cache_checked,
    push_cache_checked,
)
from .harness import (
    PARAM_INVALID,
    Spec,
    World,
    ext,
    linked,
)

INT4_45 = Spec(n=4, dtype=DataType.DT_INT4, shape=(4, 5))


def test_push_dst_batch_index_equal_to_remote_batch_size(world: World, transfer: str) -> None:
    # §3.12 step 7e: dst batch_index >= R.B -> PARAM_INVALID.  DT_INT4 (4, 5): T = 10 bytes, B = 4,
    # S = 2, so T > B*S and row 4 ([8, 10)) still lies inside the tensor: kvdd rule 1 passes and
    # only check e refuses the push.
    g = ref.geom(4, DataType.DT_INT4, (4, 5))
    assert (g.T, g.B, g.S, g.ragged) == (10, 4, 2, False)
    d, p, dh, ph = linked(world, transfer, dspec=INT4_45, pspec=INT4_45)
    push_cache_checked(world, d, dh, ph, dst_batch=3, src_batch_index=1)  # the last row works
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(4))
    with world.rejects(PARAM_INVALID):
        d.push_kv_cache(dh.cache(), ph.index(4), ext_param=ext((1, 1), (1, 1), 1))


def test_pull_dst_layer_range_upper_bound_one_tensor_per_layer(world: World, transfer: str) -> None:
    # §3.10 step 10 (and §3.11 step 6): with t = 1, dst layers (1, 4) are tensors 1..4 of a
    # 4-tensor local cache: the length (4) fits, the first index fits, the last (4) does not.
    d, p, dh, ph = linked(world, transfer, dspec=Spec(n=4), pspec=Spec(n=6))
    e = ext((0, 3), (1, 4), 1)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_cache(ph.index(), dh.cache(), ext_param=e)
    with world.rejects(PARAM_INVALID):
        d.pull_kv_blocks(ph.index(), dh.cache(), [0], [0], ext_param=e)
    # one layer less fits
    ok = ext((0, 2), (1, 3), 1)
    pull_cache_checked(world, d, ph, dh, ext_param=ok)
    pull_blocks_checked(world, d, ph, dh, [0], [0], ext_param=ok)
