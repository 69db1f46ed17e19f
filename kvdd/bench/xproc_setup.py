"""Set-up costs for the cross-process section of ``kvdd bench``: linking and registering.

* **link**: a spawned peer process (its own simulator instance, listening on loopback) registers
  ``caches`` one-tensor caches; this process (4 caches of its own) runs ``link_llm_clusters`` to it
  and then the non-force ``unlink_llm_clusters``, one timed pair per sample (the authenticated TCP
  handshake, the same-host proof when the link gets that path, the peer's table both ways, and the
  unlink's own authenticated handshake).  The data path the link really used is recorded
  (``data_path``: ``process_vm`` is a same-host link).  Rows for 4 and 1004 caches at the peer.
* **register**: ``register_kv_cache`` of a cache of ``tensors`` tensors (slices of one arena) in
  this process, each timed call followed by an untimed ``unregister_kv_cache``.

Median and min of each, in ms (link) or µs (register); targets (``setup_targets``) as the other
cross-process targets (``# target:`` lines and the JSON ``targets``).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any

from .. import (
    OPTION_DEVICE_ID,
    OPTION_LISTEN_IP_INFO,
    OPTION_SYNC_CACHE_WAIT_TIME,
    CacheDesc,
    ClusterInfo,
    DataType,
    IpInfo,
    LlmDataDist,
    LlmRole,
)
from ..backend import link_data_path
from .baselines import arena
from .harness import Row, peer_reporting, print_table, say
from .transfers import LOCALHOST

__all__ = ["SETUP_CACHES", "SETUP_TENSORS", "LINK_COLUMNS", "REGISTER_COLUMNS", "measure_setup",
           "setup_targets", "print_setup"]

SETUP_CACHES = (4, 1004)  # caches registered at the peer, per link row
SETUP_TENSORS = (2, 16, 256)  # tensors per registered cache, per register row
SETUP_LOCAL_CACHES = 4  # caches of this side (sent in its hello)
SETUP_LINKS = 60  # timed link + unlink pairs per row (default)
SETUP_REGISTERS = 200  # timed registrations per row (default)
SETUP_TENSOR_BYTES = 4096  # bytes of each registered tensor
_LOCAL_ID, _PEER_ID = 40, 41
_START_TIMEOUT_S = 120.0
_TIMEOUT_MS = 10_000


def _options(device: int) -> dict[str, str]:
    return {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", OPTION_DEVICE_ID: str(device),
            OPTION_SYNC_CACHE_WAIT_TIME: "10000"}


def _peer_main(conn: Any, cluster_id: int) -> None:
    """The spawned peer: an instance listening on loopback; ``("caches", n)`` registers one-tensor
    caches until it has ``n``; ``"stop"`` (or the bench's death) ends it."""
    parent = os.getppid()
    with peer_reporting(conn):
        with LlmDataDist(cluster_id, LlmRole.PROMPT, backend="sim") as dd:
            dd.initialize(_options(0))
            desc = CacheDesc(1, DataType.DT_UINT8, (1, SETUP_TENSOR_BYTES))
            mem = arena(SETUP_TENSOR_BYTES * max(SETUP_CACHES))
            held = 0
            conn.send(("ready", {"pid": os.getpid(), "port": dd.listen_port}))
            while True:
                while not conn.poll(0.5):
                    if os.getppid() != parent:
                        return
                msg = conn.recv()
                if msg == "stop":
                    return
                _kind, want = msg
                while held < want:
                    addr = int(mem.ctypes.data) + held * SETUP_TENSOR_BYTES
                    dd.register_kv_cache(desc, [addr])
                    held += 1
                conn.send(("caches", held))


class _Peer:
    def __init__(self, conn: Any, pid: int, port: int) -> None:
        self.conn, self.pid, self.port = conn, pid, port

    def caches(self, n: int) -> None:
        self.conn.send(("caches", n))
        if not self.conn.poll(_START_TIMEOUT_S):
            raise RuntimeError("the set-up peer did not register its caches in time")
        kind, value = self.conn.recv()
        if kind != "caches" or value != n:
            raise RuntimeError(f"the set-up peer failed: {value}")


@contextmanager
def _peer() -> Iterator[_Peer]:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(there, _PEER_ID), name="kvdd-bench-setup-peer", daemon=True)
    proc.start()
    there.close()
    try:
        if not here.poll(_START_TIMEOUT_S):
            raise RuntimeError("the set-up peer process was not ready in time")
        kind, info = here.recv()
        if kind != "ready":
            raise RuntimeError(f"the set-up peer process failed: {info}")
        yield _Peer(here, int(info["pid"]), int(info["port"]))
    finally:
        try:
            here.send("stop")
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        here.close()


def _stats(ns: Sequence[int], scale: float) -> tuple[float, float]:
    return statistics.median(ns) / scale, min(ns) / scale


def _link_rows(links: int, progress: Callable[[str], None] | None) -> list[Row]:
    rows: list[Row] = []
    clock = time.perf_counter_ns
    desc = CacheDesc(1, DataType.DT_UINT8, (1, SETUP_TENSOR_BYTES))
    mem = arena(SETUP_TENSOR_BYTES * SETUP_LOCAL_CACHES)
    with _peer() as peer, LlmDataDist(_LOCAL_ID, LlmRole.DECODER, backend="sim") as dd:
        dd.initialize(_options(1))
        for i in range(SETUP_LOCAL_CACHES):
            dd.register_kv_cache(desc, [int(mem.ctypes.data) + i * SETUP_TENSOR_BYTES])
        info = [ClusterInfo(remote_cluster_id=_PEER_ID, remote_ip_infos=(IpInfo(LOCALHOST, peer.port),))]
        for caches in SETUP_CACHES:
            if progress is not None:
                progress(f"set-up: {links} links + unlinks to a peer process with {caches} caches")
            peer.caches(caches)
            both: list[int] = []
            link: list[int] = []
            unlink: list[int] = []
            paths: set[str] = set()
            for i in range(links + 2):  # two untimed warm-ups
                t0 = clock()
                dd.link_llm_clusters(info, _TIMEOUT_MS)
                t1 = clock()
                paths.add(link_data_path(dd.backend, _PEER_ID) or "unknown")
                t2 = clock()
                dd.unlink_llm_clusters(info, _TIMEOUT_MS)
                t3 = clock()
                if i >= 2:
                    both.append(t1 - t0 + t3 - t2)
                    link.append(t1 - t0)
                    unlink.append(t3 - t2)
            med, lo = _stats(both, 1e6)
            rows.append({"kind": "link_unlink", "peer_caches": caches, "local_caches": SETUP_LOCAL_CACHES,
                         "data_path": "/".join(sorted(paths)), "median_ms": med, "min_ms": lo,
                         "link_median_ms": _stats(link, 1e6)[0], "link_min_ms": _stats(link, 1e6)[1],
                         "unlink_median_ms": _stats(unlink, 1e6)[0],
                         "samples": len(both)})
    return rows


def _register_rows(registers: int, progress: Callable[[str], None] | None) -> list[Row]:
    rows: list[Row] = []
    clock = time.perf_counter_ns
    mem = arena(SETUP_TENSOR_BYTES * max(SETUP_TENSORS))
    base = int(mem.ctypes.data)
    with LlmDataDist(_LOCAL_ID + 2, LlmRole.PROMPT, backend="sim") as dd:
        dd.initialize(_options(2))
        for tensors in SETUP_TENSORS:
            if progress is not None:
                progress(f"set-up: {registers} registrations of {tensors} tensors")
            desc = CacheDesc(tensors, DataType.DT_UINT8, (1, SETUP_TENSOR_BYTES))
            addrs = [base + i * SETUP_TENSOR_BYTES for i in range(tensors)]
            ns: list[int] = []
            for i in range(registers + 5):  # five untimed warm-ups
                t0 = clock()
                cid = dd.register_kv_cache(desc, addrs)
                t1 = clock()
                dd.unregister_kv_cache(cid)
                if i >= 5:
                    ns.append(t1 - t0)
            med, lo = _stats(ns, 1e3)
            rows.append({"kind": "register", "tensors": tensors, "median_us": med, "min_us": lo,
                         "samples": len(ns)})
    return rows


def measure_setup(repeats: int | None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The set-up rows (``links``, ``registers``) and their targets; see the module docstring.
    ``repeats`` (``--repeats``) scales the samples down: ``max(10, 4 * repeats)`` links,
    ``max(50, 20 * repeats)`` registrations."""
    links = SETUP_LINKS if repeats is None else max(10, 4 * repeats)
    registers = SETUP_REGISTERS if repeats is None else max(50, 20 * repeats)
    link_rows = _link_rows(links, progress)
    reg_rows = _register_rows(registers, progress)
    return {"links": link_rows, "registers": reg_rows, "targets": setup_targets(link_rows, reg_rows)}


#: Link targets: (caches at the peer, median ms at most).
_LINK_TARGETS = ((4, 1.5), (1004, 12.0))
#: register_kv_cache: at most this plus this per tensor (µs).
_REGISTER_BASE_US, _REGISTER_PER_TENSOR_US = 60.0, 0.5


def setup_targets(links: list[Row], registers: list[Row]) -> list[dict[str, Any]]:
    """The set-up targets against what this run measured (``ratio`` = measured / bound: <= 1 is met).
    A link target is on ``link_llm_clusters`` (the unlink after it is reported beside it) and is
    met only over the same-host path."""
    out: list[dict[str, Any]] = []
    for caches, bound in _LINK_TARGETS:
        for r in links:
            if r["peer_caches"] == caches:
                ratio = r["link_median_ms"] / bound
                out.append({"target": f"same-host link with {caches} caches at the peer: median <= {bound:g} ms "
                                      f"(measured {r['link_median_ms']:.2f} ms over {r['data_path']}; "
                                      f"with the unlink {r['median_ms']:.2f} ms)",
                            "ratio": ratio, "met": ratio <= 1.0 and r["data_path"] == "process_vm"})
    for r in registers:
        bound = _REGISTER_BASE_US + _REGISTER_PER_TENSOR_US * r["tensors"]
        ratio = r["median_us"] / bound
        out.append({"target": f"register_kv_cache of {r['tensors']} tensors: median <= {bound:g} us "
                              f"(60 + 0.5 per tensor; measured {r['median_us']:.1f} us)",
                    "ratio": ratio, "met": ratio <= 1.0})
    return out


LINK_COLUMNS = ("kind", "peer_caches", "data_path", "link_median_ms", "link_min_ms", "unlink_median_ms",
                "median_ms", "min_ms", "samples")
REGISTER_COLUMNS = ("kind", "tensors", "median_us", "min_us", "samples")


def print_setup(setup: Mapping[str, Any] | None, out: IO[str]) -> None:
    """The set-up tables (the targets are printed with the other cross-process targets)."""
    if setup is None:
        return
    print(file=out)
    say(f"Set-up (link = link_llm_clusters to a peer process holding peer_caches one-tensor caches, this side "
        f"{SETUP_LOCAL_CACHES}; unlink = the non-force unlink_llm_clusters after it; median_ms / min_ms = the "
        "two together; register = register_kv_cache of one cache of that many tensors (slices of one buffer), "
        "each followed by an untimed unregister):", out)
    print_table(setup.get("links", []), LINK_COLUMNS, out)
    print_table(setup.get("registers", []), REGISTER_COLUMNS, out)
