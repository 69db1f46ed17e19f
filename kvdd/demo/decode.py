"""The decode side: register, link, run the five transfers and verify every byte after each."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from .. import (
    BackendUnavailableError,
    CacheIndex,
    ClusterInfo,
    IpInfo,
    KvCacheExtParam,
    LLMError,
    LLMLinkFailedError,
    LlmDataDist,
    LlmRole,
)
from .control import Control, ReadyInfo, connect_control
from .errors import DemoError, Json, VerificationError
from .image import CacheImage, UnitExpect, allocate, fill_and_register, owner_map, prefill_block_expect, prefill_row_expect
from .options import DECODE_CLUSTER_ID, LINK_TIMEOUT_MS, PROTOCOL, Address, DemoOptions, datadist_options, ipv4
from .pattern import Pattern
from .report import DemoReport, TransferResult
from .text import Progress, mib

__all__ = ["DecodeCalls", "DecodeSide", "DecodeState", "decode_calls", "run_decode", "run_decode_side"]

_log = logging.getLogger(__name__)

class DecodeState:
    """The decode side's state during a run, whichever API moves the bytes: its caches, what
    every byte must hold, the prefill's ids and block tables, the control channel and the push
    (which prefill performs).  Subclasses add the four pulls through their API."""

    #: What a failed call of this API raises (reported as the transfer's error).
    api_errors: tuple[type[BaseException], ...] = (LLMError,)
    #: The prefill's push call, for the report.
    push_api = "PushKvBlocks"

    def __init__(self, opts: DemoOptions, report: DemoReport, log: Progress,
                 paged: list[CacheImage], contig: list[CacheImage]) -> None:
        self.opts = opts
        self.geom = opts.geometry
        self.report = report
        self.log = log
        self.pattern = Pattern(opts.seed)
        self.paged, self.contig = paged, contig
        rng = np.random.default_rng([opts.seed, 2])
        bpr = self.geom.blocks_per_request
        # Decode's block allocations for the three block transfers: random, non-contiguous ids of
        # its own pool (a request's blocks rarely land on the same ids as on prefill).
        picks = rng.permutation(self.geom.decode_blocks)[:3 * bpr]
        self.alloc = [[int(b) for b in picks[k * bpr:(k + 1) * bpr]] for k in range(3)]
        self.ctl: Control | None = None
        self.prefill_id = 0
        self.remote_ids: dict[str, dict[str, int]] = {}
        self.block_tables: list[list[int]] = []
        self.owner: dict[int, tuple[int, int]] = {}

    def attach(self, ctl: Control, welcome: Json) -> None:
        """Take the prefill's cluster id, cache ids and block tables from its welcome message."""
        self.ctl = ctl
        self.prefill_id = int(welcome["cluster_id"])
        self.remote_ids = {str(k): {"paged": int(v["paged"]), "contiguous": int(v["contiguous"])}
                           for k, v in welcome["caches"].items()}
        self.block_tables = [[int(b) for b in row] for row in welcome["block_tables"]]
        if (len(self.block_tables) != self.geom.requests
                or any(len(t) != self.geom.blocks_per_request for t in self.block_tables)
                or set(self.remote_ids) != {f.name for f in self.geom.families}):
            raise DemoError("the prefill's caches or block tables do not match the geometry")
        self.owner = owner_map(self.block_tables)

    @property
    def images(self) -> list[CacheImage]:
        return [*self.paged, *self.contig]

    def _request(self, k: int) -> int:
        return k % self.geom.requests

    def _verify(self, result: TransferResult, targets: set[tuple[str, int, int]]) -> None:
        checked = 0
        for img in self.images:
            checked += img.verify(self.pattern, targets, result.name)
        result.checked_bytes = checked
        result.verified = True

    @contextmanager
    def transfer(self, result: TransferResult) -> Iterator[None]:
        self.report.transfers.append(result)
        self.log(f"{result.name}: {result.what} ...")
        try:
            yield
        except self.api_errors as exc:
            result.error = str(exc)
            raise DemoError(f"{result.name} ({result.api}) failed: {exc}", transfer=result.name) from exc
        except DemoError as exc:
            result.error = exc.message
            if exc.transfer is None:
                raise type(exc)(f"{result.name} ({result.api}): {exc.message}", transfer=result.name,
                                location=exc.location) from exc
            raise
        rate = f", {result.gbps:.2f} GB/s" if result.gbps else ""
        self.log(f"{result.name}: {mib(result.bytes)} in {result.seconds * 1e3:.1f} ms{rate}, "
                 f"verified {mib(result.checked_bytes)}")

    def _blocks_expect(self, req: int, dst: Sequence[int], layers: range | None = None) -> set[tuple[str, int, int]]:
        targets = set()
        src = self.block_tables[req]
        for img in self.paged:
            t = img.fam.tensors_per_layer
            tensors = range(img.n) if layers is None else range(layers.start * t, layers.stop * t)
            for i in tensors:
                for s, d in zip(src, dst):
                    img.expect[i][d] = prefill_block_expect(self.geom, img.fam_index, i, s, self.owner, img.token_words)
                    targets.add((img.name, i, d))
        return targets

    def _row_expect(self, req: int, row: int, tokens: int | None) -> set[tuple[str, int, int]]:
        targets = set()
        for img in self.contig:
            for i in range(img.n):
                runs = prefill_row_expect(self.geom, img.fam_index, i, req, img.token_words, tokens)
                if tokens is None:
                    src = f"prefill row {req} (request {req})"
                else:
                    init = img.expect[i][row].runs[0]
                    done = tokens * img.token_words
                    runs.append((done, img.unit_words - done, init[2] + done - init[0]))
                    src = (f"prefill row {req} tokens 0-{tokens - 1}, then decode's own data "
                           f"from token {tokens}")
                img.expect[i][row] = UnitExpect(runs, src)
                targets.add((img.name, i, row))
        return targets

    def block_pull(self) -> None:
        """The paged block pull of request 0 (all layers)."""
        raise NotImplementedError

    def layer_pull(self) -> None:
        """The layer-by-layer block pull of request 1."""
        raise NotImplementedError

    def row_pull(self) -> None:
        """The batch-row pull of request 2."""
        raise NotImplementedError

    def prefix_pull(self) -> None:
        """The prefix pull (first tokens of a row) of request 3."""
        raise NotImplementedError

    def push(self, decode_listen: Address | None) -> None:
        req, dst = self._request(4), self.alloc[2]
        src = self.block_tables[req]
        r = TransferResult("push prefill -> decode", self.push_api,
                           f"request {req}: {len(src)} blocks into decode-chosen ids")
        assert self.ctl is not None
        with self.transfer(r):
            self.ctl.send({"type": "push", "cluster_id": DECODE_CLUSTER_ID, "request": req, "dst_blocks": dst,
                           "caches": {img.fam.name: img.cache_id for img in self.paged},
                           "listen": list(decode_listen) if decode_listen else None})
            msg = self.ctl.recv("pushed")
            r.calls = int(msg["calls"])
            r.bytes = int(msg["bytes"])
            r.seconds = float(msg["seconds"])
            r.tensors = sum(img.n for img in self.paged)
            self._verify(r, self._blocks_expect(req, dst))



class DecodeSide(DecodeState):
    """The decode side through kvdd's own API (``LlmDataDist``: PullKvBlocks, PullKvCache)."""

    def __init__(self, opts: DemoOptions, dd: LlmDataDist, report: DemoReport, log: Progress) -> None:
        self.dd = dd
        super().__init__(opts, report, log, *allocate("decode", dd, opts.geometry))

    def _remote(self, img: CacheImage, batch_index: int = 0) -> CacheIndex:
        return CacheIndex(self.prefill_id, self.remote_ids[img.fam.name][img.layout], batch_index)

    def block_pull(self) -> None:
        req, dst = self._request(0), self.alloc[0]
        src = self.block_tables[req]
        r = TransferResult("paged block pull", "PullKvBlocks",
                           f"request {req}: {len(src)} blocks, random ids -> random ids")
        with self.transfer(r):
            t0 = time.perf_counter()
            for img in self.paged:
                ext = KvCacheExtParam(tensor_num_per_layer=img.fam.tensors_per_layer)  # all layers
                self.dd.pull_kv_blocks(self._remote(img), img.cache, src, dst, ext)
                r.calls += 1
                r.tensors += img.n
                r.bytes += img.n * len(src) * img.unit_bytes
            r.seconds = time.perf_counter() - t0
            self._verify(r, self._blocks_expect(req, dst))

    def layer_pull(self) -> None:
        req, dst = self._request(1), self.alloc[1]
        src = self.block_tables[req]
        layers = self.geom.model.layers
        r = TransferResult("layer-by-layer pull", "PullKvBlocks",
                           f"request {req}: {layers} layers x {len(src)} blocks")
        with self.transfer(r):
            t0 = time.perf_counter()
            for layer in range(layers):  # as a pipelined prefill streams it: layer 0 first
                for img in self.paged:
                    t = img.fam.tensors_per_layer
                    ext = KvCacheExtParam((layer, layer), (layer, layer), t)
                    self.dd.pull_kv_blocks(self._remote(img), img.cache, src, dst, ext)
                    r.calls += 1
                    r.bytes += t * len(src) * img.unit_bytes
            r.seconds = time.perf_counter() - t0
            r.tensors = sum(img.n for img in self.paged)
            self._verify(r, self._blocks_expect(req, dst, range(layers)))

    def row_pull(self) -> None:
        req, row = self._request(2), 1
        r = TransferResult("batch-row pull", "PullKvCache", f"row {req} -> row {row}, contiguous layout")
        with self.transfer(r):
            t0 = time.perf_counter()
            for img in self.contig:
                ext = KvCacheExtParam(tensor_num_per_layer=img.fam.tensors_per_layer)
                self.dd.pull_kv_cache(self._remote(img, req), img.cache, batch_index=row, ext_param=ext)
                r.calls += 1
                r.tensors += img.n
                r.bytes += img.n * img.unit_bytes
            r.seconds = time.perf_counter() - t0
            self._verify(r, self._row_expect(req, row, None))

    def prefix_pull(self) -> None:
        req, row, n = self._request(3), 2, self.geom.prefix_tokens
        r = TransferResult("prefix pull", "PullKvCache",
                           f"row {req} -> row {row}, first {n} of {self.geom.tokens} tokens (size)")
        with self.transfer(r):
            t0 = time.perf_counter()
            for img in self.contig:
                size = n * img.token_bytes  # bytes per tensor from the start of the row
                ext = KvCacheExtParam(tensor_num_per_layer=img.fam.tensors_per_layer)
                self.dd.pull_kv_cache(self._remote(img, req), img.cache, batch_index=row, size=size, ext_param=ext)
                r.calls += 1
                r.tensors += img.n
                r.bytes += img.n * size
            r.seconds = time.perf_counter() - t0
            # The initial run of the row must be read before it is replaced.
            self._verify(r, self._row_expect(req, row, n))



class DecodeCalls(Protocol):
    """The decode side's LLM-DataDist calls outside the transfers, through one API."""

    backend_name: str
    listen_port: int | None

    def state(self, report: DemoReport, log: Progress) -> DecodeState: ...

    def register(self, images: Sequence[CacheImage], pattern: Pattern, log: Progress) -> None: ...

    def link(self, prefill_id: int, local_ip: str, prefill: Address, mode: str) -> None: ...

    def unlink(self) -> None: ...


class _KvddDecode:
    """:class:`DecodeCalls` through kvdd's own ``LlmDataDist``."""

    def __init__(self, opts: DemoOptions, dd: LlmDataDist) -> None:
        self.opts = opts
        self.dd = dd
        self.backend_name = dd.backend_name
        self.listen_port = dd.listen_port
        self.cluster: ClusterInfo | None = None

    def state(self, report: DemoReport, log: Progress) -> DecodeState:
        return DecodeSide(self.opts, self.dd, report, log)

    def register(self, images: Sequence[CacheImage], pattern: Pattern, log: Progress) -> None:
        fill_and_register(self.dd, images, pattern, log)

    def link(self, prefill_id: int, local_ip: str, prefill: Address, mode: str) -> None:
        self.cluster = ClusterInfo(remote_cluster_id=prefill_id, remote_role_type=LlmRole.PROMPT,
                                   local_ip_infos=(IpInfo(local_ip),), remote_ip_infos=(IpInfo(*prefill),))
        try:
            self.dd.link_llm_clusters([self.cluster], timeout_ms=LINK_TIMEOUT_MS)
        except LLMLinkFailedError as exc:
            hint = ""
            if mode == "decode":
                hint = " (is the prefill side still running, and is that port reachable from here?)"
            raise DemoError(f"LinkLlmClusters to prefill at {prefill[0]}:{prefill[1]} failed: {exc}{hint}",
                            transfer="link") from exc

    def unlink(self) -> None:
        assert self.cluster is not None
        self.dd.unlink_llm_clusters([self.cluster], timeout_ms=LINK_TIMEOUT_MS)


@contextmanager
def decode_calls(opts: DemoOptions, decode_listen: Address | None) -> Iterator[DecodeCalls]:
    """The decode side's engine through ``opts.api``, initialized (listening on ``decode_listen``
    when given), finalized on exit."""
    if opts.api == "llm_datadist":
        from .package import package_decode  # the package's one engine per process

        with package_decode(opts, decode_listen) as calls:
            yield calls
        return
    with LlmDataDist(DECODE_CLUSTER_ID, LlmRole.DECODER, backend=opts.backend_arg) as dd:
        dd.initialize(datadist_options(decode_listen, opts.transfer_backend))
        yield _KvddDecode(opts, dd)


def run_decode(opts: DemoOptions, prefill: Address, control: Address, log: Progress | None = None,
               mode: str = "decode") -> DemoReport:
    """The decode side: connect, register, link, run and verify the five transfers, unlink.

    Parameters
    ----------
    opts : DemoOptions
        The run's options (the same geometry and seed as the prefill side's).
    prefill : (str, int)
        The prefill's LLM-DataDist address (its ``llm.ListenIpInfo``).
    control : (str, int)
        The prefill's control channel; a refused connection is retried for 5 s, an unanswered
        one for ``opts.timeout`` seconds.
    log : Progress, optional
        Progress lines.
    mode : str
        ``"decode"`` (one side of a two-command run), for the report.

    Returns
    -------
    DemoReport
        Never raises for a demo failure: ``report.error`` says what failed (``report.ok``).
    """
    return run_decode_side(opts, prefill[0], lambda: ReadyInfo(prefill, control), log, mode,
                           connect_first=True)


def _local_ip_towards(host: str) -> str:
    """This host's IPv4 address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ipv4(host), 9))
            return str(s.getsockname()[0])
    except (OSError, DemoError):
        return "127.0.0.1"


def run_decode_side(opts: DemoOptions, prefill_host: str, locate: Callable[[], ReadyInfo],
                    log: Progress | None, mode: str, *, connect_first: bool = False) -> DemoReport:
    """The decode side against the prefill side ``locate`` returns (blocking until it is ready).

    Local setup (initialize, allocate, fill, register) comes first so that it overlaps with the
    prefill's, unless ``connect_first``: a prefill started on its own is already up, and a wrong
    address then fails in seconds instead of after the setup.  Never raises for a demo failure.
    """
    log = log or Progress(False, "decode")
    report = DemoReport(opts, mode)
    t_start = time.perf_counter()
    ctl: Control | None = None
    ready: ReadyInfo | None = None
    try:
        if connect_first:
            ready = locate()
            ctl = connect_control(ready.control, opts.timeout, log)
            report.connected = True
        local_ip = _local_ip_towards(prefill_host)
        decode_listen: Address | None = None
        if opts.transfer_backend == "hixl":  # hixl: every instance listens (§3.2 step 8)
            decode_listen = opts.decode_listen or (local_ip, 0)
        with decode_calls(opts, decode_listen) as calls:
            report.backend_name = calls.backend_name
            if decode_listen is not None:
                decode_listen = (decode_listen[0], calls.listen_port or 0)
            state = calls.state(report, log)
            t0 = time.perf_counter()
            calls.register(state.images, state.pattern, log)
            report.setup_seconds = time.perf_counter() - t0
            if ready is None or ctl is None:
                ready = locate()
                ctl = connect_control(ready.control, opts.timeout, log)
                report.connected = True
            prefill = ready.listen
            report.prefill_address = f"{prefill[0]}:{prefill[1]}"
            ctl.send({"type": "hello", "protocol": PROTOCOL, "geometry": opts.geometry.to_json(),
                      "seed": opts.seed, "transfer_backend": opts.transfer_backend,
                      "cluster_id": DECODE_CLUSTER_ID})
            state.attach(ctl, ctl.recv("welcome"))
            prefill_ip = ipv4(prefill[0])
            calls.link(state.prefill_id, ipv4(local_ip), (prefill_ip, prefill[1]), mode)
            log(f"linked to prefill cluster {state.prefill_id} at {prefill_ip}:{prefill[1]}")
            state.block_pull()
            state.layer_pull()
            state.row_pull()
            state.prefix_pull()
            state.push(decode_listen)
            calls.unlink()
            log("unlinked")
            ctl.send({"type": "done", "ok": True, "error": None})
            bye = ctl.recv("bye")
            report.source_intact = bool(bye.get("source_intact"))
            report.prefill["source_intact"] = report.source_intact
            if not report.source_intact:
                raise VerificationError(f"prefill source check: {bye.get('error')}", transfer="prefill source check")
        log("finalized")
    except DemoError as exc:
        report.error = exc
    except LLMError as exc:
        report.error = DemoError(f"{type(exc).__name__}: {exc}")
    except MemoryError:
        report.error = DemoError("out of memory for the caches; lower --requests or --tokens")
    except BackendUnavailableError as exc:
        report.error = DemoError(f"backend unavailable: {exc}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        report.error = DemoError(f"{type(exc).__name__}: {exc}")
    finally:
        if report.error is not None and ctl is not None:
            try:
                ctl.send({"type": "done", "ok": False, "error": report.error.message})
            except DemoError as exc:  # the prefill side has gone already
                _log.debug("could not tell the prefill side: %s", exc.message)
        if ctl is not None:
            ctl.close()
        report.wall_seconds = time.perf_counter() - t_start
    return report
