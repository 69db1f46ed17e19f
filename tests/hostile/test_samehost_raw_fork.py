"""A child made without the fork handlers must not copy through its parent's mappings.

The reader maps the owner's ``kvdd.empty`` memory ``MADV_DONTFORK``: a child of the reader holds
none of it, and the range may hold the child's own memory.  ``PeerMaps`` must therefore know,
at every copy, whether it runs in the process that mapped.  A child made by ``fork()`` runs the
``pthread_atfork`` handlers; one made by glibc's ``_Fork()`` (POSIX 2024, async-signal-safe) or a
raw ``clone`` runs none.  The child here pulls through the inherited link: the bytes must arrive
through the inherited ``/proc/<pid>/mem`` (no mapped copy), never through the absent mapping
(before: SIGSEGV in the ``_Fork`` child; into its own memory had it been reused).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import kvdd
from kvdd import (Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam,
                  LlmDataDist, LlmRole, tensor_addrs)
from kvdd._native import _xproc
from kvdd.sim.fabric import samehost

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

N = 1 << 20
ONE = KvCacheExtParam(tensor_num_per_layer=1)

_OWNER = r"""
import sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
N = int(sys.argv[1])
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
a = kvdd.empty(N, np.uint8)
a[:] = np.arange(N) % 251
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)), tensor_addrs([a]))
print(dd.listening_port, cid, flush=True)
sys.stdin.readline()
dd.finalize()
"""


@pytest.mark.parametrize("call", ["fork", "_Fork"])
def test_a_child_pulls_through_proc_mem_not_the_parents_mappings(call: str) -> None:
    libc = ctypes.PyDLL(None, use_errno=True)  # (the GIL stays held across the call)
    if not hasattr(libc, call):
        pytest.skip(f"no {call}() in this C library")
    make_child = getattr(libc, call)
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(N)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    port, cid = (int(v) for v in proc.stdout.readline().split())
    me = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    try:
        me.initialize({kvdd.OPTION_DEVICE_ID: "2", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0",
                       kvdd.OPTION_SYNC_CACHE_WAIT_TIME: "2000"})
        me.link_llm_clusters([ClusterInfo(remote_cluster_id=1,
                                          remote_ip_infos=(IpInfo("127.0.0.1", port),))])
        reader = me.backend.entities[1].peer._path._reader  # type: ignore[attr-defined]
        if reader is None or reader.maps is None:
            pytest.skip("the owner's memory is not mapped here")
        maps: _xproc.PeerMaps = reader.maps
        buf = np.zeros(N, np.uint8)
        lid = me.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)), tensor_addrs([buf]))
        pattern = (np.arange(N) % 251).astype(np.uint8)
        me.pull_kv_cache(CacheIndex(1, cid, 0), Cache(lid), 0, -1, ONE)  # mapped, here
        assert maps.uses >= 1 and (buf == pattern).all()
        r, w = os.pipe()
        pid = make_child()
        if pid == 0:  # the child: one pull, its outcome on the pipe, then _exit
            code = 1
            signal.alarm(10)  # (a lock held by another thread at the fork: killed, not hung)
            try:
                buf[:] = 0
                uses = maps.uses
                me.pull_kv_cache(CacheIndex(1, cid, 0), Cache(lid), 0, -1, ONE)
                os.write(w, b"%d %d" % (int((buf == pattern).all()), maps.uses - uses))
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        _pid, status = os.waitpid(pid, 0)
        got = os.read(r, 64).decode()
        os.close(r)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, got)
        assert got == "1 0"  # every byte pulled; no copy through the (absent) mapping
        buf[:] = 0
        me.pull_kv_cache(CacheIndex(1, cid, 0), Cache(lid), 0, -1, ONE)  # the parent: mapped
        assert (buf == pattern).all()
    finally:
        me.finalize()
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # (a child that died mid-copy left a lease counted)
            proc.kill()
            proc.wait(10)
            raise
