"""Harness shaped like vllm-ascend's ``LLMDataDistCMgrConnector`` (PYPKG.md §7.1 (a)).

    vllm_cmgr.py prefill|decode PORT_BASE mha|mla|sparse

What it keeps of the client: ``LLMConfig`` with ``device_id`` = local rank, ``sync_kv_timeout``,
``enable_switch_role``, ``enable_cache_manager`` and ``enable_remote_cache_accessible`` all set;
``init(generate_options())``; MHA: one blocks cache ``CacheDesc(2 * layers, [*kv.shape], dtype)``
(positional) over K0, V0, K1, V1, ... with 2 MiB-aligned addresses and ``BlocksCacheKey(cluster_id=
local)``; MLA: two caches of ``layers`` tensors each, ``model_id`` 0 and 1; ``(TypeError,
ValueError)`` from registration become RuntimeError; sparse attention (DeepSeek V3.2): three such
caches, ``model_id`` 0, 1, 2; a version "1.2" rank table, ``comm_name =
"pd_comm_<P device ip>_<D device ip>"``, ``cluster_rank_info = {P: 0, D: 1}``, ``link`` by both
sides and ``query_register_mem_status(comm_id=...)`` polled with no deadline until OK (FAILED ->
RuntimeError); pulls from a thread pool with ``pull_blocks(BlocksCacheKey(cluster_id=remote,
model_id=m), cache, remote_block_ids, local_block_ids)`` -- positional lists, no layer ranges,
the default ``tensor_num_per_layer`` (the MLA caches of one tensor per layer rely on the no-range
leniency), the remote list trimmed to the last ``len(local)`` ids; any ``LLMException`` becomes
RuntimeError; ``unlink(comm_id)`` with ``LLMException`` swallowed; never ``finalize`` (the
package's exit hook does it).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llm_datadist
from llm_datadist import BlocksCacheKey, CacheDesc, LLMConfig, LLMDataDist, LLMException, LLMRole

import client_support as cs

log = logging.getLogger("vllm_cmgr")

TORCH_DTYPE_TO_DATADIST = {
    "float16": llm_datadist.DataType.DT_FLOAT16,
    "bfloat16": llm_datadist.DataType.DT_BF16,
    "float32": llm_datadist.DataType.DT_FLOAT,
    "int8": llm_datadist.DataType.DT_INT8,
    "int64": llm_datadist.DataType.DT_INT64,
    "int32": llm_datadist.DataType.DT_INT32,
}
PREFILL_CLUSTER, DECODE_CLUSTER = 1, 2
DEVICE_IPS = {PREFILL_CLUSTER: "192.0.2.1", DECODE_CLUSTER: "192.0.2.2"}
LAYERS = {"mha": 4, "mla": 3, "sparse": 3}  # MLA with an odd layer count: no ranges, default t = 2
BLOCK_SIZE = 16
PREFILL_BLOCKS, DECODE_BLOCKS = 12, 20
# Per cache family: the token's shape (heads, dim) in float16.
# "sparse" (DeepSeek V3.2): the two MLA caches and the indexer's keys, model ids 0, 1, 2.
FAMILIES = {"mha": [(2, 8)], "mla": [(1, 32), (1, 8)], "sparse": [(1, 32), (1, 8), (1, 16)]}
# Two requests: the second has its first two blocks cached on decode already (prefix hit), so its
# remote list is longer than its local one and the connector keeps the last len(local) ids.
REQUESTS = {"r0": ([7, 2, 9], [4, 5, 6]), "r1": ([0, 11, 3, 8, 1], [13, 17, 12])}


class CMgrWorker:
    """The connector's worker: one engine, its caches, rank-table links, block reads."""

    def __init__(self, role: str, cluster_id: int, local_rank: int, transfer_timeout_ms: int) -> None:
        self.local_cluster_id = cluster_id
        llm_role = LLMRole.PROMPT if role == "kv_producer" else LLMRole.DECODER
        self.llm_datadist = LLMDataDist(llm_role, cluster_id)
        llm_config = LLMConfig()
        llm_config.device_id = local_rank
        llm_config.sync_kv_timeout = transfer_timeout_ms
        llm_config.enable_switch_role = True
        llm_config.enable_cache_manager = True
        llm_config.enable_remote_cache_accessible = True
        self.llm_datadist.init(llm_config.generate_options())
        self.cache_manager = self.llm_datadist.cache_manager
        self.cache: list[Any] = []  # per model id
        self.linked_cluster: dict[int, int] = {}
        self.poll_interval_s = 1.0

    def register_kv_caches(self, families: list[list[int]], shapes: list[tuple[int, ...]], dtype: str,
                           use_mla: bool) -> None:
        """``families[m]``: the tensor addresses of cache ``m``; ``shapes[m]`` one tensor's shape."""
        data_type = TORCH_DTYPE_TO_DATADIST[dtype]
        for addrs in families:
            for addr in addrs:
                assert addr % (2 * 1024 * 1024) == 0, "kv cache addresses must be 2 MiB aligned"
        try:
            if not use_mla:
                desc = CacheDesc(len(families[0]), [*shapes[0]], data_type)
                key = BlocksCacheKey(cluster_id=self.local_cluster_id)
                self.cache = [self.cache_manager.register_blocks_cache(desc, families[0], key)]
            else:
                for model_id, (addrs, shape) in enumerate(zip(families, shapes)):
                    desc = CacheDesc(len(addrs), [*shape], data_type)
                    key = BlocksCacheKey(cluster_id=self.local_cluster_id, model_id=model_id)
                    self.cache.append(self.cache_manager.register_blocks_cache(desc, addrs, key))
        except (TypeError, ValueError):
            raise RuntimeError(f"LLMDataDistCMgrConnectorWorker: register_blocks_cache failed for {dtype}")

    def add_remote_agent(self, prefill: int, decode: int) -> int:
        """Rank-table link of the prefill/decode pair; both sides call it; the comm id."""
        remote = decode if self.local_cluster_id == prefill else prefill
        devices = [{"device_id": str(rank), "device_ip": DEVICE_IPS[c], "rank_id": str(rank)}
                   for rank, c in enumerate((prefill, decode))]
        rank_table = {"version": "1.2", "server_count": "1", "status": "completed",
                      "server_list": [{"server_id": cs.HOST, "device": devices}]}
        comm_name = f"pd_comm_{DEVICE_IPS[prefill]}_{DEVICE_IPS[decode]}"
        cluster_rank_info = {prefill: 0, decode: 1}
        comm_id = self.llm_datadist.link(comm_name, cluster_rank_info, json.dumps(rank_table))
        while True:
            ret = self.llm_datadist.query_register_mem_status(comm_id=comm_id)
            if ret == llm_datadist.RegisterMemStatus.OK:
                break
            elif ret == llm_datadist.RegisterMemStatus.FAILED:
                raise RuntimeError(f"LLMDataDistCMgrConnectorWorker: linking with {remote} failed")
            time.sleep(self.poll_interval_s)
        self.linked_cluster[remote] = comm_id
        return comm_id

    def remove_remote_agent(self, cluster_id: int) -> None:
        comm_id = self.linked_cluster.pop(cluster_id)
        try:
            self.llm_datadist.unlink(comm_id)
        except LLMException:
            log.error("unlink of comm id %d failed", comm_id)

    def _read_blocks(self, remote_cluster_id: int, local_block_ids: list[int], remote_block_ids: list[int]) -> None:
        if len(local_block_ids) == 0:
            return
        remote_block_ids = remote_block_ids[-len(local_block_ids):]
        for model_id, cache in enumerate(self.cache):
            cache_key = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=model_id)
            try:
                self.cache_manager.pull_blocks(cache_key, cache, remote_block_ids, local_block_ids)
            except (TypeError, ValueError):
                raise RuntimeError(f"pull_blocks: bad arguments for cache {model_id}")
            except LLMException:
                raise RuntimeError("LLMDataDistCMgrConnectorWorker: timeout during pull_blocks, "
                                   "you can try to increase the sync_kv_timeout config")

    def start_load_kv(self, remote: int, requests: dict[str, tuple[list[int], list[int]]]) -> None:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [pool.submit(self._read_blocks, remote, local, remote_ids)
                       for remote_ids, local in requests.values()]
            for f in futures:
                f.result()


def memories(kind: str, blocks: int, tag: int | None) -> tuple[list[cs.Memory], list[tuple[int, ...]]]:
    layers = LAYERS[kind]
    shapes: list[tuple[int, ...]] = [(blocks, BLOCK_SIZE, *tok) for tok in FAMILIES[kind]]
    per = 2 * layers if kind == "mha" else layers
    mems = []
    for m, shape in enumerate(shapes):
        nbytes = 2 * blocks * BLOCK_SIZE * shape[2] * shape[3]
        mem = cs.Memory(per, nbytes)
        if tag is not None:
            mem.fill(tag, [100 * m + t for t in range(per)])
        mems.append(mem)
    return mems, shapes


def main() -> None:
    role, port, extra = cs.args()
    kind = extra[0] if extra else "mha"
    prefill = role == "prefill"
    worker = CMgrWorker("kv_producer" if prefill else "kv_consumer", PREFILL_CLUSTER if prefill else DECODE_CLUSTER,
                        0 if prefill else 1, 20000)
    worker.poll_interval_s = 0.02  # the connector polls once a second; the harness need not wait
    mems, shapes = memories(kind, PREFILL_BLOCKS if prefill else DECODE_BLOCKS, 1 if prefill else None)
    worker.register_kv_caches([m.addrs for m in mems], shapes, "float16", use_mla=kind != "mha")
    if prefill:
        ctl = cs.Control.listen(port)[0]
        ctl.recv("link")
        comm_id = worker.add_remote_agent(PREFILL_CLUSTER, DECODE_CLUSTER)
        ctl.recv("done")
        worker.remove_remote_agent(DECODE_CLUSTER)
        checked = sum(m.verify("prefill source intact") for m in mems)
        cs.result(role=role, comm_id=comm_id, cache_ids=[c.cache_id for c in worker.cache], checked=checked)
        return
    ctl = cs.Control.connect(port)
    ctl.send("link")
    comm_id = worker.add_remote_agent(PREFILL_CLUSTER, DECODE_CLUSTER)
    worker.start_load_kv(PREFILL_CLUSTER, {k: (list(r), list(loc)) for k, (r, loc) in REQUESTS.items()})
    block_bytes = mems[0].nbytes // DECODE_BLOCKS
    for m, mem in enumerate(mems):
        bb = mem.nbytes // DECODE_BLOCKS
        for t in range(len(mem.tensors)):
            for remote_ids, local in REQUESTS.values():
                mem.expect_blocks(t, 1, 100 * m + t, bb, remote_ids[-len(local):], local)
    checked = sum(m.verify(f"pull_blocks ({kind})") for m in mems)
    worker.remove_remote_agent(PREFILL_CLUSTER)
    ctl.send("done")
    cs.result(role=role, comm_id=comm_id, cache_ids=[c.cache_id for c in worker.cache], checked=checked,
              block_bytes=block_bytes)


if __name__ == "__main__":
    main()
