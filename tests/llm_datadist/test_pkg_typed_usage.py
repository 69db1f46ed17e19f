"""Client-shaped code against kvdd.llm_datadist, written the way the serving stacks of PYPKG.md
§7.1 call CANN's package (keyword names, error handling, retry sets), with no casts or
``type: ignore``: CI's ``mypy --strict`` run over tests/ proves the package's annotations serve a
user's strictly typed code; the test runs it over the recording engine."""

from __future__ import annotations

import pytest
from pkg_fake import RecordingWrapper, fake

import kvdd.llm_datadist as llm_datadist
from kvdd.llm_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)

__all__ = ["fake"]

RETRYABLE = {LLMStatusCode.LLM_REPEAT_REQUEST, LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
             LLMStatusCode.LLM_PROCESSING_LINK, LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
             LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, LLMStatusCode.LLM_LINK_BUSY}


class KvTransfer:
    """A decode-side transfer manager shaped like the clients' (register, link, pull with retry)."""

    def __init__(self, cluster_id: int, device_id: int, num_layers: int) -> None:
        config = LLMConfig()
        config.device_id = device_id
        config.sync_kv_timeout = 20000
        config.enable_switch_role = True
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        options: dict[str, str] = config.generate_options()
        options["llm.RdmaServiceLevel"] = "3"
        self.datadist = LLMDataDist(LLMRole.DECODER, cluster_id)
        self.datadist.init(options)
        self.num_layers = num_layers
        self.caches: list[Cache] = []

    def register(self, addrs: list[int], num_blocks: int, block_shape: tuple[int, ...]) -> int:
        desc = CacheDesc(num_tensors=2 * self.num_layers, shape=(num_blocks, *block_shape),
                         data_type=llm_datadist.DataType.DT_BF16, placement=Placement.DEVICE)
        try:
            cache = self.datadist.cache_manager.register_blocks_cache(desc, addrs, None)
        except (TypeError, ValueError) as exc:
            raise RuntimeError(f"bad registration arguments: {exc}") from exc
        self.caches.append(cache)
        return cache.cache_id

    def link_rank_table(self, peer: int, rank_table: str) -> int:
        comm_id = self.datadist.link("pd_comm_a_b", {peer: 0, self.datadist.cluster_id: 1}, rank_table)
        status = self.datadist.query_register_mem_status(comm_id=comm_id)
        if status == RegisterMemStatus.FAILED:
            raise RuntimeError("link failed")
        return comm_id

    def link_cluster(self, peer: int, ip: str, port: int) -> list[LLMStatusCode]:
        info = LLMClusterInfo()
        info.remote_cluster_id = peer
        info.append_local_ip_info(ip, 0)
        info.append_remote_ip_info(ip, port)
        ret, rets = self.datadist.link_clusters([info], timeout=3000)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters failed: {rets}")
        return rets

    def pull(self, peer: int, src: list[int], dst: list[int], attempts: int = 3) -> int:
        key = BlocksCacheKey(prompt_cluster_id=peer, model_id=0)
        for attempt in range(attempts):
            try:
                self.datadist.cache_manager.pull_blocks(key, self.caches[0], src, dst,
                                                        src_layer_range=range(self.num_layers),
                                                        dst_layer_range=range(self.num_layers),
                                                        tensor_num_per_layer=2)
                return attempt
            except LLMException as exc:
                if exc.status_code not in RETRYABLE:
                    raise
        raise RuntimeError("pull_blocks kept failing")

    def close(self) -> None:
        for cache in self.caches:
            self.datadist.cache_manager.unregister_cache(cache.cache_id)
        self.datadist.finalize()


def test_client_shaped_code_runs(fake: RecordingWrapper) -> None:
    client = KvTransfer(cluster_id=2, device_id=0, num_layers=2)
    assert client.register([1, 2, 3, 4], 8, (16, 64)) == 1
    fake.mem_status = 0
    assert client.link_rank_table(1, "{}") == 1
    fake.rets = [0]
    assert client.link_cluster(1, "10.0.0.1", 26000) == [LLMStatusCode.LLM_SUCCESS]
    fake.status["pull_cache_v2"] = int(LLMStatusCode.LLM_TIMEOUT)
    with pytest.raises(RuntimeError, match="kept failing"):
        client.pull(1, [0, 1], [2, 3])
    fake.status["pull_cache_v2"] = int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    with pytest.raises(LLMException):
        client.pull(1, [0], [2])
    del fake.status["pull_cache_v2"]
    assert client.pull(1, [0], [2]) == 0
    assert fake.last("pull_cache_v2")[2] == (-1, 0, [0], [2], [0, 1, 2, 3], [0, 1, 2, 3], -1, -1, 2)
    client.close()
    assert fake.names()[-2:] == ["unregister_cache", "finalize_v2"]
