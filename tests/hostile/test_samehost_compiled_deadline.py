"""A compiled same-host copy that fails part-way keeps the call's deadline (kvdd.sim._fastpath with
kvdd._native._xproc.SameHostMover, kvdd.sim.fabric.samehost_path.OneSidedPeer).

The compiled path declines a copy that failed after it started, and the Python path answers the
call.  The Python path must not copy everything again with a fresh deadline: a hostile owner that
unmaps the last page of a registered cache would otherwise hold an honest pull or push for the
compiled copy's time *plus* the Python path's (1.4x its deadline here), past deadline + 100 ms.

The owner (another process, listening) serves one cache of NT tensors of M bytes; all tensors map
one M-byte memfd (so the test costs M of memory on each side, however many tensors move), and
after registration it unmaps the last page of the last tensor.  The honest reader (this process,
``SyncKvCacheWaitTime`` W) times M-byte tensors, then moves as many as fill 0.6 W, ending with the
broken one.  Its local tensors alias one M-byte buffer inside guard bytes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import (Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam,
                  LlmDataDist, LlmRole, Status, tensor_addrs)
from kvdd.sim import _fastpath
from kvdd.sim.engine import SimBackend
from kvdd.sim.fabric import samehost

def sim(dd: LlmDataDist) -> SimBackend:
    assert isinstance(dd.backend, SimBackend)
    return dd.backend


pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

M = 8 << 20
NT = 512
W = 1000  # ms
GUARD = 4096

# The hostile owner: NT tensors at a + i*M, each a MAP_SHARED view of one memfd filled with 0x5A;
# "cut" unmaps the last page of the last tensor, "sum" prints the memfd's distinct byte values.
_OWNER = r"""
import ctypes, os, sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
M, NT = int(sys.argv[1]), int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
fd = os.memfd_create("owner")
os.ftruncate(fd, M)
base = libc.mmap(None, M * NT, 0, 0x22 | 0x4000, -1, 0)  # reserved, PROT_NONE
os.pwrite(fd, bytes([0x5A]) * M, 0)
for i in range(NT):  # SHARED|FIXED|POPULATE: every tensor's page tables filled, all alike
    assert libc.mmap(base + i * M, M, 3, 0x01 | 0x10 | 0x8000, fd, 0) == base + i * M
arrs = [np.frombuffer((ctypes.c_uint8 * M).from_address(base + i * M), np.uint8)
        for i in range(NT)]
dd = LlmDataDist(2, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "2"})
cid = dd.register_kv_cache(CacheDesc(NT, DataType.DT_UINT8, (1, M)), tensor_addrs(arrs))
print(dd.listening_port, cid, flush=True)
for line in sys.stdin:
    if line.strip() == "cut":
        print(libc.munmap(base + M * NT - 4096, 4096), flush=True)
    elif line.strip() == "sum":
        print(sorted(set(np.unique(arrs[0]).tolist())), flush=True)
    else:
        break
"""


class Owner:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(M), str(NT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port, self.cid = map(int, self.proc.stdout.readline().split())

    def ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


@pytest.fixture
def owner() -> Iterator[Owner]:
    o = Owner()
    yield o
    o.proc.kill()
    o.proc.wait(10)


def _layers(first: int, last: int) -> KvCacheExtParam:
    return KvCacheExtParam(src_layer_range=(first, last), dst_layer_range=(first, last),
                           tensor_num_per_layer=1)


@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
def test_a_copy_failing_late_is_answered_within_its_deadline(owner: Owner, write: bool,
                                                            fast: bool) -> None:
    dd = LlmDataDist(1, LlmRole.DECODER, backend="sim")
    prev = _fastpath.set_enabled(fast)
    try:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "1", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0",
                       kvdd.OPTION_SYNC_CACHE_WAIT_TIME: str(W)})
        arena = np.full(M + 2 * GUARD, 0x33, np.uint8)
        loc = arena[GUARD:GUARD + M]
        desc = CacheDesc(NT, DataType.DT_UINT8, (1, M))
        mine = Cache(dd.register_kv_cache(desc, tensor_addrs([loc] * NT)), (), desc)
        info = ClusterInfo(remote_cluster_id=2, remote_ip_infos=(IpInfo("127.0.0.1", owner.port),))
        dd.link_llm_clusters([info], 10_000)
        assert sim(dd).link_data_path(2) == "process_vm"
        idx = CacheIndex(2, owner.cid, 0)

        def move(ext: KvCacheExtParam) -> tuple[Status, float]:
            t0 = time.monotonic()
            try:
                if write:
                    dd.push_kv_cache(mine, idx, 0, -1, ext)
                else:
                    dd.pull_kv_cache(idx, mine, 0, -1, ext)
                st = Status.LLM_SUCCESS
            except kvdd.LLMError as exc:
                st = Status(exc.status)
            return st, time.monotonic() - t0

        # the copy's speed here: 32 tensors, best of three
        per = min(move(_layers(0, 31))[1] for _ in range(3)) / 32
        k = int(0.6 * W / 1000 / per)
        if k > NT:
            pytest.skip(f"copies too fast here ({per * 1e3:.2f} ms per {M >> 20} MiB tensor)")
        assert (arena[:GUARD] == 0x33).all() and (arena[-GUARD:] == 0x33).all()
        taken = sim(dd).fast_transfers.taken
        assert owner.ask("cut") == "0"
        st, took = move(_layers(NT - k, NT - 1))  # ends in the cut page, after ~0.6 W of copying
        assert st in (Status.LLM_FAILED, Status.LLM_TIMEOUT), st
        assert took < (W + 100) / 1000, f"{k} tensors: {took * 1e3:.0f} ms (deadline {W} ms)"
        assert sim(dd).fast_transfers.taken == taken  # the failed call was not counted as taken
        assert (arena[:GUARD] == 0x33).all() and (arena[-GUARD:] == 0x33).all()
        if write:  # the owner's bytes are ours, nothing else
            assert owner.ask("sum") in ("[51]", "[51, 90]")
        else:
            assert set(np.unique(loc).tolist()) <= {0x5A}
        # the link still serves what is mapped (a failure that is not a timeout keeps the link)
        if st == Status.LLM_FAILED:
            assert move(_layers(0, 0))[0] == Status.LLM_SUCCESS
    finally:
        _fastpath.set_enabled(prev)
        dd.finalize()
