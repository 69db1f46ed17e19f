"""kvdd example: two instances swap roles with CANN's ``llm_datadist`` package (``switch_role``).

    python switch_role.py prefill PORT_BASE   # A: cluster 1, PROMPT, listens on PORT_BASE
    python switch_role.py decode  PORT_BASE   # B: cluster 2, DECODER

Phase 1: B links to A and pulls blocks of A's cache; ``switch_role`` while linked is refused with
LLM_EXIST_LINK; B unlinks (a non-force unlink removes the link on both sides).  Phase 2: A becomes
DECODER (``switch_role`` without options stops its listener), B becomes PROMPT listening on the
port A gave up (``{"llm.listenIpInfo": ...}``); A links to B and pulls blocks of B's cache, some of
which B had pulled from A in phase 1, then B pushes blocks into A layer by layer over the same
link.  Each side checks every byte of its cache.
Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
"""

from __future__ import annotations

from llm_datadist import BlocksCacheKey, Cache, CacheDesc, DataType, LLMDataDist, LLMRole, LLMStatusCode

import common
from common import DECODE_CLUSTER, PREFILL_CLUSTER, TENSORS, Control, Tensors

BLOCKS = 16
PHASE1 = ([0, 1, 2, 3], [8, 9, 10, 11])  # A's blocks -> B's blocks
PHASE2 = ([8, 9, 10, 4], [12, 13, 14, 15])  # B's blocks -> A's blocks (A pulls)
PUSH = ([5, 6], [9, 10])  # B's own blocks -> A's blocks (B pushes)


def register(engine: LLMDataDist, kv: Tensors, cluster_id: int) -> Cache:
    return engine.cache_manager.register_blocks_cache(
        CacheDesc(TENSORS, common.block_shape(BLOCKS), DataType.DT_FLOAT16), kv.addrs,
        BlocksCacheKey(cluster_id, model_id=0))


def pull(engine: LLMDataDist, cache: Cache, remote: int, src: list[int], dst: list[int]) -> None:
    engine.cache_manager.pull_blocks(BlocksCacheKey(remote, model_id=0), cache, src, dst)


def side_a(port: int) -> None:
    a = LLMDataDist(LLMRole.PROMPT, PREFILL_CLUSTER)
    a.init(common.config(device_id=0, listen_port=port))
    kv = Tensors(TENSORS, common.block_shape(BLOCKS))
    kv.fill(tag=1)
    cache = register(a, kv, PREFILL_CLUSTER)
    ctl = Control.listen(port)[0]
    ctl.send("ready")
    ctl.recv("unlinked")  # phase 1 done
    kv.verify("A: source intact after phase 1")

    a.switch_role(LLMRole.DECODER)  # no listen address: A stops listening
    ctl.send("switched")
    ctl.recv("listening")  # B is PROMPT now, listening on the port A gave up
    peer = common.cluster(DECODE_CLUSTER, port)
    common.link(a, [peer])
    pull(a, cache, DECODE_CLUSTER, *PHASE2)
    bw = common.block_words()
    for t in range(TENSORS):
        for s, d in zip(*PHASE2):
            # B's blocks 8-10 hold what B pulled from A in phase 1 (A's blocks 0-2); block 4 is B's own.
            src_tag, src_block = (1, PHASE1[0][PHASE1[1].index(s)]) if s in PHASE1[1] else (2, s)
            kv.expected[t][d * bw:(d + 1) * bw] = common.pattern(src_tag, t, bw, src_block * bw)
    kv.verify("A (now DECODER): pull_blocks from B")
    ctl.send("pulled")
    ctl.recv("pushed")  # B pushed over the link A made (comm links serve both directions)
    for t in range(TENSORS):
        for s, d in zip(*PUSH):
            kv.expected[t][d * bw:(d + 1) * bw] = common.pattern(2, t, bw, s * bw)
    kv.verify("A (now DECODER): push_blocks from B")
    common.unlink(a, [peer])
    ctl.send("done", ok=True)
    a.finalize()
    print("A: every byte right")


def side_b(port: int) -> None:
    b = LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER)
    b.init(common.config(device_id=1))
    kv = Tensors(TENSORS, common.block_shape(BLOCKS))
    kv.fill(tag=2)
    cache = register(b, kv, DECODE_CLUSTER)
    ctl = Control.connect(port)
    ctl.recv("ready")
    peer = common.cluster(PREFILL_CLUSTER, port)
    common.link(b, [peer])
    pull(b, cache, PREFILL_CLUSTER, *PHASE1)
    bw = common.block_words()
    for t in range(TENSORS):
        for s, d in zip(*PHASE1):
            kv.expected[t][d * bw:(d + 1) * bw] = common.pattern(1, t, bw, s * bw)
    kv.verify("B (DECODER): pull_blocks from A")
    common.expect_exception(LLMStatusCode.LLM_EXIST_LINK, "switch_role while linked", b.switch_role,
                            LLMRole.PROMPT, {"llm.listenIpInfo": f"{common.HOST}:{port}"})
    common.unlink(b, [peer])
    ctl.send("unlinked")

    ctl.recv("switched")
    b.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": f"{common.HOST}:{port}"})
    ctl.send("listening")
    ctl.recv("pulled")
    # Two tensors per layer, one layer at a time, into A's blocks.
    for layer in range(common.LAYERS):
        b.cache_manager.push_blocks(BlocksCacheKey(PREFILL_CLUSTER, model_id=0), cache, src_blocks=PUSH[0],
                                    dst_blocks=PUSH[1], src_layer_range=range(layer, layer + 1),
                                    dst_layer_range=range(layer, layer + 1), tensor_num_per_layer=2)
    ctl.send("pushed")
    done = ctl.recv("done")
    kv.verify("B (now PROMPT): source intact after phase 2")
    b.finalize()
    if not done["ok"]:
        common.fail("A reported a failure")
    print("B: every byte right")


if __name__ == "__main__":
    role, port_base, _ = common.parse_args("switch_role.py")
    side_a(port_base) if role == "prefill" else side_b(port_base)
