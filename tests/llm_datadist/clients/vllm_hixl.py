"""Harness shaped like vllm-ascend's HIXL connector (PYPKG.md §7.1 (d)).

    vllm_hixl.py prefill|decode PORT_BASE    # prefill listens on PORT_BASE, decode on PORT_BASE + 1

What it keeps of the client: one engine per process; ``LLMConfig`` with ``device_id``,
``local_comm_res = ""``, ``transfer_backend = "hixl"``, ``listen_ip_info = "ip:port"`` (every
instance listens), ``link_total_time``, ``link_retry_count``, ``sync_kv_timeout`` and a raw key
written into the live ``cfg.ge_options``; one blocks cache per KV-cache group registered with
``CacheDesc(num_tensors=, shape=<list incl. num_blocks>, data_type=, placement=Placement.DEVICE)``,
``remote_accessible=True`` on both sides and a unique ``BlocksCacheKey(cluster_id, model_id)``
per cache from an allocator (so no registration overwrites another's key): an attention group
(K, V per layer) and a Mamba group (conv and ssm states, one tensor per layer each);
``link_clusters([LLMClusterInfo(...)], timeout_ms)`` with the own listen address as the local
entry, the first element compared with ``LLMStatusCode.LLM_SUCCESS`` and a RuntimeError carrying
the per-cluster list otherwise; pulls with the keywords ``src_blocks=``, ``dst_blocks=``,
``src_layer_range=range(n)``, ``dst_layer_range=range(n)`` and the default ``tensor_num_per_layer``
(attention, ``n = num_tensors // 2``) or ``tensor_num_per_layer=1`` (Mamba); an ``LLMException``
logged and re-raised; shutdown = ``unlink_clusters([...], timeout, force=True)`` then
``finalize()``, exceptions swallowed.
"""

from __future__ import annotations

import itertools
import logging
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
    Placement,
)

import client_support as cs

logger = logging.getLogger("vllm_hixl")

PREFILL_CLUSTER, DECODE_CLUSTER = 5, 6
LAYERS = 3
NUM_BLOCKS = {PREFILL_CLUSTER: 10, DECODE_CLUSTER: 14}
# group -> (tensors per layer, one block's shape after num_blocks, bytes per element)
GROUPS = {"attention": (2, [8, 2, 16], 2), "mamba_conv": (1, [4, 32], 2), "mamba_ssm": (1, [2, 16, 16], 4)}
DTYPES = {2: DataType.DT_BF16, 4: DataType.DT_FLOAT}
TIMEOUT_MS = 20000


class HixlDataDist:
    """The connector's process-wide engine."""

    _instance: HixlDataDist | None = None

    def __init__(self, role: LLMRole, cluster_id: int, device_id: int, listen: str) -> None:
        self.cluster_id = cluster_id
        self.listen = listen
        self.datadist = LLMDataDist(role, cluster_id)
        cfg = LLMConfig()
        cfg.device_id = device_id
        cfg.local_comm_res = ""
        cfg.transfer_backend = "hixl"
        cfg.listen_ip_info = listen
        cfg.link_total_time = 30
        cfg.link_retry_count = 3
        cfg.sync_kv_timeout = 20000
        cfg.ge_options["llm.RdmaTrafficClass"] = "132"  # raw keys go into the live dict
        self.datadist.init(cfg.generate_options())
        self.cache_manager = self.datadist.cache_manager
        self._model_ids = itertools.count()  # unique model id per registered cache
        self.caches: dict[str, Any] = {}
        self.model_id_of: dict[str, int] = {}

    @classmethod
    def get(cls, role: LLMRole, cluster_id: int, device_id: int, listen: str) -> HixlDataDist:
        if cls._instance is None:
            cls._instance = cls(role, cluster_id, device_id, listen)
        return cls._instance

    def register(self, group: str, num_blocks: int, addrs: list[int]) -> None:
        per_layer, block_shape, elem = GROUPS[group]
        desc = CacheDesc(num_tensors=len(addrs), shape=[num_blocks, *block_shape], data_type=DTYPES[elem],
                         placement=Placement.DEVICE)
        model_id = next(self._model_ids)
        key = BlocksCacheKey(self.cluster_id, model_id)
        self.caches[group] = self.cache_manager.register_blocks_cache(desc, addrs, key, remote_accessible=True)
        self.model_id_of[group] = model_id

    def _cluster(self, remote_cluster_id: int, remote: str) -> LLMClusterInfo:
        info = LLMClusterInfo()
        info.remote_cluster_id = remote_cluster_id
        ip, port = self.listen.split(":")
        info.append_local_ip_info(ip, int(port))
        rip, rport = remote.split(":")
        info.append_remote_ip_info(rip, int(rport))
        return info

    def link(self, remote_cluster_id: int, remote: str) -> None:
        ret, rets = self.datadist.link_clusters([self._cluster(remote_cluster_id, remote)], TIMEOUT_MS)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters to {remote_cluster_id} failed: {ret}, {rets}")

    def pull(self, remote_cluster_id: int, group: str, remote_model_id: int, src: list[int], dst: list[int]) -> None:
        per_layer = GROUPS[group][0]
        cache = self.caches[group]
        n = cache.cache_desc.num_tensors // per_layer
        key = BlocksCacheKey(remote_cluster_id, remote_model_id)
        try:
            if per_layer == 2:
                self.cache_manager.pull_blocks(key, cache, src_blocks=src, dst_blocks=dst,
                                               src_layer_range=range(n), dst_layer_range=range(n))
            else:
                self.cache_manager.pull_blocks(key, cache, src_blocks=src, dst_blocks=dst,
                                               src_layer_range=range(n), dst_layer_range=range(n),
                                               tensor_num_per_layer=1)
        except LLMException as e:
            logger.error("pull_blocks from %d failed: %s", remote_cluster_id, e.status_code)
            raise

    def shutdown(self, remote_cluster_id: int | None, remote: str | None) -> None:
        try:
            if remote_cluster_id is not None and remote is not None:
                self.datadist.unlink_clusters([self._cluster(remote_cluster_id, remote)], TIMEOUT_MS, force=True)
            self.datadist.finalize()
        except Exception as exc:  # the connector swallows shutdown errors
            logger.warning("shutdown: %s", exc)


def caches(engine: HixlDataDist, cluster_id: int, tag: int | None) -> dict[str, cs.Memory]:
    mems = {}
    blocks = NUM_BLOCKS[cluster_id]
    for g, (per_layer, shape, elem) in GROUPS.items():
        block_bytes = elem
        for d in shape:
            block_bytes *= d
        mem = cs.Memory(per_layer * LAYERS, blocks * block_bytes)
        if tag is not None:
            mem.fill(tag, [1000 * list(GROUPS).index(g) + t for t in range(per_layer * LAYERS)])
        engine.register(g, blocks, mem.addrs)
        mems[g] = mem
    return mems


def main() -> None:
    role, port, _ = cs.args()
    p_listen, d_listen = f"{cs.HOST}:{port}", f"{cs.HOST}:{port + 1}"
    if role == "prefill":
        engine = HixlDataDist.get(LLMRole.PROMPT, PREFILL_CLUSTER, 0, p_listen)
        mems = caches(engine, PREFILL_CLUSTER, tag=3)
        ctl = cs.Control.listen(port)[0]
        ctl.send("ready", model_ids=engine.model_id_of)
        ctl.recv("done")
        checked = sum(m.verify("prefill source intact") for m in mems.values())
        engine.shutdown(None, None)
        cs.result(role=role, model_ids=engine.model_id_of, checked=checked)
        return
    engine = HixlDataDist.get(LLMRole.DECODER, DECODE_CLUSTER, 1, d_listen)
    mems = caches(engine, DECODE_CLUSTER, tag=None)
    ctl = cs.Control.connect(port)
    remote_models = ctl.recv("ready")["model_ids"]
    engine.link(PREFILL_CLUSTER, p_listen)
    src, dst = [9, 0, 4, 5], [1, 13, 6, 7]
    for g, mem in mems.items():
        engine.pull(PREFILL_CLUSTER, g, int(remote_models[g]), src, dst)
        bb = mem.nbytes // NUM_BLOCKS[DECODE_CLUSTER]
        for t in range(len(mem.tensors)):
            mem.expect_blocks(t, 3, 1000 * list(GROUPS).index(g) + t, bb, src, dst)
    checked = sum(m.verify(f"pull_blocks of group {g}") for g, m in mems.items())
    ctl.send("done")
    engine.shutdown(PREFILL_CLUSTER, p_listen)
    cs.result(role=role, checked=checked)


if __name__ == "__main__":
    main()
