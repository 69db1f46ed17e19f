"""The cross-process section of ``kvdd bench``.

A peer *process* (:mod:`kvdd.bench.xproc_peer`) hosts a simulator instance with one registered
tensor of `row_bytes` (a pattern), registered as a row cache and as a paged 64 KiB block pool, and
serves a raw loopback socket that sends the first N bytes of the same buffer on request
(sendall).  This process links to it and times, interleaved with the raw mechanisms of the same
bytes: process_vm_readv/writev (``_xproc.pvm_bench``: one iovec each side, one thread), a local
memcpy (1 and 2 threads) and, on the TCP path, the raw socket transfer (recv_into a preallocated
buffer).

The TCP path is forced with ``KVDD_SIM_XPROC=tcp`` (docs/backends.md); the data path each link
really uses is read with :func:`kvdd.backend.link_data_path`.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import IO, Any

import numpy as np

from .. import (
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
from .baselines import TwoThreadMemcpy, arena, fill_pattern, memcpy_limits
from .harness import KiB, MiB, Row, Timing, fmt, gbps, interleaved, print_table, repeats_for, say
from .transfers import LOCALHOST
from .xproc_peer import (XP_BLOCK_BYTES, XP_LOCAL_ID, XP_RAW_CHUNK, XP_RAW_GATHER, XP_RAW_LOWAT, XP_SMALL,
                         XP_WAIT_MS, RawSocket, in_process_peer, xp_data_path, xp_env, xp_options,
                         xp_peer)
from .xproc_setup import measure_setup, print_setup
from .xproc_small import LAT_COLUMNS, CpuMeter, latency, pvm_ctypes, small_block_rows, xp_targets

__all__ = ["XP_BLOCKS", "XP_BLOCK_BYTES", "XP_COLUMNS", "XP_QUICK_BLOCKS", "XP_QUICK_ROW_BYTES", "XP_ROW_BYTES",
           "measure_cross_process", "print_cross_process"]

XP_ROW_BYTES, XP_BLOCKS = 256 * MiB, 1024  # the workload of the cross-process targets
XP_QUICK_ROW_BYTES, XP_QUICK_BLOCKS = 64 * MiB, 256
XP_PATHS = ("process_vm", "tcp")
XP_CALLS = 2000  # timed calls per function for the small-call latency (default)


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
        "socket_chunks_gbps": rate("socket_chunks"),
        "socket_gathered_gbps": rate("socket_gathered"),
        "vs_pvm": ratio("pvm", "min_s"),
        "vs_pvm_iov": ratio("pvm_iov", "min_s"),
        "vs_mem": ratio("mem", "min_s"),
        "vs_mem_iov": ratio("mem_iov", "min_s"),
        "vs_memcpy": ratio("memcpy_1t", "min_s"),
        "vs_memcpy_2t": ratio("memcpy_2t", "min_s"),
        "vs_socket": ratio("socket", "min_s"),
        "vs_socket_chunks": ratio("socket_chunks", "min_s"),
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


def _best_socket(res: dict[str, Timing]) -> dict[str, Timing]:
    """``res`` with ``socket`` the faster (by its best time) of the raw receivers: 64 KiB chunks
    (kept as ``socket_chunks`` too) and 4 MiB receives woken per MiB (``socket_gathered``)."""
    gathered = res.get("socket_gathered")
    if "socket" in res:
        res["socket_chunks"] = res["socket"]
        if gathered is not None and gathered["min_s"] < res["socket"]["min_s"]:
            res["socket"] = gathered
    return res


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
                peer = stack.enter_context(xp_peer(path, row_bytes, peer_cpu))
                dd = stack.enter_context(LlmDataDist(XP_LOCAL_ID, LlmRole.DECODER, backend="sim"))
                dd.initialize(xp_options(1))
                rows_cache = Cache(dd.register_kv_cache(row_desc, tensor_addrs([dst])), (dst.ctypes.data,), row_desc)
                dst_paged = Cache(dd.register_kv_cache(paged_desc, tensor_addrs([dst])), (dst.ctypes.data,),
                                  paged_desc)
                src_paged = Cache(dd.register_kv_cache(paged_desc, tensor_addrs([src])), (src.ctypes.data,),
                                  paged_desc)
                small_cache = Cache(dd.register_kv_cache(small_desc, tensor_addrs([small])),
                                    (small.ctypes.data,), small_desc)
                with xp_env(path):
                    dd.link_llm_clusters([ClusterInfo(remote_cluster_id=peer.cluster_id,
                                                      remote_ip_infos=(IpInfo(LOCALHOST, peer.port),))], 10_000)
                data_path = xp_data_path(dd, peer.cluster_id)
                peers.append({"path": path, "pid": peer.pid, "data_path": data_path})
                row_idx = CacheIndex(peer.cluster_id, peer.row_cache, 0)
                blk_idx = CacheIndex(peer.cluster_id, peer.paged_cache, 0)
                ext = KvCacheExtParam(tensor_num_per_layer=1)  # one tensor, one layer
                pull_row = functools.partial(dd.pull_kv_cache, row_idx, rows_cache, 0, -1, ext)
                pull_blocks = functools.partial(dd.pull_kv_blocks, blk_idx, dst_paged, src_ids, dst_ids, ext)
                push_blocks = functools.partial(dd.push_kv_blocks, src_paged, blk_idx, src_ids, dst_ids, ext)
                raw = RawSocket(peer.raw_port)
                stack.callback(raw.close)
                meter = CpuMeter(peer.pid)
                mem_fd = os.open(f"/proc/{peer.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
                stack.callback(os.close, mem_fd)

                # small calls: a 64-byte pull from the peer process vs the same pull from an instance in
                # this process and vs a raw blocking 64-byte request/response over loopback
                ref_idx, python_pull = stack.enter_context(in_process_peer(dd, XP_SMALL, ext))
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
                    if path == "tcp" and not write:  # the faster of two raw receivers (_best_socket)
                        fns["socket"] = functools.partial(raw.pull, dst_mv, nbytes)
                        fns["socket_gathered"] = functools.partial(raw.pull_gathered, dst_mv, nbytes)
                    return fns

                def measure(kind: str, fn: Callable[[], object], nbytes: int, run_bytes: int, write: bool,
                            verify: Callable[[], bool]) -> None:
                    dst.fill(0)
                    fn()
                    verified = verify()
                    fns: dict[str, Callable[[], object]] = {"transfer": fn}
                    fns.update(limits(nbytes, write, not kind.startswith("pull_row")))
                    for raw_fn in ("socket", "socket_gathered"):  # the raw socket moves the same bytes
                        if raw_fn in fns:
                            dst.fill(0)
                            fns[raw_fn]()
                            verified = verified and bool(np.array_equal(dst[:nbytes], src[:nbytes]))
                    reps = repeats if repeats is not None else repeats_for(nbytes, 2 * budget_s, 5e9, lo=5, hi=50)
                    res = _best_socket(interleaved(fns, reps))
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
                       "raw_chunk_bytes": XP_RAW_CHUNK, "raw_gather_bytes": XP_RAW_GATHER,
                       "raw_lowat_bytes": XP_RAW_LOWAT},
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
          "1-thread local memcpy, socket = raw loopback TCP, the faster of receiving in 64 KiB chunks and 4 MiB "
          "at a time woken per MiB queued; cpu_s_per_gb = CPU "
          "seconds of both processes per GB moved):", out)
    if cross.get("error"):
        print(f"(not measured: {cross['error']})", file=out)
        return
    rows = [{k: v for k, v in r.items() if v is not None} for r in cross["rows"]]
    print_table(rows, XP_COLUMNS, out)
    print(file=out)
    say(f"Small calls ({cfg.get('calls')} timed calls each, interleaved; in_process = the same pull from an "
          "instance in this process (the compiled call path, as same-host calls take it), in_process_python = "
          "the same with that path off (the engine's Python checks, as TCP calls take them), socket_rr = "
          "a raw blocking request/response of the same bytes over loopback, pvm_ctypes = a bare "
          "process_vm_readv of the same iovecs from Python; pull_blocks_Nx64KiB = N blocks of the block "
          "pool):", out)
    print_table(cross.get("latency", []), LAT_COLUMNS, out)
    print_setup(cross.get("setup"), out)
    for p in cross["peers"]:
        if p["data_path"] != p["path"]:
            print(f"# note: the {p['path']} link used the {p['data_path']} data path", file=out)
    for t in cross["targets"]:
        print(f"# target: {t['target']}: {t['ratio']:.2f}x, {'met' if t['met'] else 'NOT met'}", file=out)
