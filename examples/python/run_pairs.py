"""Run every Python example of CANN's ``llm_datadist`` package as its processes on loopback.

    python examples/python/run_pairs.py [--port-base N] [--only NAME,...] [--timeout S] [--sim|--installed]

Each example runs as a prefill and a decode process (``many_prefills``: three prefills and a
decode); a pair passes when every process exits 0.  Exit status 0 when every pair passed.

Which ``llm_datadist`` the examples import:

* ``--installed``: whatever ``import llm_datadist`` finds (CANN's package on an Atlas node, or
  kvdd's simulator after ``source DEST/set_env.sh`` of a root made by ``kvdd cann-root DEST``);
* ``--sim``: kvdd's simulator, put on ``import llm_datadist`` for the child processes by a
  ``sitecustomize`` that calls ``kvdd.llm_datadist.toplevel.install()`` (nothing is installed);
* default: ``--installed`` when ``import llm_datadist`` works, else ``--sim``.

The runner prints which package the children import.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAIRS = ("pull_blocks", "pull_cache", "push", "layerwise_push", "switch_role", "many_prefills", "rank_table")
PORTS_PER_PAIR = 10  # PORT_BASE .. PORT_BASE + 9 (the control socket is PORT_BASE + 9)
MANY_PREFILLS = 3
SHIM = "from kvdd.llm_datadist.toplevel import install\ninstall()\n"


def _free(base: int) -> bool:
    for port in range(base, base + PORTS_PER_PAIR):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _port_base(start: int | None) -> int:
    """``start`` when given; else a random free range of ports in 20000..60000."""
    if start is not None:
        return start
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000, PORTS_PER_PAIR)
        if _free(base):
            return base
    raise SystemExit("run_pairs: no free range of 10 loopback ports found")


def _which(env: dict[str, str]) -> str | None:
    """Where ``import llm_datadist`` leads with ``env``, or None when it fails."""
    code = "import llm_datadist, sys; sys.stdout.write(llm_datadist.__file__ or '?')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=HERE)
    return r.stdout.strip() if r.returncode == 0 else None


def _commands(name: str, port: int) -> list[list[str]]:
    script = str(HERE / f"{name}.py")
    if name == "many_prefills":
        return ([[sys.executable, script, "prefill", str(port), str(i)] for i in range(MANY_PREFILLS)]
                + [[sys.executable, script, "decode", str(port), str(MANY_PREFILLS)]])
    return [[sys.executable, script, "prefill", str(port)], [sys.executable, script, "decode", str(port)]]


def run_pair(name: str, port: int, env: dict[str, str], timeout: float, logs: Path) -> bool:
    """Start the example's processes, wait for all; True when all exited 0 (else print their logs)."""
    t0 = time.perf_counter()
    procs = []
    for k, cmd in enumerate(_commands(name, port)):
        log = open(logs / f"{name}-{k}-{cmd[2]}.log", "w+")
        procs.append((cmd, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE)))
    deadline = time.monotonic() + timeout
    codes = []
    for cmd, _log, proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    ok = all(c == 0 for c in codes)
    seconds = time.perf_counter() - t0
    print(f"examples/python: {name}: {'passed' if ok else 'FAILED'} ({seconds:.1f} s"
          + ("" if ok else f", exit statuses {codes}") + ")", flush=True)
    for (cmd, log, _proc), code in zip(procs, codes):
        log.seek(0)
        text = log.read()
        log.close()
        if not ok:
            print(f"--- {' '.join(Path(c).name for c in cmd[1:])} (exit {code}) ---\n{text}", end="", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port-base", type=int, help="first loopback port (10 per example; default: a free range)")
    ap.add_argument("--only", help=f"comma-separated subset of: {', '.join(PAIRS)}")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per example (default 120)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--sim", action="store_true", help="import kvdd's simulator as llm_datadist")
    which.add_argument("--installed", action="store_true", help="import the llm_datadist that is installed")
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",")] if args.only else list(PAIRS)
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        ap.error(f"unknown example {', '.join(unknown)}; choose from {', '.join(PAIRS)}")

    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)  # each example imports `common` from its own folder
    with tempfile.TemporaryDirectory(prefix="kvdd-examples-") as tmp:
        found = None if args.sim else _which(env)
        if found is None:
            if args.installed:
                print("run_pairs: `import llm_datadist` fails (source set_env.sh of a CANN root first)",
                      file=sys.stderr)
                return 2
            shim = Path(tmp, "shim")
            shim.mkdir()
            (shim / "sitecustomize.py").write_text(SHIM)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH")) if p)
            found = _which(env)
            if found is None:
                print("run_pairs: kvdd's simulator cannot be imported as llm_datadist", file=sys.stderr)
                return 2
            print(f"examples/python: llm_datadist = kvdd's simulator ({found}, via sitecustomize)", flush=True)
        else:
            print(f"examples/python: llm_datadist = {found}", flush=True)
        logs = Path(tmp, "logs")
        logs.mkdir()
        failed = 0
        start = args.port_base
        for name in names:
            port = _port_base(start)
            if start is not None:
                start += PORTS_PER_PAIR
            failed += not run_pair(name, port, env, args.timeout, logs)
    print(f"examples/python: {len(names) - failed} of {len(names)} passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
