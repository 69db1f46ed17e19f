"""``kvdd demo --api llm_datadist``: the same job through the calls of CANN's Python package.

The two sides run the demo's job (the same geometry, data, control channel, transfers and
verification) with :mod:`kvdd.llm_datadist`, the simulator's face of CANN's ``llm_datadist``
package (docs/spec/PYPKG.md), instead of kvdd's own ``LlmDataDist``:

* each side: ``LLMConfig`` (``device_id``, ``enable_cache_manager``, ``enable_remote_cache_accessible``,
  ``sync_kv_timeout``, ``listen_ip_info``; with ``--transfer-backend hixl`` also ``local_comm_res=""``
  and ``transfer_backend="hixl"``), ``LLMDataDist(role, cluster_id).init(cfg.generate_options())``;
* paged caches: ``register_blocks_cache`` under ``BlocksCacheKey(own cluster, model_id=family)``;
  contiguous caches: ``register_cache``;
* decode ``link_clusters`` to prefill (``--link rank-table``: both sides ``link`` a two-member
  rank-table domain named after the prefill's port and poll ``query_register_mem_status`` until OK;
  ``unlink`` of the comm id at the end); the paged pull is ``pull_blocks(BlocksCacheKey(prefill,
  model_id=family), ...)`` of all layers, the layer-by-layer pull one ``pull_blocks`` per layer with
  ``src_layer_range`` / ``dst_layer_range``; the row and prefix pulls are ``pull_cache`` with a
  ``CacheKeyByIdAndIndex`` (and ``size``); prefill pushes with ``push_blocks`` (hixl: over its own
  ``link_clusters`` to decode, as links are one-way there);
* ``unlink_clusters`` and ``finalize``.

The package has one engine per process and no way to read back a listener's port: a side asked
to listen on port 0 takes a free port first.  The package runs on kvdd's simulator here (``--backend
sim``); on an Atlas node CANN's own package is the real thing.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .. import llm_datadist as ld
from .decode import DecodeState
from .errors import ConfigError, DemoError, Json
from .geometry import Geometry
from .image import CacheImage
from .options import DECODE_CLUSTER_ID, LINK_TIMEOUT_MS, PREFILL_CLUSTER_ID, SYNC_WAIT_MS, Address, DemoOptions
from .pattern import Pattern
from .report import DemoReport, TransferResult
from .text import Progress, mib

__all__ = ["package_decode", "package_prefill", "check_package_options"]

#: What a failed call of the package raises (a wrong argument is a demo bug, reported the same way).
PACKAGE_ERRORS: tuple[type[BaseException], ...] = (ld.LLMException, TypeError, ValueError)


def check_package_options(opts: DemoOptions, in_process: bool) -> None:
    """``ConfigError`` for what ``--api llm_datadist`` cannot do."""
    if opts.backend != "sim":
        raise ConfigError("--api llm_datadist runs CANN's package on kvdd's simulator: use --backend sim "
                          "(on an Atlas node, CANN's own llm_datadist package is the real one)")
    if in_process:
        raise ConfigError("--api llm_datadist needs two processes (the package has one engine per process)")
    if opts.link == "rank-table" and opts.transfer_backend == "hixl":
        raise ConfigError("--link rank-table needs the comm transfer backend (the package's rank-table link is "
                          "LLM_FEATURE_NOT_ENABLED on hixl)")
    for addr in (opts.listen, opts.decode_listen):
        if addr is not None and ":" in addr[0]:
            raise ConfigError("--api llm_datadist takes IPv4 listen addresses (the package splits "
                              "listen_ip_info on ':')")


def _data_type(geom: Geometry) -> ld.DataType:
    try:
        return ld.DataType[geom.data_type.name]
    except KeyError:
        raise ConfigError(f"CANN's package has no {geom.data_type.name}") from None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _options(listen: Address | None, transfer_backend: str, device_id: int) -> dict[str, str]:
    cfg = ld.LLMConfig()
    cfg.device_id = device_id
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = SYNC_WAIT_MS
    if transfer_backend == "hixl":
        cfg.local_comm_res = ""
        cfg.transfer_backend = "hixl"
    if listen is not None:
        cfg.listen_ip_info = f"{listen[0]}:{listen[1]}"
    return dict(cfg.generate_options())


@contextmanager
def _errors(what: str) -> Iterator[None]:
    """A failed package call outside a transfer becomes a DemoError naming the call."""
    try:
        yield
    except PACKAGE_ERRORS as exc:
        raise DemoError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _cluster(remote_id: int, local_ip: str, remote: Address) -> ld.LLMClusterInfo:
    info = ld.LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info(local_ip, 0)
    info.append_remote_ip_info(remote[0], remote[1])
    return info


def _link(engine: ld.LLMDataDist, info: ld.LLMClusterInfo, what: str) -> None:
    with _errors(what):
        ret, rets = engine.link_clusters([info], timeout=LINK_TIMEOUT_MS)
    if ret != ld.LLMStatusCode.LLM_SUCCESS:
        raise DemoError(f"{what} failed: {ret.name} {[r.name for r in rets]}", transfer="link")


def _unlink(engine: ld.LLMDataDist, info: ld.LLMClusterInfo, what: str) -> None:
    with _errors(what):
        ret, rets = engine.unlink_clusters([info], timeout=LINK_TIMEOUT_MS)
    if ret != ld.LLMStatusCode.LLM_SUCCESS:
        raise DemoError(f"{what} failed: {ret.name} {[r.name for r in rets]}")


#: How long a side polls ``query_register_mem_status`` (the engine ends PREPARING itself after
#: ``llm.LinkTotalTime``, 30 s when unset; this only bounds the demo's own wait).
RANK_TABLE_WAIT_S = 90.0


def rank_table_domain(prefill_port: int) -> tuple[str, dict[int, int], str]:
    """``(comm_name, cluster_rank_info, rank_table)`` of the demo's two-member domain: prefill rank 0,
    decode rank 1, named after the prefill's listen port (unique per run on a host)."""
    devices = [{"device_id": str(rank), "device_ip": f"192.0.2.{rank + 1}", "rank_id": str(rank)} for rank in (0, 1)]
    table = {"version": "1.0", "server_count": "1", "status": "completed",
             "server_list": [{"server_id": "127.0.0.1", "device": devices}]}
    return f"kvdd_demo_{prefill_port}", {PREFILL_CLUSTER_ID: 0, DECODE_CLUSTER_ID: 1}, json.dumps(table)


def rank_table_link(engine: ld.LLMDataDist, prefill_port: int, log: Progress) -> int:
    """``link`` the demo's domain, then poll ``query_register_mem_status`` until OK; the comm id."""
    comm_name, ranks, table = rank_table_domain(prefill_port)
    with _errors(f"link({comm_name!r})"):
        comm_id = engine.link(comm_name, ranks, table)
    deadline = time.monotonic() + RANK_TABLE_WAIT_S
    while True:
        with _errors("query_register_mem_status"):
            status = engine.query_register_mem_status(comm_id=comm_id)
        if status == ld.RegisterMemStatus.OK:
            log(f"rank-table link {comm_name!r} ready (comm id {comm_id})")
            return comm_id
        if status == ld.RegisterMemStatus.FAILED or time.monotonic() > deadline:
            raise DemoError(f"the rank-table link {comm_name!r} ended {status.name}", transfer="link")
        time.sleep(0.01)


class _Side:
    """One side's engine and its caches (the package's ``Cache`` of every image, by name)."""

    def __init__(self, opts: DemoOptions, engine: ld.LLMDataDist, cluster_id: int) -> None:
        self.opts = opts
        self.engine = engine
        self.cluster_id = cluster_id
        self.backend_name = "sim"
        self.caches: dict[str, ld.Cache] = {}

    def allocate(self, side: str) -> tuple[list[CacheImage], list[CacheImage]]:
        geom = self.opts.geometry
        blocks, rows = ((geom.prefill_blocks, geom.requests) if side == "prefill"
                        else (geom.decode_blocks, geom.decode_rows))
        paged = [CacheImage(side, geom, f, "paged", blocks) for f in range(len(geom.families))]
        contig = [CacheImage(side, geom, f, "contiguous", rows) for f in range(len(geom.families))]
        return paged, contig

    def register(self, images: Sequence[CacheImage], pattern: Pattern, log: Progress) -> None:
        """Fill, then ``register_blocks_cache`` (paged, keyed by family) / ``register_cache``."""
        total = sum(img.nbytes for img in images)
        with log.step(f"filling {len(images)} caches, {mib(total)}"):
            for img in images:
                img.fill(pattern)
        cm = self.engine.cache_manager
        dtype = _data_type(self.opts.geometry)
        for img in images:
            addrs = [int(t.ctypes.data) for t in img.tensors()]
            desc = ld.CacheDesc(img.n, list(img.array.shape[1:]), dtype)
            with _errors(f"registering {img.name}"):
                if img.layout == "paged":
                    key = ld.BlocksCacheKey(self.cluster_id, model_id=img.fam_index)
                    cache = cm.register_blocks_cache(desc, addrs, key)
                else:
                    cache = cm.register_cache(desc, addrs)
            self.caches[img.name] = cache
            img.registered(cache.cache_id, addrs)
        log(f"registered {', '.join(f'{img.name}=id {img.cache_id}' for img in images)}")


class _PackagePrefill(_Side):
    """:class:`~kvdd.demo.prefill.PrefillCalls` through the package."""

    def __init__(self, opts: DemoOptions, engine: ld.LLMDataDist, listen_port: int) -> None:
        super().__init__(opts, engine, PREFILL_CLUSTER_ID)
        self.listen_port = listen_port
        self.comm_id: int | None = None

    def decode_connected(self, decode_id: int, log: Progress) -> None:
        """With ``--link rank-table``: our half of the domain's ``link``, polled until OK."""
        if self.opts.link == "rank-table":
            self.comm_id = rank_table_link(self.engine, self.listen_port, log)

    def close(self) -> None:
        if self.comm_id is not None:
            try:
                self.engine.unlink(self.comm_id)
            except ld.LLMException:
                pass  # finalize tears it down as well

    def allocate(self, side: str = "prefill") -> tuple[list[CacheImage], list[CacheImage]]:
        return super().allocate(side)

    def serve_push(self, paged: Sequence[CacheImage], block_tables: Sequence[Sequence[int]],
                   msg: Mapping[str, Any], log: Progress) -> Json:
        """``push_blocks`` of one request's blocks into the decode blocks named in ``msg``."""
        decode_id = int(msg["cluster_id"])
        req = int(msg["request"])
        src = list(block_tables[req])
        dst = [int(b) for b in msg["dst_blocks"]]
        linked: ld.LLMClusterInfo | None = None
        if self.opts.transfer_backend == "hixl":  # one-way links: prefill links to decode to write
            linked = _cluster(decode_id, self.opts.listen[0], (str(msg["listen"][0]), int(msg["listen"][1])))
            _link(self.engine, linked, "link_clusters to decode for the push")
        calls = nbytes = 0
        t0 = time.perf_counter()
        for img in paged:
            key = ld.BlocksCacheKey(decode_id, model_id=img.fam_index)
            with _errors(f"push_blocks of {img.name}"):
                self.engine.cache_manager.push_blocks(key, self.caches[img.name], src_blocks=src, dst_blocks=dst,
                                                      tensor_num_per_layer=img.fam.tensors_per_layer)
            calls += 1
            nbytes += img.n * len(src) * img.unit_bytes
        seconds = time.perf_counter() - t0
        if linked is not None:
            _unlink(self.engine, linked, "unlink_clusters of decode")
        log(f"pushed request {req}: {mib(nbytes)} in {seconds * 1e3:.1f} ms")
        return {"calls": calls, "bytes": nbytes, "seconds": seconds, "src_blocks": src, "dst_blocks": dst}


class PackageDecodeSide(DecodeState):
    """The decode side's four pulls through the package (``pull_blocks``, ``pull_cache``)."""

    api_errors = PACKAGE_ERRORS
    push_api = "push_blocks"

    def __init__(self, opts: DemoOptions, side: _Side, report: DemoReport, log: Progress) -> None:
        self.side = side
        super().__init__(opts, report, log, *side.allocate("decode"))

    @property
    def _cm(self) -> Any:
        return self.side.engine.cache_manager

    def _row_key(self, img: CacheImage, row: int) -> ld.CacheKeyByIdAndIndex:
        return ld.CacheKeyByIdAndIndex(self.prefill_id, self.remote_ids[img.fam.name]["contiguous"], row)

    def _blocks_key(self, img: CacheImage) -> ld.BlocksCacheKey:
        return ld.BlocksCacheKey(self.prefill_id, model_id=img.fam_index)

    def block_pull(self) -> None:
        req, dst = self._request(0), self.alloc[0]
        src = self.block_tables[req]
        r = TransferResult("paged block pull", "pull_blocks",
                           f"request {req}: {len(src)} blocks, random ids -> random ids")
        with self.transfer(r):
            t0 = time.perf_counter()
            for img in self.paged:
                self._cm.pull_blocks(self._blocks_key(img), self.side.caches[img.name], src, dst,
                                     tensor_num_per_layer=img.fam.tensors_per_layer)
                r.calls += 1
                r.tensors += img.n
                r.bytes += img.n * len(src) * img.unit_bytes
            r.seconds = time.perf_counter() - t0
            self._verify(r, self._blocks_expect(req, dst))

    def layer_pull(self) -> None:
        req, dst = self._request(1), self.alloc[1]
        src = self.block_tables[req]
        layers = self.geom.model.layers
        r = TransferResult("layer-by-layer pull", "pull_blocks", f"request {req}: {layers} layers x {len(src)} blocks")
        with self.transfer(r):
            t0 = time.perf_counter()
            for layer in range(layers):
                for img in self.paged:
                    t = img.fam.tensors_per_layer
                    self._cm.pull_blocks(self._blocks_key(img), self.side.caches[img.name], src_blocks=src,
                                         dst_blocks=dst, src_layer_range=range(layer, layer + 1),
                                         dst_layer_range=range(layer, layer + 1), tensor_num_per_layer=t)
                    r.calls += 1
                    r.bytes += t * len(src) * img.unit_bytes
            r.seconds = time.perf_counter() - t0
            r.tensors = sum(img.n for img in self.paged)
            self._verify(r, self._blocks_expect(req, dst, range(layers)))

    def _row_pull(self, r: TransferResult, req: int, row: int, tokens: int | None) -> None:
        """``pull_cache`` of prefill row ``req`` into our ``row``: whole, or its first ``tokens``."""
        with self.transfer(r):
            t0 = time.perf_counter()
            for img in self.contig:
                size = -1 if tokens is None else tokens * img.token_bytes  # bytes per tensor
                self._cm.pull_cache(self._row_key(img, req), self.side.caches[img.name], row, size,
                                    tensor_num_per_layer=img.fam.tensors_per_layer)
                r.calls += 1
                r.tensors += img.n
                r.bytes += img.n * (img.unit_bytes if tokens is None else size)
            r.seconds = time.perf_counter() - t0
            # The initial run of the row must be read before it is replaced.
            self._verify(r, self._row_expect(req, row, tokens))

    def row_pull(self) -> None:
        req, row = self._request(2), 1
        self._row_pull(TransferResult("batch-row pull", "pull_cache", f"row {req} -> row {row}, contiguous layout"),
                       req, row, None)

    def prefix_pull(self) -> None:
        req, row, n = self._request(3), 2, self.geom.prefix_tokens
        self._row_pull(TransferResult("prefix pull", "pull_cache",
                                      f"row {req} -> row {row}, first {n} of {self.geom.tokens} tokens (size)"),
                       req, row, n)


class _PackageDecode(_Side):
    """:class:`~kvdd.demo.decode.DecodeCalls` through the package."""

    def __init__(self, opts: DemoOptions, engine: ld.LLMDataDist, listen_port: int | None) -> None:
        super().__init__(opts, engine, DECODE_CLUSTER_ID)
        self.listen_port = listen_port
        self.linked: ld.LLMClusterInfo | None = None
        self.comm_id: int | None = None
        self.log = Progress(False, "decode")

    def state(self, report: DemoReport, log: Progress) -> DecodeState:
        self.log = log
        return PackageDecodeSide(self.opts, self, report, log)

    def link(self, prefill_id: int, local_ip: str, prefill: Address, mode: str) -> None:
        if self.opts.link == "rank-table":
            self.comm_id = rank_table_link(self.engine, prefill[1], self.log)
            return
        self.linked = _cluster(prefill_id, local_ip, prefill)
        hint = " (is the prefill side still running, and is that port reachable from here?)" if mode == "decode" else ""
        try:
            _link(self.engine, self.linked, f"link_clusters to prefill at {prefill[0]}:{prefill[1]}")
        except DemoError as exc:
            raise DemoError(exc.message + hint, transfer="link") from exc

    def unlink(self) -> None:
        if self.comm_id is not None:
            with _errors(f"unlink({self.comm_id})"):
                self.engine.unlink(self.comm_id)
            self.comm_id = None
            return
        assert self.linked is not None
        _unlink(self.engine, self.linked, "unlink_clusters")


def _engine(role: ld.LLMRole, cluster_id: int, options: Mapping[str, str]) -> ld.LLMDataDist:
    engine = ld.LLMDataDist(role, cluster_id)
    with _errors(f"LLMDataDist({role.name}, {cluster_id}).init"):
        engine.init(dict(options))
    return engine


@contextmanager
def _package_log_on_stderr() -> Iterator[None]:
    """The package logs to stdout (its logger ``LLM_DATADIST``, PYPKG.md §1.1); the demo's stdout is
    its report (``--json`` a JSON document), so the package's records go to stderr meanwhile."""
    log = logging.getLogger("LLM_DATADIST")
    saved = list(log.handlers)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(name)s %(asctime)s %(message)s"))
    log.handlers = [handler]
    try:
        yield
    finally:
        log.handlers = saved


@contextmanager
def package_prefill(opts: DemoOptions) -> Iterator[_PackagePrefill]:
    """The prefill's engine through the package, listening, finalized on exit."""
    check_package_options(opts, False)
    host, port = opts.listen
    port = port or _free_port(host)
    with _package_log_on_stderr():
        engine = _engine(ld.LLMRole.PROMPT, PREFILL_CLUSTER_ID, _options((host, port), opts.transfer_backend, 0))
        calls = _PackagePrefill(opts, engine, port)
        try:
            yield calls
        finally:
            calls.close()
            engine.finalize()


@contextmanager
def package_decode(opts: DemoOptions, listen: Address | None) -> Iterator[_PackageDecode]:
    """The decode's engine through the package (listening when ``listen`` is given), finalized on exit."""
    check_package_options(opts, False)
    port: int | None = None
    if listen is not None:
        port = listen[1] or _free_port(listen[0])
        listen = (listen[0], port)
    with _package_log_on_stderr():
        engine = _engine(ld.LLMRole.DECODER, DECODE_CLUSTER_ID, _options(listen, opts.transfer_backend, 1))
        try:
            yield _PackageDecode(opts, engine, port)
        finally:
            engine.finalize()
