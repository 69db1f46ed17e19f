"""``kvdd demo`` on the command line: options, the prefill-only and decode-only commands, output."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import IO

from .. import BackendUnavailableError, LLMError
from .control import ReadyInfo
from .decode import run_decode
from .errors import ConfigError, DemoError, Json
from .geometry import Geometry
from .model import DEFAULT_MODEL, DTYPES, MODELS, model_from_hf_config, resolve_model
from .options import JSON_SCHEMA, Address, DemoOptions
from .prefill import run_prefill
from .report import render_text
from .runner import run_demo
from .text import Progress, fmt_seconds, mib

__all__ = ["add_demo_arguments", "main", "options_from_args", "run_from_args"]

_log = logging.getLogger(__name__)


def _address(text: str) -> Address:
    text = text.strip()
    if text.startswith("["):
        host, _, port = text[1:].partition("]:")
    else:
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _pos(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvdd demo`` options (``kvdd.cli`` adds the subparser and calls :func:`run_from_args`)."""
    g = parser.add_argument_group("geometry (both sides must pass the same values)")
    g.add_argument("--model", metavar="NAME",
                   help=f"a built-in model: {', '.join(MODELS)} (default {DEFAULT_MODEL})")
    g.add_argument("--model-config", metavar="PATH",
                   help="derive the geometry from a Hugging Face config.json or a model directory "
                        "holding one (layers, KV heads, head_dim or MLA ranks, torch_dtype)")
    g.add_argument("--requests", type=_pos, help="requests held by prefill (default 4)")
    g.add_argument("--tokens", type=_pos, help="tokens per request (default 1024)")
    g.add_argument("--block-size", type=_pos, default=128, help="tokens per block (default 128)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="override the model's dtype")
    g.add_argument("--quick", action="store_true", help="1 request of 256 tokens (CI)")
    g.add_argument("--seed", type=int, default=0, help="seed of the data and of the block choices (default 0)")
    r = parser.add_argument_group("processes and links")
    r.add_argument("--role", choices=("prefill", "decode"),
                   help="run one side only (two commands or two hosts); default: both, as two processes")
    r.add_argument("--listen", type=_address, metavar="HOST:PORT",
                   help="LLM-DataDist listen address: prefill's (default 127.0.0.1:0 = a free port); with "
                        "--role decode and --transfer-backend hixl, decode's (default: its IP on the route "
                        "to the prefill, port 0)")
    r.add_argument("--connect", type=_address, metavar="HOST:PORT",
                   help="--role decode: the prefill's LLM-DataDist address")
    r.add_argument("--control-port", type=int, metavar="PORT",
                   help="prefill's control-channel port (default: its LLM-DataDist port + 1, or a free port "
                        "when that is 0; prefill prints it)")
    r.add_argument("--backend", choices=("sim", "native", "auto"), default="sim",
                   help="kvdd backend (default sim; auto applies kvdd's selection rule)")
    r.add_argument("--transfer-backend", choices=("comm", "hixl"), default="comm",
                   help="llm.TransferBackend: comm (HCCL, default, bidirectional links) or hixl "
                        "(one-way links: for the push, decode listens and prefill links to it)")
    r.add_argument("--api", choices=("kvdd", "llm_datadist"), default="kvdd",
                   help="whose calls move the bytes: kvdd's own LlmDataDist (default) or those of CANN's "
                        "Python package llm_datadist (register_blocks_cache, link_clusters, pull_blocks per "
                        "layer, pull_cache, push_blocks), on the simulator")
    r.add_argument("--link", choices=("clusters", "rank-table"), default="clusters",
                   help="with --api llm_datadist: how decode and prefill link: link_clusters (default) or a "
                        "rank-table link that both sides make (link, query_register_mem_status, unlink; "
                        "docs/llm_datadist.md)")
    r.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="how long one side waits for the other (default 60; 600 for --role prefill, "
                        "which waits for a decode command to be started)")
    r.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON document (schema kvdd.demo/1)")
    o.add_argument("--progress", action="store_true", default=None,
                   help="progress lines on stderr (default: when stderr is a terminal)")
    o.add_argument("--no-progress", action="store_false", dest="progress", help="no progress lines")


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Build :class:`DemoOptions` from parsed ``kvdd demo`` arguments; ``ConfigError`` on misuse."""
    if args.model and args.model_config:
        raise ConfigError("pass either --model or --model-config, not both")
    model = model_from_hf_config(args.model_config) if args.model_config else resolve_model(args.model or DEFAULT_MODEL)
    if args.dtype:
        model = replace(model, dtype=args.dtype, notes=tuple(n for n in model.notes if "torch_dtype" not in n))
    requests = args.requests if args.requests is not None else (1 if args.quick else 4)
    tokens = args.tokens if args.tokens is not None else (256 if args.quick else 1024)
    geom = Geometry(model, requests, tokens, args.block_size)
    if args.role != "decode" and args.connect is not None:
        raise ConfigError("--connect is for --role decode")
    if args.role == "decode" and args.connect is None:
        raise ConfigError("--role decode needs --connect HOST:PORT (the prefill's LLM-DataDist address)")
    if args.in_process and args.role:
        raise ConfigError("--in-process runs both sides; it cannot be combined with --role")
    timeout = args.timeout if args.timeout is not None else (600.0 if args.role == "prefill" else 60.0)
    if timeout <= 0:
        raise ConfigError("--timeout must be positive")
    if args.control_port is not None and not 0 <= args.control_port <= 65535:
        raise ConfigError("--control-port must be in 0..65535")
    listen: Address = ("127.0.0.1", 0)
    decode_listen: Address | None = None
    if args.role == "decode":
        decode_listen = args.listen
    elif args.listen is not None:
        listen = args.listen
    if listen[1] == 65535 and args.control_port is None:
        raise ConfigError("pass --control-port (the default, the listen port + 1, does not exist)")
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    opts = DemoOptions(geometry=geom, backend=args.backend, transfer_backend=args.transfer_backend,
                       seed=args.seed, timeout=timeout, listen=listen, control_port=args.control_port,
                       connect=args.connect, decode_listen=decode_listen, progress=progress,
                       api=getattr(args, "api", "kvdd"), link=getattr(args, "link", "clusters"))
    if opts.api == "llm_datadist":
        from .package import check_package_options

        check_package_options(opts, bool(args.in_process))
    elif opts.link != "clusters":
        raise ConfigError("--link rank-table is a call of CANN's package: add --api llm_datadist")
    return opts


def _check_backend(backend: str | None) -> None:
    from ..backend import backend_problem, resolve_backend_name

    try:
        problem = backend_problem(resolve_backend_name(backend))
    except (ValueError, ImportError) as exc:
        raise ConfigError(str(exc)) from None
    if problem is not None:
        name = backend or "auto"  # the demo passes None for --backend auto
        raise ConfigError(f"--backend {name}: {problem}" if backend else
                          f"--backend auto selects native, which is unusable: {problem}")


def _check_memory(opts: DemoOptions, both: bool) -> None:
    geom = opts.geometry
    need = geom.side_bytes("prefill") + geom.side_bytes("decode") if both else geom.side_bytes(
        "prefill" if opts.connect is None else "decode")
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if need > avail * 0.9:
        raise ConfigError(f"this geometry needs {mib(need)} of cache memory here but only {mib(avail)} is "
                          "available; lower --requests or --tokens, or run the sides on two hosts (--role)")


def _print_json(doc: Json, out: IO[str]) -> None:
    out.write(json.dumps(doc, indent=2) + "\n")
    out.flush()


def run_from_args(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    """``kvdd demo``: 0 when every transfer verified, 1 on any failure, 2 on bad arguments."""
    out = out or sys.stdout
    try:
        opts = options_from_args(args)
        _check_backend(opts.backend_arg)
        _check_memory(opts, args.role is None)
    except ConfigError as exc:
        print(f"kvdd demo: error: {exc}", file=sys.stderr)
        return 2
    if args.role == "prefill":
        return _run_prefill_cli(opts, args.json, out)
    if args.role == "decode":
        assert opts.connect is not None
        try:
            control = opts.decode_control_address()
        except DemoError as exc:
            print(f"kvdd demo: error: {exc.message}", file=sys.stderr)
            return 2
        report = run_decode(opts, opts.connect, control, Progress(opts.progress, "decode"))
    else:
        report = run_demo(opts, in_process=bool(args.in_process))
    # The text report (geometry, transfer table, summary line) describes a run: once the decode
    # side reached the prefill side.  A failure before that (no prefill there, another secret, a
    # prefill that failed to start) is reported like a failed --role prefill: the error alone.
    shown = args.json or report.connected
    try:
        if args.json:
            _print_json(report.to_json(), out)
        elif shown:
            render_text(report, out)
            out.flush()
    except BrokenPipeError:  # `kvdd demo | head`: the reader left; stop writing quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        except (OSError, ValueError) as exc:
            _log.debug("could not silence stdout after a broken pipe: %s", exc)
    if not report.ok:
        msg = report.error.message if report.error else "not every transfer was verified"
        # The text report ends with the same FAILED line: when it went to the terminal that stderr
        # shows too, one line is enough; otherwise (none, a pipe, a file, --json) stderr must say it.
        if args.json or not shown or not _same_terminal(out, sys.stderr):
            print(f"kvdd demo: FAILED: {msg}", file=sys.stderr)
        return 1
    return 0


def _same_terminal(a: IO[str], b: IO[str]) -> bool:
    try:
        if not (a.isatty() and b.isatty()):
            return False
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError):  # not a real file (a test's StringIO): not a terminal
        return False
    return (sa.st_dev, sa.st_ino, sa.st_rdev) == (sb.st_dev, sb.st_ino, sb.st_rdev)


def _run_prefill_cli(opts: DemoOptions, as_json: bool, out: IO[str]) -> int:
    def ready(info: ReadyInfo) -> None:
        if as_json:
            out.write(json.dumps({"schema": JSON_SCHEMA, "event": "ready", **info.to_json()}) + "\n")
        else:
            host, port = info.listen
            cport = info.control[1]
            extra = "" if opts.control_port is None and port and cport == port + 1 else f" --control-port {cport}"
            shown = host if host not in ("0.0.0.0", "::") else "<this host's address>"
            out.write(f"prefill ready: LLM-DataDist on {host}:{port}, control channel on {host}:{cport}\n"
                      f"run the decode side with the same geometry options:\n"
                      f"  kvdd demo --role decode --connect {shown}:{port}{extra}{_geometry_args(opts)}\n")
        out.flush()

    t0 = time.perf_counter()
    try:
        result = run_prefill(opts, ready, Progress(opts.progress, "prefill"))
        error: str | None = None
    except (DemoError, LLMError, OSError, BackendUnavailableError) as exc:
        result = {"role": "prefill"}
        error = exc.message if isinstance(exc, DemoError) else f"{type(exc).__name__}: {exc}"
    if as_json:  # one line, as the ready event: a JSON-lines stream
        out.write(json.dumps({"schema": JSON_SCHEMA, "event": "result", "ok": error is None, "mode": "prefill",
                              "geometry": opts.geometry.to_json(), "prefill": result,
                              "wall_seconds": time.perf_counter() - t0, "error": error}) + "\n")
        out.flush()
    elif error is None:
        push = result.get("push", {})
        out.write(f"prefill done: served decode (push {mib(push.get('bytes', 0))} in "
                  f"{fmt_seconds(push.get('seconds', 0.0))}), source caches intact\n")
    if error is not None:
        print(f"kvdd demo: FAILED: {error}", file=sys.stderr)
        return 1
    return 0


def _geometry_args(opts: DemoOptions) -> str:
    geom = opts.geometry
    parts = []
    if geom.model.source == "built-in":
        if geom.model.name != DEFAULT_MODEL:
            parts.append(f"--model {geom.model.name}")
    else:
        parts.append(f"--model-config {geom.model.source}")
    if (geom.requests, geom.tokens) == (1, 256):
        parts.append("--quick")
    elif geom.requests != 4 or geom.tokens != 1024:
        parts.append(f"--requests {geom.requests} --tokens {geom.tokens}")
    if geom.block_size != 128:
        parts.append(f"--block-size {geom.block_size}")
    if geom.model.source != "built-in" or geom.model.dtype != MODELS.get(geom.model.name, geom.model).dtype:
        parts.append(f"--dtype {geom.model.dtype}")
    if opts.seed:
        parts.append(f"--seed {opts.seed}")
    if opts.transfer_backend != "comm":
        parts.append(f"--transfer-backend {opts.transfer_backend}")
    if opts.backend != "sim":
        parts.append(f"--backend {opts.backend}")
    if opts.api != "kvdd":
        parts.append(f"--api {opts.api}")
    if opts.link != "clusters":
        parts.append(f"--link {opts.link}")
    return "".join(" " + p for p in parts)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvdd.demo`` (same as ``kvdd demo``)."""
    parser = argparse.ArgumentParser(prog="kvdd demo", description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_demo_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
