"""A same-host peer that execs or forks after the reader opened its memory
(kvdd._native._xproc.mem_open and pvm_copy's ``mem_fd``: the file the one-sided path copies
through, in both its Python and compiled paths).

* exec: the pid and the pidfd stay the same, the address space is new.  Every copy fails with
  ProcessLookupError; the new image, with memory at the very address, is neither read nor written.
  Control: ``process_vm_readv`` on the pid number reads the new image there.
* fork: the child has a copy of the peer's memory at the same addresses.  While the peer lives,
  writes reach the peer alone; once it exits, every copy fails and the child is never touched.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import samehost

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

FIXED = 0x2C0000000000
SIZE = 1 << 20

# Maps SIZE bytes of argv[2] at FIXED, prints "READY <pid>", then on stdin: "sum" (digest),
# "exec <fill>" (exec itself with a new fill: same pid, new address space), "fork <fill>" (a
# child that fills its copy with <fill> and answers "sum" on the same pipes; the parent exits
# once the child runs), "forkstay <fill>" (a child that fills its copy, then reports its digest
# 0.5 s later and exits; the parent stays), "exit".
_PEER = r"""
import ctypes, hashlib, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
FIXED, SIZE, fill = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if libc.mmap(FIXED, SIZE, 3, 0x22 | 0x100000, -1, 0) != FIXED:
    print("MAPFAIL", flush=True); sys.exit(1)
ctypes.memset(FIXED, fill, SIZE)
print("READY", os.getpid(), flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "sum":
        print(hashlib.sha256(ctypes.string_at(FIXED, SIZE)).hexdigest(), flush=True)
    elif cmd[0] == "exec":
        os.execv(sys.executable, [sys.executable, "-c", sys.argv[4], str(FIXED), str(SIZE), cmd[1],
                                  sys.argv[4]])
    elif cmd[0] == "fork":
        if os.fork() == 0:
            ctypes.memset(FIXED, int(cmd[1]), SIZE)
            print("CHILD", os.getpid(), flush=True)
            continue
        os._exit(0)
    elif cmd[0] == "forkstay":  # the child reports its copy's digest 0.5 s later, and exits
        if os.fork() == 0:
            ctypes.memset(FIXED, int(cmd[1]), SIZE)
            print("CHILD", os.getpid(), flush=True)
            import time
            time.sleep(0.5)
            print(hashlib.sha256(ctypes.string_at(FIXED, SIZE)).hexdigest(), flush=True)
            os._exit(0)
    else:
        break
"""


class Peer:
    def __init__(self, fill: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PEER, str(FIXED), str(SIZE), str(fill),
                                      _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        words = self.read().split()
        assert words[0] == "READY", words
        self.pid = int(words[1])
        self.pidfd = _xproc.pidfd_open(self.pid)
        self.mem_fd = _xproc.mem_open(self.pid, self.pidfd)

    def read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        os.close(self.mem_fd)
        os.close(self.pidfd)
        try:
            self.ask("exit")
        except (BrokenPipeError, OSError):
            pass
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer(0x50)
    yield p
    p.close()


def _digest(fill: int) -> str:
    return hashlib.sha256(bytes([fill]) * SIZE).hexdigest()


def _copy(p: Peer, local: np.ndarray, write: bool, mem: bool = True) -> int:
    """All SIZE bytes between ``local`` (inside guards: [4096, 4096 + SIZE)) and FIXED."""
    return int(_xproc.pvm_copy(p.pid, [Region(int(local.ctypes.data) + 4096, SIZE, local)], [FIXED],
                               SIZE, np.array([0], np.int64), np.array([0], np.int64),
                               np.array([SIZE], np.int64), write, timeout_ms=2000,
                               chunk=1 << 20, pidfd=p.pidfd if mem else -1,
                               mem_fd=p.mem_fd if mem else -1))


def _local() -> np.ndarray:
    return np.full(SIZE + 8192, 0x33, np.uint8)


@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
def test_a_peer_that_execs_is_never_reached_again(peer: Peer, write: bool) -> None:
    local = _local()
    assert _copy(peer, local, False) == SIZE and (local[4096:-4096] == 0x50).all()
    assert peer.ask("exec 96").split() == ["READY", str(peer.pid)]  # same pid, new image
    assert _xproc.pidfd_alive(peer.pidfd)  # the pidfd cannot tell
    local[:] = 0x33
    with pytest.raises(ProcessLookupError):
        _copy(peer, local, write)
    assert (local == 0x33).all()  # nothing read (nor any guard touched)
    assert peer.ask("sum") == _digest(96)  # nothing written into the new image
    # control: the pid number reaches the new image at that address
    assert _copy(peer, local, False, mem=False) == SIZE and (local[4096:-4096] == 96).all()
    assert (local[:4096] == 0x33).all() and (local[-4096:] == 0x33).all()


@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
def test_a_forked_child_is_never_reached(peer: Peer, write: bool) -> None:
    local = _local()
    words = peer.ask("fork 97").split()  # the child answers from now on; the peer exits
    assert words[0] == "CHILD"
    child = int(words[1])
    assert child != peer.pid
    for _ in range(200):  # the peer's exit (bounded: 2 s)
        if not _xproc.pidfd_alive(peer.pidfd):
            break
        time.sleep(0.01)
    assert not _xproc.pidfd_alive(peer.pidfd)
    with pytest.raises(ProcessLookupError):
        _copy(peer, local, write)
    assert (local == 0x33).all()
    assert peer.ask("sum") == _digest(97)  # the child's copy unchanged


def test_a_living_forking_peer_keeps_its_own_memory(peer: Peer) -> None:
    """The peer forks and stays: our push reaches the peer's pages, never the child's copy."""
    local = _local()
    local[4096:-4096] = 0x41
    assert peer.ask("forkstay 98").split()[0] == "CHILD"
    assert _copy(peer, local, True) == SIZE
    assert peer.read() == _digest(98)  # the child's copy, after our push
    assert peer.ask("sum") == _digest(0x41)  # the peer's pages got it
