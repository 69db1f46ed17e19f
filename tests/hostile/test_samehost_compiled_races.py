"""Unregister, unlink and finalize racing *compiled* same-host copies (kvdd.sim._fastpath through
kvdd._native._xproc.SameHostMover), facade to facade: once the owner's call returned, no byte is
written into its cache and none read out of it.

The owner (this process) links to a reader process whose instance reads and writes the owner's
cache one-sided (through its /proc/<pid>/mem, or through a mapping when the cache lives in
kvdd.empty memory); the reader loops ``pull_kv_cache`` or ``push_kv_cache`` of 1 MiB; the owner
removes the cache (unregister), the link (unlink) or itself (finalize) while they run, then at
once fills the memory with a marker and watches it."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

import kvdd
from kvdd import CacheDesc, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

N = 1 << 20
MARK = 0xEE

# The reader (cluster 2, listening): one [1, N] cache; told the owner's cache id, it loops pulls
# or pushes until "stop", then reports "<ok> <failed> <pulls carrying the marker> <taken>".
_READER = r"""
import sys, threading, numpy as np, kvdd
from kvdd import Cache, CacheDesc, CacheIndex, DataType, LlmDataDist, LlmRole, tensor_addrs
n, write = int(sys.argv[1]), sys.argv[2] == "1"
dd = LlmDataDist(2, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "2",
               kvdd.OPTION_SYNC_CACHE_WAIT_TIME: "2000"})
buf = np.full(n, 0xAB, np.uint8)
desc = CacheDesc(1, DataType.DT_UINT8, (1, n))
mine = Cache(dd.register_kv_cache(desc, tensor_addrs([buf])), (), desc)
print(dd.listening_port, flush=True)
cid = int(sys.stdin.readline())
dd.backend.link_data_path(1)  # (waits for the owner's lease table if it is still on its way)
mover = dd.backend.entities[1].peer.one_sided()
mapped = int(mover is not None and mover.maps is not None)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
idx = CacheIndex(1, cid, 0)
one = kvdd.KvCacheExtParam(tensor_num_per_layer=1)
ok = failed = marked = 0
while not stop.is_set():
    try:
        if write:
            dd.push_kv_cache(mine, idx, 0, -1, one)
        else:
            buf[:] = 0
            dd.pull_kv_cache(idx, mine)
        ok += 1
    except kvdd.LLMError as exc:
        if not failed:
            print(repr(exc), file=sys.stderr, flush=True)
        failed += 1
    if not write and (buf == 0xEE).any():
        marked += 1
print(ok, failed, marked, dd.backend.fast_transfers.taken, dd.backend.link_data_path(1), mapped,
      flush=True)
"""


@pytest.mark.parametrize("alloc", ["numpy", "shm"])
@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
@pytest.mark.parametrize("removal", ["unregister", "unlink", "finalize", "force_unlink"])
def test_nothing_moves_after_removal_returns(removal: str, write: bool, alloc: str) -> None:
    """``alloc``: the owner's cache in numpy memory (copies through its /proc/<pid>/mem) or in
    kvdd.empty memory (mapped by the reader).  ``force_unlink``: a force unlink (local: the
    reader is not told, its copies find the link's table closed), then the cache's unregister."""
    p = subprocess.Popen([sys.executable, "-c", _READER, str(N), "1" if write else "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    owner = LlmDataDist(1, LlmRole.DECODER, backend="sim")
    finalized = False
    try:
        assert p.stdout is not None and p.stdin is not None
        port = int(p.stdout.readline())
        owner.initialize({kvdd.OPTION_DEVICE_ID: "1", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        arena = kvdd.empty(N, np.uint8) if alloc == "shm" else np.empty(N, np.uint8)
        arena[:] = 0x11
        cid = owner.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)),
                                      tensor_addrs([arena]))
        info = ClusterInfo(remote_cluster_id=2, remote_ip_infos=(IpInfo("127.0.0.1", port),))
        owner.link_llm_clusters([info], 10_000)
        p.stdin.write(f"{cid}\n")
        p.stdin.flush()
        deadline = time.monotonic() + 10
        if write:
            while not (arena == 0xAB).any():
                assert time.monotonic() < deadline, "the reader never pushed"
                time.sleep(0.001)
        else:
            time.sleep(0.3)
        t0 = time.monotonic()
        if removal == "unregister":
            owner.unregister_kv_cache(cid)
        elif removal == "unlink":
            owner.unlink_llm_clusters([info], 10_000)  # (a force unlink is local only: see docs)
        elif removal == "finalize":
            owner.finalize()
            finalized = True
        else:
            owner.unlink_llm_clusters([info], 10_000, force=True)
            owner.unregister_kv_cache(cid)
        took = time.monotonic() - t0
        arena[:] = MARK  # the owner reuses the memory at once
        time.sleep(0.3)  # the reader keeps trying meanwhile
        unchanged = bool((arena == MARK).all())
        p.stdin.write("stop\n")
        p.stdin.flush()
        ok, failed, marked, taken, path, mapped = p.stdout.readline().split()
        assert mapped == str(int(alloc == "shm"))
        p.wait(30)
        assert path in ("process_vm", "tcp", "None")  # (tcp: its one-sided access revoked)
        assert unchanged  # no byte written after the removal returned
        assert int(marked) == 0  # no byte read after it
        assert int(ok) > 0 and int(failed) > 0  # copies before, refusals after
        assert int(taken) > 0  # by the compiled path
        assert took < 2.1
    finally:
        p.kill()
        p.wait()
        if not finalized:
            owner.finalize()
