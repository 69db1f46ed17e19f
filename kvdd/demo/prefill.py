"""The prefill side: listen, fill and register its caches, serve one decode side."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from .. import Cache, CacheIndex, CachePlacement, ClusterInfo, IpInfo, KvCacheExtParam, LlmDataDist, LlmRole
from .control import Control, ReadyInfo, accept_control, control_secret, send_error
from .errors import DemoError, Json, VerificationError
from .geometry import Geometry
from .image import CacheImage, UnitExpect, allocate, fill_and_register, owner_map, prefill_block_expect, prefill_row_expect
from .options import LINK_TIMEOUT_MS, PREFILL_CLUSTER_ID, PROTOCOL, DemoOptions, datadist_options, ipv4
from .pattern import Pattern
from .text import Progress, mib

__all__ = ["PrefillCalls", "prefill_calls", "run_prefill"]

def run_prefill(opts: DemoOptions, on_ready: Callable[[ReadyInfo], None] | None = None,
                log: Progress | None = None, cancel: threading.Event | None = None) -> Json:
    """The prefill side: listen, register and fill, serve one decode side; return a summary.

    Parameters
    ----------
    opts : DemoOptions
        The run's options (listen address, control port, geometry, seed, timeout in seconds).
    on_ready : callable, optional
        Called once the caches are registered and both the LLM-DataDist listener and the control
        channel accept connections.
    log : Progress, optional
        Progress lines.
    cancel : threading.Event, optional
        Set to stop waiting for a decode side.

    Returns
    -------
    dict
        The JSON summary (addresses, setup seconds, the push, ``source_intact``).

    Raises
    ------
    DemoError
        On any failure (a :class:`VerificationError` when its source caches changed), after
        telling a connected decode side.
    LLMError
        A failing LLM-DataDist call.
    """
    log = log or Progress(False, "prefill")
    geom = opts.geometry
    pattern = Pattern(opts.seed)
    rng = np.random.default_rng([opts.seed, 1])
    ctl: Control | None = None
    server: socket.socket | None = None
    result: Json = {"role": "prefill", "cluster_id": PREFILL_CLUSTER_ID}
    secret = control_secret()  # a missing or unusable secret fails before any setup
    try:
        with prefill_calls(opts) as calls:
            listen = (opts.listen[0], calls.listen_port)
            paged, contig = calls.allocate()
            # Each request's block table: random, non-contiguous physical blocks of the pool.
            tables = rng.permutation(geom.prefill_blocks).reshape(geom.requests, geom.blocks_per_request)
            block_tables = [[int(b) for b in row] for row in tables]
            owner = owner_map(block_tables)
            for img in paged:
                for i in range(img.n):
                    for p in range(img.units):
                        img.expect[i][p] = prefill_block_expect(geom, img.fam_index, i, p, owner, img.token_words)
            for img in contig:
                for i in range(img.n):
                    for r in range(img.units):
                        img.expect[i][r] = UnitExpect(prefill_row_expect(geom, img.fam_index, i, r, img.token_words),
                                                      f"prefill row {r} (request {r})")
            t0 = time.perf_counter()
            calls.register([*paged, *contig], pattern, log)
            result["setup_seconds"] = time.perf_counter() - t0

            family = socket.AF_INET6 if ":" in opts.listen[0] else socket.AF_INET
            server = socket.socket(family, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind((opts.listen[0], opts.prefill_control_port()))
            except OSError as exc:
                raise DemoError(f"cannot listen for the control channel on {opts.listen[0]}:"
                                f"{opts.prefill_control_port()}: {exc.strerror or exc} (choose --control-port)") from None
            server.listen(4)
            ready = ReadyInfo(listen, (opts.listen[0], server.getsockname()[1]))
            result.update(ready.to_json())
            log(f"LLM-DataDist listening on {ready.to_json()['listen']}, control channel on "
                f"{ready.to_json()['control']}; waiting for decode")
            if on_ready is not None:
                on_ready(ready)
            # A decode side that does not match (geometry, seed, transfer backend, protocol) is told
            # why and refused, as one without the secret is; prefill keeps waiting for the real one.
            deadline = time.monotonic() + opts.timeout
            refused = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DemoError(f"no matching decode side connected within {opts.timeout:g} s "
                                    f"({refused} refused)")
                ctl, peer_addr, failed_auth = accept_control(server, left, secret, log.warn, cancel)
                ctl.timeout = opts.timeout
                ctl.sock.settimeout(opts.timeout)
                refused += failed_auth
                try:
                    hello = ctl.recv("hello")
                    problem = _hello_problem(hello, geom, opts)
                except DemoError as exc:
                    hello, problem = {}, exc.message
                if problem is None:
                    break
                refused += 1
                log.warn(f"refused decode from {peer_addr[0]}: {problem}; still waiting for decode")
                try:
                    ctl.send({"type": "error", "refused": True, "message": problem})
                except DemoError:
                    pass  # that side has gone already
                ctl.close()
                ctl = None
            server.close()
            server = None
            result["refused_control"] = refused
            decode_id = int(hello["cluster_id"])
            log(f"decode cluster {decode_id} connected from {peer_addr[0]}")
            ctl.send({"type": "welcome", "cluster_id": PREFILL_CLUSTER_ID,
                      "caches": {img.fam.name: {"paged": paged[k].cache_id, "contiguous": contig[k].cache_id}
                                 for k, img in enumerate(paged)},
                      "block_tables": block_tables})
            calls.decode_connected(decode_id, log)
            while True:
                msg = ctl.recv("push", "done")
                if msg["type"] == "done":
                    break
                result["push"] = calls.serve_push(paged, block_tables, msg, log)
                ctl.send({"type": "pushed", **result["push"]})
            result["decode_ok"] = bool(msg.get("ok"))
            result["decode_error"] = msg.get("error")
            # Pulls only read the source and the push reads it too: it must be exactly as filled.
            step = "prefill source check"
            intact = True
            error: str | None = None
            try:
                with log.step("checking the source caches are intact"):
                    for img in (*paged, *contig):
                        img.verify(pattern, set(), step)
            except VerificationError as exc:
                intact = False
                error = exc.message
            result["source_intact"] = intact
            try:
                ctl.send({"type": "bye", "source_intact": intact, "error": error})
            except DemoError:
                if result["decode_ok"]:
                    raise  # a failed decode side may have gone already
            if error is not None:
                raise VerificationError(error, transfer=step)
            if not result["decode_ok"]:
                raise DemoError(f"decode side failed: {result['decode_error']}")
        log("finalized")
        return result
    except BaseException as exc:
        send_error(ctl, exc)
        raise
    finally:
        if server is not None:
            server.close()
        if ctl is not None:
            ctl.close()



class PrefillCalls(Protocol):
    """The prefill side's LLM-DataDist calls, through one API."""

    listen_port: int

    def allocate(self) -> tuple[list[CacheImage], list[CacheImage]]: ...

    def register(self, images: Sequence[CacheImage], pattern: Pattern, log: Progress) -> None: ...

    def decode_connected(self, decode_id: int, log: Progress) -> None:
        """The decode side has the welcome (a rank-table link is made by both sides now)."""
        ...

    def serve_push(self, paged: Sequence[CacheImage], block_tables: Sequence[Sequence[int]],
                   msg: Mapping[str, Any], log: Progress) -> Json: ...


class _KvddPrefill:
    """:class:`PrefillCalls` through kvdd's own ``LlmDataDist``."""

    def __init__(self, opts: DemoOptions, dd: LlmDataDist) -> None:
        self.opts = opts
        self.dd = dd
        port = dd.listen_port
        assert port is not None
        self.listen_port = port

    def allocate(self) -> tuple[list[CacheImage], list[CacheImage]]:
        return allocate("prefill", self.dd, self.opts.geometry)

    def register(self, images: Sequence[CacheImage], pattern: Pattern, log: Progress) -> None:
        fill_and_register(self.dd, images, pattern, log)

    def decode_connected(self, decode_id: int, log: Progress) -> None:
        """Nothing: decode links to us with LinkLlmClusters."""

    def serve_push(self, paged: Sequence[CacheImage], block_tables: Sequence[Sequence[int]],
                   msg: Mapping[str, Any], log: Progress) -> Json:
        return _serve_push(self.dd, self.opts, paged, block_tables, msg, log)


@contextmanager
def prefill_calls(opts: DemoOptions) -> Iterator[PrefillCalls]:
    """The prefill side's engine through ``opts.api``, initialized and listening, finalized on exit."""
    if opts.api == "llm_datadist":
        from .package import package_prefill  # the package's one engine per process

        with package_prefill(opts) as calls:
            yield calls
        return
    with LlmDataDist(PREFILL_CLUSTER_ID, LlmRole.PROMPT, backend=opts.backend_arg) as dd:
        dd.initialize(datadist_options(opts.listen, opts.transfer_backend))
        yield _KvddPrefill(opts, dd)


def _serve_push(dd: LlmDataDist, opts: DemoOptions, paged: Sequence[CacheImage],
                block_tables: Sequence[Sequence[int]], msg: Mapping[str, Any], log: Progress) -> Json:
    """PushKvBlocks one request's blocks into the decode blocks named in ``msg``."""
    decode_id = int(msg["cluster_id"])
    req = int(msg["request"])
    src = list(block_tables[req])
    dst = [int(b) for b in msg["dst_blocks"]]
    linked: ClusterInfo | None = None
    if opts.transfer_backend == "hixl":
        # hixl links are one-way (SEMANTICS.md §2.3): to write into decode, prefill links to it.
        host, port = str(msg["listen"][0]), int(msg["listen"][1])
        linked = ClusterInfo(remote_cluster_id=decode_id, remote_role_type=LlmRole.DECODER,
                             local_ip_infos=(IpInfo(ipv4(opts.listen[0])),), remote_ip_infos=(IpInfo(host, port),))
        dd.link_llm_clusters([linked], timeout_ms=LINK_TIMEOUT_MS)
        log(f"linked to decode at {host}:{port} for the push (hixl links are one-way)")
    calls = 0
    nbytes = 0
    t0 = time.perf_counter()
    for img in paged:
        dst_id = int(msg["caches"][img.fam.name])
        # Push reads num_tensors and placement from the src Cache struct (§3.12); upstream requires
        # DEVICE there whatever the registration said.
        src_cache = Cache(cache_id=img.cache_id, tensor_addrs=img.cache.tensor_addrs,
                          cache_desc=replace(img.desc, placement=CachePlacement.DEVICE))
        # All layers, but with this cache's tensors per layer: the default ext_param assumes K,V
        # pairs (2), which rejects (or mis-plans) a one-tensor-per-layer MLA cache (§3.12 step 6).
        ext = KvCacheExtParam(tensor_num_per_layer=img.fam.tensors_per_layer)
        dd.push_kv_blocks(src_cache, CacheIndex(decode_id, dst_id), src, dst, ext)
        calls += 1
        nbytes += img.n * len(src) * img.unit_bytes
    seconds = time.perf_counter() - t0
    if linked is not None:
        dd.unlink_llm_clusters([linked], timeout_ms=LINK_TIMEOUT_MS)
    log(f"pushed request {req}: {mib(nbytes)} in {seconds * 1e3:.1f} ms")
    return {"calls": calls, "bytes": nbytes, "seconds": seconds, "src_blocks": src, "dst_blocks": dst}


def _hello_problem(hello: Mapping[str, Any], geom: Geometry, opts: DemoOptions) -> str | None:
    """Why prefill refuses a decode side's ``hello`` (None: it matches this prefill)."""
    if hello.get("protocol") != PROTOCOL:
        return f"decode speaks control protocol {hello.get('protocol')}, prefill {PROTOCOL}"
    try:
        theirs = Geometry.from_json(hello["geometry"])
        int(hello["cluster_id"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"malformed hello from decode ({type(exc).__name__}: {exc})"
    if theirs.agreement_key() != geom.agreement_key() or hello.get("seed") != opts.seed:
        return _disagreement(geom, theirs, opts.seed, hello.get("seed"))
    if hello.get("transfer_backend") != opts.transfer_backend:
        return (f"decode uses transfer backend {hello.get('transfer_backend')}, prefill "
                f"{opts.transfer_backend}: pass the same --transfer-backend to both")
    return None


def _disagreement(mine: Geometry, theirs: Geometry, my_seed: int, their_seed: object) -> str:
    a, b = mine.agreement_key(), theirs.agreement_key()
    diffs = []
    for key in ("requests", "tokens", "block_size"):
        if a[key] != b[key]:
            diffs.append(f"{key} prefill={a[key]} decode={b[key]}")
    for key in sorted(set(a["model"]) | set(b["model"])):
        if a["model"].get(key) != b["model"].get(key):
            diffs.append(f"model {key} prefill={a['model'].get(key)} decode={b['model'].get(key)}")
    if my_seed != their_seed:
        diffs.append(f"seed prefill={my_seed} decode={their_seed}")
    return ("the two sides disagree on the geometry (pass the same --model/--model-config, --requests, "
            "--tokens, --block-size, --dtype, --seed or --quick to both): " + "; ".join(diffs or ["?"]))
