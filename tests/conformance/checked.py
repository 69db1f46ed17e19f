"""Checked transfers for the conformance tests: perform a transfer through a :class:`Node`, then
compare every byte of every node's memory with the reference model's prediction (reference.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvdd import Cache, CacheIndex, KvCacheExtParam

from . import reference as ref
from .harness import CacheHandle, Err, Node, Snapshot, World, raises
from .reference import Bytes


def _ext_or_default(e: KvCacheExtParam | None) -> KvCacheExtParam:
    return KvCacheExtParam() if e is None else e


def pull_cache_checked(world: World, caller: Node, src: CacheHandle, dst: CacheHandle, *,
                       batch_index: int = 0, size: int = -1, ext_param: KvCacheExtParam | None = None,
                       src_batch: int = 0, index: CacheIndex | None = None) -> None:
    """``caller`` pulls ``src`` (remote) into ``dst`` (its own); checks every byte (§3.10)."""
    idx = src.index(src_batch) if index is None else index
    before = world.snapshot()
    caller.pull_kv_cache(idx, dst.cache(), batch_index, size, ext_param)
    e = _ext_or_default(ext_param)
    ss, ds, k = ref.pull_tensor_span(dst.geom.n, e.src_layer_range, e.dst_layer_range,
                                     e.tensor_num_per_layer)
    expected = before.copy()
    ref.pull_cache(expected.tensors(dst), before.tensors(src), dst.geom, size=size,
                   src_batch=idx.batch_index, dst_batch=batch_index, ss=ss, ds=ds, k=k)
    world.assert_memory(expected, "after PullKvCache: ")


def pull_blocks_checked(world: World, caller: Node, src: CacheHandle, dst: CacheHandle,
                        src_blocks: Sequence[int], dst_blocks: Sequence[int], *,
                        ext_param: KvCacheExtParam | None = None,
                        index: CacheIndex | None = None) -> None:
    """``caller`` pulls blocks of ``src`` into ``dst``; checks every byte (§3.11)."""
    idx = src.index() if index is None else index
    before = world.snapshot()
    caller.pull_kv_blocks(idx, dst.cache(), src_blocks, dst_blocks, ext_param)
    e = _ext_or_default(ext_param)
    ss, ds, k = ref.pull_tensor_span(dst.geom.n, e.src_layer_range, e.dst_layer_range,
                                     e.tensor_num_per_layer)
    expected = before.copy()
    ref.pull_blocks(expected.tensors(dst), before.tensors(src), dst.geom, src.geom.T, src_blocks,
                    dst_blocks, ss=ss, ds=ds, k=k)
    world.assert_memory(expected, "after PullKvBlocks: ")


def _push_expected(before: Snapshot, src: CacheHandle, dst: CacheHandle, cache: Cache,
                   e: KvCacheExtParam, layers_ok: int | None,
                   apply: Callable[[list[Bytes], list[Bytes], int, int], None]) -> Snapshot:
    plan = ref.push_layer_plan(e.src_layer_range, e.dst_layer_range, e.tensor_num_per_layer,
                               cache.cache_desc.num_tensors)
    if layers_ok is not None:
        plan = plan[:layers_ok]
    expected = before.copy()
    remote = expected.tensors(dst)
    # Sources are read from the pre-call state (distinct memory unless a test shares it).
    local = before.tensors(src)
    for ls, ld in plan:
        apply(remote, local, ls, ld)
    return expected


def push_cache_checked(world: World, caller: Node, src: CacheHandle, dst: CacheHandle, *,
                       src_batch_index: int = 0, dst_batch: int = 0,
                       ext_param: KvCacheExtParam | None = None, cache: Cache | None = None,
                       index: CacheIndex | None = None, error: Err | None = None,
                       layers_ok: int | None = None) -> None:
    """``caller`` pushes row ``src_batch_index`` of ``src`` (its own) into row ``dst_batch`` of
    ``dst`` (remote); checks every byte (§3.12).  With ``error``, the call must fail with it after
    exactly the first ``layers_ok`` (default 0) planned layers were written (§7.6)."""
    struct = src.cache() if cache is None else cache
    idx = dst.index(dst_batch) if index is None else index
    e = _ext_or_default(ext_param)
    t = e.tensor_num_per_layer
    before = world.snapshot()
    if error is None:
        caller.push_kv_cache(struct, idx, src_batch_index, -1, ext_param)
    else:
        with raises(error):
            caller.push_kv_cache(struct, idx, src_batch_index, -1, ext_param)
        layers_ok = layers_ok or 0
    L, R = src.geom, dst.geom

    def apply(remote: list[Bytes], local: list[Bytes], ls: int, ld: int) -> None:
        ref.push_cache_layer(remote, local, L, R, t, ls, ld, src_batch=src_batch_index,
                             dst_batch=idx.batch_index)

    expected = _push_expected(before, src, dst, struct, e, layers_ok, apply)
    world.assert_memory(expected, "after PushKvCache: ")


def push_blocks_checked(world: World, caller: Node, src: CacheHandle, dst: CacheHandle,
                        src_blocks: Sequence[int], dst_blocks: Sequence[int], *,
                        ext_param: KvCacheExtParam | None = None, cache: Cache | None = None,
                        index: CacheIndex | None = None, error: Err | None = None,
                        layers_ok: int | None = None) -> None:
    """Like :func:`push_cache_checked` for PushKvBlocks (§3.13)."""
    struct = src.cache() if cache is None else cache
    idx = dst.index() if index is None else index
    e = _ext_or_default(ext_param)
    t = e.tensor_num_per_layer
    before = world.snapshot()
    if error is None:
        caller.push_kv_blocks(struct, idx, src_blocks, dst_blocks, ext_param)
    else:
        with raises(error):
            caller.push_kv_blocks(struct, idx, src_blocks, dst_blocks, ext_param)
        layers_ok = layers_ok or 0
    L = src.geom

    def apply(remote: list[Bytes], local: list[Bytes], ls: int, ld: int) -> None:
        ref.push_blocks_layer(remote, local, L, t, ls, ld, src_blocks, dst_blocks)

    expected = _push_expected(before, src, dst, struct, e, layers_ok, apply)
    world.assert_memory(expected, "after PushKvBlocks: ")
