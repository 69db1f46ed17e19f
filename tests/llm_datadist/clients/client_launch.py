"""Start a client-shaped harness as its processes, with kvdd's simulator as ``llm_datadist``.

Every process runs ``python -c BOOT SCRIPT ROLE PORT_BASE [SCENARIO...]``: ``BOOT`` installs
:mod:`kvdd.llm_datadist` as the top-level ``llm_datadist`` (``kvdd.llm_datadist.toplevel.install``,
what ``source DEST/set_env.sh`` of a ``kvdd cann-root`` does for a user), puts this folder on
``sys.path`` and runs the script as ``__main__``.  Faults come from ``KVDD_SIM_FAULTS`` in one
process's environment, as a user injects them into an unmodified program (docs/faults.md).
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo_support import child_env

HERE = Path(__file__).resolve().parent
PORTS = 10
BOOT = (
    "import runpy, sys\n"
    "from kvdd.llm_datadist.toplevel import install\n"
    "install()\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@dataclass
class Proc:
    """One finished process: exit status, output, its ``RESULT`` lines."""

    name: str
    code: int
    out: str
    err: str
    results: list[dict[str, Any]] = field(default_factory=list)

    @property
    def result(self) -> dict[str, Any]:
        assert self.results, f"{self.name} printed no RESULT line\n{self.out}\n{self.err}"
        return self.results[-1]


def free_port_base() -> int:
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000, PORTS)
        ok = True
        for port in range(base, base + PORTS):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free range of loopback ports")



def run(script: str, roles: Sequence[tuple[str, Sequence[str]]], faults: Mapping[str, str] | None = None,
        timeout: float = 120.0) -> dict[str, Proc]:
    """Run ``script`` once per ``(role, extra args)``, all at once, on one free port range.

    ``faults`` maps a role to its ``KVDD_SIM_FAULTS``.  Returns the processes by role; raises
    AssertionError (with every process's output) when one exits non-zero or times out.
    """
    port = free_port_base()
    path = str(HERE / script)
    started = []
    for role, extra in roles:
        cmd = [sys.executable, "-c", BOOT, str(HERE), path, role, str(port), *extra]
        started.append((role, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               env=child_env((faults or {}).get(role)))))
    deadline = time.monotonic() + timeout
    procs: dict[str, Proc] = {}
    timed_out = []
    for role, p in started:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            timed_out.append(role)
        results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        procs[role] = Proc(role, p.returncode, out, err, results)
    bad = [p for p in procs.values() if p.code != 0]
    if bad or timed_out:
        logs = "\n".join(f"--- {p.name} (exit {p.code}) ---\n{p.out}{p.err}" for p in procs.values())
        raise AssertionError(f"{script}: {'timed out: ' + ', '.join(timed_out) + '; ' if timed_out else ''}"
                             f"failed: {', '.join(p.name for p in bad)}\n{logs}")
    return procs
