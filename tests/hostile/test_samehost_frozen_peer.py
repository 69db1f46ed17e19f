"""The frozen-page attack, facade to facade: a linked peer process freezes the pages of a
cache it registered (a userfaultfd it never answers).  An honest pull or push of that cache with
``llm.SyncKvCacheWaitTime`` 2000 ms returns within 2.1 s (before: 18.1 s, when the attacker chose),
an unlink and a pull of another cache issued meanwhile are not held, and nothing outside the
transfers' own bytes changes here."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvdd
from kvdd import (Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam,
                  LlmDataDist, LlmRole, tensor_addrs)
from kvdd.sim.fabric import samehost

pytestmark = pytest.mark.skipif(not samehost.availability()[0] or
                                os.uname().machine not in ("x86_64", "aarch64"),
                                reason=samehost.availability()[1] or "userfaultfd numbers unknown")

N = 64 << 10

# The attacker: two caches of N bytes in one mapping, the second never touched and registered
# with a userfaultfd (missing mode) that nobody answers.  Prints its port and cache ids.
_ATTACKER = r"""
import ctypes, os, sys, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole
N = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.syscall.restype = ctypes.c_long
base = libc.mmap(None, 2 * N, 3, 0x22, -1, 0)
ctypes.memset(base, 0x50, N)
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
desc = CacheDesc(1, DataType.DT_UINT8, (1, N))
good = dd.register_kv_cache(desc, [base])
frozen = dd.register_kv_cache(desc, [base + N])
uffd = libc.syscall({"x86_64": 323, "aarch64": 282}[os.uname().machine], os.O_CLOEXEC)
api = (ctypes.c_uint64 * 3)(0xAA, 0, 0)
reg = (ctypes.c_uint64 * 4)(base + N, N, 1, 0)
if uffd < 0 or libc.ioctl(uffd, 0xc018aa3f, api) or libc.ioctl(uffd, 0xc020aa00, reg):
    print("NOUFFD", ctypes.get_errno(), flush=True)
    sys.exit(0)
print(dd.listening_port, good, frozen, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("write", [False, True], ids=["pull", "push"])
def test_a_frozen_cache_does_not_hold_honest_calls(write: bool) -> None:
    p = subprocess.Popen([sys.executable, "-c", _ATTACKER, str(N)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    me = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    try:
        assert p.stdout is not None
        line = p.stdout.readline().split()
        if not line or line[0] == "NOUFFD":
            pytest.skip(f"userfaultfd refused ({line}): needs CAP_SYS_PTRACE or "
                        "vm.unprivileged_userfaultfd=1")
        port, good, frozen = (int(x) for x in line)
        me.initialize({kvdd.OPTION_DEVICE_ID: "2", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0",
                       kvdd.OPTION_SYNC_CACHE_WAIT_TIME: "2000"})
        arena = np.full(3 * N, 0x33, np.uint8)  # guard, the cache's N bytes, guard
        desc = CacheDesc(1, DataType.DT_UINT8, (1, N))
        mine = Cache(me.register_kv_cache(desc, tensor_addrs([arena[N:2 * N]])), (), desc)
        info = ClusterInfo(remote_cluster_id=1, remote_ip_infos=(IpInfo("127.0.0.1", port),))
        me.link_llm_clusters([info], 10_000)
        assert me.backend.link_data_path(1) == "process_vm"  # type: ignore[attr-defined]
        one = KvCacheExtParam(tensor_num_per_layer=1)
        box: list[tuple[str, float]] = []

        def attacked() -> None:
            t0 = time.monotonic()
            try:
                if write:
                    me.push_kv_cache(mine, CacheIndex(1, frozen, 0), 0, -1, one)
                else:
                    me.pull_kv_cache(CacheIndex(1, frozen, 0), mine, 0, -1, one)
                box.append(("ok", time.monotonic() - t0))
            except kvdd.LLMError as exc:
                box.append((type(exc).__name__, time.monotonic() - t0))

        def meanwhile() -> None:
            t0 = time.monotonic()
            me.pull_kv_cache(CacheIndex(1, good, 0), mine, 0, -1, one)
            box.append(("other", time.monotonic() - t0))

        threads = [threading.Thread(target=attacked, daemon=True),
                   threading.Thread(target=meanwhile, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        if len(box) < 2:
            p.kill()  # releases a held copy, so that the test ends
            pytest.fail(f"an honest call was held by the frozen page: {box}")
        results = dict(box)
        outcome = next(k for k in results if k != "other")
        assert outcome != "ok" and results[outcome] < 2.1
        assert results["other"] < 2.1
        assert (arena[N:2 * N] == 0x50).all()  # the good cache's bytes, by the second pull
        assert (arena[:N] == 0x33).all() and (arena[2 * N:] == 0x33).all()
        t0 = time.monotonic()
        me.unlink_llm_clusters([info], 10_000)
        assert time.monotonic() - t0 < 2.1
    finally:
        p.kill()  # first: a copy the attacker holds ends with it
        p.wait()
        me.finalize()
