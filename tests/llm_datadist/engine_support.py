"""Engines of CANN's Python package for the engine tests: in-process pairs, numpy caches, and the
calls a peer process runs (through ``peer.Peer``) to serve or pull across processes.

In-process tests build engines directly (:func:`engine`), not through the process-wide
``initialize_v2``: the engine rules are the same, and two of them can live in one process.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvdd.sim.checks import Rejected
from kvdd.sim.pypkg import lifecycle, links, pulls, pushes, registry
from kvdd.sim.pypkg.instance import Claim, PkgInstance, stating
from kvdd.sim.pypkg.lifecycle import Engine
from kvdd.sim.pypkg.wrapper import process_wrapper
from kvdd.types import ClusterInfo, IpInfo

NO = (1 << 64) - 1
S_OK = 0
FAILED = 0xFFFFFFFF
NOT_EXIST = 0x5010B002
PARAM_INVALID = 0x5010B005
NOT_YET_LINK = 0x5010B007
FEATURE_NOT_ENABLED = 0x5010B019
TIMEOUT = 0x5010B01A
LINK_BUSY = 0x5010B01B
UINT8 = 4  # DataType.DT_UINT8
DEVICE, HOST = 1, 0
LOCALHOST = 0x0100007F


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- keys as the Python layer packs them (PYPKG.md §1.4) ------------------------------------------
def blocks_key(cluster: int, model: int = 0) -> tuple[int, int, int, int, int, int, bool]:
    return (cluster, -1, 0, NO, NO, model, True)


def id_key(cluster: int, cache_id: int, batch: int = 0) -> tuple[int, int, int, int, int, int, bool]:
    return (cluster, cache_id, batch, NO, NO, 0, False)


def cache_key(cluster: int, req: int, model: int = 0,
              prefix: int = NO) -> tuple[int, int, int, int, int, int, bool]:
    return (cluster, -1, 0, req, prefix, model, False)


def pull_param(src_blocks: Sequence[int] = (), dst_blocks: Sequence[int] = (), size: int = -1,
               batch: int = 0, src: range | None = None, dst: range | None = None,
               t: int = 2) -> tuple[int, int, list[int], list[int], list[int], list[int], int, int, int]:
    """A PullParamTuple as the Python layer builds it from layer ranges (half-open)."""
    src_idx = list(range(src.start * t, src.stop * t)) if src else []
    dst_idx = list(range(dst.start * t, dst.stop * t)) if dst else []
    return (size, batch, list(src_blocks), list(dst_blocks), src_idx, dst_idx, -1, -1, t)


# -- memory ---------------------------------------------------------------------------------------
@dataclass
class Mem:
    """``n`` tensors of ``rows x row_bytes`` uint8 (numpy), each filled with a distinct pattern."""

    n: int
    rows: int
    row_bytes: int
    seed: int = 0
    tensors: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.tensors = [rng.integers(0, 256, self.rows * self.row_bytes, dtype=np.uint8)
                        if self.seed else np.zeros(self.rows * self.row_bytes, np.uint8)
                        for _ in range(self.n)]

    @property
    def addrs(self) -> list[int]:
        return [int(t.ctypes.data) for t in self.tensors]

    def desc(self, blocks: bool, num_tensors: int | None = None) -> tuple[int, int, int, list[int], int, bool]:
        n = self.n if num_tensors is None else num_tensors
        return (n, UINT8, -1, [self.rows, self.row_bytes], DEVICE, blocks)

    def copy(self) -> list[np.ndarray]:
        return [t.copy() for t in self.tensors]


# -- in-process engines ---------------------------------------------------------------------------
def engine(cluster_id: int, ra: bool = True, listen: bool = True, wait_ms: int = 1000) -> Engine:
    """An initialized engine (not the process's): listening on 127.0.0.1 when ``listen``."""
    opts = {"llm.Role": "Prompt", "llm.EnableRemoteCacheAccessible": "1" if ra else "0",
            "llm.DeviceId": "0", "llm.SyncKvCacheWaitTime": str(wait_ms)}
    if listen:
        opts["llm.ListenIpInfo"] = f"127.0.0.1:{free_port()}"
    inst = PkgInstance(cluster_id, 1, ra)
    status = inst.initialize(opts)
    assert status == S_OK, (hex(status), inst.last_error_detail())
    return Engine(inst, opts, 30)


def link(puller: Engine, server: Engine) -> None:
    """Link ``puller`` to ``server`` (comm backend: both sides get an entity)."""
    port = server.instance.listen_port
    assert port is not None
    inst = puller.instance
    with stating(Claim(inst.cluster_id, inst.remote_accessible)):  # as link_clusters_v2 does
        status, rets = inst.link_llm_clusters(
            [ClusterInfo(remote_cluster_id=server.cluster_id,
                         remote_ip_infos=[IpInfo("127.0.0.1", port)],
                         local_ip_infos=[IpInfo("127.0.0.1", 0)])], 2000)
    assert status == S_OK, (hex(status), puller.instance.last_error_detail())


def unlink(puller: Engine, server: Engine) -> None:
    status, _ = puller.instance.unlink_llm_clusters(
        [ClusterInfo(remote_cluster_id=server.cluster_id, remote_ip_infos=[], local_ip_infos=[])],
        2000, True)
    assert status == S_OK


def register(e: Engine, mem: Mem, blocks: bool = True, keys: Sequence[Any] = (),
             ra: bool = True, num_tensors: int | None = None) -> int:
    return registry.register(e, mem.desc(blocks, num_tensors), mem.addrs, list(keys), ra)


def status_of(fn: Any, *args: Any) -> int:
    """The status a call returns, or the one its rejection carries."""
    try:
        return int(fn(*args))
    except Rejected as exc:
        return exc.status


def pull(e: Engine, dst_id: int, key: Any, param: Any) -> int:
    return status_of(pulls.pull_cache_v2, e, dst_id, key, param)


def push(e: Engine, cfg: Any, block_cfg: Any = (0, [], [])) -> int:
    return status_of(pushes.transfer_cache_v2, e, 0, cfg, block_cfg)


def expect_blocks(dst: Sequence[np.ndarray], before: Sequence[np.ndarray],
                  src: Sequence[np.ndarray], pairs: Sequence[tuple[int, int]], S: int,
                  tensors: Sequence[tuple[int, int]] | None = None) -> None:
    """Every byte of ``dst``: block ``d`` of tensor ``k`` equals block ``s`` of source tensor ``j``
    for each pair and each (k, j) in ``tensors`` (default k == j for all); the rest unchanged."""
    want = [b.copy() for b in before]
    for k, j in (tensors if tensors is not None else [(i, i) for i in range(len(dst))]):
        for s, d in pairs:
            want[k][d * S:(d + 1) * S] = src[j][s * S:(s + 1) * S]
    for k, (got, w) in enumerate(zip(dst, want)):
        bad = np.flatnonzero(got != w)
        assert bad.size == 0, f"tensor {k}: {bad.size} bytes differ, first at {bad[:4]}"


# -- the process's engine (for peer processes and the wrapper tests) -------------------------------
_held: dict[str, Any] = {}


def process_options(port: int | None, ra: bool = True, wait_ms: int = 1000) -> dict[str, str]:
    opts = {"llm.Role": "Prompt", "llm.EnableCacheManager": "1", "ge.exec.deviceId": "0",
            "llm.EnableRemoteCacheAccessible": "1" if ra else "0",
            "llm.SyncKvCacheWaitTime": str(wait_ms)}
    if port is not None:
        opts.update({"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.ListenIp": "127.0.0.1",
                     "llm.ListenPort": str(port)})
    return opts


def serve(cluster_id: int, port: int, caches: Sequence[dict[str, Any]], ra: bool = True) -> list[int]:
    """In a peer: initialize the process's engine listening on ``port`` and register ``caches``
    (dicts: n, rows, row_bytes, seed, blocks, keys, ra); returns their ids (-status on failure)."""
    w = process_wrapper()
    status = w.initialize_v2(cluster_id, process_options(port, ra))
    assert status == S_OK, (hex(status), w.last_error_detail())
    ids = []
    for c in caches:
        mem = Mem(c["n"], c["rows"], c["row_bytes"], c.get("seed", 0))
        _held.setdefault("mems", []).append(mem)
        st, (cid, _addrs) = w.register_cache(mem.desc(c.get("blocks", True)), mem.addrs,
                                            c.get("keys", []), c.get("ra", True))
        ids.append(cid if st == S_OK else -st)
    return ids


def register_more(c: dict[str, Any]) -> int:
    """In a peer: register one more cache (see :func:`serve`)."""
    mem = Mem(c["n"], c["rows"], c["row_bytes"], c.get("seed", 0))
    _held.setdefault("mems", []).append(mem)
    st, (cid, _addrs) = process_wrapper().register_cache(
        mem.desc(c.get("blocks", True)), mem.addrs, c.get("keys", []), c.get("ra", True))
    return cid if st == S_OK else -st


def tensors(index: int) -> list[bytes]:
    """In a peer: the bytes of the ``index``-th cache it registered."""
    return [t.tobytes() for t in _held["mems"][index].tensors]


def link_to(cluster_id: int, port: int) -> int:
    """In this process or a peer: link_clusters_v2 to 127.0.0.1:port."""
    status, _rets = links.link_clusters_v2([(cluster_id, 0, [(LOCALHOST, 0)],
                                             [(LOCALHOST, port)])], 2000)
    return status


def finalize() -> None:
    lifecycle.finalize_v2()
    _held.clear()


def addresses(index: int) -> list[int]:
    """In a peer: the tensor addresses of the ``index``-th cache it registered."""
    return list(_held["mems"][index].addrs)
