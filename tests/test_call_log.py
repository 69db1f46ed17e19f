"""DEBUG records of LlmDataDist calls (logger ``kvdd.calls``): name, cluster, peer, bytes, status,
time; nothing recorded, formatted or timed when DEBUG is off."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import (OPTION_DEVICE_ID, OPTION_LISTEN_IP_INFO, Cache, CacheDesc, CacheIndex, ClusterInfo, DataType,
                  IpInfo, KvCacheExtParam, LlmRole, tensor_addrs)

RECORD = re.compile(r"^(\w+) cluster=(\d+) peer=(\S+) bytes=(\S+) status=(\w+) (\d+\.\d{3}) ms$")
T, BLOCK = 4, 64  # tensors, bytes per block


class Pair:
    def __init__(self) -> None:
        self.p = kvdd.LlmDataDist(1, LlmRole.PROMPT, backend="sim")
        self.p.initialize({OPTION_DEVICE_ID: "0", OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        self.d = kvdd.LlmDataDist(2, LlmRole.DECODER, backend="sim")
        self.d.initialize({OPTION_DEVICE_ID: "1"})
        self.src = [np.full((8, BLOCK), k + 1, np.uint8) for k in range(T)]
        self.dst = [np.zeros((8, BLOCK), np.uint8) for _ in range(T)]
        desc = CacheDesc(T, DataType.DT_UINT8, (8, BLOCK))
        self.rid = self.p.register_kv_cache(desc, tensor_addrs(self.src))
        self.lid = self.d.register_kv_cache(desc, tensor_addrs(self.dst))
        self.link = ClusterInfo(remote_cluster_id=1, local_ip_infos=[IpInfo("127.0.0.1")],
                                remote_ip_infos=[IpInfo("127.0.0.1", self.p.listening_port)])
        self.d.link_llm_clusters([self.link])

    def close(self) -> None:
        self.d.finalize()
        self.p.finalize()


@pytest.fixture
def pair() -> Iterator[Pair]:
    pr = Pair()
    yield pr
    pr.close()


def records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, ...]]:
    out = []
    for r in caplog.records:
        assert r.name == "kvdd.calls" and r.levelno == logging.DEBUG
        m = RECORD.match(r.getMessage())
        assert m, r.getMessage()
        out.append(m.groups()[:5])
    return out


def test_each_call_is_one_record_with_its_bytes_and_status(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvdd.calls")
    d, rid, lid = pair.d, pair.rid, pair.lid
    d.pull_kv_blocks(CacheIndex(1, rid), Cache(lid), [1, 2, 3], [0, 1, 2])
    d.pull_kv_cache(CacheIndex(1, rid, 3), Cache(lid), 5, 32, KvCacheExtParam((0, 0), (1, 1), 2))
    d.push_kv_blocks(Cache(lid, cache_desc=CacheDesc(T, DataType.DT_UINT8, (8, BLOCK))), CacheIndex(1, rid),
                     [0], [7], KvCacheExtParam((1, 1), (1, 1), 1))
    with pytest.raises(kvdd.LLMKvCacheNotExistError):
        d.pull_kv_cache(CacheIndex(1, 99), Cache(lid))
    with pytest.raises(TypeError):
        d.pull_kv_cache("not an index", Cache(lid))  # type: ignore[arg-type]
    d.unlink_llm_clusters([pair.link])
    assert records(caplog) == [
        ("PullKvBlocks", "2", "1", str(3 * BLOCK * T), "LLM_SUCCESS"),
        ("PullKvCache", "2", "1", str(32 * 2), "LLM_SUCCESS"),  # layer 1 of 2-tensor layers, 32 bytes each
        ("PushKvBlocks", "2", "1", str(BLOCK * 1), "LLM_SUCCESS"),  # layer 1 of 1-tensor layers
        ("PullKvCache", "2", "1", str(BLOCK * T), "LLM_KV_CACHE_NOT_EXIST"),
        ("PullKvCache", "2", "-", str(BLOCK * T), "TypeError"),
        ("UnlinkLlmClusters", "2", "1", "-", "LLM_SUCCESS"),
    ]
    # the traced calls did their work exactly once
    assert (pair.dst[0][:3] == 1).all() and (pair.dst[2][5, :32] == 1).all() and (pair.dst[2][5, 32:] == 0).all()
    assert (pair.src[1][7] == 2).all() and (pair.src[0][7] == 1).all() and (pair.src[2][7] == 3).all()


def test_lifecycle_and_registration_records(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kvdd.calls")
    with kvdd.LlmDataDist(5, LlmRole.PROMPT, backend="sim") as dd:
        dd.initialize({OPTION_DEVICE_ID: "0"})
        kv = [np.zeros((2, 16), np.float32)]
        cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_FLOAT, (2, 16)), tensor_addrs(kv))
        dd.unregister_kv_cache(cid)
    assert records(caplog) == [
        ("Initialize", "5", "-", "-", "LLM_SUCCESS"),
        ("RegisterKvCache", "5", "-", str(2 * 16 * 4), "LLM_SUCCESS"),
        ("UnregisterKvCache", "5", "-", "-", "LLM_SUCCESS"),
        ("Finalize", "5", "-", "-", "LLM_SUCCESS"),
    ]


def test_off_by_default_nothing_is_traced(pair: Pair, caplog: pytest.LogCaptureFixture,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="kvdd.calls")

    def never(*args: object) -> None:
        raise AssertionError("traced while DEBUG is off")

    monkeypatch.setattr(kvdd.datadist, "traced", never)
    pair.d.pull_kv_blocks(CacheIndex(1, pair.rid), Cache(pair.lid), [1], [0])
    pair.d.pull_kv_cache(CacheIndex(1, pair.rid), Cache(pair.lid))
    assert caplog.records == []
    assert (pair.dst[3][0] == 4).all() and (pair.dst[3][1:] == 0).all()


def test_the_compiled_path_takes_calls_only_while_debug_is_off(pair: Pair,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    fast = pair.d._fast  # the backend's compiled path (kvdd.backend.FastTransfers)
    assert fast is not None
    idx, dst = CacheIndex(1, pair.rid), Cache(pair.lid)
    caplog.set_level(logging.INFO, logger="kvdd.calls")  # clears the logger's cached answers
    pair.d.pull_kv_cache(idx, dst)  # the facade asks the logger: DEBUG is off (now cached)
    assert fast.pull_kv_cache(idx, dst, 0, -1, None) is True  # accepted, copied
    caplog.set_level(logging.DEBUG, logger="kvdd.calls")
    assert fast.pull_kv_cache(idx, dst, 0, -1, None) is False  # declined: the facade records it
    pair.d.pull_kv_cache(idx, dst)
    assert records(caplog) == [("PullKvCache", "2", "1", str(BLOCK * T), "LLM_SUCCESS")]
