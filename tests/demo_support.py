"""Shared set-up of the ``kvdd demo`` tests (test_demo*.py): quick options, a prefill side in a
thread, the checks of a good run, child processes that import the kvdd under test, a corrupting
pull, a closed port, and the command line run on a pseudo-terminal."""

from __future__ import annotations

import ctypes
import json
import os
import pty
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvdd
from kvdd import ClusterInfo, IpInfo, LlmRole
from kvdd.cli import main as cli_main
from kvdd.demo import DEFAULT_MODEL, DemoOptions, DemoReport, Geometry, resolve_model, run_prefill
from kvdd.demo.control import ReadyInfo
from kvdd.sim.engine import SimBackend

__all__ = ["KiB", "TRANSFERS", "quick", "PrefillThread", "prefill_thread", "assert_ok", "child_env",
           "cross_process_problem", "needs_cross_process", "write_config", "poke", "corrupt_first_block_pull",
           "closed_port", "terminal_output"]

KiB = 1024
TRANSFERS = ["paged block pull", "layer-by-layer pull", "batch-row pull", "prefix pull",
             "push prefill -> decode"]


def quick(**kw: Any) -> DemoOptions:
    geom = kw.pop("geometry", None) or Geometry(resolve_model(DEFAULT_MODEL), 1, 256)
    return DemoOptions(geometry=geom, timeout=30.0, **kw)


#: A prefill side running in a thread: its ReadyInfo, its outcome (``"result"`` or ``"error"``), its thread.
PrefillThread = tuple[ReadyInfo, dict[str, Any], threading.Thread]


def prefill_thread(options: DemoOptions) -> Iterator[PrefillThread]:
    """Run :func:`kvdd.demo.run_prefill` with ``options`` in a thread until it is ready; yield it,
    then cancel it and join its thread (``yield from`` in a fixture)."""
    out: dict[str, Any] = {}
    ready: list[ReadyInfo] = []
    event = threading.Event()
    cancel = threading.Event()

    def on_ready(info: ReadyInfo) -> None:
        ready.append(info)
        event.set()

    def run() -> None:
        try:
            out["result"] = run_prefill(options, on_ready, cancel=cancel)
        except BaseException as exc:
            out["error"] = exc
            event.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert event.wait(60) and ready, out.get("error")
    yield ready[0], out, thread
    cancel.set()
    thread.join(60)


def assert_ok(report: DemoReport) -> None:
    assert report.error is None, report.error.message
    assert report.ok
    assert [t.name for t in report.transfers] == TRANSFERS
    assert all(t.verified and t.checked_bytes > 0 for t in report.transfers)
    assert report.source_intact is True
    assert report.connected


# ---- child processes ------------------------------------------------------------------------------

def child_env(faults: str | None = None, extra_paths: Sequence[str] = ()) -> dict[str, str]:
    """Environment for child processes: import the same kvdd as this test process (then modules
    from ``extra_paths``), with the fault injections ``faults`` (``KVDD_SIM_FAULTS``; none by
    default, whatever this process has)."""
    env = dict(os.environ)
    root = str(Path(kvdd.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *extra_paths, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.pop("KVDD_SIM_FAULTS", None)
    if faults:
        env["KVDD_SIM_FAULTS"] = faults
    return env


_PEER = textwrap.dedent("""
    import sys, kvdd
    dd = kvdd.LlmDataDist(7, kvdd.LlmRole.PROMPT, backend="sim")
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    print(dd.listen_port, flush=True)
    sys.stdin.readline()
    dd.finalize()
""")

_cross: list[str | None] = []


def cross_process_problem() -> str | None:
    """None when this build's simulator links instances in two processes; else why not (found out
    by trying: a peer process listens, this process links to it)."""
    if _cross:
        return _cross[0]
    proc = subprocess.Popen([sys.executable, "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=child_env())
    problem: str | None = None
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        with kvdd.LlmDataDist(8, LlmRole.DECODER, backend="sim") as dd:
            dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
            cluster = ClusterInfo(7, LlmRole.PROMPT, local_ip_infos=(IpInfo("127.0.0.1"),),
                                  remote_ip_infos=(IpInfo("127.0.0.1", port),))
            try:
                dd.link_llm_clusters([cluster], timeout_ms=5000)
                dd.unlink_llm_clusters([cluster], timeout_ms=5000)
            except kvdd.LLMError as exc:
                problem = ("cross-process links are not available in this build's simulator "
                           f"({type(exc).__name__})")
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _cross.append(problem)
    return problem


def needs_cross_process() -> None:
    problem = cross_process_problem()
    if problem is not None:
        pytest.skip(problem)


# ---- configs, corruption, ports, terminals -------------------------------------------------------

def write_config(tmp_path: Path, doc: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def poke(addr: int) -> None:
    """Flip one byte of registered memory (what a faulty transport would do)."""
    old = ctypes.string_at(addr, 1)[0]
    ctypes.memset(addr, old ^ 0xFF, 1)


@pytest.fixture
def corrupt_first_block_pull(monkeypatch: pytest.MonkeyPatch, python_path_only: None
                             ) -> Iterator[list[tuple[int, int, int]]]:
    """The first PullKvBlocks of each run also flips byte 1000 of tensor 5 of its first dst block."""
    done: list[tuple[int, int, int]] = []
    original = SimBackend.pull_kv_blocks

    def pull(self: SimBackend, idx: kvdd.CacheIndex, dst: kvdd.Cache, src_blocks: Sequence[int],
             dst_blocks: Sequence[int], ext: kvdd.KvCacheExtParam) -> int:
        status = original(self, idx, dst, src_blocks, dst_blocks, ext)
        if status == 0 and not done:
            entry = self.caches[dst.cache_id]
            poke(entry.addrs[5] + dst_blocks[0] * entry.S + 1000)
            done.append((dst.cache_id, 5, dst_blocks[0]))
        return status

    monkeypatch.setattr(SimBackend, "pull_kv_blocks", pull)
    yield done


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once closed


def _drain(fd: int, chunks: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO once the slave side is closed
            return
        if not data:
            return
        chunks.append(data)


def terminal_output(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """``kvdd ARGV`` with stdout and stderr on one terminal (as in an interactive shell)."""
    master, slave = pty.openpty()
    term = os.fdopen(slave, "w", buffering=1)
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(master, chunks), daemon=True)
    reader.start()
    try:
        monkeypatch.setattr(sys, "stdout", term)
        monkeypatch.setattr(sys, "stderr", term)
        rc = cli_main(argv)
    finally:
        term.close()
        reader.join(10)
        os.close(master)
    return rc, b"".join(chunks).decode()
