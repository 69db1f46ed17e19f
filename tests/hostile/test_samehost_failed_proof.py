"""An acceptor that proves the session key, takes our lease table and then withholds the proof's
last message (kvdd.sim.fabric.samehost_link.extension_accept, SameHostPath.abandon).

By then our side has attached its table to the acceptor (a proven reader) and mapped the
acceptor's kvdd.empty memory for its own reads.  The link must go on over TCP at once: the
acceptor counting itself in flight on every slot of our table does not hold the link call (an
unregister waits for such a count, bounded, as on a link that works), and our mappings of its
memory are dropped on the unmapper thread right away, not when the collector frees the reader
(whose last unmap, after the owner exited, frees the owner's memory on whatever thread collects).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import (CacheDesc, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole,
                  tensor_addrs)
from kvdd._native import _xproc
from kvdd.sim.fabric import samehost, samehost_close

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

N = 64 << 20  # the acceptor's cache (kvdd.empty, every page touched)

# The acceptor: never sends M_ACK; "hog": its reader enters every slot of our table first.
_OWNER = r"""
import os, sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost_endpoint, samehost_link, samehost_path
N, HOG = int(sys.argv[1]), sys.argv[2] == "hog"
real = samehost_endpoint.send_message
def send(sock, kind, body=b"", fd=-1):
    if kind == samehost_endpoint.M_ACK:
        raise OSError("this acceptor never acknowledges")
    return real(sock, kind, body, fd)
samehost_endpoint.send_message = send
class Reader(samehost_path.OneSidedPeer):
    def __init__(self, link):
        super().__init__(link)
        for slot in range(self.table.slots if HOG else 0):
            self.table.enter(slot)
samehost_link.OneSidedPeer = Reader
arena = kvdd.empty(N, np.uint8)
arena[::4096] = 1
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)), tensor_addrs([arena]))
print(dd.listening_port, flush=True)
sys.stdin.readline()
os._exit(0)
"""


@pytest.fixture(params=["quiet", "hog"])
def acceptor(request: pytest.FixtureRequest) -> Iterator[tuple[int, str, subprocess.Popen[str]]]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(N), request.param],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        yield int(proc.stdout.readline()), request.param, proc
    finally:
        proc.kill()
        proc.wait(30)


def test_a_proof_failing_at_its_end_neither_holds_the_link_nor_keeps_its_maps(
        acceptor: tuple[int, str, subprocess.Popen[str]]) -> None:
    port, mode, proc = acceptor
    me = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    me.initialize({kvdd.OPTION_DEVICE_ID: "2", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    mine = np.full(4096, 0x5A, np.uint8)
    me.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, 4096)), tensor_addrs([mine]))
    before = _xproc.peer_map_totals()
    collecting = gc.isenabled()
    gc.disable()  # (the collector would free the abandoned reader at a time of its own)
    try:
        t0 = time.monotonic()
        me.link_llm_clusters([ClusterInfo(remote_cluster_id=1,
                                          remote_ip_infos=(IpInfo("127.0.0.1", port),))], 1000)
        took = time.monotonic() - t0
        assert me.backend.link_data_path(1) == "tcp"  # type: ignore[attr-defined]
        assert took < 1.1, f"{mode}: the link call took {took:.2f} s"
        assert samehost_close.unmaps_idle(10)
        assert _xproc.peer_map_totals() == before  # nothing of the acceptor's stays mapped
    finally:
        if collecting:
            gc.enable()
        proc.kill()  # (first: our finalize would wait for a living hog's counts, bounded)
        proc.wait(30)
        me.finalize()
    assert (mine == 0x5A).all()
