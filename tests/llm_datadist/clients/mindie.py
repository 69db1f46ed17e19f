"""Harness shaped like MindIE-LLM's ``SeparateDeploymentEngine`` / worker (PYPKG.md §7.1 (c)).

    mindie.py prefill|decode PORT_BASE [ROLE_OF_PREFILL] [PULL_TRIES]

What it keeps of the client: ``LLMConfig`` imported as ``LLMDataDistConfig``; roles PROMPT /
DECODER / MIX; ``device_id``, ``enable_cache_manager``, ``enable_remote_cache_accessible``,
``link_total_time`` (seconds), ``link_retry_count = 80``, ``sync_kv_timeout`` = seconds x 1000;
raw ``llm.RdmaServiceLevel`` / ``llm.RdmaTrafficClass`` added to the generated dict after the
client's own range checks (0-7, 0-255); per model a ``CacheDesc(num_tensors=, shape=(num_blocks,
*block_shape), data_type=, placement=Placement.DEVICE)`` registered with ``BlocksCacheKey(cluster_id=
local, model_id=0|1)`` (K = model 0, V = model 1); a version "1.0" rank table and
``link(link_name, cluster_rank_info, rank_table)`` whose result is compared with
``LLMStatusCode.LLM_ALREADY_LINK``; a failed link (``LLMException``) is reported and the link is
requested again by the coordinator; ``query_register_mem_status`` asked a few times, then the
link is re-queued (FAILED: unlink); ``pull_blocks(BlocksCacheKey(cluster_id=, model_id=), cache,
src, dst)`` per model after the client-side check that every destination block id is below
``num_blocks``, an ``LLMException``'s ``status_code`` logged and an error code returned (the
scheduler retries the request); ``unlink(comm_id)``; ``finalize``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)
from llm_datadist import LLMConfig as LLMDataDistConfig

import client_support as cs

logger = logging.getLogger("mindie")

SUCCESS, PULL_KV_ERROR, LINK_ERROR, RETRY_QUERY, BLOCK_ID_OUT_OF_RANGE = 0, 1, 2, 3, 4
ROLES = {"prefill": LLMRole.PROMPT, "decoder": LLMRole.DECODER, "mix": LLMRole.MIX}
STR_DTYPE_TO_DTYPE = {"float16": DataType.DT_FLOAT16, "bfloat16": DataType.DT_BF16,
                      "float": DataType.DT_FLOAT, "int8": DataType.DT_INT8}
PREFILL_CLUSTER, DECODE_CLUSTER = 100, 200
DEVICE_IPS = {PREFILL_CLUSTER: "198.51.100.1", DECODE_CLUSTER: "198.51.100.2"}
LAYERS = 3
NUM_BLOCKS = {PREFILL_CLUSTER: 8, DECODE_CLUSTER: 12}
BLOCK_SHAPE = (4, 2, 8)  # block size 4 tokens, 2 heads, dim 8, int8


class SeparateDeploymentEngine:
    def __init__(self, role: str, local_cluster_id: int, local_logic_device_id: int, kv_trans_timeout: int = 1,
                 kv_link_timeout: int = 1080, kv_rdma_sl: int = -1, kv_rdma_tc: int = -1) -> None:
        self.separate_deployment_engine = LLMDataDist(ROLES[role], local_cluster_id)
        config = LLMDataDistConfig()
        config.device_id = local_logic_device_id
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        config.link_total_time = kv_link_timeout
        config.link_retry_count = 80
        config.sync_kv_timeout = kv_trans_timeout * 1000
        options = config.generate_options()
        if 0 <= kv_rdma_sl <= 7:
            options["llm.RdmaServiceLevel"] = str(kv_rdma_sl)
        if 0 <= kv_rdma_tc <= 255:
            options["llm.RdmaTrafficClass"] = str(kv_rdma_tc)
        self.separate_deployment_engine.init(options)
        self.npu_cache_map: dict[int, Any] = {}

    def link(self, link_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> dict[str, Any]:
        try:
            result = self.separate_deployment_engine.link(link_name, cluster_rank_info, rank_table)
            if result == LLMStatusCode.LLM_ALREADY_LINK:  # never true: link returns an id or raises
                return {"status": LINK_ERROR, "comm_id": None}
            return {"status": SUCCESS, "comm_id": result}
        except LLMException as e:
            logger.error("Link failed, error code is %s", e.status_code)
            return {"status": LINK_ERROR, "comm_id": None, "code": e.status_code.name}

    def unlink(self, comm_id: int) -> int:
        try:
            self.separate_deployment_engine.unlink(comm_id)
            return SUCCESS
        except LLMException:
            return LINK_ERROR

    def pull_kv(self, model_id: int, src_block_table: list[int], dst_block_table: list[int],
                remote_cluster_id: int) -> tuple[int, str]:
        remote_cache_key = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=model_id)
        try:
            self.separate_deployment_engine.cache_manager.pull_blocks(
                remote_cache_key, self.npu_cache_map[model_id], src_block_table, dst_block_table)
            return SUCCESS, "LLM_SUCCESS"
        except LLMException as e:
            logger.error("Pull kv from remote_cluster_id: %d failed, CANN status_code is: %s",
                         remote_cluster_id, e.status_code)
            return PULL_KV_ERROR, e.status_code.name

    def register_blocks_cache(self, cache_desc: CacheDesc, npu_addrs: list[int], cache_key: BlocksCacheKey) -> Any:
        return self.separate_deployment_engine.cache_manager.register_blocks_cache(cache_desc, npu_addrs, cache_key)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        return self.separate_deployment_engine.query_register_mem_status(comm_id)

    def finalize(self) -> None:
        self.separate_deployment_engine.finalize()


class SeparateDeploymentWorker:
    def __init__(self, role: str, cluster_id: int, device_id: int) -> None:
        self.local_cluster_id = cluster_id
        self.engine = SeparateDeploymentEngine(role, cluster_id, device_id, kv_trans_timeout=10,
                                               kv_link_timeout=20, kv_rdma_sl=3, kv_rdma_tc=100)
        self.cache_desc_map: dict[int, CacheDesc] = {}
        self.max_block_nums_map: dict[int, int] = {}
        self.cluster_comm_map: dict[int, int] = {}
        self.statuses: list[str] = []

    def build(self, model_id: int, num_tensors: int, num_blocks: int, blockshape: tuple[int, ...], dtype: str) -> None:
        self.cache_desc_map[model_id] = CacheDesc(num_tensors=int(num_tensors), shape=(int(num_blocks), *blockshape),
                                                  data_type=STR_DTYPE_TO_DTYPE[dtype], placement=Placement.DEVICE)
        self.max_block_nums_map[model_id] = num_blocks

    def set_npu_cache(self, model_id: int, npu_addrs: list[int]) -> None:  # K is model 0, V model 1
        cache_key = BlocksCacheKey(cluster_id=self.local_cluster_id, model_id=model_id)
        self.engine.npu_cache_map[model_id] = self.engine.register_blocks_cache(
            self.cache_desc_map[model_id], npu_addrs, cache_key)

    def try_link(self, remote_cluster_id: int) -> bool:
        """One link attempt and its queries; True once the memory status is OK."""
        ranks = sorted((self.local_cluster_id, remote_cluster_id), key=lambda c: DEVICE_IPS[c])
        cluster_rank_info = {c: r for r, c in enumerate(ranks)}
        rank_table = json.dumps({"version": "1.0", "server_count": "2", "status": "completed", "server_list": [
            {"server_id": cs.HOST, "device": [{"device_id": str(r), "device_ip": DEVICE_IPS[c], "rank_id": str(r)}]}
            for r, c in enumerate(ranks)]})
        ips = sorted(DEVICE_IPS.values(), reverse=True)
        result = self.engine.link(f"link{ips[0]}:{ips[1]}_0:0", cluster_rank_info, rank_table)
        if result["status"] != SUCCESS:
            self.statuses.append(f"link:{result.get('code')}")
            return False
        self.cluster_comm_map[remote_cluster_id] = result["comm_id"]
        while True:  # the window: a few queries, then requeued
            for _ in range(3):
                status = self.engine.query_register_mem_status(result["comm_id"])
                if status == RegisterMemStatus.OK:
                    return True
                if status == RegisterMemStatus.FAILED:
                    self.engine.unlink(self.cluster_comm_map.pop(remote_cluster_id))
                    self.statuses.append("query:FAILED")
                    return False
                time.sleep(0.05)

    def pull_blocks(self, remote_cluster_id: int, src_block_table: list[int], dst_block_table: list[int]) -> int:
        if remote_cluster_id not in self.cluster_comm_map:
            return LINK_ERROR
        for model_id in self.cache_desc_map:
            if not all(0 <= x < self.max_block_nums_map[model_id] for x in dst_block_table):
                return BLOCK_ID_OUT_OF_RANGE
            rt, name = self.engine.pull_kv(model_id, src_block_table, dst_block_table, remote_cluster_id)
            self.statuses.append(f"pull:{name}")
            if rt != SUCCESS:
                return rt
        return SUCCESS

    def unlink(self, remote_cluster_id: int) -> int:
        return self.engine.unlink(self.cluster_comm_map.pop(remote_cluster_id))


def worker_with_caches(role: str, cluster_id: int, device_id: int, tag: int | None) -> tuple[SeparateDeploymentWorker,
                                                                                              list[cs.Memory]]:
    worker = SeparateDeploymentWorker(role, cluster_id, device_id)
    blocks = NUM_BLOCKS[cluster_id]
    mems = []
    for model_id in (0, 1):  # K, V
        worker.build(model_id, LAYERS, blocks, BLOCK_SHAPE, "int8")
        mem = cs.Memory(LAYERS, blocks * 64)
        if tag is not None:
            mem.fill(tag, [10 * model_id + t for t in range(LAYERS)])
        worker.set_npu_cache(model_id, mem.addrs)
        mems.append(mem)
    return worker, mems


def link_with_retries(worker: SeparateDeploymentWorker, remote: int, tries: int = 5) -> int:
    """The coordinator asks again after a failed link; the attempts used."""
    for attempt in range(1, tries + 1):
        if worker.try_link(remote):
            return attempt
        time.sleep(0.05)
    cs.fail(f"no link to {remote} after {tries} attempts: {worker.statuses}")


def main() -> None:
    role, port, extra = cs.args()
    prefill_role = extra[0] if extra else "prefill"
    if role == "prefill":
        worker, mems = worker_with_caches(prefill_role, PREFILL_CLUSTER, 0, tag=7)
        ctl = cs.Control.listen(port)[0]
        ctl.send("ready")
        attempts = link_with_retries(worker, DECODE_CLUSTER)
        ctl.recv("done")
        if worker.unlink(DECODE_CLUSTER) != SUCCESS:
            cs.fail("unlink failed")
        checked = sum(m.verify("prefill source intact") for m in mems)
        worker.engine.finalize()
        cs.result(role=role, link_attempts=attempts, checked=checked)
        return
    worker, mems = worker_with_caches("decoder", DECODE_CLUSTER, 1, tag=None)
    ctl = cs.Control.connect(port)
    ctl.recv("ready")
    attempts = link_with_retries(worker, PREFILL_CLUSTER)
    if worker.pull_blocks(PREFILL_CLUSTER, [0, 1], [0, NUM_BLOCKS[DECODE_CLUSTER]]) != BLOCK_ID_OUT_OF_RANGE:
        cs.fail("a destination block past num_blocks was not refused by the client's check")
    src, dst = [3, 4, 7, 0], [11, 2, 3, 4]
    pulls = 0
    while True:  # the scheduler retries a request whose pull failed
        pulls += 1
        rt = worker.pull_blocks(PREFILL_CLUSTER, src, dst)
        if rt == SUCCESS:
            break
        if pulls >= 5:
            cs.fail(f"pull failed {pulls} times: {worker.statuses}")
        time.sleep(0.05)
    for model_id, mem in enumerate(mems):
        for t in range(LAYERS):
            mem.expect_blocks(t, 7, 10 * model_id + t, 64, src, dst)
    checked = sum(m.verify("decode after pull_blocks (K and V models)") for m in mems)
    if worker.unlink(PREFILL_CLUSTER) != SUCCESS:
        cs.fail("unlink failed")
    ctl.send("done")
    worker.engine.finalize()
    cs.result(role=role, link_attempts=attempts, pulls=pulls, statuses=worker.statuses, checked=checked)


if __name__ == "__main__":
    main()
