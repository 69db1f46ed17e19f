"""Both sides at once: two OS processes (default) or two threads of this process."""

from __future__ import annotations

import logging
import multiprocessing
import queue
import sys
import threading
import time
from typing import Any

from .decode import run_decode_side
from .errors import DemoError, Json
from .options import Address, DemoOptions
from .control import ReadyInfo
from .prefill import run_prefill
from .report import DemoReport
from .text import Progress

__all__ = ["run_demo"]

_log = logging.getLogger(__name__)


def run_demo(opts: DemoOptions, *, in_process: bool = False) -> DemoReport:
    """Run both sides: two OS processes (parent = decode, spawned child = prefill) or two threads.

    Parameters
    ----------
    opts : DemoOptions
        The run's options.
    in_process : bool
        Run the sides as two threads of this process instead.

    Returns
    -------
    DemoReport
        Never raises for a demo failure: see ``report.ok`` and ``report.error``.
    """
    return _run_threads(opts) if in_process else _run_processes(opts)


def _merge_prefill(report: DemoReport, prefill: Json | None, prefill_error: str | None) -> None:
    if prefill:
        report.prefill.update(prefill)
    if prefill_error and report.error is None:
        report.error = DemoError(f"prefill side failed: {prefill_error}")


def _connectable(ready: ReadyInfo) -> ReadyInfo:
    """Where a decode on this host reaches a prefill that listens on ``ready`` (wildcards: loopback)."""
    def fix(a: Address) -> Address:
        return ("127.0.0.1", a[1]) if a[0] in ("0.0.0.0", "") else a
    return ReadyInfo(fix(ready.listen), fix(ready.control))


def _run_threads(opts: DemoOptions) -> DemoReport:
    ready_q: queue.Queue[ReadyInfo | BaseException] = queue.Queue()
    out: dict[str, Any] = {}

    cancel = threading.Event()

    def prefill_main() -> None:
        try:
            out["result"] = run_prefill(opts, ready_q.put, Progress(opts.progress, "prefill"), cancel)
        except BaseException as exc:  # reported by the main thread
            out["error"] = exc
            ready_q.put(exc)

    def locate() -> ReadyInfo:
        try:
            first = ready_q.get(timeout=opts.timeout + 60)
        except queue.Empty:
            raise DemoError("the prefill side did not become ready") from None
        if isinstance(first, BaseException):
            raise DemoError(f"prefill side failed: {_describe(first)}")
        return _connectable(first)

    thread = threading.Thread(target=prefill_main, name="kvdd-demo-prefill", daemon=True)
    t0 = time.perf_counter()
    thread.start()
    report = run_decode_side(opts, _connectable(ReadyInfo(opts.listen, opts.listen)).listen[0], locate,
                         Progress(opts.progress, "decode"), "threads")
    if report.error is not None:
        cancel.set()  # the prefill may still wait for a decode that never connected
    thread.join(opts.timeout + 10)
    err = out.get("error")
    _merge_prefill(report, out.get("result"), None if err is None else _describe(err))
    report.wall_seconds = time.perf_counter() - t0
    return report


def _describe(exc: BaseException) -> str:
    return exc.message if isinstance(exc, DemoError) else f"{type(exc).__name__}: {exc}"


def _prefill_child(opts: DemoOptions, conn: Any, log_level: int = logging.NOTSET) -> None:
    """Entry point of the spawned prefill process: ready info and the result go back over ``conn``.

    ``log_level`` is the parent's root logging level when its command line asked for logs
    (``-v``): a spawned process starts with no logging configured, so it sets up the same
    stderr logging, its lines marked ``[prefill]``."""
    if log_level != logging.NOTSET:
        logging.basicConfig(level=log_level, format="[prefill] %(name)s: %(levelname)s: %(message)s")
    try:
        result = run_prefill(opts, lambda ready: conn.send(("ready", ready)), Progress(opts.progress, "prefill"))
        conn.send(("result", result))
    except BaseException as exc:
        try:
            conn.send(("error", _describe(exc)))
        except OSError as lost:  # the parent has gone: nobody to tell
            _log.debug("prefill child could not report %r: %s", exc, lost)
        sys.exit(1)
    finally:
        conn.close()


def _run_processes(opts: DemoOptions) -> DemoReport:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    root = logging.getLogger()
    log_level = root.level if root.handlers else logging.NOTSET  # the CLI's -v, passed on
    proc = ctx.Process(target=_prefill_child, args=(opts, child, log_level), name="kvdd-demo-prefill",
                       daemon=True)
    proc.start()
    child.close()

    def recv(deadline: float) -> tuple[str, Any]:
        while True:
            if parent.poll(0.1):
                try:
                    kind, payload = parent.recv()
                    return str(kind), payload
                except EOFError:
                    return "error", f"the prefill process exited with code {proc.exitcode} without a word"
            if not proc.is_alive() and not parent.poll(0.2):
                proc.join(1)
                return "error", f"the prefill process exited with code {proc.exitcode}"
            if time.monotonic() > deadline:
                return "error", "the prefill process did not answer in time"

    def locate() -> ReadyInfo:
        kind, payload = recv(time.monotonic() + opts.timeout + 60)
        if kind != "ready":
            raise DemoError(f"prefill side failed: {payload}")
        assert isinstance(payload, ReadyInfo)
        return _connectable(payload)

    try:
        report = run_decode_side(opts, _connectable(ReadyInfo(opts.listen, opts.listen)).listen[0], locate,
                             Progress(opts.progress, "decode"), "processes")
        prefill_result: Json | None = None
        prefill_error: str | None = None
        if proc.is_alive() or parent.poll(0):
            # After a decode failure the prefill may wait for a decode that never connected: give
            # it a moment to report (it checks its source after a `done`), then stop it.
            grace = opts.timeout if report.error is None else min(opts.timeout, 10.0)
            kind, payload = recv(time.monotonic() + grace)
            if kind == "result":
                prefill_result = payload
            elif report.error is None or "prefill" not in report.error.message:
                prefill_error = str(payload)
        proc.join(10 if report.error is None else 1)
        if proc.is_alive():
            proc.terminate()  # our child, stuck waiting for a decode side that is gone
            proc.join(5)
        if proc.exitcode not in (0, None) and prefill_error is None and report.error is None:
            prefill_error = f"the prefill process exited with code {proc.exitcode}"
        _merge_prefill(report, prefill_result, prefill_error)
        report.prefill["pid"] = proc.pid
        report.wall_seconds = time.perf_counter() - t0
        return report
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        parent.close()
