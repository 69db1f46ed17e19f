"""kvdd example: prefill streams KV blocks to decode layer by layer as it computes them, with CANN's
``llm_datadist`` package (``transfer_cache_async`` and a ``LayerSynchronizer``).

    python layerwise_push.py prefill PORT_BASE   # cluster 1, listens on 127.0.0.1:PORT_BASE
    python layerwise_push.py decode  PORT_BASE   # cluster 2, links to it

Decode registers its blocks under ``BlocksCacheKey(2, model_id=0)`` and links.  Prefill starts
``transfer_cache_async`` of a request's blocks, all layers, to that key, then "computes" the layers
one at a time (writes their K and V blocks); its ``LayerSynchronizer`` lets the transfer of layer
``l`` start only once layer ``l`` is written, so the compute of the next layer overlaps the
transfer of this one.  ``CacheTask.synchronize()`` and ``get_results()`` report LLM_SUCCESS, and
decode checks every byte: a layer sent before it was computed would arrive as the old bytes.
Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
"""

from __future__ import annotations

import threading
import time

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    TransferWithCacheKeyConfig,
)

import common
from common import DECODE_CLUSTER, LAYERS, PREFILL_CLUSTER, TENSORS, Control, Tensors

BLOCKS = 12
SRC_BLOCKS = [7, 1, 4, 10]
DST_BLOCKS = [0, 3, 2, 11]
COMPUTE_S = 0.02  # "compute" time per layer
WAIT_MS = 20000


class LayersDone(LayerSynchronizer):
    """Layer ``l`` may be sent once the compute loop has written it."""

    def __init__(self, layers: int) -> None:
        self.done = [threading.Event() for _ in range(layers)]
        self.asked: list[int] = []

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.asked.append(layer_index)
        return self.done[layer_index].wait(WAIT_MS / 1000)


def prefill(port: int) -> None:
    engine = LLMDataDist(LLMRole.PROMPT, PREFILL_CLUSTER)
    engine.init(common.config(device_id=0, listen_port=port))
    cm = engine.cache_manager
    kv = Tensors(TENSORS, common.block_shape(BLOCKS))
    kv.fill(tag=1)  # what the blocks hold before this request's layers are computed
    cache = cm.register_blocks_cache(CacheDesc(TENSORS, common.block_shape(BLOCKS), DataType.DT_FLOAT16), kv.addrs)
    ctl = Control.listen(port)[0]
    ctl.recv("linked")

    sync = LayersDone(LAYERS)
    config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODE_CLUSTER, model_id=0), range(0, LAYERS),
                                        range(0, LAYERS))
    task = cm.transfer_cache_async(cache, sync, [config], SRC_BLOCKS, DST_BLOCKS)
    bw = common.block_words()
    for layer in range(LAYERS):  # the "forward pass": write this layer's K and V blocks
        time.sleep(COMPUTE_S)
        for t in (2 * layer, 2 * layer + 1):
            words = kv.read(t).copy()
            for b in SRC_BLOCKS:
                words[b * bw:(b + 1) * bw] = common.pattern(3, t, bw, b * bw)
            kv.write(t, words)
            kv.expected[t] = words
        sync.done[layer].set()
    status = task.synchronize(WAIT_MS)
    results = task.get_results(WAIT_MS)
    if status != LLMStatusCode.LLM_SUCCESS or results != [LLMStatusCode.LLM_SUCCESS]:
        common.fail(f"transfer_cache_async: synchronize {status}, results {results}")
    if sync.asked != list(range(LAYERS)):
        common.fail(f"the layers were asked for in the order {sync.asked}")
    print(f"{'transfer_cache_async, one layer at a time':<52} ok ({status.name})", flush=True)
    ctl.send("pushed")
    done = ctl.recv("done")
    kv.verify("prefill: computed layers intact")
    engine.finalize()
    if not done["ok"]:
        common.fail("decode reported a failure")
    print("prefill: decode reported every byte right")


def decode(port: int) -> None:
    engine = LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER)
    engine.init(common.config(device_id=1))
    kv = Tensors(TENSORS, common.block_shape(BLOCKS))
    engine.cache_manager.register_blocks_cache(CacheDesc(TENSORS, common.block_shape(BLOCKS), DataType.DT_FLOAT16),
                                               kv.addrs, BlocksCacheKey(DECODE_CLUSTER, model_id=0))
    ctl = Control.connect(port)
    peer = common.cluster(PREFILL_CLUSTER, port)
    common.link(engine, [peer])
    ctl.send("linked")
    ctl.recv("pushed")
    bw = common.block_words()
    for t in range(TENSORS):
        for s, d in zip(SRC_BLOCKS, DST_BLOCKS):
            kv.expected[t][d * bw:(d + 1) * bw] = common.pattern(3, t, bw, s * bw)
    kv.verify("every layer arrived as computed")
    common.unlink(engine, [peer])
    ctl.send("done", ok=True)
    engine.finalize()
    print("decode: every byte right")


if __name__ == "__main__":
    role, port_base, _ = common.parse_args("layerwise_push.py")
    prefill(port_base) if role == "prefill" else decode(port_base)
