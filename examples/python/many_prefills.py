"""kvdd example: one decode pulls from several prefills at once with CANN's ``llm_datadist`` package.

    python many_prefills.py prefill PORT_BASE I   # cluster 10 + I, listens on PORT_BASE + I
    python many_prefills.py decode  PORT_BASE N   # cluster 2, links to the N prefills (N <= 8)

Each prefill registers its blocks under ``BlocksCacheKey(its cluster, model_id=0)`` and tells the
decode its block table.  The decode links to all of them in one ``link_clusters`` call, pulls
every prefill's request concurrently from a thread pool (as serving engines do) into its own
blocks, checks every byte, and unlinks them all in one ``unlink_clusters`` call.
Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from llm_datadist import BlocksCacheKey, Cache, CacheDesc, DataType, LLMDataDist, LLMRole

import common
from common import DECODE_CLUSTER, TENSORS, Control, Tensors

PREFILL_BLOCKS = 8
REQUEST_BLOCKS = 3
MAX_PREFILLS = 8


def prefill_cluster(i: int) -> int:
    return 10 + i


def desc(blocks: int) -> CacheDesc:
    return CacheDesc(TENSORS, common.block_shape(blocks), DataType.DT_FLOAT16)


def prefill(port: int, i: int) -> None:
    cluster_id = prefill_cluster(i)
    engine = LLMDataDist(LLMRole.PROMPT, cluster_id)
    engine.init(common.config(device_id=i, listen_port=port + i))
    kv = Tensors(TENSORS, common.block_shape(PREFILL_BLOCKS))
    kv.fill(tag=cluster_id)
    engine.cache_manager.register_blocks_cache(desc(PREFILL_BLOCKS), kv.addrs, BlocksCacheKey(cluster_id, 0))
    ctl = Control.connect(port)
    # A different, non-contiguous block table on every prefill.
    table = [(i + 3 * k) % PREFILL_BLOCKS for k in range(REQUEST_BLOCKS)]
    ctl.send("ready", index=i, cluster_id=cluster_id, src_blocks=table)
    done = ctl.recv("done")
    kv.verify(f"prefill {i}: source intact")
    engine.finalize()
    if not done["ok"]:
        common.fail("decode reported a failure")
    print(f"prefill {i}: decode reported every byte right")


def decode(port: int, n: int) -> None:
    if not 1 <= n <= MAX_PREFILLS:
        common.fail(f"decode needs 1..{MAX_PREFILLS} prefills, not {n}")
    engine = LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER)
    engine.init(common.config(device_id=n))
    blocks = n * REQUEST_BLOCKS + 2  # two blocks nobody writes
    kv = Tensors(TENSORS, common.block_shape(blocks))
    cache: Cache = engine.cache_manager.register_blocks_cache(desc(blocks), kv.addrs)
    ctls = Control.listen(port, peers=n)
    ready = sorted((c.recv("ready") for c in ctls), key=lambda m: int(m["index"]))
    if [int(m["index"]) for m in ready] != list(range(n)):
        common.fail(f"expected prefills 0..{n - 1}, got {[m['index'] for m in ready]}")
    peers = [common.cluster(int(m["cluster_id"]), port + int(m["index"])) for m in ready]
    common.link(engine, peers)

    def pull(i: int) -> None:
        # Prefill i's request lands in our blocks n*i.. in reverse order.
        dst = [REQUEST_BLOCKS * (i + 1) - 1 - k for k in range(REQUEST_BLOCKS)]
        engine.cache_manager.pull_blocks(BlocksCacheKey(prefill_cluster(i), model_id=0), cache,
                                         ready[i]["src_blocks"], dst)

    with ThreadPoolExecutor(max_workers=n) as pool:
        for f in [pool.submit(pull, i) for i in range(n)]:
            f.result()  # re-raises a failed pull's LLMException

    bw = common.block_words()
    for i in range(n):
        dst = [REQUEST_BLOCKS * (i + 1) - 1 - k for k in range(REQUEST_BLOCKS)]
        for t in range(TENSORS):
            for s, d in zip(ready[i]["src_blocks"], dst):
                kv.expected[t][d * bw:(d + 1) * bw] = common.pattern(prefill_cluster(i), t, bw, s * bw)
    kv.verify(f"pull_blocks from {n} prefills concurrently")
    common.unlink(engine, peers)
    for c in ctls:
        c.send("done", ok=True)
    engine.finalize()
    print("decode: every byte right")


if __name__ == "__main__":
    role, port_base, index = common.parse_args("many_prefills.py", indexed=True)
    prefill(port_base, index) if role == "prefill" else decode(port_base, index or 3)
