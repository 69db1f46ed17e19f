"""kvdd example: decode pulls paged KV blocks from prefill with CANN's ``llm_datadist`` package.

    python pull_blocks.py prefill PORT_BASE   # cluster 1, listens on 127.0.0.1:PORT_BASE
    python pull_blocks.py decode  PORT_BASE   # cluster 2, links to it and pulls

Calls: ``register_blocks_cache`` with a ``BlocksCacheKey``, ``link_clusters``, ``pull_blocks`` of a
request's blocks for all layers at once, then layer by layer (``src_layer_range`` /
``dst_layer_range``), then shifted by one layer; an out-of-range destination block is refused with
LLM_PARAM_INVALID and moves nothing.  Decode checks every byte of its cache after each step.
Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
"""

from __future__ import annotations

from llm_datadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole, LLMStatusCode

import common
from common import DECODE_CLUSTER, LAYERS, PREFILL_CLUSTER, TENSORS, Control, Tensors

PREFILL_BLOCKS = 16
DECODE_BLOCKS = 24
# One request's block table on prefill (non-contiguous), and where decode puts it, per step.
SRC_BLOCKS = [3, 4, 9, 1, 14]
DST_ALL = [0, 1, 2, 7, 8]
DST_PER_LAYER = [10, 11, 12, 13, 20]
DST_SHIFTED = [21, 22, 23, 5, 6]


def desc(blocks: int) -> CacheDesc:
    return CacheDesc(TENSORS, common.block_shape(blocks), DataType.DT_FLOAT16)


def prefill(port: int) -> None:
    engine = LLMDataDist(LLMRole.PROMPT, PREFILL_CLUSTER)
    engine.init(common.config(device_id=0, listen_port=port))
    kv = Tensors(TENSORS, common.block_shape(PREFILL_BLOCKS))
    kv.fill(tag=1)
    cache = engine.cache_manager.register_blocks_cache(desc(PREFILL_BLOCKS), kv.addrs,
                                                       BlocksCacheKey(PREFILL_CLUSTER, model_id=0))
    ctl = Control.listen(port)[0]
    ctl.send("ready", src_blocks=SRC_BLOCKS)
    done = ctl.recv("done")
    kv.verify("prefill: source cache intact")
    engine.cache_manager.unregister_cache(cache.cache_id)
    engine.finalize()
    if not done["ok"]:
        common.fail("decode reported a failure")
    print("prefill: decode reported every byte right")


def expect_pull(kv: Tensors, src: list[int], dst: list[int], src_tensors: range, dst_tensors: range) -> None:
    """What a pull of blocks ``src`` -> ``dst`` of tensors ``src_tensors`` -> ``dst_tensors`` writes."""
    bw = common.block_words()
    for s_t, d_t in zip(src_tensors, dst_tensors):
        for s, d in zip(src, dst):
            kv.expected[d_t][d * bw:(d + 1) * bw] = common.pattern(1, s_t, bw, s * bw)


def decode(port: int) -> None:
    engine = LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER)
    engine.init(common.config(device_id=1))
    kv = Tensors(TENSORS, common.block_shape(DECODE_BLOCKS))
    cache = engine.cache_manager.register_blocks_cache(desc(DECODE_BLOCKS), kv.addrs)  # no key: a pull target
    ctl = Control.connect(port)
    src = ctl.recv("ready")["src_blocks"]
    peer = common.cluster(PREFILL_CLUSTER, port)
    common.link(engine, [peer])
    key = BlocksCacheKey(cluster_id=PREFILL_CLUSTER, model_id=0)
    cm = engine.cache_manager

    # 1. All layers in one call (no ranges, K and V of every layer).
    cm.pull_blocks(key, cache, src, DST_ALL)
    expect_pull(kv, src, DST_ALL, range(TENSORS), range(TENSORS))
    kv.verify("pull_blocks, all layers")

    # 2. Layer by layer, as a pipelined prefill streams them (half-open ranges of layers).
    for layer in range(LAYERS):
        cm.pull_blocks(key, cache, src_blocks=src, dst_blocks=DST_PER_LAYER,
                       src_layer_range=range(layer, layer + 1), dst_layer_range=range(layer, layer + 1))
        expect_pull(kv, src, DST_PER_LAYER, range(2 * layer, 2 * layer + 2), range(2 * layer, 2 * layer + 2))
        kv.verify(f"pull_blocks, layer {layer}")

    # 3. Prefill's layers 1..3 into decode's layers 0..2.
    cm.pull_blocks(key, cache, src_blocks=src, dst_blocks=DST_SHIFTED,
                   src_layer_range=range(1, 4), dst_layer_range=range(0, 3), tensor_num_per_layer=2)
    expect_pull(kv, src, DST_SHIFTED, range(2, 8), range(0, 6))
    kv.verify("pull_blocks, layers 1-3 -> 0-2")

    # 4. A destination block past the pool: refused before anything moves.
    common.expect_exception(LLMStatusCode.LLM_PARAM_INVALID, "pull_blocks into block 24 of 24",
                            cm.pull_blocks, key, cache, src[:2], [0, DECODE_BLOCKS])
    kv.verify("nothing moved by the refused pull")

    common.unlink(engine, [peer])
    ctl.send("done", ok=True)
    cm.unregister_cache(cache.cache_id)
    engine.finalize()
    print("decode: every byte right")


if __name__ == "__main__":
    role, port_base, _ = common.parse_args("pull_blocks.py")
    prefill(port_base) if role == "prefill" else decode(port_base)
