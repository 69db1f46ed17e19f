"""kvdd example: decode pulls contiguous KV-cache rows from prefill with CANN's ``llm_datadist`` package.

    python pull_cache.py prefill PORT_BASE   # cluster 1, listens on 127.0.0.1:PORT_BASE
    python pull_cache.py decode  PORT_BASE   # cluster 2, links to it and pulls

Calls: ``register_cache`` of a ``[rows, tokens, heads, dim]`` cache, ``link_clusters``,
``pull_cache`` with a ``CacheKeyByIdAndIndex`` naming the prefill's cache id and row: a whole row
into another row, the first tokens of a row (``size``), and one layer of a row into another layer
(``src_layer_range`` / ``dst_layer_range``).  A ``size`` one byte past the row is refused with
LLM_PARAM_INVALID.  Decode checks every byte of its cache after each step.
Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
"""

from __future__ import annotations

import numpy as np

from llm_datadist import CacheDesc, CacheKeyByIdAndIndex, DataType, LLMDataDist, LLMRole, LLMStatusCode

import common
from common import DECODE_CLUSTER, PREFILL_CLUSTER, TENSORS, TOKEN_SHAPE, Control, Tensors

TOKENS = 32
PREFILL_ROWS = 3
DECODE_ROWS = 3
TOKEN_WORDS = int(np.prod(TOKEN_SHAPE))  # float16: one uint16 word per element
ROW_WORDS = TOKENS * TOKEN_WORDS
PREFIX_TOKENS = 13


def shape(rows: int) -> list[int]:
    return [rows, TOKENS, *TOKEN_SHAPE]


def prefill(port: int) -> None:
    engine = LLMDataDist(LLMRole.PROMPT, PREFILL_CLUSTER)
    engine.init(common.config(device_id=0, listen_port=port))
    kv = Tensors(TENSORS, shape(PREFILL_ROWS))
    kv.fill(tag=1)
    cache = engine.cache_manager.register_cache(CacheDesc(TENSORS, shape(PREFILL_ROWS), DataType.DT_FLOAT16),
                                                kv.addrs)
    ctl = Control.listen(port)[0]
    ctl.send("ready", cache_id=cache.cache_id)
    done = ctl.recv("done")
    kv.verify("prefill: source cache intact")
    engine.finalize()
    if not done["ok"]:
        common.fail("decode reported a failure")
    print("prefill: decode reported every byte right")


def expect_rows(kv: Tensors, src_row: int, dst_row: int, words: int, src_tensors: range, dst_tensors: range) -> None:
    for s_t, d_t in zip(src_tensors, dst_tensors):
        kv.expected[d_t][dst_row * ROW_WORDS:dst_row * ROW_WORDS + words] = \
            common.pattern(1, s_t, words, src_row * ROW_WORDS)


def decode(port: int) -> None:
    engine = LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER)
    engine.init(common.config(device_id=1))
    kv = Tensors(TENSORS, shape(DECODE_ROWS))
    cm = engine.cache_manager
    cache = cm.register_cache(CacheDesc(TENSORS, shape(DECODE_ROWS), DataType.DT_FLOAT16), kv.addrs)
    ctl = Control.connect(port)
    remote_id = ctl.recv("ready")["cache_id"]
    peer = common.cluster(PREFILL_CLUSTER, port)
    common.link(engine, [peer])

    # 1. Prefill's row 2 into our row 1, every tensor.
    cm.pull_cache(CacheKeyByIdAndIndex(PREFILL_CLUSTER, remote_id, 2), cache, 1)
    expect_rows(kv, 2, 1, ROW_WORDS, range(TENSORS), range(TENSORS))
    kv.verify("pull_cache, row 2 -> row 1")

    # 2. The first PREFIX_TOKENS tokens of prefill's row 0 into our row 0 (size in bytes per tensor).
    size = PREFIX_TOKENS * TOKEN_WORDS * 2
    cm.pull_cache(CacheKeyByIdAndIndex(cluster_id=PREFILL_CLUSTER, cache_id=remote_id, batch_index=0), cache,
                  batch_index=0, size=size)
    expect_rows(kv, 0, 0, PREFIX_TOKENS * TOKEN_WORDS, range(TENSORS), range(TENSORS))
    kv.verify(f"pull_cache, first {PREFIX_TOKENS} tokens of row 0")

    # 3. Layer 3 of prefill's row 1 into layer 0 of our row 2.
    cm.pull_cache(CacheKeyByIdAndIndex(PREFILL_CLUSTER, remote_id, 1), cache, batch_index=2,
                  src_layer_range=range(3, 4), dst_layer_range=range(0, 1))
    expect_rows(kv, 1, 2, ROW_WORDS, range(6, 8), range(0, 2))
    kv.verify("pull_cache, row 1 layer 3 -> row 2 layer 0")

    # 4. One byte more than a row: refused, nothing moves.
    common.expect_exception(LLMStatusCode.LLM_PARAM_INVALID, "pull_cache with size = row + 1 byte",
                            cm.pull_cache, CacheKeyByIdAndIndex(PREFILL_CLUSTER, remote_id, 0), cache, 0,
                            ROW_WORDS * 2 + 1)
    kv.verify("nothing moved by the refused pull")

    common.unlink(engine, [peer])
    ctl.send("done", ok=True)
    engine.finalize()
    print("decode: every byte right")


if __name__ == "__main__":
    role, port_base, _ = common.parse_args("pull_cache.py")
    prefill(port_base) if role == "prefill" else decode(port_base)
