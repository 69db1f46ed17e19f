"""``aclrtMalloc`` of the simulated CANN root returns shareable memory: in a process that loaded
``libascendcl.so`` globally (as a C++ program linked with ``-lascendcl`` does), :func:`kvdd.shm.lookup`
finds the block's sealed memfd, and a same-host peer copies a cache in that memory through a mapping
(docs/security.md, "Mapped copies").  Each check runs in a fresh process: loading the library
globally is for the whole process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo
from kvdd.sim.fabric import samehost

_ACL = """
import ctypes, fcntl, os, sys
acl = ctypes.CDLL(sys.argv[1] + "/lib64/libascendcl.so", mode=ctypes.RTLD_GLOBAL)
acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
acl.aclrtFree.argtypes = [ctypes.c_void_p]
assert acl.aclrtSetDevice(0) == 0
def malloc(n):
    p = ctypes.c_void_p()
    assert acl.aclrtMalloc(ctypes.byref(p), n, 0) == 0
    return p.value
"""


def _python(root: Path, body: str, stdin: int | None = None) -> subprocess.Popen[str]:
    """A Python process that loaded the root's libascendcl.so globally, running ``body``."""
    script = _ACL + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script, str(root)], text=True, stdin=stdin,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_lookup_finds_the_blocks_memfd(root: Path) -> None:
    proc = _python(root, """
        from kvdd import shm
        page = os.sysconf("SC_PAGESIZE")
        a = malloc(10000)
        size = -(-10000 // page) * page
        alloc, off = shm.lookup(a, 10000)
        assert (alloc.addr, alloc.size, off) == (a, size, 0), (alloc, off)
        assert shm.lookup(a + 100, size - 100)[1] == 100
        assert shm.lookup(a + 100, size - 99) is None      # one byte past the block
        assert shm.lookup(a + size, 1) is None
        assert shm.lookup(a - 1, 1) is None
        seals = fcntl.fcntl(alloc.fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & want == want, seals
        assert os.fstat(alloc.fd).st_ino == alloc.ino
        ctypes.memset(a, 7, 10000)
        assert os.pread(alloc.fd, 4, 9996) == b"\\x07" * 4  # the file is the block's memory
        assert acl.aclrtFree(a) == 0
        assert shm.lookup(a, 1) is None
        print("ok")
    """)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == "ok\n"


_OWNER = """
import numpy as np, kvdd
from kvdd import CacheDesc, DataType
n = 8 * 1024
arrays = []
for k in range(4):
    a = malloc(n)
    ctypes.memset(a, 16 + k, n)
    arrays.append(np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a)))
dd = kvdd.LlmDataDist(cluster_id=1, role=kvdd.LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
cid = dd.register_kv_cache(CacheDesc(4, DataType.DT_UINT8, (8, 1024)), kvdd.tensor_addrs(arrays))
print(dd.listening_port, cid, flush=True)
sys.stdin.readline()
dd.finalize()
"""


@pytest.mark.skipif(not samehost.availability()[0], reason=samehost.availability()[1])
def test_a_peer_maps_acl_memory(root: Path) -> None:
    proc = _python(root, _OWNER, stdin=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.stderr else ""
    port, remote = (int(x) for x in line.split())
    dst = [kvdd.empty((8, 1024), np.uint8) for _ in range(4)]
    try:
        with kvdd.LlmDataDist(cluster_id=2, role=kvdd.LlmRole.DECODER, backend="sim") as dd:
            dd.initialize({kvdd.OPTION_DEVICE_ID: "1"})
            local = dd.register_kv_cache(CacheDesc(4, DataType.DT_UINT8, (8, 1024)),
                                         kvdd.tensor_addrs(dst))
            link = ClusterInfo(remote_cluster_id=1, local_ip_infos=[IpInfo("127.0.0.1")],
                               remote_ip_infos=[IpInfo("127.0.0.1", port)])
            dd.link_llm_clusters([link])
            if dd.backend.link_data_path(1) != "process_vm":  # type: ignore[attr-defined]
                pytest.skip("the link does not use the same-host path")
            maps = dd.backend.entities[1].peer._path._reader.maps  # type: ignore[attr-defined]
            assert maps is not None
            before = maps.uses
            dd.pull_kv_blocks(CacheIndex(1, remote), Cache(local), [5, 2], [0, 1])
            assert maps.uses == before + 1  # through the mapping of the aclrtMalloc memfds
            for k in range(4):
                assert (dst[k][:2] == 16 + k).all() and (dst[k][2:] == 0).all()
            dd.unlink_llm_clusters([link])
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(30)
