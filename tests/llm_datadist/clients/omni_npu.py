"""Harness shaped like omni-npu's ``DatadistEngine`` (PYPKG.md §7.1 (e)).

    omni_npu.py prefill|decode PORT_BASE    # prefill listens on PORT_BASE; decode on port 0

What it keeps of the client: ``LLMConfig`` with ``device_id``, ``sync_kv_timeout = 120000``,
``enable_remote_cache_accessible = True``, ``local_comm_res = ""`` and **no**
``enable_cache_manager`` (``llm.LocalCommRes`` implies it), ``listen_ip_info`` (prefill a fixed
port, decode port 0) and ``transfer_backend = "hixl"``; a random 64-bit cluster id;
``link_clusters([info], timeout=...)`` compared with ``LLM_SUCCESS``; the decode registers its cache
**after** linking, ``CacheDesc(num_tensors=, shape=<tuple>, data_type=DataType.DT_UINT8)`` with no key;
``pull_blocks(BlocksCacheKey(cid, model_id), cache, p_blocks, d_blocks)`` and, when it fails with a
retryable status, unlink + relink and try again ("a newly registered cache may require relink");
``sleep()`` = ``unregister_cache`` of every cache + ``finalize()``, ``wakeup()`` = ``init`` with the
same options dict; ``unlink_clusters(infos, timeout=..., force=True)`` with infos that carry no IP
lists; ``engine.cluster_id``, ``cache.cache_id``.

Scenario: decode pulls model 0; prefill then registers a second cache (model 1), which the
decode's snapshot of prefill's cache table does not show: the pull of model 1 fails with
LLM_KV_CACHE_NOT_EXIST, the engine relinks and the retry succeeds.  Then decode sleeps (cache ids
restart at 1 after the wake-up), wakes, relinks and pulls again.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

import client_support as cs

logger = logging.getLogger("omni_npu")

RETRY_CODES = {
    LLMStatusCode.LLM_REPEAT_REQUEST, LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
    LLMStatusCode.LLM_PROCESSING_LINK, LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY, LLMStatusCode.LLM_TIMEOUT,
    LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, LLMStatusCode.LLM_LINK_BUSY,
    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, LLMStatusCode.LLM_NOT_YET_LINK,
}
MAX_TRIES = 3
LINK_TIMEOUT_MS = 20000
TENSORS = 4
BLOCKS = {"prefill": 6, "decode": 9}
BLOCK_BYTES = 128


class DatadistEngine:
    def __init__(self, role: LLMRole, device_id: int, listen: str) -> None:
        self.cluster_id = random.getrandbits(64)
        self.engine = LLMDataDist(role, self.cluster_id)
        config = LLMConfig()
        config.device_id = device_id
        config.sync_kv_timeout = 120000
        config.enable_remote_cache_accessible = True
        config.local_comm_res = ""
        config.listen_ip_info = listen
        config.transfer_backend = "hixl"
        self.options = config.generate_options()
        self.engine.init(self.options)
        self.caches: dict[int, Any] = {}
        self.linked: dict[int, LLMClusterInfo] = {}
        self.relinks = 0
        self.failures: list[str] = []

    def register(self, model_id: int, addrs: list[int], blocks: int, key: bool) -> Any:
        desc = CacheDesc(num_tensors=len(addrs), shape=(blocks, BLOCK_BYTES), data_type=DataType.DT_UINT8)
        cache_key = BlocksCacheKey(self.engine.cluster_id, model_id) if key else None
        cache = self.engine.cache_manager.register_blocks_cache(desc, addrs, cache_key)
        self.caches[model_id] = cache
        return cache

    def link(self, remote_cluster_id: int, remote_ip: str | int, remote_port: int) -> None:
        info = LLMClusterInfo()
        info.remote_cluster_id = remote_cluster_id
        info.append_local_ip_info(cs.HOST, 0)
        info.append_remote_ip_info(remote_ip, remote_port)
        ret, _ = self.engine.link_clusters([info], timeout=LINK_TIMEOUT_MS)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters to {remote_cluster_id} failed: {ret}")
        self.linked[remote_cluster_id] = info

    def unlink(self, remote_cluster_id: int) -> None:
        info = LLMClusterInfo()  # no IP lists: a forced unlink needs none
        info.remote_cluster_id = remote_cluster_id
        self.linked.pop(remote_cluster_id, None)
        self.engine.unlink_clusters([info], timeout=LINK_TIMEOUT_MS, force=True)

    def pull(self, remote_cluster_id: int, model_id: int, cache: Any, p_blocks: list[int], d_blocks: list[int]) -> None:
        for attempt in range(1, MAX_TRIES + 1):
            try:
                self.engine.cache_manager.pull_blocks(BlocksCacheKey(remote_cluster_id, model_id), cache,
                                                      p_blocks, d_blocks)
                return
            except LLMException as e:
                self.failures.append(e.status_code.name)
                if e.status_code not in RETRY_CODES or attempt == MAX_TRIES:
                    raise
                # A newly registered cache may require relink.
                info = self.linked[remote_cluster_id]
                self.unlink(remote_cluster_id)
                ip, port = info.remote_ip_info_list[0]  # the IP as the package packed it (an int)
                self.link(remote_cluster_id, ip, port)
                self.relinks += 1

    def sleep(self) -> None:
        for cache in self.caches.values():
            self.engine.cache_manager.unregister_cache(cache.cache_id)
        self.caches.clear()
        self.linked.clear()
        self.engine.finalize()

    def wakeup(self) -> None:
        self.engine.init(self.options)


def main() -> None:
    role, port, _ = cs.args()
    if role == "prefill":
        eng = DatadistEngine(LLMRole.PROMPT, 0, f"{cs.HOST}:{port}")
        mems = [cs.Memory(TENSORS, BLOCKS["prefill"] * BLOCK_BYTES, tag=20 + m) for m in (0, 1)]
        eng.register(0, mems[0].addrs, BLOCKS["prefill"], key=True)
        ctl = cs.Control.listen(port)[0]
        ctl.send("ready", cluster_id=eng.cluster_id)
        ctl.recv("pulled")  # decode's first pull snapshotted our cache table
        eng.register(1, mems[1].addrs, BLOCKS["prefill"], key=True)
        ctl.send("registered")
        ctl.recv("done")
        checked = sum(m.verify("prefill source intact") for m in mems)
        eng.sleep()
        cs.result(role=role, cache_ids=[1, 2], checked=checked)
        return
    eng = DatadistEngine(LLMRole.DECODER, 1, f"{cs.HOST}:0")
    ctl = cs.Control.connect(port)
    p_cluster = int(ctl.recv("ready")["cluster_id"])
    eng.link(p_cluster, cs.HOST, port)
    mems = [cs.Memory(TENSORS, BLOCKS["decode"] * BLOCK_BYTES) for _ in (0, 1)]
    caches = [eng.register(m, mems[m].addrs, BLOCKS["decode"], key=False) for m in (0, 1)]  # lazily, after linking
    first_ids = [c.cache_id for c in caches]

    def pull(model_id: int, src: list[int], dst: list[int]) -> None:
        eng.pull(p_cluster, model_id, caches[model_id], src, dst)
        for t in range(TENSORS):
            mems[model_id].expect_blocks(t, 20 + model_id, t, BLOCK_BYTES, src, dst)
        mems[model_id].verify(f"pull_blocks of model {model_id}")

    pull(0, [5, 1, 2], [0, 8, 3])
    ctl.send("pulled")
    ctl.recv("registered")
    pull(1, [0, 4], [7, 6])  # KV_CACHE_NOT_EXIST over the old snapshot, then relink and retry
    relinks_before_sleep = eng.relinks

    eng.sleep()
    eng.wakeup()
    eng.link(p_cluster, cs.HOST, port)
    caches = [eng.register(m, mems[m].addrs, BLOCKS["decode"], key=False) for m in (0, 1)]
    pull(0, [3, 4], [4, 5])
    pull(1, [1], [1])
    ctl.send("done")
    eng.unlink(p_cluster)
    eng.sleep()
    cs.result(role=role, first_ids=first_ids, ids_after_wakeup=[c.cache_id for c in caches],
              relinks=relinks_before_sleep, total_relinks=eng.relinks, failures=eng.failures,
              checked=sum(len(m.tensors) * m.nbytes for m in mems))


if __name__ == "__main__":
    main()
