"""A same-host owner that hands the reader many large memfds while the unmapper thread is busy.

A peer's memfd holding more than ``samehost_close.FREE_INLINE`` bytes is closed on the unmapper
thread (its last close frees its pages).  That thread is busy for as long as freeing an exited
owner's cache memory takes (about 0.2 s per GiB; here: held by a job the test queues).  The owner
announces ``FILES`` records naming as many fd numbers of one populated 65 MiB memfd (dups): each
is taken with ``pidfd_getfd`` by the reader.  Mapped ones (the true inode) need no close on
another thread at all (the mapping holds the file: closing the fd frees nothing); refused ones
(a wrong inode) are admitted against the same bound as the closer's (``MAX_PENDING``).  Either
way the reader holds at most about ``MAX_PENDING`` of the owner's fds, whatever the owner sends
and however long the unmapper is busy; the link works and no byte outside the registered
regions changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd import (OPTION_DEVICE_ID, OPTION_LISTEN_IP_INFO, Cache, CacheDesc, CacheIndex,
                  ClusterInfo, DataType, IpInfo, KvCacheExtParam, LlmDataDist, LlmRole,
                  tensor_addrs)
from kvdd.sim.fabric import samehost, samehost_close

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

N = 64 << 10  # bytes of the cache (one row, one tensor)
G = 4096  # guard bytes on each side
OWNER = 1
FILES = 256  # fd numbers of the large memfd the owner announces (four times MAX_PENDING)
ONE = KvCacheExtParam(tensor_num_per_layer=1)

# The owner: mode (mapped | refused), N, G, FILES.  Its cache is in ordinary memory (served
# through /proc/<pid>/mem); its records name FILES dups of one populated 65 MiB memfd as
# tensors 1.. of slot 0 (never copied: the cache has one tensor), with the file's inode
# ("mapped") or one past it ("refused").
_OWNER = r"""
import fcntl, os, sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost_shm
MODE, N, G, FILES = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
arena = np.full(N + 2 * G, 0x77, np.uint8)
arena[G:G + N] = np.arange(N) % 251
fd = os.memfd_create("large", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
os.posix_fallocate(fd, 0, 65 << 20)  # held: more than FREE_INLINE
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
ino = os.fstat(fd).st_ino + (1 if MODE == "refused" else 0)
rows = [[0, 1 + t, os.dup(fd), 0, ino] for t in range(FILES)]
samehost_shm.records_of = lambda entries: np.array(rows, dtype="<u8")
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)), tensor_addrs([arena[G:G + N]]))
print(dd.listening_port, int(arena.ctypes.data), cid, flush=True)
sys.stdin.readline()
dd.finalize()
"""


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def busy_unmapper() -> Iterator[threading.Event]:
    """The unmapper thread held (as by freeing an exited owner's memory) until the test ends."""
    gate = threading.Event()
    samehost_close.unmap_later(lambda: None if gate.wait(30) else None)
    try:
        yield gate
    finally:
        gate.set()
        assert samehost_close.unmaps_idle(10)


@pytest.mark.parametrize("mode", ["mapped", "refused"])
def test_large_memfds_from_an_owner_are_bounded_while_the_unmapper_is_busy(
        mode: str, busy_unmapper: threading.Event) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, mode, str(N), str(G), str(FILES)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    port, addr, cid = (int(v) for v in proc.stdout.readline().split())
    me = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    local = np.full(N + 2 * G, 0x77, np.uint8)
    try:
        me.initialize({OPTION_DEVICE_ID: "2", OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        local_id = me.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)),
                                        tensor_addrs([local[G:G + N]]))
        before = _fds()
        me.link_llm_clusters([ClusterInfo(remote_cluster_id=OWNER,
                                          remote_ip_infos=(IpInfo("127.0.0.1", port),))])
        if me.backend.link_data_path(OWNER) != "process_vm":  # type: ignore[attr-defined]
            pytest.skip("the link does not use the same-host path")
        held = _fds() - before
        # the link's own fds (socket, pidfd, /proc/<pid>/mem, ...) and at most MAX_PENDING of
        # the owner's files waiting for the busy unmapper; before: one per announced fd (256)
        assert held <= samehost_close.MAX_PENDING + 16, held
        # (plus what a set-up queues after its admission: the proof's sockets, the table)
        assert samehost_close.pending() <= samehost_close.MAX_PENDING + 4
        maps = me.backend.entities[OWNER].peer._path._reader.maps  # type: ignore[attr-defined]
        if mode == "mapped":  # every file mapped, the busy unmapper notwithstanding
            assert maps is not None and len(maps) == FILES
        else:
            assert maps is None
        me.pull_kv_cache(CacheIndex(OWNER, cid, 0), Cache(local_id), 0, -1, ONE)
        np.testing.assert_array_equal(local[G:G + N], (np.arange(N) % 251).astype(np.uint8))
        assert (local[:G] == 0x77).all() and (local[G + N:] == 0x77).all()
        mem = os.open(f"/proc/{proc.pid}/mem", os.O_RDONLY)
        try:
            theirs = np.frombuffer(os.pread(mem, N + 2 * G, addr), np.uint8)
        finally:
            os.close(mem)
        assert (theirs[:G] == 0x77).all() and (theirs[G + N:] == 0x77).all()
    finally:
        me.finalize()
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(30)
