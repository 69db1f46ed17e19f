"""Shared by the fault-injection tests (test_faults.py, test_fault_points.py): simulator
instances in this process with one 4-tensor cache each, and the modules' fixtures (imported there)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

import kvdd
from kvdd import (Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam, LLMError,
                  Status)
from kvdd.sim import faults

__all__ = ["LOCAL", "N", "SHAPE", "DESC", "U8", "Node", "Pair", "make_node", "cluster", "expect",
           "rows", "linked_pair", "no_injections", "no_leftover_faults", "pair"]

LOCAL = "127.0.0.1"
N, SHAPE = 4, (4, 16)  # 4 tensors of int32 (4, 16): T = 256 B, B = 4, S = 64 B
DESC = CacheDesc(num_tensors=N, data_type=DataType.DT_INT32, shape=SHAPE)
U8 = npt.NDArray[np.uint8]


@dataclass
class Node:
    dd: kvdd.LlmDataDist
    mem: list[U8]
    cache_id: int

    @property
    def cid(self) -> int:
        return self.dd.cluster_id

    def snapshot(self) -> list[bytes]:
        return [m.tobytes() for m in self.mem]


def make_node(cluster_id: int, listen: bool, fill: int, options: dict[str, str] | None = None) -> Node:
    dd = kvdd.LlmDataDist(cluster_id, kvdd.LlmRole.MIX, backend="sim")
    opts = {kvdd.OPTION_DEVICE_ID: "0"}
    if listen:
        opts[kvdd.OPTION_LISTEN_IP_INFO] = f"{LOCAL}:0"
    opts.update(options or {})
    dd.initialize(opts)
    rng = np.random.default_rng(fill)
    mem = [rng.integers(0, 256, 256, dtype=np.uint8) for _ in range(N)]
    cache_id = dd.register_kv_cache(DESC, kvdd.tensor_addrs(mem))
    return Node(dd, mem, cache_id)


def cluster(to: Node) -> ClusterInfo:
    port = to.dd.listen_port
    assert port is not None
    return ClusterInfo(remote_cluster_id=to.cid, local_ip_infos=(IpInfo(LOCAL),),
                       remote_ip_infos=(IpInfo(LOCAL, port),))


@dataclass
class Pair:
    p: Node  # listens, cluster 1
    d: Node  # links to p, cluster 2

    def link(self) -> list[Status]:
        return self.d.dd.link_llm_clusters([cluster(self.p)])

    def unlink(self, force: bool = False) -> list[Status]:
        return self.d.dd.unlink_llm_clusters([cluster(self.p)], force=force)

    def pull(self, batch: int = 0) -> None:
        self.d.dd.pull_kv_cache(CacheIndex(self.p.cid, self.p.cache_id, batch), Cache(cache_id=self.d.cache_id),
                                batch)

    def pull_blocks(self, src: list[int], dst: list[int]) -> None:
        self.d.dd.pull_kv_blocks(CacheIndex(self.p.cid, self.p.cache_id), Cache(cache_id=self.d.cache_id), src, dst)

    def push(self, batch: int = 0, ext: KvCacheExtParam | None = None) -> None:
        src = Cache(cache_id=self.d.cache_id, cache_desc=DESC)
        self.d.dd.push_kv_cache(src, CacheIndex(self.p.cid, self.p.cache_id, batch), batch, ext_param=ext)

    def push_blocks(self, src: list[int], dst: list[int]) -> None:
        self.d.dd.push_kv_blocks(Cache(cache_id=self.d.cache_id, cache_desc=DESC),
                                 CacheIndex(self.p.cid, self.p.cache_id), src, dst)


@contextmanager
def no_injections() -> Iterator[None]:
    """No injection before or after the block (also none loaded from KVDD_SIM_FAULTS)."""
    faults.clear()
    try:
        yield
    finally:
        faults.clear()


@contextmanager
def linked_pair() -> Iterator[Pair]:
    """Instance 2 linked to instance 1 (which listens); both finalized at the end."""
    p = make_node(1, listen=True, fill=11)
    d = make_node(2, listen=False, fill=22)
    pr = Pair(p, d)
    try:
        pr.link()
        yield pr
    finally:
        d.dd.finalize()
        p.dd.finalize()


@pytest.fixture(autouse=True)
def no_leftover_faults() -> Iterator[None]:
    """Autouse in a module that imports it: no injection before or after each test."""
    with no_injections():
        yield


@pytest.fixture
def pair() -> Iterator[Pair]:
    """Instance 2 linked to instance 1, each with one 4-tensor cache of distinct random bytes."""
    with linked_pair() as pr:
        yield pr


def expect(status: Status, fn: Callable[[], object]) -> LLMError:
    with pytest.raises(LLMError) as info:
        fn()
    assert info.value.status == status, f"got {info.value}"
    assert type(info.value) is type(LLMError.from_status(status, ""))
    return info.value


def rows(mem: list[U8], batch: int) -> list[bytes]:
    return [m[batch * 64:(batch + 1) * 64].tobytes() for m in mem]
