"""A descendant of the reader that gets the reader's pid (kvdd._native._xproc.PeerMaps).

The reader A maps an owner's memory (a PeerMaps) and forks B; A exits; B forks C, which the kernel
gives A's pid (a private pid namespace and ``ns_last_pid`` make it certain here; on a busy host
pids wrap around by themselves).  C inherited A's PeerMaps (through B) but none of its mappings
(MADV_DONTFORK), and keeps memory of its own where A's mapping was; C then maps a peer of its own
(any new PeerMaps).  A push through the inherited PeerMaps must not go through A's mappings
(absent in C: SIGSEGV, or C's own memory written), and closing it must not unmap C's memory.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest

from kvdd.sim.fabric import samehost

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

N = 1 << 16

# Run as pid 1 of a private pid namespace: forks A and prints what A's grandchild C reports.
_SCRIPT = r"""
import ctypes, fcntl, mmap, os, sys, time
import numpy as np
from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric.samehost_path import new_table_fd
N = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]

def c_runs(maps, table, lo, w):
    assert libc.mmap(lo, N, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000, -1, 0) == lo
    mine = np.ctypeslib.as_array((ctypes.c_ubyte * N).from_address(lo))
    mine[:] = 0x5A                        # C's own memory where A's mapping was
    _xproc.PeerMaps(1)                    # C maps a peer of its own
    src = np.full(N, 0xC3, np.uint8)
    dst = np.zeros(N, np.uint8)           # the remote address of the copy when not mapped
    z, ln = np.array([0], np.int64), np.array([N], np.int64)
    uses = maps.uses
    moved = _xproc.pvm_copy(os.getpid(), [Region(int(src.ctypes.data), N, src)],
                            [int(dst.ctypes.data)], N, z, z, ln, True, leases=table, slot=0,
                            maps=maps, map_tensors=(0,))
    out = [moved, maps.uses - uses, int((mine == 0x5A).sum()), int((dst == 0xC3).sum())]
    maps.close()
    out.append(int((mine == 0x5A).sum()))  # still mapped (a SIGSEGV here otherwise)
    os.write(w, (" ".join(map(str, out)) + "\n").encode())
    os._exit(0)

def a_runs(w):
    fd = os.memfd_create("kvdd-pid-reuse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, N)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    maps = _xproc.PeerMaps(1)
    assert maps.place(0, 0, maps.add(fd, os.fstat(fd).st_ino), 0)
    with open("/proc/self/maps") as f:
        lo = next(int(line.split("-")[0], 16) for line in f if "kvdd-pid-reuse" in line)
    table = _xproc.LeaseTable(new_table_fd(1), 1, True)
    a = os.getpid()
    if os.fork() == 0:                    # B
        while os.path.exists(f"/proc/{a}"):
            time.sleep(0.01)
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(a - 1))
        c = os.fork()
        if c == 0:
            c_runs(maps, table, lo, w)
        _, status = os.waitpid(c, 0)
        os.write(w, f"{a} {c} {status}\n".encode())
        os._exit(0)
    os._exit(0)                           # A exits: its pid is free

r, w = os.pipe()
a = os.fork()
if a == 0:
    os.close(r)
    a_runs(w)
os.close(w)
os.waitpid(a, 0)
with os.fdopen(r) as f:
    sys.stdout.write(f.read())
try:
    while True:
        os.wait()
except ChildProcessError:
    pass
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None
                    or platform.machine() not in ("x86_64", "aarch64"),
                    reason="needs root and unshare (a private pid namespace and ns_last_pid)")
def test_a_descendant_with_the_readers_pid_neither_copies_nor_unmaps_through_its_maps() -> None:
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                          _SCRIPT, str(N)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "unshare" in out.stderr:
        pytest.skip(f"unshare failed: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    a, c, status = lines[-2].split()
    assert a == c  # C got A's pid
    assert status == "0", out.stdout  # (11 << 0: SIGSEGV)
    moved, mapped_uses, mine, landed, mine_after_close = map(int, lines[0].split())
    # through /proc (process_vm here): the push landed where it was addressed, the mapping unused
    assert (moved, mapped_uses, landed) == (N, 0, N)
    assert mine == N and mine_after_close == N  # C's own memory neither written nor unmapped
