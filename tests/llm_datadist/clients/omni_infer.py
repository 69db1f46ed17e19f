"""Harness shaped like omni-infer's ``LLMDataDistManager`` (PYPKG.md §7.1 (b)).

    omni_infer.py prefill PORT_BASE INDEX          # cluster 10 + INDEX, rank INDEX
    omni_infer.py decode  PORT_BASE N [SCENARIO]   # cluster 2, rank N: links N prefills

What it keeps of the client: the retry set (REPEAT_REQUEST, CLUSTER_NUM_EXCEED_LIMIT,
PROCESSING_LINK, DEVICE_OUT_OF_MEMORY, TIMEOUT, WAIT_PROCESS_TIMEOUT, LINK_BUSY); ``LLMConfig``
with ``device_id``, ``enable_switch_role``, ``enable_cache_manager``, ``sync_kv_timeout = 20000``,
``enable_remote_cache_accessible``; one ``register_blocks_cache(CacheDesc(num_tensors=, shape=<tuple>,
data_type=), addrs, key)`` per model, ``BlocksCacheKey(cluster_id, model_id=i)`` on prefill and
``None`` on decode; ``pull_blocks(BlocksCacheKey(prompt_cluster_id=..., model_id=...), cache, src,
dst)`` tried up to 3 times with a sleep between tries while the status is in the retry set,
``TypeError``/``ValueError`` re-raised; rank-table ``link`` of each prefill in batches (32 per
batch, a pause between batches), then ``query_register_mem_status`` polled until every link is OK.

The decode prints how many tries each pull took and the last status, so the tests can drive the
retry path with injected statuses (``KVDD_SIM_FAULTS``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import llm_datadist
from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    RegisterMemStatus,
)

import client_support as cs

log = logging.getLogger("omni_infer")

RETRYABLE_CODES = [
    LLMStatusCode.LLM_REPEAT_REQUEST,
    LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
    LLMStatusCode.LLM_PROCESSING_LINK,
    LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
    LLMStatusCode.LLM_TIMEOUT,
    LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
    LLMStatusCode.LLM_LINK_BUSY,
]
NUM_DIE_PER_HOST = 32  # links per batch
MODELS = 2  # two caches per instance, model ids 0 and 1
LAYERS = 2
BLOCKS = 10
BLOCK_BYTES = 256
DECODE_CLUSTER = 2


class LLMDataDistManager:
    def __init__(self, role: LLMRole, cluster_id: int, device_id: int) -> None:
        self.role = role
        self.local_cluster_id = cluster_id
        self.data_dist_engine = LLMDataDist(role, cluster_id)
        config = LLMConfig()
        config.device_id = device_id
        config.enable_switch_role = True
        config.enable_cache_manager = True
        config.sync_kv_timeout = 20000
        config.enable_remote_cache_accessible = True
        self.data_dist_engine.init(config.generate_options())
        self.data_dist_manager = self.data_dist_engine.cache_manager
        self.registered_kv_caches: list[Any] = []
        self.max_retry = 3
        self.retry_sleep_s = 2.0
        self.link_pause_s = 0.5
        self.query_interval_s = 3.0
        self.tries: list[int] = []  # per pull_kv call: tries used (for the harness)

    def register_memory(self, kv_caches: list[list[int]], shape: tuple[int, ...]) -> None:
        for model_id, addrs in enumerate(kv_caches):
            cache_desc = CacheDesc(num_tensors=len(addrs), shape=shape, data_type=llm_datadist.DataType.DT_INT8)
            cache_key = BlocksCacheKey(self.local_cluster_id, model_id=model_id) \
                if self.role == LLMRole.PROMPT else None
            self.registered_kv_caches.append(
                self.data_dist_manager.register_blocks_cache(cache_desc, addrs, cache_key))

    def pull_kv(self, src_blocks: list[int], dst_blocks: list[int], prompt_cluster_id: int) -> None:
        for model_id, kv_cache in enumerate(self.registered_kv_caches):
            prompt_cache_key = BlocksCacheKey(prompt_cluster_id=prompt_cluster_id, model_id=model_id)
            self._pull_blocks(prompt_cache_key, kv_cache, src_blocks, dst_blocks)

    def _pull_blocks(self, src_cache_key: BlocksCacheKey, dst_cache: Any, src_blocks: list[int],
                     dst_blocks: list[int]) -> None:
        for attempt in range(1, self.max_retry + 1):
            try:
                self.data_dist_manager.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks)
                self.tries.append(attempt)
                return
            except LLMException as e:
                code = e.status_code
                if code in RETRYABLE_CODES and attempt < self.max_retry:
                    log.warning("pull_blocks: %s, retrying (%d/%d)", code, attempt, self.max_retry)
                    time.sleep(self.retry_sleep_s)
                    continue
                self.tries.append(attempt)
                raise
            except (TypeError, ValueError):
                raise

    def link(self, domains: list[tuple[str, dict[int, int], str]]) -> list[int]:
        """Rank-table ``link`` of every ``(comm_name, cluster_rank_info, rank_table)``,
        ``NUM_DIE_PER_HOST`` per batch with a pause between batches, then poll until all are OK."""
        comm_ids: list[int] = []
        for start in range(0, len(domains), NUM_DIE_PER_HOST):
            for comm_name, cluster_rank_info, rank_table in domains[start:start + NUM_DIE_PER_HOST]:
                comm_ids.append(self.data_dist_engine.link(comm_name, cluster_rank_info, rank_table))
            time.sleep(self.link_pause_s)
        pending = set(comm_ids)
        while pending:
            for comm_id in sorted(pending):
                status = self.data_dist_engine.query_register_mem_status(comm_id)
                if status == RegisterMemStatus.OK:
                    pending.discard(comm_id)
                elif status == RegisterMemStatus.FAILED:
                    raise RuntimeError(f"link of comm id {comm_id} failed")
            if pending:
                time.sleep(self.query_interval_s)
        return comm_ids


def domain(prefill_cluster: int) -> tuple[str, dict[int, int], str]:
    """The two-member rank-table domain of one prefill (rank 0) and the decode (rank 1)."""
    devices = [{"device_id": str(r), "device_ip": f"192.0.2.{prefill_cluster}", "rank_id": str(r)}
               for r in (0, 1)]
    devices[1]["device_ip"] = "192.0.2.200"
    table = json.dumps({"version": "1.0", "server_count": "1", "status": "completed",
                        "server_list": [{"server_id": cs.HOST, "device": devices}]})
    return f"omni_pd_{prefill_cluster}", {prefill_cluster: 0, DECODE_CLUSTER: 1}, table


def shape() -> tuple[int, ...]:
    return (BLOCKS, BLOCK_BYTES)


def prefill(port: int, index: int) -> None:
    cluster_id = 10 + index
    mgr = LLMDataDistManager(LLMRole.PROMPT, cluster_id, index)
    mems = [cs.Memory(2 * LAYERS, BLOCKS * BLOCK_BYTES) for _ in range(MODELS)]
    for m, mem in enumerate(mems):
        mem.fill(cluster_id, [100 * m + t for t in range(2 * LAYERS)])
    mgr.register_memory([m.addrs for m in mems], shape())
    ctl = cs.Control.connect(port)
    ctl.send("ready", index=index, cluster_id=cluster_id)
    ctl.recv("link")
    mgr.query_interval_s = 0.02  # the manager polls every 3 s and pauses 0.5 s per batch
    mgr.link_pause_s = 0.0
    (comm_id,) = mgr.link([domain(cluster_id)])
    ctl.recv("done")
    mgr.data_dist_engine.unlink(comm_id)
    checked = sum(m.verify("prefill source intact") for m in mems)
    mgr.data_dist_engine.finalize()
    cs.result(role="prefill", cluster_id=cluster_id, checked=checked)


def decode(port: int, n: int, expect_failure: bool) -> None:
    mgr = LLMDataDistManager(LLMRole.DECODER, DECODE_CLUSTER, n)
    mgr.retry_sleep_s = 0.05  # the manager sleeps 2 s between tries
    mgr.link_pause_s = 0.0
    mgr.query_interval_s = 0.02
    mems = [cs.Memory(2 * LAYERS, BLOCKS * BLOCK_BYTES) for _ in range(MODELS)]
    mgr.register_memory([m.addrs for m in mems], shape())
    ctls = cs.Control.listen(port, peers=n)
    ready = sorted((c.recv("ready") for c in ctls), key=lambda m: int(m["index"]))
    for c in ctls:
        c.send("link")
    comm_ids = dict(zip((int(m["cluster_id"]) for m in ready),
                        mgr.link([domain(int(m["cluster_id"])) for m in ready])))
    status = "LLM_SUCCESS"
    for i, msg in enumerate(ready):
        cid = int(msg["cluster_id"])
        src, dst = [1, 2, 5], [3 * i, 3 * i + 1, 3 * i + 2]
        try:
            mgr.pull_kv(src, dst, cid)
        except LLMException as e:
            status = e.status_code.name
            break
        for m, mem in enumerate(mems):
            for t in range(2 * LAYERS):
                mem.expect_blocks(t, cid, 100 * m + t, BLOCK_BYTES, src, dst)
    checked = sum(m.verify("decode after the pulls") for m in mems)  # a failed pull moved nothing
    if (status != "LLM_SUCCESS") != expect_failure:
        cs.fail(f"pulls ended with {status}")
    for cid, comm_id in comm_ids.items():
        mgr.data_dist_engine.unlink(comm_id)
    for c in ctls:
        c.send("done")
    mgr.data_dist_engine.finalize()
    cs.result(role="decode", tries=mgr.tries, status=status, checked=checked)


def main() -> None:
    role, port, extra = cs.args()
    if role.startswith("prefill"):
        prefill(port, int(extra[0]))
    else:
        decode(port, int(extra[0]), len(extra) > 1 and extra[1] == "expect-failure")


if __name__ == "__main__":
    main()
