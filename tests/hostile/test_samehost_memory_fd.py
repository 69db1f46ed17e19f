"""The same-host reader copies through the peer's ``/proc/<pid>/mem``: identity per system call and
a deadline whatever the peer does to its own memory (kvdd._native._xproc.mem_open / pvm_copy's
``mem_fd``, kvdd.sim.fabric.samehost_path.OneSidedPeer).

* A pid reused while a transfer runs: the file names the address space the attested process had,
  so every later system call fails (ESRCH) and the third process that now holds the pid, with
  memory at the very same address, is neither read nor written.  The pid-number path
  (``process_vm_*``) is run as a control: it does reach the third process.
* A page frozen with a userfaultfd, an unmapped range, a peer that exits: the honest pull or push
  returns at once (well within its deadline + 100 ms), the bytes outside the transfer untouched.
  The control: ``process_vm_readv`` on the frozen page does not return until the peer lets go.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvdd import Status
from kvdd._native import _xproc
from kvdd._native._copy import Region
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.protocol import RemoteCache
from kvdd.sim.fabric.samehost_path import OneSidedLease, OneSidedPeer, new_table_fd

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

FIXED = 0x2A0000000000  # where the peer and the third process both map their memory
SIZE = 8 << 20
BIG = 64 << 20  # the pid-reuse transfer: 16384 system calls of 4 KiB

# A process with SIZE bytes of `fill` at FIXED (MAP_FIXED_NOREPLACE), optionally with a
# userfaultfd registered (missing mode) over everything past the first 64 KiB, which it never
# touches: a read or write there waits for an answer that never comes.  Commands on stdin:
# "sum" -> a digest of its memory, "unmap" -> munmap the upper half, "exit".
_HOLDER = r"""
import ctypes, hashlib, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.syscall.restype = ctypes.c_long
FIXED, SIZE, fill, freeze = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
p = libc.mmap(FIXED, SIZE, 3, 0x22 | 0x100000, -1, 0)  # RW, PRIVATE|ANON|FIXED_NOREPLACE
if p != FIXED:
    print("MAPFAIL", ctypes.get_errno(), flush=True); sys.exit(1)
touched = 64 << 10 if freeze else SIZE
ctypes.memset(FIXED, fill, touched)
if freeze:
    nr = {"x86_64": 323, "aarch64": 282}[os.uname().machine]
    uffd = libc.syscall(nr, os.O_CLOEXEC)
    if uffd < 0:
        print("NOUFFD", ctypes.get_errno(), flush=True); sys.exit(0)
    api = (ctypes.c_uint64 * 3)(0xAA, 0, 0)
    reg = (ctypes.c_uint64 * 4)(FIXED + touched, SIZE - touched, 1, 0)
    if libc.ioctl(uffd, 0xc018aa3f, api) or libc.ioctl(uffd, 0xc020aa00, reg):
        print("NOUFFD", ctypes.get_errno(), flush=True); sys.exit(0)
print("READY", os.getpid(), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "sum":
        view = (ctypes.c_char * touched).from_address(FIXED)
        print(hashlib.sha256(bytes(view)).hexdigest(), flush=True)
    elif cmd == "unmap":
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        print(libc.munmap(FIXED + SIZE // 2, SIZE // 2), flush=True)
    else:
        break
"""


@dataclass
class Holder:
    proc: subprocess.Popen[str]
    pid: int

    def ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _holder(fill: int, freeze: bool = False, python: str = sys.executable) -> Holder:
    proc = subprocess.Popen([python, "-c", _HOLDER, str(FIXED), str(SIZE), str(fill),
                             "1" if freeze else "0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        proc.kill()
        proc.wait()
        if line and line[0] == "NOUFFD":
            pytest.skip(f"userfaultfd refused here (errno {line[1]}; needs CAP_SYS_PTRACE or "
                        "vm.unprivileged_userfaultfd=1)")
        pytest.fail(f"holder did not start: {line}")
    return Holder(proc, int(line[1]))


def _digest(fill: int, n: int) -> str:
    return hashlib.sha256(bytes([fill]) * n).hexdigest()


# ---- a reused pid ---------------------------------------------------------------------------------

# In a private pid namespace (this script is pid 1): a peer P with memory at FIXED, an honest
# copier C (another process) that holds P's pidfd and, unless "pid" mode, P's /proc/<pid>/mem.  C's
# first copy system call is held at its entry for 1.5 s (strace attached to C), the way a frozen
# page held it; meanwhile P exits and a third process V takes P's pid with memory at FIXED.
_PID_REUSE = r"""
import ctypes, hashlib, os, subprocess, sys, time
FIXED, SIZE, write, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]

def holder(fill):
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        if libc.mmap(FIXED, SIZE, 3, 0x22 | 0x100000, -1, 0) != FIXED:
            os._exit(3)
        ctypes.memset(FIXED, fill, SIZE)
        os.write(w, b"R")
        os.read(r2, 1)
        os.write(w, hashlib.sha256(ctypes.string_at(FIXED, SIZE)).hexdigest().encode())
        os.read(r2, 1)
        os._exit(0)
    assert os.read(r, 1) == b"R"
    return pid, r, w2

def digest(h):
    os.write(h[2], b"?")
    return os.read(h[1], 64).decode()

COPIER = (
    "import os, sys, numpy as np\n"
    "from kvdd._native import _xproc\n"
    "from kvdd._native._copy import Region\n"
    "peer, fixed, size, write, mode = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),\n"
    "                                  sys.argv[4] == '1', sys.argv[5])\n"
    "pidfd = _xproc.pidfd_open(peer)\n"
    "mem = -1 if mode == 'pid' else _xproc.mem_open(peer, pidfd)\n"
    "buf = np.full(size, 0x41, np.uint8); z = np.array([0], np.int64)\n"
    "print('READY', flush=True); sys.stdin.readline()\n"
    "try:\n"
    "    r = _xproc.pvm_copy(peer, [Region(int(buf.ctypes.data), size, buf)], [fixed], size, z,\n"
    "                        z, np.array([size], np.int64), write, mem_fd=mem)\n"
    "except OSError as exc:\n"
    "    r = type(exc).__name__\n"
    "print(r, int((buf == 0x56).sum()), flush=True)\n")
peer = holder(0x50)
c = subprocess.Popen([sys.executable, "-c", COPIER, str(peer[0]), str(FIXED), str(SIZE),
                      "1" if write else "0", mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True)
assert c.stdout.readline().strip() == "READY"
calls = "pread64,pwrite64,process_vm_readv,process_vm_writev"
st = subprocess.Popen(["strace", "-f", "-p", str(c.pid), "-o", "/dev/null", "-e", "trace=" + calls,
                       "-e", "inject=" + calls + ":delay_enter=1500000:when=1"],
                      stderr=subprocess.PIPE, text=True)
while "attached" not in st.stderr.readline():
    pass
c.stdin.write("go\n"); c.stdin.flush()
time.sleep(0.3)                               # C is inside its first copy call (held)
os.kill(peer[0], 9); os.waitpid(peer[0], 0)  # the attested process exits ...
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(peer[0] - 1))
victim = holder(0x56)                         # ... and a third process takes its pid
result, read_victim = c.stdout.readline().split()
print(peer[0], victim[0], result, digest(victim), read_victim, flush=True)
st.kill()
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None
                    or shutil.which("strace") is None
                    or platform.machine() not in ("x86_64", "aarch64"),
                    reason="needs root, unshare (a private pid namespace and ns_last_pid) and "
                           "strace (to hold a system call at its entry)")
@pytest.mark.parametrize("mode", ["mem", "pid"], ids=["proc-pid-mem", "control-process-vm"])
@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
def test_a_pid_reused_mid_transfer_reaches_no_third_process(write: bool, mode: str) -> None:
    """The attested peer exits while the copier's copy system call is held at its entry, and a
    third process takes its pid with memory at the same address.  Through /proc/<pid>/mem the
    call fails (the address space is gone): 0 bytes of the third process written (its digest) or
    read (none of its bytes in the destination).  Control: ``process_vm`` on the pid number
    reaches it (writes it, or reads it), which is what the attack did."""
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                          _PID_REUSE, str(FIXED), str(1 << 20), "1" if write else "0", mode],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "unshare" in out.stderr:
        pytest.skip(f"unshare failed: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    old, new, result, victim, read_victim = out.stdout.split()
    assert old == new  # the pid was reused while the call was held
    untouched = victim == _digest(0x56, 1 << 20) and read_victim == "0"
    if mode == "pid":
        assert not untouched and result == str(1 << 20)  # the attack, reproduced
        return
    assert victim == _digest(0x56, 1 << 20)  # not one byte of the third process written ...
    assert read_victim == "0"  # ... nor read
    assert result == "ProcessLookupError"


# ---- a peer that freezes, unmaps or drops its memory ----------------------------------------------


@pytest.fixture
def table_fd() -> Iterator[int]:
    fd = new_table_fd(1)
    owner = _xproc.LeaseTable(fd, 1, True)
    owner.store(0, 2, 7)  # slot 0 serves cache 7
    yield fd
    owner.close()
    os.close(fd)


def _reader(h: Holder, table_fd: int) -> OneSidedPeer:
    link = samehost.SameHostLink(h.pid, os.getuid(), _xproc.pidfd_open(h.pid), os.dup(table_fd), 1)
    return OneSidedPeer(link)


def _move(r: OneSidedPeer, local: np.ndarray, off: int, n: int, write: bool,
          wait_ms: int = 2000, h: Holder | None = None) -> tuple[int, float]:
    """One transfer; a call still running after 5 s fails the test (the holder is killed, which
    releases a copy it holds)."""
    out: list[tuple[int, float]] = []
    t = threading.Thread(target=lambda: out.append(_move_now(r, local, off, n, write, wait_ms)),
                         daemon=True)
    t.start()
    t.join(5.0)
    if not out:
        if h is not None:
            h.stop()
        t.join(10)
        pytest.fail("the transfer was held by the peer")
    return out[0]


def _move_now(r: OneSidedPeer, local: np.ndarray, off: int, n: int, write: bool,
              wait_ms: int) -> tuple[int, float]:
    rc = RemoteCache(7, 1, SIZE, 1, SIZE, False, 7)
    t0 = time.monotonic()
    got = r.acquire(rc, (FIXED,), wait_ms)
    assert got is not None and got[0] == Status.LLM_SUCCESS
    lease = got[1]
    assert isinstance(lease, OneSidedLease)
    try:
        st = r.move(lease, [0], [Region(int(local.ctypes.data), n, local)],
                    np.array([0], np.int64), np.array([off], np.int64), np.array([n], np.int64),
                    write)
    finally:
        r.release(lease)
    return st, time.monotonic() - t0


@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
def test_a_frozen_page_does_not_hold_the_honest_call(table_fd: int, write: bool) -> None:
    """The peer registered a userfaultfd over its memory past 64 KiB and never answers: a pull or
    push over the frozen range returns LLM_FAILED at once (< deadline + 100 ms: 2.1 s), a pull of
    the 64 KiB before it succeeds, and nothing past the transfer's own bytes changes."""
    h = _holder(0x50, freeze=True)
    r = _reader(h, table_fd)
    try:
        local = np.full(1 << 20, 0x33, np.uint8)
        st, took = _move(r, local, 0, 64 << 10, False)
        assert st == Status.LLM_SUCCESS and (local[:64 << 10] == 0x50).all()
        local[:] = 0x33
        st, took = _move(r, local, 32 << 10, 1 << 20, write, h=h)  # into the frozen range
        assert st == Status.LLM_FAILED
        assert took < 2.1
        if not write:  # the destination holds a prefix at most, from the unfrozen 32 KiB
            assert set(np.unique(local[:32 << 10])) <= {0x33, 0x50}
            assert (local[32 << 10:] == 0x33).all()
        # the peer's bytes: a push wrote exactly the 32 KiB before the frozen page
        want = (bytes([0x50]) * (32 << 10)) + bytes([0x33 if write else 0x50]) * (32 << 10)
        assert h.ask("sum") == hashlib.sha256(want).hexdigest()
        st, _ = _move(r, local, 0, 64 << 10, False)  # the link still serves
        assert st == Status.LLM_SUCCESS
    finally:
        r.close()
        h.stop()


def test_the_frozen_page_holds_process_vm_readv_control() -> None:
    """Control for the test above: ``process_vm_readv`` (the pid-number path) on the frozen page
    does not return while the peer lives; it returns when the peer exits."""
    h = _holder(0x50, freeze=True)
    local = np.zeros(4096, np.uint8)
    done: list[object] = []

    def pull() -> None:
        try:
            done.append(_xproc.pvm_copy(h.pid, [Region(int(local.ctypes.data), 4096, local)],
                                        [FIXED + (1 << 20)], 4096, np.array([0], np.int64),
                                        np.array([0], np.int64), np.array([4096], np.int64),
                                        False))
        except OSError as exc:
            done.append(exc)

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    t.join(0.3)
    try:
        assert t.is_alive() and not done  # held by the peer
    finally:
        h.stop()
        t.join(10)
    assert done


@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
def test_unmapped_and_exited_peer_memory_returns_at_once(table_fd: int, write: bool) -> None:
    """The peer unmaps the upper half of its memory: a transfer there is LLM_FAILED at once; the
    peer exits: LLM_TIMEOUT at once (the link's certain death), its pid number never used."""
    h = _holder(0x50)
    r = _reader(h, table_fd)
    try:
        local = np.full(1 << 20, 0x33, np.uint8)
        assert h.ask("unmap") == "0"
        st, took = _move(r, local, SIZE // 2, 1 << 20, write)
        assert (st, took < 2.1) == (Status.LLM_FAILED, True)
        assert write or (local == 0x33).all()
        st, _ = _move(r, local, 0, 1 << 20, write)
        assert st == Status.LLM_SUCCESS
        h.stop()
        st, took = _move(r, local, 0, 1 << 20, write)
        assert (st, took < 2.1) == (Status.LLM_TIMEOUT, True)
    finally:
        r.close()
        h.stop()
