"""The package section of ``kvdd bench``: ``pull_blocks`` through the façade of CANN's Python
package (:mod:`kvdd.llm_datadist`) against the same transfer through kvdd's own API
(``LlmDataDist.pull_kv_blocks``), in the same run, across processes.

A spawned peer process holds one paged cache of a model's K/V tensors (Qwen2.5-7B: 56 tensors of
128 KiB blocks, a pool twice the request) with a pattern, registered twice over the same memory:
with the façade's ``register_blocks_cache`` under ``BlocksCacheKey(peer, model_id=0)`` and with
kvdd's ``register_kv_cache``.  This process links to both (the façade's ``link_clusters``, kvdd's
``link_llm_clusters``) with one destination pool registered on each side, and times, interleaved:
a 1024-token request's blocks (random distinct ids into random ids) in one call of all layers,
and layer by layer (one call per layer: the façade's ``src_layer_range`` / ``dst_layer_range``,
kvdd's ``KvCacheExtParam``, prebuilt), and one block of one layer (the fixed cost of a call).  ``ratio`` = façade time / kvdd time (min over repeats;
``ratio_median`` from medians); the goal is at most :data:`GOAL`.  Both pulls are checked once
against the pattern (every byte of the destination pool) before timing.

Why not in-process too: the package has one engine per process (PYPKG.md §3.0), so its peer is
always another process; both APIs are measured against peers in the same other process, on the
fabric's process_vm path and on its TCP path (``KVDD_SIM_XPROC=tcp``).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt

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
)
from ..models import BLOCK_TOKENS
from ..sim.fabric import ENV_XPROC
from .baselines import arena, fill_pattern
from .harness import Row, Timing, gbps, interleaved, peer_reporting
from .transfers import GEOMETRIES, LOCALHOST, BenchGeometry

__all__ = ["GOAL", "PKG_COLUMNS", "PKG_GEOMETRY", "PKG_TOKENS", "measure_package", "print_package"]

GOAL = 1.1
PKG_GEOMETRY = "qwen2.5-7b"
PKG_TOKENS = 1024
PKG_PATHS = ("process_vm", "tcp")
PKG_COLUMNS = ("path", "kind", "calls", "tensors", "bytes", "package_ms", "kvdd_ms", "package_gbps", "kvdd_gbps",
               "ratio", "ratio_median", "goal", "met", "verified")
_PEER_PKG, _PEER_KVDD, _LOCAL_PKG, _LOCAL_KVDD = 41, 42, 43, 44
_WAIT_MS = 60_000
_START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


def _pkg_options(listen_port: int | None, device: int) -> dict[str, str]:
    from .. import llm_datadist as ld

    cfg = ld.LLMConfig()
    cfg.device_id = device
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = _WAIT_MS
    if listen_port is not None:
        cfg.listen_ip_info = f"{LOCALHOST}:{listen_port}"
    return dict(cfg.generate_options())


def _kvdd_options(device: int) -> dict[str, str]:
    return {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", OPTION_DEVICE_ID: str(device),
            OPTION_SYNC_CACHE_WAIT_TIME: str(_WAIT_MS)}


def _shape(geom: BenchGeometry, blocks: int) -> list[int]:
    return [blocks, BLOCK_TOKENS, *geom.token_shape]


def _addrs(mem: npt.NDArray[np.uint8], n: int) -> list[int]:
    step = mem.size // n
    return [int(mem.ctypes.data) + t * step for t in range(n)]


def _peer_main(conn: Any, geom_name: str, pool: int, tcp: bool) -> None:
    """The spawned peer: the pattern pool registered with the façade and with kvdd; wait for stop."""
    from .. import llm_datadist as ld

    if tcp:
        os.environ[ENV_XPROC] = "tcp"
    parent = os.getppid()
    geom = GEOMETRIES[geom_name]
    with peer_reporting(conn):
        mem = arena(geom.tensors * pool * geom.block_bytes)
        fill_pattern(mem)
        addrs = _addrs(mem, geom.tensors)
        port = _free_port()
        engine = ld.LLMDataDist(ld.LLMRole.PROMPT, _PEER_PKG)
        engine.init(_pkg_options(port, 0))
        try:
            engine.cache_manager.register_blocks_cache(
                ld.CacheDesc(geom.tensors, _shape(geom, pool), ld.DataType.DT_BF16), addrs,
                ld.BlocksCacheKey(_PEER_PKG, model_id=0))
            with LlmDataDist(_PEER_KVDD, LlmRole.PROMPT, backend="sim") as dd:
                dd.initialize(_kvdd_options(1))
                cid = dd.register_kv_cache(CacheDesc(geom.tensors, DataType.DT_BF16, tuple(_shape(geom, pool))), addrs)
                conn.send(("ready", {"pid": os.getpid(), "pkg_port": port, "kvdd_port": dd.listening_port,
                                     "kvdd_cache": cid}))
                while not conn.poll(0.5):
                    if os.getppid() != parent:
                        return
                conn.recv()
        finally:
            engine.finalize()
        t = os.times()
        conn.send(("cpu", t.user + t.system))


@contextmanager
def _peer(path: str, geom: BenchGeometry, pool: int) -> Iterator[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_peer_main, args=(there, geom.name, pool, path == "tcp"),
                       name=f"kvdd-bench-package-{path}", daemon=True)
    proc.start()
    there.close()
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not here.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"the package peer ({path}) exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the package peer ({path}) was not ready within {_START_TIMEOUT_S:.0f} s")
        kind, info = here.recv()
        if kind != "ready":
            raise RuntimeError(f"the package peer ({path}) failed: {info}")
        yield dict(info)
    finally:
        try:
            here.send("stop")
            here.poll(10)
        except (OSError, EOFError, ValueError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        here.close()


@contextmanager
def _env(path: str) -> Iterator[None]:
    """``KVDD_SIM_XPROC=tcp`` here too while linking on the TCP path (chosen at link time)."""
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


def _expected(geom: BenchGeometry, pool: int, src: list[int], dst: list[int],
              tensors: range | None = None) -> npt.NDArray[np.uint64]:
    """The destination pool (as 8-byte words) after a pull of ``tensors`` (all by default): zeros
    but the pulled blocks, which hold the peer's pattern (every word its index in the peer's arena)."""
    words_per_block = geom.block_bytes // 8
    out = np.zeros(geom.tensors * pool * words_per_block, np.uint64)
    tensor_words = pool * words_per_block
    for t in (range(geom.tensors) if tensors is None else tensors):
        for s, d in zip(src, dst):
            start = t * tensor_words + s * words_per_block
            at = t * tensor_words + d * words_per_block
            out[at:at + words_per_block] = np.arange(start, start + words_per_block, dtype=np.uint64)
    return out


def _row(path: str, kind: str, calls: int, geom: BenchGeometry, nbytes: int, res: dict[str, Timing],
         verified: bool, judged: bool = True) -> Row:
    """One row; ``judged``: the :data:`GOAL` applies (the 1024-token request), else the row only
    reports (the fixed cost of one small call)."""
    pkg, own = res["package"], res["kvdd"]
    ratio = pkg["min_s"] / own["min_s"]
    return {"path": path, "kind": kind, "calls": calls, "tensors": geom.tensors, "bytes": nbytes,
            "package_ms": pkg["min_s"] * 1e3, "package_median_ms": pkg["median_s"] * 1e3,
            "kvdd_ms": own["min_s"] * 1e3, "kvdd_median_ms": own["median_s"] * 1e3,
            "package_gbps": gbps(nbytes, pkg["min_s"]), "kvdd_gbps": gbps(nbytes, own["min_s"]),
            "ratio": ratio, "ratio_median": pkg["median_s"] / own["median_s"], "goal": GOAL if judged else None,
            "met": ratio <= GOAL if judged else None, "samples": pkg["samples"], "verified": verified}


def _measure_path(path: str, geom: BenchGeometry, blocks: int, repeats: int, seed: int) -> list[Row]:
    from .. import llm_datadist as ld

    pool = 2 * blocks
    rng = np.random.default_rng(seed)
    src = [int(b) for b in rng.choice(pool, blocks, replace=False)]
    dst = [int(b) for b in rng.choice(pool, blocks, replace=False)]
    dst_mem = arena(geom.tensors * pool * geom.block_bytes)
    dst_mem[:] = 0
    addrs = _addrs(dst_mem, geom.tensors)
    nbytes = geom.tensors * blocks * geom.block_bytes
    rows: list[Row] = []
    with _peer(path, geom, pool) as peer, _env(path):
        engine = ld.LLMDataDist(ld.LLMRole.DECODER, _LOCAL_PKG)
        engine.init(_pkg_options(None, 2))
        try:
            cm = engine.cache_manager
            cache = cm.register_blocks_cache(ld.CacheDesc(geom.tensors, _shape(geom, pool), ld.DataType.DT_BF16), addrs)
            info = ld.LLMClusterInfo()
            info.remote_cluster_id = _PEER_PKG
            info.append_local_ip_info(LOCALHOST, 0)
            info.append_remote_ip_info(LOCALHOST, int(peer["pkg_port"]))
            ret, rets = engine.link_clusters([info], timeout=10_000)
            if ret != ld.LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link_clusters to the package peer: {ret.name} {rets}")
            with LlmDataDist(_LOCAL_KVDD, LlmRole.DECODER, backend="sim") as dd:
                dd.initialize(_kvdd_options(3))
                desc = CacheDesc(geom.tensors, DataType.DT_BF16, tuple(_shape(geom, pool)))
                own_cache = Cache(dd.register_kv_cache(desc, addrs), tensor_addrs=tuple(addrs), cache_desc=desc)
                dd.link_llm_clusters([ClusterInfo(remote_cluster_id=_PEER_KVDD,
                                                  remote_ip_infos=(IpInfo(LOCALHOST, int(peer["kvdd_port"])),))])
                idx = CacheIndex(_PEER_KVDD, int(peer["kvdd_cache"]), 0)
                key = ld.BlocksCacheKey(_PEER_PKG, model_id=0)
                layers = geom.layers
                t = geom.per_layer
                ranges = [range(layer, layer + 1) for layer in range(layers)]
                exts = [KvCacheExtParam((layer, layer), (layer, layer), t) for layer in range(layers)]
                pull_blocks = cm.pull_blocks
                pull_kv_blocks = dd.pull_kv_blocks

                def pkg_all() -> None:
                    pull_blocks(key, cache, src, dst, tensor_num_per_layer=t)

                def own_all() -> None:
                    pull_kv_blocks(idx, own_cache, src, dst)

                def pkg_layers() -> None:
                    for r in ranges:
                        pull_blocks(key, cache, src_blocks=src, dst_blocks=dst, src_layer_range=r, dst_layer_range=r,
                                    tensor_num_per_layer=t)

                def own_layers() -> None:
                    for e in exts:
                        pull_kv_blocks(idx, own_cache, src, dst, e)

                # The fixed cost of a call: one block of the last layer.
                last = layers - 1
                small_ext = KvCacheExtParam((last, last), (last, last), t)

                def pkg_small() -> None:
                    pull_blocks(key, cache, src_blocks=src[:1], dst_blocks=dst[:1], src_layer_range=ranges[last],
                                dst_layer_range=ranges[last], tensor_num_per_layer=t)

                def own_small() -> None:
                    pull_kv_blocks(idx, own_cache, src[:1], dst[:1], small_ext)

                full = _expected(geom, pool, src, dst)
                small = _expected(geom, pool, src[:1], dst[:1], range(last * t, layers * t))
                words = dst_mem.view(np.uint64)

                def check(fn: Callable[[], None], want: npt.NDArray[np.uint64]) -> bool:
                    words[:] = 0
                    fn()
                    return bool(np.array_equal(words, want))

                for kind, pkg_fn, own_fn, calls, want, moved in (
                        ("pull_blocks", pkg_all, own_all, 1, full, nbytes),
                        ("pull_blocks per layer", pkg_layers, own_layers, layers, full, nbytes),
                        ("pull_blocks 1 block 1 layer", pkg_small, own_small, 1, small, t * geom.block_bytes)):
                    verified = check(pkg_fn, want) and check(own_fn, want)
                    res = interleaved({"package": pkg_fn, "kvdd": own_fn}, repeats, own_warm=True)
                    rows.append(_row(path, kind, calls, geom, moved, res, verified, judged=moved == nbytes))
        finally:
            engine.finalize()
    return rows


def measure_package(tokens: int | None, repeats: int | None, seed: int, quick: bool,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The package section: rows per data path and kind, and whether each met :data:`GOAL`."""
    geom = GEOMETRIES[PKG_GEOMETRY]
    request_tokens = tokens if tokens is not None else PKG_TOKENS
    blocks = max(1, request_tokens // BLOCK_TOKENS)
    reps = repeats if repeats is not None else (7 if quick else 21)
    rows: list[Row] = []
    errors: dict[str, str] = {}
    for path in PKG_PATHS:
        if progress is not None:
            progress(f"package pull_blocks vs kvdd pull_kv_blocks ({path})")
        try:
            rows += _measure_path(path, geom, blocks, reps, seed)
        except Exception as exc:  # reported in the document
            errors[path] = f"{type(exc).__name__}: {exc}"
    judged = [r for r in rows if r["goal"] is not None]
    worst = max((r["ratio"] for r in judged), default=None)
    return {"geometry": geom.model, "tokens": blocks * BLOCK_TOKENS, "blocks": blocks, "goal": GOAL,
            "rows": rows, "worst_ratio": worst, "met": bool(judged) and all(r["met"] for r in judged) and not errors,
            "errors": errors}


def print_package(section: dict[str, Any], out: Any) -> None:
    from .harness import print_table, say

    print(file=out)
    say(f"CANN's Python package on the simulator ({section['geometry']}, a {section['tokens']}-token request = "
        f"{section['blocks']} blocks):", out)
    say("# package = kvdd.llm_datadist pull_blocks, kvdd = LlmDataDist.pull_kv_blocks, same peer process, same "
        f"memory; ratio = package time / kvdd time, goal <= {section['goal']}x for the request; the 1-block "
        "row shows the fixed cost of a call", out)
    shown = [{k: ("-" if v is None else v) for k, v in row.items()} for row in section["rows"]]
    print_table(shown, PKG_COLUMNS, out)
    for path, err in section["errors"].items():
        say(f"# package section, {path}: {err}", out)
    if section["worst_ratio"] is not None:
        say(f"# package vs kvdd, {section['tokens']}-token request: worst {section['worst_ratio']:.3f}x, "
            f"{'met' if section['met'] else 'NOT met'}", out)
