"""The cross-process section of ``kvdd bench``.

A peer *process* (multiprocessing spawn) hosts a simulator instance with one registered tensor of
`row_bytes` (a pattern), registered twice: as a ``[1, row_bytes]`` cache (the row) and as a paged
``[row_bytes / 64 KiB, 64 KiB]`` cache (the block pool).  It also serves a raw loopback socket
that sends the first N bytes of the same buffer on request (sendall).  This process links to it
and times, interleaved with the raw mechanisms of the same bytes: process_vm_readv/writev
(``_xproc.pvm_bench``: one iovec each side, one thread), a local memcpy (1 and 2 threads) and,
on the TCP path, the raw socket transfer (recv_into a preallocated buffer).

The TCP path is forced with ``KVDD_SIM_XPROC=tcp`` (docs/backends.md); the data path each link
really uses is read with :func:`kvdd.backend.link_data_path`.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from .. import (
    OPTION_DEVICE_ID,
    OPTION_LISTEN_IP_INFO,
    OPTION_SYNC_CACHE_WAIT_TIME,
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmDataDist,
    LlmRole,
    empty,
    tensor_addrs,
)
from .._native import _copy
from ..backend import link_data_path
from .baselines import TwoThreadMemcpy, arena, fill_pattern, memcpy_limits
from .harness import (KiB, MiB, Row, Timing, fmt, gbps, interleaved, peer_reporting, print_table, repeats_for,
                      say)
from .transfers import LOCALHOST
from .xproc_setup import measure_setup, print_setup
from .xproc_small import LAT_COLUMNS, CpuMeter, latency, pvm_ctypes, small_block_rows, xp_targets

__all__ = ["XP_BLOCKS", "XP_BLOCK_BYTES", "XP_COLUMNS", "XP_QUICK_BLOCKS", "XP_QUICK_ROW_BYTES", "XP_ROW_BYTES",
           "measure_cross_process", "print_cross_process"]

XP_BLOCK_BYTES = 64 * KiB
XP_ROW_BYTES, XP_BLOCKS = 256 * MiB, 1024  # the workload of the cross-process targets
XP_QUICK_ROW_BYTES, XP_QUICK_BLOCKS = 64 * MiB, 256
XP_LOCAL_ID = 20
XP_PEER_IDS = {"process_vm": 21, "tcp": 22}
XP_PATHS = ("process_vm", "tcp")
XP_WAIT_MS = 60_000  # llm.SyncKvCacheWaitTime of both sides: no slow transfer times out
ENV_XPROC = "KVDD_SIM_XPROC"  # "tcp": the simulator links other processes over TCP (docs/backends.md)
XP_START_TIMEOUT_S = 120.0  # the peer must be ready within this (spawn, import, fill, listen)
XP_RAW_CHUNK = 64 * KiB  # the raw socket limit receives in chunks of this
XP_SMALL = 64  # bytes of the small-call latency pulls
XP_CALLS = 2000  # timed calls per function for the small-call latency (default)
_XP_STOP = b"\0" * 8


def _xp_options(device: int) -> dict[str, str]:
    return {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", OPTION_DEVICE_ID: str(device),
            OPTION_SYNC_CACHE_WAIT_TIME: str(XP_WAIT_MS)}


def _xp_serve_raw(server: socket.socket, buf: memoryview) -> None:
    """The raw loopback limit, peer side: for every 8-byte request N > 0, sendall N bytes of `buf`."""
    try:
        conn, _ = server.accept()
    except OSError:
        return
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        req = bytearray(8)
        while True:
            got = 0
            try:
                while got < 8:
                    n = conn.recv_into(memoryview(req)[got:])
                    if n == 0:
                        return
                    got += n
                want = int.from_bytes(req, "little")
                if want == 0 or want > len(buf):
                    return
                conn.sendall(buf[:want])
            except OSError:
                return


def _xp_peer_main(conn: Any, row_bytes: int, cluster_id: int, tcp: bool) -> None:
    """Entry point of the spawned peer: register the pattern, report where it is, wait for `stop`
    (or the parent's death), finalize."""
    if tcp:
        os.environ[ENV_XPROC] = "tcp"
    parent = os.getppid()
    with peer_reporting(conn):
        mem = arena(row_bytes) if tcp else empty(row_bytes, np.uint8)  # the same-host path maps it
        fill_pattern(mem)
        server = socket.create_server((LOCALHOST, 0))
        with server, LlmDataDist(cluster_id, LlmRole.PROMPT, backend="sim") as dd:
            dd.initialize(_xp_options(0))
            addrs = tensor_addrs([mem])
            row_id = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, row_bytes)), addrs)
            paged_id = dd.register_kv_cache(
                CacheDesc(1, DataType.DT_UINT8, (row_bytes // XP_BLOCK_BYTES, XP_BLOCK_BYTES)), addrs)
            raw = threading.Thread(target=_xp_serve_raw, args=(server, mem.data.cast("B")),
                                   name="kvdd-bench-raw", daemon=True)
            raw.start()
            conn.send(("ready", {"pid": os.getpid(), "port": dd.listen_port, "raw_port": server.getsockname()[1],
                                 "row_cache": row_id, "paged_cache": paged_id, "addr": int(mem.ctypes.data)}))
            while not conn.poll(0.5):
                if os.getppid() != parent:  # the bench died: do not linger
                    return
            conn.recv()
        t = os.times()
        conn.send(("cpu", t.user + t.system))


@dataclass
class _XPeer:
    path: str
    pid: int
    cluster_id: int
    port: int
    raw_port: int
    row_cache: int
    paged_cache: int
    addr: int


@contextmanager
def _xp_peer(path: str, row_bytes: int, cpu_out: list[float]) -> Iterator[_XPeer]:
    """A spawned peer process (with ``KVDD_SIM_XPROC=tcp`` on the TCP path); stopped, or killed,
    on the way out, whatever happens.  Its CPU time is appended to `cpu_out` when it stops."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    cluster_id = XP_PEER_IDS[path]
    proc = ctx.Process(target=_xp_peer_main, args=(there, row_bytes, cluster_id, path == "tcp"),
                       name=f"kvdd-bench-peer-{path}", daemon=True)
    proc.start()
    there.close()
    try:
        deadline = time.monotonic() + XP_START_TIMEOUT_S
        while not here.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"the {path} peer process exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {path} peer process was not ready within {XP_START_TIMEOUT_S:.0f} s")
        try:
            kind, info = here.recv()
        except EOFError:
            raise RuntimeError(f"the {path} peer process exited without a word") from None
        if kind != "ready":
            raise RuntimeError(f"the {path} peer process failed: {info}")
        peer = _XPeer(path, int(info["pid"]), cluster_id, int(info["port"]), int(info["raw_port"]),
                      int(info["row_cache"]), int(info["paged_cache"]), int(info["addr"]))
        yield peer
    finally:
        try:
            here.send("stop")
            if here.poll(10):
                kind, value = here.recv()
                if kind == "cpu":
                    cpu_out.append(float(value))
        except (OSError, EOFError, ValueError, TypeError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        here.close()


@contextmanager
def _xp_env(path: str) -> Iterator[None]:
    """``KVDD_SIM_XPROC=tcp`` in this process too while the TCP link is made (the fabric chooses a
    link's data path when linking)."""
    old = os.environ.get(ENV_XPROC)
    if path == "tcp":
        os.environ[ENV_XPROC] = "tcp"
    try:
        yield
    finally:
        if path == "tcp":
            if old is None:
                os.environ.pop(ENV_XPROC, None)
            else:
                os.environ[ENV_XPROC] = old


def _xp_data_path(dd: LlmDataDist, peer_cluster_id: int) -> str:
    """The data path the fabric chose for the link (``process_vm``, ``tcp``)."""
    path = link_data_path(dd.backend, peer_cluster_id)
    return path if path is not None else "unknown"


class _RawSocket:
    """The raw loopback limit, bench side: ask for N bytes (a blocking request/response), then
    recv_into a preallocated buffer in 64 KiB chunks."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((LOCALHOST, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def pull(self, buf: memoryview, nbytes: int) -> None:
        self.sock.sendall(nbytes.to_bytes(8, "little"))
        recv_into = self.sock.recv_into
        got = 0
        while got < nbytes:
            n = recv_into(buf[got:min(nbytes, got + XP_RAW_CHUNK)])
            if n == 0:
                raise RuntimeError("the raw socket peer closed the connection")
            got += n

    def close(self) -> None:
        try:
            self.sock.sendall(_XP_STOP)
        except OSError:
            pass
        self.sock.close()


def _xp_row(path: str, kind: str, nbytes: int, run_bytes: int, res: dict[str, Timing], verified: bool,
            limit: str, data_path: str, cpu: Mapping[str, Any]) -> Row:
    tr = res["transfer"]

    def ratio(name: str, key: str) -> float | None:
        t = res.get(name)
        return None if t is None else t[key] / tr[key]

    def rate(name: str) -> float | None:
        t = res.get(name)
        return None if t is None else gbps(nbytes, t["min_s"])

    row: Row = {
        "path": path,
        "data_path": data_path,
        "kind": kind,
        "run_bytes": run_bytes,
        "bytes": nbytes,
        "min_ms": tr["min_s"] * 1e3,
        "median_ms": tr["median_s"] * 1e3,
        "gbps": gbps(nbytes, tr["min_s"]),
        "pvm_gbps": rate("pvm"),
        "pvm_iov_gbps": rate("pvm_iov"),
        "mem_gbps": rate("mem"),
        "mem_iov_gbps": rate("mem_iov"),
        "memcpy_1t_gbps": rate("memcpy_1t"),
        "memcpy_2t_gbps": rate("memcpy_2t"),
        "socket_gbps": rate("socket"),
        "vs_pvm": ratio("pvm", "min_s"),
        "vs_pvm_iov": ratio("pvm_iov", "min_s"),
        "vs_mem": ratio("mem", "min_s"),
        "vs_mem_iov": ratio("mem_iov", "min_s"),
        "vs_memcpy": ratio("memcpy_1t", "min_s"),
        "vs_memcpy_2t": ratio("memcpy_2t", "min_s"),
        "vs_socket": ratio("socket", "min_s"),
        "limit": limit,
        "ratio": ratio(limit, "min_s"),
        "ratio_median": ratio(limit, "median_s"),
        "cpu_s_per_gb": cpu["cpu_s_per_gb"],
        "own_cpu_s_per_gb": cpu["own_cpu_s_per_gb"],
        "peer_cpu_s_per_gb": cpu["peer_cpu_s_per_gb"],
        "samples": tr["samples"],
        "verified": verified,
    }
    return row


def _latency_row(path: str, data_path: str, res: Mapping[str, Mapping[str, float]], verified: bool) -> Row:
    tr = res["transfer"]
    row: Row = {"path": path, "data_path": data_path, "kind": f"pull_{XP_SMALL}B", "bytes": XP_SMALL,
                "median_us": tr["median_us"], "p99_us": tr["p99_us"], "calls": int(tr["calls"]),
                "verified": verified}
    for ref in ("in_process", "in_process_python", "socket_rr", "pvm_ctypes"):
        r = res[ref]
        row[f"{ref}_median_us"] = r["median_us"]
        row[f"{ref}_p99_us"] = r["p99_us"]
        row[f"vs_{ref}_median"] = tr["median_us"] / r["median_us"]
        row[f"vs_{ref}_p99"] = tr["p99_us"] / r["p99_us"]
    return row


@contextmanager
def _in_process_peer(local: LlmDataDist, nbytes: int,
                     ext: KvCacheExtParam) -> Iterator[tuple[CacheIndex, Callable[[], object]]]:
    """A second instance in this process (the in-process reference of the small-call latency):
    one ``[1, nbytes]`` cache holding a pattern, linked from ``local``; with the index of that
    cache, the same pull by a third instance whose compiled path is off (``python_pull``: the
    in-process pull through the engine's Python checks, as every cross-process call runs)."""
    mem, dst = arena(nbytes), arena(nbytes)
    fill_pattern(mem)
    desc = CacheDesc(1, DataType.DT_UINT8, (1, nbytes))
    with LlmDataDist(XP_LOCAL_ID + 10, LlmRole.PROMPT, backend="sim") as ref, \
            LlmDataDist(XP_LOCAL_ID + 11, LlmRole.DECODER, backend="sim") as py:
        ref.initialize(_xp_options(2))
        py.initialize(_xp_options(3))
        cid = ref.register_kv_cache(desc, tensor_addrs([mem]))
        py_cache = Cache(py.register_kv_cache(desc, tensor_addrs([dst])))
        info = ClusterInfo(remote_cluster_id=XP_LOCAL_ID + 10,
                           remote_ip_infos=(IpInfo(LOCALHOST, ref.listening_port),))
        local.link_llm_clusters([info], 10_000)
        py.link_llm_clusters([info], 10_000)
        fast = getattr(py.backend, "fast_transfers", None)
        if fast is not None:
            fast.enabled = False
        idx = CacheIndex(XP_LOCAL_ID + 10, cid, 0)
        try:
            yield idx, functools.partial(py.pull_kv_cache, idx, py_cache, 0, nbytes, ext)
        finally:
            local.unlink_llm_clusters([info], 10_000, force=True)


def measure_cross_process(row_bytes: int, blocks: int, budget_s: float, repeats: int | None, seed: int,
                          paths: Sequence[str] = XP_PATHS,
                          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The cross-process section of ``kvdd bench``: see the module docstring."""
    if row_bytes < XP_BLOCK_BYTES or row_bytes % XP_BLOCK_BYTES:
        raise ValueError(f"the cross-process size must be a positive multiple of {XP_BLOCK_BYTES // KiB} KiB")
    pool = row_bytes // XP_BLOCK_BYTES
    if not 1 <= blocks <= pool:
        raise ValueError(f"the cross-process block count must lie in [1, {pool}] (the size / 64 KiB)")
    try:
        from .._native import _xproc
    except ImportError as exc:  # not Linux: no process_vm_readv
        raise RuntimeError(f"no process_vm_readv here ({exc})") from None
    rng = np.random.default_rng(seed)
    src_ids = [int(x) for x in rng.permutation(pool)[:blocks]]
    dst_ids = [int(x) for x in rng.permutation(pool)[:blocks]]
    blk_bytes = blocks * XP_BLOCK_BYTES
    B = XP_BLOCK_BYTES
    calls = XP_CALLS if repeats is None else max(50, 25 * repeats)
    iov_local = np.asarray(dst_ids, dtype=np.int64) * B
    iov_remote = np.asarray(src_ids, dtype=np.int64) * B
    iov_len = np.full(blocks, B, dtype=np.int64)

    # this side: `src` holds the peer's pattern (memcpy source, push source, expected bytes), `dst`
    # receives (pulls, raw limits); both registered as paged caches, `dst` also as the row
    src = empty(row_bytes, np.uint8)  # kvdd's shareable memory, as the peer's
    fill_pattern(src)
    dst = empty(row_bytes, np.uint8)
    dst.fill(0)
    small = arena(XP_SMALL)
    src_r = _copy.Region(src.ctypes.data, src.nbytes, src)
    dst_r = _copy.Region(dst.ctypes.data, dst.nbytes, dst)
    dst_mv = dst.data.cast("B")
    row_desc = CacheDesc(1, DataType.DT_UINT8, (1, row_bytes))
    paged_desc = CacheDesc(1, DataType.DT_UINT8, (pool, B))
    small_desc = CacheDesc(1, DataType.DT_UINT8, (1, XP_SMALL))

    def blocks_equal() -> bool:
        return all(np.array_equal(dst[d * B:(d + 1) * B], src[s * B:(s + 1) * B]) for s, d in zip(src_ids, dst_ids))

    rows: list[Row] = []
    lat_rows: list[Row] = []
    peers: list[dict[str, Any]] = []
    peer_cpu: list[float] = []
    pair = TwoThreadMemcpy()
    try:
        for path in paths:
            if progress is not None:
                progress(f"cross-process over {path}: {row_bytes // MiB if row_bytes >= MiB else row_bytes} "
                         f"{'MiB' if row_bytes >= MiB else 'B'} row, {blocks} x 64 KiB blocks, {calls} x "
                         f"{XP_SMALL} B pulls (peer process)")
            with ExitStack() as stack:
                peer = stack.enter_context(_xp_peer(path, row_bytes, peer_cpu))
                dd = stack.enter_context(LlmDataDist(XP_LOCAL_ID, LlmRole.DECODER, backend="sim"))
                dd.initialize(_xp_options(1))
                rows_cache = Cache(dd.register_kv_cache(row_desc, tensor_addrs([dst])), (dst.ctypes.data,), row_desc)
                dst_paged = Cache(dd.register_kv_cache(paged_desc, tensor_addrs([dst])), (dst.ctypes.data,),
                                  paged_desc)
                src_paged = Cache(dd.register_kv_cache(paged_desc, tensor_addrs([src])), (src.ctypes.data,),
                                  paged_desc)
                small_cache = Cache(dd.register_kv_cache(small_desc, tensor_addrs([small])),
                                    (small.ctypes.data,), small_desc)
                with _xp_env(path):
                    dd.link_llm_clusters([ClusterInfo(remote_cluster_id=peer.cluster_id,
                                                      remote_ip_infos=(IpInfo(LOCALHOST, peer.port),))], 10_000)
                data_path = _xp_data_path(dd, peer.cluster_id)
                peers.append({"path": path, "pid": peer.pid, "data_path": data_path})
                row_idx = CacheIndex(peer.cluster_id, peer.row_cache, 0)
                blk_idx = CacheIndex(peer.cluster_id, peer.paged_cache, 0)
                ext = KvCacheExtParam(tensor_num_per_layer=1)  # one tensor, one layer
                pull_row = functools.partial(dd.pull_kv_cache, row_idx, rows_cache, 0, -1, ext)
                pull_blocks = functools.partial(dd.pull_kv_blocks, blk_idx, dst_paged, src_ids, dst_ids, ext)
                push_blocks = functools.partial(dd.push_kv_blocks, src_paged, blk_idx, src_ids, dst_ids, ext)
                raw = _RawSocket(peer.raw_port)
                stack.callback(raw.close)
                meter = CpuMeter(peer.pid)
                mem_fd = os.open(f"/proc/{peer.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
                stack.callback(os.close, mem_fd)

                # small calls: a 64-byte pull from the peer process vs the same pull from an instance in
                # this process and vs a raw blocking 64-byte request/response over loopback
                ref_idx, python_pull = stack.enter_context(_in_process_peer(dd, XP_SMALL, ext))
                small_mv = small.data.cast("B")
                small.fill(0)
                dd.pull_kv_cache(row_idx, small_cache, 0, XP_SMALL, ext)
                ok_small = bool(np.array_equal(small, src[:XP_SMALL]))
                lat = latency({"transfer": functools.partial(dd.pull_kv_cache, row_idx, small_cache, 0, XP_SMALL,
                                                             ext),
                               "in_process": functools.partial(dd.pull_kv_cache, ref_idx, small_cache, 0,
                                                               XP_SMALL, ext),
                               "in_process_python": python_pull,
                               "socket_rr": functools.partial(raw.pull, small_mv, XP_SMALL),
                               "pvm_ctypes": pvm_ctypes(peer.pid, [small.ctypes.data], [peer.addr], [XP_SMALL])}, calls)
                lat_rows.append(_latency_row(path, data_path, lat, ok_small))
                if path == "process_vm":  # small block lists against the bare syscall of their iovecs
                    def pull_k(k: int) -> Callable[[], object]:
                        return functools.partial(dd.pull_kv_blocks, blk_idx, dst_paged, src_ids[:k], dst_ids[:k], ext)

                    def pvm_k(k: int) -> Callable[[], object]:
                        return pvm_ctypes(peer.pid, [dst.ctypes.data + d * B for d in dst_ids[:k]],
                                          [peer.addr + s * B for s in src_ids[:k]], [B] * k)

                    def landed(k: int) -> bool:
                        return all(np.array_equal(dst[d * B:(d + 1) * B], src[s * B:(s + 1) * B])
                                   for s, d in zip(src_ids[:k], dst_ids[:k]))
                    dst.fill(0)
                    lat_rows.extend(small_block_rows(path, data_path, pull_k, pvm_k, landed, B, max(50, calls // 4),
                                                     blocks))

                def limits(nbytes: int, write: bool, iov: bool) -> dict[str, Callable[[], object]]:
                    fns: dict[str, Callable[[], object]] = {}
                    fns["pvm"] = functools.partial(_xproc.pvm_bench, peer.pid, src_r if write else dst_r,
                                                   peer.addr, nbytes, write)
                    lo, ro = (iov_remote, iov_local) if write else (iov_local, iov_remote)
                    if iov:  # the same scattered runs as the block transfer, one bare call
                        fns["pvm_iov"] = functools.partial(_xproc.pvm_bench_runs, peer.pid,
                                                           src_r if write else dst_r, peer.addr, lo, ro,
                                                           iov_len, write)
                    # the mechanism the data path uses: pread / pwrite on /proc/<pid>/mem
                    whole = np.array([nbytes], np.int64)
                    zero = np.array([0], np.int64)
                    fns["mem"] = functools.partial(_xproc.mem_bench_runs, mem_fd, src_r if write else dst_r,
                                                   peer.addr, zero, zero, whole, write)
                    if iov:
                        fns["mem_iov"] = functools.partial(_xproc.mem_bench_runs, mem_fd,
                                                           src_r if write else dst_r, peer.addr, lo, ro,
                                                           iov_len, write)
                    fns.update(memcpy_limits(dst_r, src_r, nbytes, pair))
                    if path == "tcp" and not write:
                        fns["socket"] = functools.partial(raw.pull, dst_mv, nbytes)
                    return fns

                def measure(kind: str, fn: Callable[[], object], nbytes: int, run_bytes: int, write: bool,
                            verify: Callable[[], bool]) -> None:
                    dst.fill(0)
                    fn()
                    verified = verify()
                    fns: dict[str, Callable[[], object]] = {"transfer": fn}
                    fns.update(limits(nbytes, write, not kind.startswith("pull_row")))
                    if "socket" in fns:  # the raw socket moves the same bytes
                        dst.fill(0)
                        fns["socket"]()
                        verified = verified and bool(np.array_equal(dst[:nbytes], src[:nbytes]))
                    reps = repeats if repeats is not None else repeats_for(nbytes, 2 * budget_s, 5e9, lo=5, hi=50)
                    res = interleaved(fns, reps)
                    cpu = meter.per_gb(fn, nbytes, max(1, min(reps, 10)))
                    limit = ("socket" if path == "tcp" else "pvm" if kind.startswith("pull_row") else "pvm_iov")
                    rows.append(_xp_row(path, kind, nbytes, run_bytes, res, verified, limit, data_path, cpu))

                measure("pull_row", pull_row, row_bytes, row_bytes, False,
                        lambda: bool(np.array_equal(dst, src)))
                maps = getattr(getattr(dd.backend, "entities", {})[peer.cluster_id].peer.one_sided(),
                               "maps", None) if path == "process_vm" else None
                if maps is not None:  # the same row through /proc/<pid>/mem (memory not shared)
                    maps.enabled = False
                    try:
                        measure("pull_row_proc_mem", pull_row, row_bytes, row_bytes, False,
                                lambda: bool(np.array_equal(dst, src)))
                    finally:
                        maps.enabled = True
                measure("pull_blocks", pull_blocks, blk_bytes, B, False, blocks_equal)
                if path == "process_vm":
                    def pushed() -> bool:  # read the peer's blocks back (pull verified above)
                        dst.fill(0)
                        dd.pull_kv_blocks(blk_idx, dst_paged, dst_ids, dst_ids, ext)
                        return all(np.array_equal(dst[d * B:(d + 1) * B], src[s * B:(s + 1) * B])
                                   for s, d in zip(src_ids, dst_ids))
                    measure("push_blocks", push_blocks, blk_bytes, B, True, pushed)
    finally:
        pair.close()
    setup = measure_setup(repeats, progress)  # link set-up and registration (xproc_setup.py)
    return {"config": {"row_bytes": row_bytes, "blocks": blocks, "block_bytes": XP_BLOCK_BYTES,
                       "sync_wait_ms": XP_WAIT_MS, "small_bytes": XP_SMALL, "calls": calls,
                       "raw_chunk_bytes": XP_RAW_CHUNK},
            "peers": peers, "peer_cpu_s": sum(peer_cpu), "rows": rows, "latency": lat_rows,
            "setup": setup, "targets": xp_targets(rows, lat_rows) + setup["targets"]}


XP_COLUMNS = ("path", "kind", "run_bytes", "bytes", "min_ms", "median_ms", "gbps", "pvm_gbps", "pvm_iov_gbps",
              "mem_gbps", "mem_iov_gbps", "socket_gbps", "vs_pvm", "vs_pvm_iov", "vs_mem", "vs_mem_iov",
              "vs_memcpy", "vs_socket", "ratio_median", "cpu_s_per_gb",
              "own_cpu_s_per_gb", "peer_cpu_s_per_gb", "verified")


def print_cross_process(cross: Mapping[str, Any], file: IO[str] | None = None) -> None:
    """The cross-process tables and the cross-process targets."""
    out = file if file is not None else sys.stdout
    cfg = cross["config"]
    print(file=out)
    say(f"Cross-process (a spawned peer process, {fmt(cfg['row_bytes'])}B row, {cfg['blocks']} x 64 KiB "
          "blocks; vs_X = transfer speed / X's speed on the same bytes, same run: pvm = one bare "
          "process_vm_readv/writev loop, pvm_iov = bare process_vm_readv/writev of the same iovecs, memcpy = "
          "1-thread local memcpy, socket = raw loopback TCP receiving in 64 KiB chunks; cpu_s_per_gb = CPU "
          "seconds of both processes per GB moved):", out)
    if cross.get("error"):
        print(f"(not measured: {cross['error']})", file=out)
        return
    rows = [{k: v for k, v in r.items() if v is not None} for r in cross["rows"]]
    print_table(rows, XP_COLUMNS, out)
    print(file=out)
    say(f"Small calls ({cfg.get('calls')} timed calls each, interleaved; in_process = the same pull from an "
          "instance in this process (the simulator's compiled in-process path), in_process_python = the same "
          "with that path off (the engine's Python checks, which every cross-process call runs), socket_rr = "
          "a raw blocking request/response of the same bytes over loopback):", out)
    print_table(cross.get("latency", []), LAT_COLUMNS, out)
    print_setup(cross.get("setup"), out)
    for p in cross["peers"]:
        if p["data_path"] != p["path"]:
            print(f"# note: the {p['path']} link used the {p['data_path']} data path", file=out)
    for t in cross["targets"]:
        print(f"# target: {t['target']}: {t['ratio']:.2f}x, {'met' if t['met'] else 'NOT met'}", file=out)
