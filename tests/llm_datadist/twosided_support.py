"""Two-sided engines for tests/llm_datadist/test_engine_twosided.py: in-process engines with a
memory pool, and the calls a peer process runs (through ``peer.Peer``) to serve two-sided pulls.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import engine_support as es
from engine_support import DEVICE, S_OK, UINT8, Mem

from kvdd.sim.pypkg import lifecycle, pools, registry
from kvdd.sim.pypkg.instance import PkgInstance
from kvdd.sim.pypkg.lifecycle import Engine
from kvdd.sim.pypkg.wrapper import process_wrapper

POOL = '{"memory_size": 1048576, "page_shift": 12}'

_held: dict[str, Any] = {}


def engine(cluster_id: int, pool: bool = False, wait_ms: int = 1000) -> Engine:
    """An initialized two-sided engine listening on 127.0.0.1 (a device pool when ``pool``)."""
    opts = {"llm.Role": "Prompt", "llm.EnableRemoteCacheAccessible": "0", "llm.DeviceId": "0",
            "llm.SyncKvCacheWaitTime": str(wait_ms),
            "llm.ListenIpInfo": f"127.0.0.1:{es.free_port()}"}
    if pool:
        opts["llm.MemPoolConfig"] = POOL
    inst = PkgInstance(cluster_id, 1, False)
    status = inst.initialize(opts)
    assert status == S_OK, (hex(status), inst.last_error_detail())
    return Engine(inst, opts, 30)


def desc(rows: int, row_bytes: int, n: int, blocks: bool,
         placement: int = DEVICE) -> tuple[int, int, int, list[int], int, bool]:
    return (n, UINT8, -1, [rows, row_bytes], placement, blocks)


def register(e: Engine, mem: Mem, blocks: bool, keys: Sequence[Any] = (),
             placement: int = DEVICE) -> int:
    return registry.register(e, desc(mem.rows, mem.row_bytes, mem.n, blocks, placement),
                             mem.addrs, list(keys), placement == DEVICE)


def allocate(e: Engine, rows: int, row_bytes: int, n: int, keys: Sequence[Any],
             seed: int) -> tuple[int, Mem]:
    """An owned cache from ``e``'s pool, its tensors filled like a seeded Mem (returned)."""
    cid, addrs = pools.allocate(e, desc(rows, row_bytes, n, False), list(keys))
    pattern = Mem(n, rows, row_bytes, seed)
    for addr, src in zip(addrs, pattern.tensors):
        ctypes.memmove(addr, src.ctypes.data, src.nbytes)
    return cid, pattern



# -- a peer process ---------------------------------------------------------------------------
def serve(cluster_id: int, port: int, wait_ms: int = 1000) -> None:
    """In a peer: the process's engine, two-sided, with a device pool, listening on ``port``."""
    opts = es.process_options(port, ra=False, wait_ms=wait_ms)
    opts["llm.MemPoolConfig"] = POOL
    status = process_wrapper().initialize_v2(cluster_id, opts)
    assert status == S_OK, hex(status)


def register_blocks(n: int, rows: int, row_bytes: int, seed: int, model: int) -> int:
    mem = Mem(n, rows, row_bytes, seed)
    _held.setdefault("mems", []).append(mem)
    st, (cid, _a) = process_wrapper().register_cache(
        desc(rows, row_bytes, n, True), mem.addrs, [es.blocks_key(0, model)], True)
    assert st == S_OK, hex(st)
    return cid


def allocate_cache(n: int, rows: int, row_bytes: int, seed: int, reqs: Sequence[int]) -> int:
    """In a peer: an owned cache with CacheKeys (req_id in ``reqs``, model 0), seeded bytes."""
    eng = lifecycle.current()
    assert eng is not None
    assert isinstance(eng, Engine)
    cid, mem = allocate(eng, rows, row_bytes, n, [es.cache_key(0, r) for r in reqs], seed)
    _held.setdefault("mems", []).append(mem)
    return cid


def tensors(index: int) -> list[bytes]:
    return [t.tobytes() for t in _held["mems"][index].tensors]


def keys() -> list[tuple[int, int]]:
    eng = lifecycle.current()
    assert eng is not None
    return sorted(eng.instance.cache_table.req_keys)


def finalize() -> None:
    lifecycle.finalize_v2()
    _held.clear()



def link_to(d: Engine, cluster_id: int, port: int) -> int:
    """Link the in-process two-sided engine ``d`` to a peer process listening on ``port``."""
    from kvdd.sim.pypkg.instance import Claim, stating
    from kvdd.types import ClusterInfo, IpInfo
    inst = d.instance
    with stating(Claim(inst.cluster_id, False)):
        status, _rets = inst.link_llm_clusters(
            [ClusterInfo(remote_cluster_id=cluster_id, remote_ip_infos=[IpInfo("127.0.0.1", port)],
                         local_ip_infos=[IpInfo("127.0.0.1", 0)])], 2000)
    return int(status)
