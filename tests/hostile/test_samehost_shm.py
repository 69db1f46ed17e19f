"""A same-host owner that lies about its shareable memory (kvdd.sim.fabric.samehost_shm).

The owner is a real instance in another process serving one cache (N bytes inside guards of 0x77).
Its announcement of the memory behind that cache (the records the reader takes with pidfd_getfd)
is replaced by a lie: a disk file, a pipe, a /dev/shm file, an unsealed memfd, a memfd smaller
than the tensor, a hugetlbfs memfd, one file more than MAX_LINK_MAPS (the limit shrunk to 2 here).  The reader must map none of them, and every
call must still do what the honest call does (through the owner's /proc/<pid>/mem): the same
status, the owner's bytes pulled, ours pushed, and not one byte outside the registered regions of
either process touched.  An honest owner that punches holes in its memory or tries to shrink it
afterwards cannot crash the reader either.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvdd import (OPTION_DEVICE_ID, OPTION_LISTEN_IP_INFO, Cache, CacheDesc, CacheIndex,
                  ClusterInfo, DataType, IpInfo, KvCacheExtParam, LlmDataDist,
                  LlmRole, tensor_addrs)
from kvdd import LLMTimeoutError
from kvdd._native import _xproc
from kvdd.sim import _fastpath
from kvdd.sim.fabric import samehost, samehost_shm

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

N = 64 << 10  # bytes of the cache (one row, one tensor)
G = 4096  # guard bytes on each side
OWNER = 1
ONE = KvCacheExtParam(tensor_num_per_layer=1)  # one tensor, one layer

# The owner: mode, N, G, a disk directory.  Prints its port, the arena's address, the cache id
# and what the lie needed; then runs commands from stdin: punch, truncate, quit.
_OWNER = r"""
import ctypes, fcntl, os, sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, shm, tensor_addrs
from kvdd.sim.fabric import samehost_shm
MODE, N, G, DISK = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
shared = MODE in ("honest", "punch") or MODE.startswith("files")
arena = kvdd.empty(N + 2 * G, np.uint8) if shared else np.zeros(N + 2 * G, np.uint8)
arena[:] = 0x77
arena[G:G + N] = np.arange(N) % 251
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

def memfd(size, seals=SEALS, flags=0):
    fd = os.memfd_create("lie", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd

fds, note = [], ""
if MODE == "disk":
    fds = [os.open(os.path.join(DISK, "disk-file"), os.O_RDWR | os.O_CREAT, 0o600)]
    os.ftruncate(fds[0], 1 << 20)
elif MODE == "pipe":
    fds = [os.pipe()[0]]
elif MODE == "devshm":
    path = f"/dev/shm/kvdd-test-{os.getpid()}"
    fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600)]
    os.unlink(path)
    os.ftruncate(fds[0], 1 << 20)
elif MODE == "unsealed":
    fds = [memfd(1 << 20, seals=0)]
elif MODE == "small":
    fds = [memfd(N // 2)]
elif MODE == "hugetlb":
    try:
        fds = [memfd(2 << 20, flags=os.MFD_HUGETLB)]
    except OSError as exc:
        note = f"no hugetlb memfd here: {exc}"
elif MODE.startswith("files"):  # the arena's memfd (tensor 0, the truth) and more files
    alloc, _off = shm.lookup(int(arena.ctypes.data), arena.nbytes)
    fds = [alloc.fd] + [memfd(1 << 20) for _ in range(int(MODE[5:]) - 1)]
if fds:
    rows = [[0, t, fd, G if t == 0 and shared else 0, os.fstat(fd).st_ino]
            for t, fd in enumerate(fds)]
    samehost_shm.records_of = lambda entries: np.array(rows, dtype="<u8")
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)), tensor_addrs([arena[G:G + N]]))
print(dd.listening_port, int(arena.ctypes.data), cid, note.replace(" ", "_") or "-", flush=True)
libc = ctypes.CDLL(None, use_errno=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "punch":  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE over the whole file
        alloc, _off = shm.lookup(int(arena.ctypes.data), arena.nbytes)
        r = libc.fallocate(alloc.fd, 3, ctypes.c_long(0), ctypes.c_long(alloc.size))
        print(r, flush=True)
    elif cmd == "truncate":
        alloc, _off = shm.lookup(int(arena.ctypes.data), arena.nbytes)
        try:
            os.ftruncate(alloc.fd, 0)
            print("truncated", flush=True)
        except OSError as exc:
            print(exc.errno, flush=True)
    else:
        break
dd.finalize()
"""


@dataclass
class Link:
    me: LlmDataDist
    local: np.ndarray  # our guarded arena
    local_id: int
    proc: subprocess.Popen[str]
    addr: int  # the owner's arena
    cid: int
    mem: int  # the owner's /proc/<pid>/mem (the test's own view)

    def owner_arena(self) -> np.ndarray:
        return np.frombuffer(os.pread(self.mem, N + 2 * G, self.addr), np.uint8)

    def maps(self) -> _xproc.PeerMaps | None:
        maps = self.me.backend.entities[OWNER].peer._path._reader.maps  # type: ignore[attr-defined]
        assert maps is None or isinstance(maps, _xproc.PeerMaps)
        return maps

    def command(self, cmd: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


def _pattern() -> np.ndarray:
    return (np.arange(N) % 251).astype(np.uint8)


@pytest.fixture
def link(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[Link]:
    mode = request.param
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, mode, str(N), str(G), str(tmp_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    port, addr, cid, note = proc.stdout.readline().split()
    mem = os.open(f"/proc/{proc.pid}/mem", os.O_RDWR)
    me = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    local = np.full(N + 2 * G, 0x77, np.uint8)
    try:
        if note != "-":
            pytest.skip(note.replace("_", " "))
        me.initialize({OPTION_DEVICE_ID: "2", OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        local_id = me.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)),
                                        tensor_addrs([local[G:G + N]]))
        me.link_llm_clusters([ClusterInfo(remote_cluster_id=OWNER,
                                          remote_ip_infos=(IpInfo("127.0.0.1", int(port)),))])
        if me.backend.link_data_path(OWNER) != "process_vm":  # type: ignore[attr-defined]
            pytest.skip("the link does not use the same-host path")
        yield Link(me, local, local_id, proc, int(addr), int(cid), mem)
    finally:
        me.finalize()
        try:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
        except BrokenPipeError:  # (killed by the test)
            pass
        proc.wait(30)
        os.close(mem)


def _honest_calls(ln: Link) -> None:
    """A pull and a push do what they do through /proc/<pid>/mem; no guard byte changes."""
    idx = CacheIndex(OWNER, ln.cid, 0)
    ln.me.pull_kv_cache(idx, Cache(ln.local_id), 0, -1, ONE)  # raises on any status but success
    np.testing.assert_array_equal(ln.local[G:G + N], _pattern())
    assert (ln.local[:G] == 0x77).all() and (ln.local[G + N:] == 0x77).all()
    ln.local[G:G + N] = 0x3C
    desc = CacheDesc(1, DataType.DT_UINT8, (1, N))
    ln.me.push_kv_cache(Cache(ln.local_id, (), desc), idx, 0, -1, ONE)
    theirs = ln.owner_arena()
    assert (theirs[G:G + N] == 0x3C).all()
    assert (theirs[:G] == 0x77).all() and (theirs[G + N:] == 0x77).all()


@pytest.mark.parametrize("link", ["disk", "pipe", "devshm", "unsealed", "hugetlb"],
                         indirect=True)
def test_a_file_that_is_not_a_sealed_tmpfs_memfd_is_not_mapped(link: Link) -> None:
    assert link.maps() is None
    _honest_calls(link)


@pytest.mark.parametrize("link", ["small"], indirect=True)
def test_a_memfd_smaller_than_the_tensor_is_not_used(link: Link) -> None:
    maps = link.maps()
    assert maps is not None and maps.placed(0) == 1
    before = maps.uses
    _honest_calls(link)
    assert maps.uses == before  # all through /proc/<pid>/mem


@pytest.fixture
def two_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(samehost_shm, "MAX_LINK_MAPS", 2)


@pytest.mark.parametrize("link", ["files2"], indirect=True)
def test_exactly_max_link_maps_files_are_mapped(two_maps: None, link: Link) -> None:
    maps = link.maps()
    assert maps is not None and len(maps) == 2
    before = maps.uses
    _honest_calls(link)
    assert maps.uses == before + 2


@pytest.mark.parametrize("link", ["files3"], indirect=True)
def test_one_file_past_max_link_maps_maps_none(two_maps: None, link: Link) -> None:
    assert link.maps() is None
    _honest_calls(link)


@pytest.mark.parametrize("link", ["honest"], indirect=True)
def test_the_honest_owner_is_mapped(link: Link) -> None:
    maps = link.maps()
    assert maps is not None and len(maps) == 1
    before = maps.uses
    _honest_calls(link)
    assert maps.uses == before + 2


@pytest.mark.parametrize("link", ["punch"], indirect=True)
def test_holes_punched_by_the_owner_read_as_zeros_and_it_cannot_shrink(link: Link) -> None:
    maps = link.maps()
    assert maps is not None
    assert link.command("punch") == "0"
    idx = CacheIndex(OWNER, link.cid, 0)
    link.me.pull_kv_cache(idx, Cache(link.local_id), 0, -1, ONE)
    assert (link.local[G:G + N] == 0).all()
    assert (link.local[:G] == 0x77).all() and (link.local[G + N:] == 0x77).all()
    assert link.command("truncate") == str(1)  # EPERM: F_SEAL_SHRINK
    _honest_calls_after_punch(link)


def _honest_calls_after_punch(ln: Link) -> None:
    ln.local[G:G + N] = 0x5A
    ln.me.push_kv_cache(Cache(ln.local_id, (), CacheDesc(1, DataType.DT_UINT8, (1, N))),
                        CacheIndex(OWNER, ln.cid, 0), 0, -1, ONE)
    theirs = ln.owner_arena()
    assert (theirs[G:G + N] == 0x5A).all()
    assert (theirs[:G] == 0).all() and (theirs[G + N:] == 0).all()  # punched, not written


@pytest.mark.parametrize("link", ["honest"], indirect=True)
def test_a_dead_owner_times_out_as_through_proc_mem(link: Link) -> None:
    """The mapping outlives the owner; its pidfd does not: LLM_TIMEOUT, as /proc/<pid>/mem says
    for an address space that is gone, and nothing copied."""
    maps = link.maps()
    assert maps is not None
    link.proc.kill()
    link.proc.wait(10)
    link.local[G:G + N] = 0x21
    idx = CacheIndex(OWNER, link.cid, 0)
    for fast in (True, False):
        prev = _fastpath.set_enabled(fast)
        try:
            with pytest.raises(LLMTimeoutError):
                link.me.pull_kv_cache(idx, Cache(link.local_id), 0, -1, ONE)
        finally:
            _fastpath.set_enabled(prev)
    assert (link.local[G:G + N] == 0x21).all()
