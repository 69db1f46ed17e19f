"""kvdd example: prefill pushes KV blocks and a KV-cache row into decode with CANN's ``llm_datadist`` package.

    python push.py prefill PORT_BASE   # cluster 1, listens on 127.0.0.1:PORT_BASE, pushes
    python push.py decode  PORT_BASE   # cluster 2, links to it (a comm link serves both directions)

Calls: decode registers a blocks cache under ``BlocksCacheKey(2, model_id=0)`` and a contiguous
cache, links, and tells prefill its cache id; prefill calls ``push_blocks`` (all layers, then one
layer at a time with ``src_layer_range`` / ``dst_layer_range``) and ``push_cache`` (a row into
another row, by ``CacheKeyByIdAndIndex``).  Push needs remote-accessible caches
(``enable_remote_cache_accessible``).  Decode checks every byte of its caches after the pushes.
Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
"""

from __future__ import annotations

import numpy as np

from llm_datadist import BlocksCacheKey, CacheDesc, CacheKeyByIdAndIndex, DataType, LLMDataDist, LLMRole

import common
from common import DECODE_CLUSTER, LAYERS, PREFILL_CLUSTER, TENSORS, TOKEN_SHAPE, Control, Tensors

PREFILL_BLOCKS, DECODE_BLOCKS = 12, 16
SRC_BLOCKS = [2, 3, 4, 11]
DST_ALL = [0, 1, 2, 9]  # all layers in one call
DST_LAYERS = [5, 6, 7, 15]  # layer by layer
TOKENS, ROWS = 16, 3
ROW_WORDS = TOKENS * int(np.prod(TOKEN_SHAPE))


def row_shape(rows: int) -> list[int]:
    return [rows, TOKENS, *TOKEN_SHAPE]


def prefill(port: int) -> None:
    engine = LLMDataDist(LLMRole.PROMPT, PREFILL_CLUSTER)
    engine.init(common.config(device_id=0, listen_port=port))
    cm = engine.cache_manager
    blocks = Tensors(TENSORS, common.block_shape(PREFILL_BLOCKS))
    blocks.fill(tag=1)
    rows = Tensors(TENSORS, row_shape(ROWS))
    rows.fill(tag=2)
    src_blocks = cm.register_blocks_cache(CacheDesc(TENSORS, common.block_shape(PREFILL_BLOCKS),
                                                    DataType.DT_FLOAT16), blocks.addrs)
    src_rows = cm.register_cache(CacheDesc(TENSORS, row_shape(ROWS), DataType.DT_FLOAT16), rows.addrs)
    ctl = Control.listen(port)[0]
    linked = ctl.recv("linked")  # decode linked to us: the link serves pushes too

    key = BlocksCacheKey(DECODE_CLUSTER, model_id=0)
    cm.push_blocks(key, src_blocks, SRC_BLOCKS, DST_ALL)
    for layer in range(LAYERS):
        cm.push_blocks(key, src_blocks, src_blocks=SRC_BLOCKS, dst_blocks=DST_LAYERS,
                       src_layer_range=range(layer, layer + 1), dst_layer_range=range(layer, layer + 1),
                       tensor_num_per_layer=2)
    cm.push_cache(CacheKeyByIdAndIndex(DECODE_CLUSTER, linked["row_cache_id"], 0), src_rows, src_batch_index=2)
    ctl.send("pushed")
    done = ctl.recv("done")
    blocks.verify("prefill: source blocks intact")
    rows.verify("prefill: source rows intact")
    engine.finalize()
    if not done["ok"]:
        common.fail("decode reported a failure")
    print("prefill: decode reported every byte right")


def decode(port: int) -> None:
    engine = LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER)
    engine.init(common.config(device_id=1))
    cm = engine.cache_manager
    blocks = Tensors(TENSORS, common.block_shape(DECODE_BLOCKS))
    rows = Tensors(TENSORS, row_shape(ROWS))
    cm.register_blocks_cache(CacheDesc(TENSORS, common.block_shape(DECODE_BLOCKS), DataType.DT_FLOAT16),
                             blocks.addrs, BlocksCacheKey(DECODE_CLUSTER, model_id=0))
    row_cache = cm.register_cache(CacheDesc(TENSORS, row_shape(ROWS), DataType.DT_FLOAT16), rows.addrs)
    ctl = Control.connect(port)
    peer = common.cluster(PREFILL_CLUSTER, port)
    common.link(engine, [peer])
    ctl.send("linked", row_cache_id=row_cache.cache_id)
    ctl.recv("pushed")

    bw = common.block_words()
    for t in range(TENSORS):
        for dst in (DST_ALL, DST_LAYERS):
            for s, d in zip(SRC_BLOCKS, dst):
                blocks.expected[t][d * bw:(d + 1) * bw] = common.pattern(1, t, bw, s * bw)
        rows.expected[t][0:ROW_WORDS] = common.pattern(2, t, ROW_WORDS, 2 * ROW_WORDS)
    blocks.verify("push_blocks, all layers and layer by layer")
    rows.verify("push_cache, prefill row 2 -> decode row 0")

    common.unlink(engine, [peer])
    ctl.send("done", ok=True)
    engine.finalize()
    print("decode: every byte right")


if __name__ == "__main__":
    role, port_base, _ = common.parse_args("push.py")
    prefill(port_base) if role == "prefill" else decode(port_base)
