"""The outcome of a run: one result per transfer, the JSON document and the text report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO

from .errors import DemoError, Json
from .options import DECODE_CLUSTER_ID, JSON_SCHEMA, PREFILL_CLUSTER_ID, DemoOptions
from .text import fmt_seconds, mib, plural

__all__ = ["DemoReport", "TransferResult", "render_geometry", "render_text"]

@dataclass
class TransferResult:
    """One row of the report."""

    name: str
    api: str
    what: str
    calls: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    verified: bool = False
    checked_bytes: int = 0
    error: str | None = None

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 and self.bytes else None

    def to_json(self) -> Json:
        return {"name": self.name, "api": self.api, "what": self.what, "calls": self.calls,
                "tensors": self.tensors, "bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps,
                "verified": self.verified, "checked_bytes": self.checked_bytes, "error": self.error}


@dataclass
class DemoReport:
    """The outcome of a run (or of the decode side of one)."""

    options: DemoOptions
    mode: str  # "processes", "threads" or "decode" (--role decode)
    backend_name: str = ""
    transfers: list[TransferResult] = field(default_factory=list)
    error: DemoError | None = None
    source_intact: bool | None = None
    prefill: Json = field(default_factory=dict)
    setup_seconds: float = 0.0
    wall_seconds: float = 0.0
    prefill_address: str = ""
    #: The decode side reached the prefill side (its control channel authenticated): before that
    #: there is no run to report, only the error (``kvdd demo`` then prints that alone).
    connected: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and all(t.verified for t in self.transfers) and bool(self.transfers) \
            and self.source_intact is True

    def to_json(self) -> Json:
        moved = sum(t.bytes for t in self.transfers)
        return {
            "schema": JSON_SCHEMA,
            "ok": self.ok,
            "mode": self.mode,
            "backend": self.backend_name or self.options.backend,
            "transfer_backend": self.options.transfer_backend,
            **({} if self.options.api == "kvdd" else {"api": self.options.api}),
            "seed": self.options.seed,
            "geometry": self.options.geometry.to_json(),
            "prefill": {"cluster_id": PREFILL_CLUSTER_ID, "address": self.prefill_address, **{
                k: v for k, v in self.prefill.items() if k in ("setup_seconds", "push", "source_intact")}},
            "decode": {"cluster_id": DECODE_CLUSTER_ID, "setup_seconds": self.setup_seconds},
            "transfers": [t.to_json() for t in self.transfers],
            "summary": {"transfers": len(self.transfers), "verified": sum(t.verified for t in self.transfers),
                        "bytes": moved, "transfer_seconds": sum(t.seconds for t in self.transfers),
                        "checked_bytes": sum(t.checked_bytes for t in self.transfers),
                        "source_intact": self.source_intact, "wall_seconds": self.wall_seconds},
            "error": None if self.error is None else self.error.to_json(),
        }


def render_geometry(opts: DemoOptions, mode: str, out: IO[str]) -> None:
    geom = opts.geometry
    m = geom.model
    w = out.write
    col = max(10, *(len(f.name) + 8 for f in geom.families))
    src = "built-in" if m.source == "built-in" else f"from {m.source}"
    w(f"kvdd demo: {m.name} KV cache, prefill -> decode; verifies every byte\n")
    w(f"  {'model':<{col}}{m.name} ({src}): {m.describe()}\n")
    for note in m.notes:
        w(f"  {'':<{col}}note: {note}\n")
    w(f"  {'workload':<{col}}{geom.requests} request{'s' if geom.requests != 1 else ''} x {geom.tokens} tokens, "
      f"{geom.block_size}-token blocks ({geom.blocks_per_request} per request)\n")
    pad = " " * (2 + col)
    dtype = m.dtype
    for f in geom.families:
        n = geom.num_tensors(f)
        parts = ",".join(f.parts)
        tok = ", ".join(map(str, f.token_shape))
        w(f"  {f.name + '/paged':<{col}}{n} tensors ({parts} x {m.layers} layers), each [blocks, "
          f"{geom.block_size}, {tok}] {dtype}\n")
        w(f"{pad}{mib(geom.block_bytes(f))} per block per tensor; prefill "
          f"{plural(geom.prefill_blocks, 'block')} = {mib(n * geom.prefill_blocks * geom.block_bytes(f))}, "
          f"decode {plural(geom.decode_blocks, 'block')} = {mib(n * geom.decode_blocks * geom.block_bytes(f))}\n")
        w(f"  {f.name + '/contig':<{col}}{n} tensors, each [rows, {geom.tokens}, {tok}] {dtype}\n")
        w(f"{pad}{mib(geom.row_bytes(f))} per row per tensor; prefill {plural(geom.requests, 'row')} = "
          f"{mib(n * geom.requests * geom.row_bytes(f))}, decode {plural(geom.decode_rows, 'row')} = "
          f"{mib(n * geom.decode_rows * geom.row_bytes(f))}\n")
    where = {"processes": "two processes", "threads": "two threads of one process",
             "decode": "decode side of a two-command run"}.get(mode, mode)
    api = "" if opts.api == "kvdd" else ", the calls of CANN's llm_datadist package"
    w(f"  {'total':<{col}}prefill {mib(geom.side_bytes('prefill'))}, decode {mib(geom.side_bytes('decode'))} "
      f"registered; {opts.backend} backend, {opts.transfer_backend} transfer backend, {where}{api}\n")


def render_text(report: DemoReport, out: IO[str]) -> None:
    """The human report: geometry, one table row per transfer, a one-line summary."""
    opts = report.options
    render_geometry(opts, report.mode, out)
    w = out.write
    w("\n")
    header = f"  {'#':<2} {'transfer':<22} {'API':<13} {'calls':>5} {'tensors':>7} {'bytes':>10} " \
             f"{'time':>9} {'GB/s':>7}  {'verified':<8}  what\n"
    w(header)
    for k, t in enumerate(report.transfers, 1):
        gbps = f"{t.gbps:.2f}" if t.gbps else "-"
        status = "yes" if t.verified else "FAILED"
        w(f"  {k:<2} {t.name:<22} {t.api:<13} {t.calls:>5} {t.tensors:>7} {mib(t.bytes):>10} "
          f"{fmt_seconds(t.seconds):>9} {gbps:>7}  {status:<8}  {t.what}\n")
    if not report.transfers:
        w("  (no transfer ran)\n")
    w("\n")
    moved = sum(t.bytes for t in report.transfers)
    if report.ok:
        w(f"OK: {len(report.transfers)} transfers moved {mib(moved)}; after each one all "
          f"{mib(opts.geometry.side_bytes('decode'))} of decode cache memory matched the expected bytes, "
          f"and the prefill source stayed intact ({report.wall_seconds:.1f} s in all)\n")
    else:
        msg = report.error.message if report.error else "verification incomplete"
        w(f"FAILED: {msg}\n")
