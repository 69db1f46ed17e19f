"""A same-host reader that counts itself in flight on every slot of every lease table we serve it
(kvdd.sim.fabric.samehost_tables, ServedTable, kvdd.sim.entries.retire_all).

Its counts never go down, so every wait for them lasts the owner's cap (shortened here: the tables
take ``cap_ms``).  Such a reader must not hold an honest call longer than its own bound:

* a link that evicts one of the reader's tables (more than ``MAX_TABLES_PER_READER``) returns
  within its timeout: the evicted table is revoked, not waited for, on the link call's thread; it
  stays attached, so the unregister of its cache still waits for the count (one cap) and nothing
  moves once that returned; beyond ``MAX_EVICTED_PER_READER`` such tables a new link of that
  reader is not served a table at all;
* an unregister of a cache the reader counts on over several links, or a finalize with several
  such links, waits one cap in all, not one per link.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import (CacheDesc, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole, Status,
                  tensor_addrs)
from kvdd.sim.fabric import samehost, samehost_link, samehost_tables
from kvdd.sim.fabric.samehost_path import DRAIN_GRACE_MS, ServedTable

from hostile.hog import HOG_READER

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

T = 4096
CAP_MS = 2000  # the owner's cap on waiting for a living reader (60 s in production)
BOUND_S = (CAP_MS + DRAIN_GRACE_MS) / 1000.0  # one wait for the hog's counts

# The hog: K instances; its reader enters every slot of every table we serve it and never leaves.
# Each line on stdin, "i cluster cache_id", pushes instance i's cache (bytes 0xEE) into that
# cache of ours and prints the status.
_HOG = HOG_READER + r"""
import os, sys, numpy as np, kvdd
from kvdd import Cache, CacheDesc, CacheIndex, DataType, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost_link
samehost_link.OneSidedPeer = HogReader
dds, caches, bufs = [], [], []
for i in range(int(sys.argv[1])):
    dd = LlmDataDist(100 + i, LlmRole.PROMPT, backend="sim")
    dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: str(i)})
    bufs.append(np.full((2, int(sys.argv[2])), 0xEE, np.uint8))  # one layer: K and V
    desc = CacheDesc(2, DataType.DT_UINT8, (1, int(sys.argv[2])))
    addrs = tensor_addrs([bufs[-1][0], bufs[-1][1]])
    caches.append(Cache(dd.register_kv_cache(desc, addrs), addrs, desc))
    dds.append(dd)
print(" ".join(str(dd.listening_port) for dd in dds), flush=True)
for line in sys.stdin:
    i, cluster, cache_id = map(int, line.split())
    try:
        dds[i].push_kv_cache(caches[i], CacheIndex(cluster, cache_id, 0))
        print(0, flush=True)
    except kvdd.LLMError as exc:
        print(int(exc.status), flush=True)
os._exit(0)
"""


class Hog:
    def __init__(self, instances: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOG, str(instances), str(T)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.ports = [int(p) for p in self.proc.stdout.readline().split()]
        assert len(self.ports) == instances

    def push(self, i: int, cluster: int, cache_id: int) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{i} {cluster} {cache_id}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


class Side:
    """One honest instance here with one registered cache of two tensors (bytes 0x5A)."""

    def __init__(self, cluster: int) -> None:
        self.cluster = cluster
        self.dd = LlmDataDist(cluster, LlmRole.DECODER, backend="sim")
        self.dd.initialize({kvdd.OPTION_DEVICE_ID: str(cluster),
                            kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        self.buf = np.full((2, T), 0x5A, np.uint8)  # one layer: K and V
        self.cache_id = self.dd.register_kv_cache(CacheDesc(2, DataType.DT_UINT8, (1, T)),
                                                  tensor_addrs([self.buf[0], self.buf[1]]))

    def link(self, port: int, hog_cluster: int) -> float:
        t0 = time.monotonic()
        self.dd.link_llm_clusters([ClusterInfo(remote_cluster_id=hog_cluster,
                                               remote_ip_infos=(IpInfo("127.0.0.1", port),))], 1000)
        took = time.monotonic() - t0
        assert self.dd.backend.link_data_path(hog_cluster) == "process_vm"  # type: ignore[attr-defined]
        return took

    def unregister(self) -> float:
        t0 = time.monotonic()
        self.dd.unregister_kv_cache(self.cache_id)
        return time.monotonic() - t0


@pytest.fixture
def capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our tables wait CAP_MS for a living reader (the link module makes them)."""
    monkeypatch.setattr(samehost_link, "ServedTable",
                        lambda entries: ServedTable(entries, CAP_MS))


def _counted(tables: int, before: int) -> None:
    """Wait until the hog counts itself in flight on every table we serve it."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with samehost_tables._lock:
            held = [*samehost_tables._tables, *samehost_tables._evicted][before:]
        if len(held) >= tables and all(t.table.inflight(s) == 1 for t in held
                                       for s in range(len(t.entries))):
            return
        time.sleep(0.01)
    raise AssertionError("the hog never counted itself in flight")


def _nothing_moves(hog: Hog, side: Side, hog_instance: int,
                   status: int = Status.LLM_KV_CACHE_NOT_EXIST) -> None:
    """After the call returned the memory is reused: the hog's push lands nowhere."""
    side.buf[:] = 0x11
    st = hog.push(hog_instance, side.cluster, side.cache_id)
    assert st == status
    assert (side.buf == 0x11).all()


@pytest.fixture
def hog() -> Iterator[Hog]:
    h = Hog(3)
    try:
        yield h
    finally:
        h.kill()


def test_eviction_never_holds_the_link_and_stays_bounded(
        hog: Hog, capped: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(samehost_tables, "MAX_TABLES_PER_READER", 2)
    monkeypatch.setattr(samehost_tables, "MAX_EVICTED_PER_READER", 1)
    samehost_tables.sweep()
    base = samehost_tables.live_tables()
    sides = [Side(10 + i) for i in range(4)]
    try:
        for i in range(3):  # the third evicts the first, which the hog still counts
            took = sides[i].link(hog.ports[0], 100)
            assert took < 1.1, f"link {i + 1} took {took:.2f} s"
            _counted(i + 1, base)
        assert samehost_tables.live_tables() == base + 3
        assert samehost_tables.evicted_tables() == 1
        took = sides[3].link(hog.ports[0], 100)  # one evicted table still counted: not served
        assert took < 1.1, f"link 4 took {took:.2f} s"
        assert samehost_tables.live_tables() == base + 3
        # the evicted table is still attached: its unregister waits for the hog's count, once
        took = sides[0].unregister()
        assert 0.9 * CAP_MS / 1000 < took < BOUND_S + 0.5, f"{took:.2f} s"
        _nothing_moves(hog, sides[0], 0)
        took = sides[3].unregister()  # never served to the hog: nothing to wait for
        assert took < 0.5, f"{took:.2f} s"
        _nothing_moves(hog, sides[3], 0)
        # the other sides' caches were not touched by any of it
        assert all((s.buf == 0x5A).all() for s in sides[1:3])
    finally:
        hog.kill()  # (first: our finalize would wait for the living hog's counts, bounded)
        for s in sides:
            s.dd.finalize()
    samehost_tables.sweep()
    assert samehost_tables.live_tables() == base and samehost_tables.evicted_tables() == 0


@pytest.mark.parametrize("call", ["unregister", "finalize", "unlink"])
def test_one_wait_for_a_hog_on_three_links(hog: Hog, capped: None, call: str) -> None:
    samehost_tables.sweep()
    base = samehost_tables.live_tables()
    side = Side(20)
    try:
        for i in range(3):
            assert side.link(hog.ports[i], 100 + i) < 1.1
        _counted(3, base)
        assert hog.push(0, side.cluster, side.cache_id) == 0  # (the control: a push lands)
        assert (side.buf == 0xEE).all()
        side.buf[:] = 0x5A
        t0 = time.monotonic()
        if call == "unregister":
            side.dd.unregister_kv_cache(side.cache_id)
        elif call == "finalize":
            side.dd.finalize()
        else:  # one call unlinking the three
            side.dd.unlink_llm_clusters([ClusterInfo(remote_cluster_id=100 + i, remote_ip_infos=(
                IpInfo("127.0.0.1", hog.ports[i]),)) for i in range(3)], 1000)
        took = time.monotonic() - t0
        # one wait for the three tables, not one per table (before: 3 x BOUND_S)
        assert 0.9 * CAP_MS / 1000 < took < BOUND_S + 0.5, f"{call}: {took:.2f} s"
        if call != "finalize":  # (an unlink told the hog: it has no link to push over)
            for i in range(3):
                _nothing_moves(hog, side, i, Status.LLM_KV_CACHE_NOT_EXIST
                               if call == "unregister" else Status.LLM_NOT_YET_LINK)
        else:
            side.buf[:] = 0x11
            for i in range(3):
                assert hog.push(i, side.cluster, side.cache_id) != 0
            assert (side.buf == 0x11).all()
    finally:
        hog.kill()
        side.dd.finalize()
