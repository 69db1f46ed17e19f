"""Connection floods run in processes of their own (so the attacker does not share the test's GIL),
for the bounds tests (:mod:`test_bounds`).

Each flood is a small Python program started with :func:`start`; it runs for the given seconds and
prints what it did as ``key=value`` words on its last line (:func:`result`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_TESTS = str(Path(__file__).resolve().parent.parent)

#: TCP connections opened as fast as possible from ``src`` that send ``first`` bytes of an
#: authentication hello (0: never a byte) and nothing more; the newest ``hold`` stay open (older
#: ones are reset: no TIME_WAIT, so the ports last).
CHURN = r"""
import collections, resource, socket, struct, sys, time
port, src, secs, hold = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, hold + 64)), hard))
first = b"KV\x03\x1e" + bytes(64)  # the start of an AUTH_HELLO header
first = first[:int(sys.argv[5]) if len(sys.argv) > 5 else 0]
rst = struct.pack("ii", 1, 0)
ring = collections.deque()
n = errors = 0
end = time.monotonic() + secs
while time.monotonic() < end:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, rst)
    s.setsockopt(socket.IPPROTO_IP, 24, 1)  # IP_BIND_ADDRESS_NO_PORT
    s.setblocking(False)
    try:
        s.bind((src, 0))
        if s.connect_ex(("127.0.0.1", port)) not in (0, 115):  # EINPROGRESS
            errors += 1
        elif first:
            s.send(first)
    except OSError:
        errors += 1
    ring.append(s)
    n += 1
    while len(ring) > hold:
        ring.popleft().close()
for s in ring:
    s.close()
print(f"connections={n} errors={errors} seconds={secs}")
"""

#: ``count`` authenticated connections from ``src`` that never send their hello, re-opened
#: (re-authenticated) as soon as the victim closes one.
IDLE_AUTH = r"""
import select, socket, sys, time
from hostile import rawpeer
port, src, secs, count = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])

def one():
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(src, 0))
    rawpeer.authenticate(s)
    return s

socks = [one() for _ in range(count)]
print("ready", flush=True)
reopened = 0
end = time.monotonic() + secs
while time.monotonic() < end:
    readable, _, _ = select.select(socks, [], [], 0.05)
    for s in readable:
        try:
            if s.recv(1):
                continue
        except OSError:
            pass
        socks[socks.index(s)] = one()
        s.close()
        reopened += 1
print(f"held={count} reopened={reopened}")
"""

#: A key holder's hellos from ``src``: ``mode`` "complete" sends whole link hellos of ``caches``
#: caches (each a new cluster id) as fast as it can, one connection after the other, ``conns`` at a
#: time; "partial" keeps ``conns`` authenticated connections that announced a hello of ``caches``
#: caches and sent half of it, re-opened as soon as the victim closes one.
HELLOS = r"""
import select, socket, sys, time
from hostile import rawpeer
from kvdd.sim.fabric import wire
port, src, secs, mode, conns, caches = (int(sys.argv[1]), sys.argv[2], float(sys.argv[3]),
                                        sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
sent = refused = reopened = 0
end = time.monotonic() + secs

def authed():
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(src, 0))
    rawpeer.authenticate(s)
    return s

if mode == "complete":
    cid = 1 << 40
    while time.monotonic() < end:
        socks = []
        for _ in range(conns):
            try:
                s = authed()
                cid += 1
                s.sendall(rawpeer.frame(wire.F_HELLO_LINK, rawpeer.hello_link(cid, caches=caches)))
                socks.append(s)
                sent += 1
            except (OSError, PermissionError):
                refused += 1
        for s in socks:
            try:
                rawpeer.read_frame(s)
            except (OSError, AssertionError):
                refused += 1
            s.close()
else:
    body = rawpeer.hello_link(1 << 41, caches=caches)
    half = rawpeer.hdr(wire.F_HELLO_LINK, len(body)) + body[:len(body) // 2]
    def one():
        s = authed()
        s.sendall(half)
        return s
    socks = [one() for _ in range(conns)]
    print("ready", flush=True)
    while time.monotonic() < end:
        readable, _, _ = select.select(socks, [], [], 0.05)
        for s in readable:
            try:
                if s.recv(1):
                    continue
            except OSError:
                pass
            socks[socks.index(s)] = one()
            s.close()
            reopened += 1
print(f"sent={sent} refused={refused} reopened={reopened}")
"""

#: AF_UNIX SOCK_SEQPACKET connections to the abstract name ``sys.argv[1]`` (without its leading
#: NUL), as fast as possible, each closed at once.
ABSTRACT = r"""
import socket, sys, time
name, secs = b"\0" + sys.argv[1].encode(), float(sys.argv[2])
n = refused = 0
end = time.monotonic() + secs
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setblocking(False)
    try:
        s.connect(name)
        n += 1
    except OSError:
        refused += 1
    s.close()
print(f"connections={n} refused={refused}")
"""


def start(code: str, *args: object, user: int | None = None, **kw: Any) -> subprocess.Popen[str]:
    """Run ``code`` with ``args`` in a new Python process (as uid ``user`` when given: then the
    system's Python, which that user can run; ``code`` must need only the standard library)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, env.get("PYTHONPATH", "")) if p)
    python = sys.executable if user is None else shutil.which("python3", path="/usr/bin:/bin")
    assert python, "no system python3 for another user"
    return subprocess.Popen([python, "-c", code, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, text=True, user=user, cwd="/", **kw)


def result(proc: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, float]:
    """The flood's last line as numbers (it must have exited with 0)."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"the flood failed ({proc.returncode}): {out[-500:]}"
    last = out.strip().splitlines()[-1]
    return {k: float(v) for k, v in (w.split("=", 1) for w in last.split())}


def hello_cost(first: int, seconds: float = 4.0) -> str:
    """CPU time the listener thread of an instance in this process spends per connection of a
    CHURN flood sending ``first`` bytes (41: a whole authentication hello, answered with a
    challenge; 0: nothing, held by the kernel)."""
    import gc
    import threading

    import kvdd
    from kvdd.sim.fabric.listener import Listener

    dd = kvdd.LlmDataDist(1, kvdd.LlmRole.PROMPT)
    dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    try:
        listener = next(o for o in gc.get_objects()
                        if isinstance(o, Listener) and o.port == dd.listen_port and not o._closed)
        tid = listener._thread.native_id

        def cpu() -> float:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        n0, c0 = listener.accepted, cpu()
        got = result(start(CHURN, dd.listen_port, "127.0.0.2", seconds, 2000, first))
        n, used = listener.accepted - n0, cpu() - c0
        assert threading.main_thread().is_alive()
        return (f"{got['connections']:.0f} connections sending {first} bytes in {seconds:.0f} s: "
                f"{n} reached the listener, {used:.2f} s of its CPU"
                + (f", {1e6 * used / n:.0f} us each" if n else ""))
    finally:
        dd.finalize()


if __name__ == "__main__":  # python tests/hostile/floods.py [first bytes...]
    sys.path.insert(0, _TESTS)
    for first in map(int, sys.argv[1:] or ["0", "1", "41"]):
        print(hello_cost(first), flush=True)
