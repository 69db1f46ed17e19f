"""kvdd example: a rank-table link with CANN's ``llm_datadist`` package (``link`` /
``query_register_mem_status`` / ``unlink``), then a block pull over it.

    python rank_table.py prefill PORT_BASE   # cluster 1, rank 0
    python rank_table.py decode  PORT_BASE   # cluster 2, rank 1

Both sides register their caches first (memory registered after ``link`` is not reachable over
it), then call ``link(comm_name, {1: 0, 2: 1}, rank_table)`` at about the same time and poll
``query_register_mem_status`` until it is OK (PREPARING until every member has linked; FAILED ends
the program).  Nobody listens: the comm domain is found by ``comm_name`` (on hardware through
HCCL and the devices' IPs in the rank table; set EXAMPLE_DEVICE_IPS="ip0,ip1" there).  After the
link, a new registration defaults to not remote-accessible and an explicit
``remote_accessible=True`` is refused with LLM_PARAM_INVALID.  Decode pulls a request's blocks and
checks every byte; both sides ``unlink`` their comm id.
Exit status 0 when every byte is right, 1 on a failed call or a wrong byte, 2 on bad arguments.
"""

from __future__ import annotations

import json
import os
import time

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    RegisterMemStatus,
)

import common
from common import DECODE_CLUSTER, PREFILL_CLUSTER, TENSORS, Control, Tensors

BLOCKS = 12
SRC_BLOCKS = [5, 0, 7, 2]
DST_BLOCKS = [1, 2, 3, 11]
PREPARE_DEADLINE_S = 60.0
POLL_S = 0.05


def rank_table() -> tuple[str, str]:
    """``(comm_name, rank table JSON)`` of a two-member domain: prefill rank 0, decode rank 1."""
    ips = os.environ.get("EXAMPLE_DEVICE_IPS", "192.0.2.10,192.0.2.11").split(",")
    servers = [{"server_id": common.HOST,
                "device": [{"device_id": str(rank), "device_ip": ips[rank], "rank_id": str(rank)}]}
               for rank in (0, 1)]
    table = {"version": "1.0", "server_count": "2", "server_list": servers, "status": "completed"}
    return f"pd_comm_{ips[0]}_{ips[1]}", json.dumps(table)


def link_and_wait(engine: LLMDataDist) -> int:
    """``link`` the two-member domain and poll until its memory is registered; the comm id."""
    comm_name, table = rank_table()
    comm_id = engine.link(comm_name, {PREFILL_CLUSTER: 0, DECODE_CLUSTER: 1}, table)
    deadline = time.monotonic() + PREPARE_DEADLINE_S
    while True:
        status = engine.query_register_mem_status(comm_id=comm_id)
        if status == RegisterMemStatus.OK:
            print(f"{'link + query_register_mem_status':<52} ok (comm id {comm_id})", flush=True)
            return comm_id
        if status == RegisterMemStatus.FAILED:
            common.fail(f"query_register_mem_status({comm_id}) is FAILED")
        if time.monotonic() > deadline:
            common.fail(f"query_register_mem_status({comm_id}) still {status} after {PREPARE_DEADLINE_S:.0f} s")
        time.sleep(POLL_S)


def desc() -> CacheDesc:
    return CacheDesc(TENSORS, common.block_shape(BLOCKS), DataType.DT_FLOAT16)


def prefill(port: int) -> None:
    engine = LLMDataDist(LLMRole.PROMPT, PREFILL_CLUSTER)
    engine.init(common.config(device_id=0))
    kv = Tensors(TENSORS, common.block_shape(BLOCKS))
    kv.fill(tag=1)
    engine.cache_manager.register_blocks_cache(desc(), kv.addrs, BlocksCacheKey(PREFILL_CLUSTER, 0))
    ctl = Control.listen(port)[0]
    ctl.send("ready")  # registered: link now
    comm_id = link_and_wait(engine)
    done = ctl.recv("done")
    engine.unlink(comm_id)
    kv.verify("prefill: source intact")
    engine.finalize()
    if not done["ok"]:
        common.fail("decode reported a failure")
    print("prefill: decode reported every byte right")


def decode(port: int) -> None:
    engine = LLMDataDist(LLMRole.DECODER, DECODE_CLUSTER)
    engine.init(common.config(device_id=1))
    cm = engine.cache_manager
    kv = Tensors(TENSORS, common.block_shape(BLOCKS))
    cache = cm.register_blocks_cache(desc(), kv.addrs)
    ctl = Control.connect(port)
    ctl.recv("ready")
    comm_id = link_and_wait(engine)

    late = Tensors(TENSORS, common.block_shape(2))
    common.expect_exception(LLMStatusCode.LLM_PARAM_INVALID, "register remote_accessible=True after link",
                            cm.register_blocks_cache, CacheDesc(TENSORS, common.block_shape(2),
                                                                DataType.DT_FLOAT16),
                            late.addrs, None, remote_accessible=True)

    cm.pull_blocks(BlocksCacheKey(PREFILL_CLUSTER, model_id=0), cache, SRC_BLOCKS, DST_BLOCKS)
    bw = common.block_words()
    for t in range(TENSORS):
        for s, d in zip(SRC_BLOCKS, DST_BLOCKS):
            kv.expected[t][d * bw:(d + 1) * bw] = common.pattern(1, t, bw, s * bw)
    kv.verify("pull_blocks over the rank-table link")
    engine.unlink(comm_id)
    ctl.send("done", ok=True)
    engine.finalize()
    print("decode: every byte right")


if __name__ == "__main__":
    role, port_base, _ = common.parse_args("rank_table.py")
    prefill(port_base) if role == "prefill" else decode(port_base)
