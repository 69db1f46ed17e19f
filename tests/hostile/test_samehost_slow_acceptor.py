"""An acceptor that holds back its same-host proof (kvdd.sim.fabric.samehost.finish_proof), or
whose endpoint accepts nothing while its queue is full.

The initiator waits for the acceptor's proof and table after the link reply (the one message of
the acceptor's it waits for).  That wait used to be SETUP_TIMEOUT_S (2 s) of its own, whatever the
link call's timeout.  It now ends by the link call's deadline, and the link goes on over TCP
(the acceptor's link reply comes late too, so that this wait, not the connect's, bounds the call).  The
connect to the endpoint, made before the link reply is read, waits at most half of the time left,
so that the reply still has the other half.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import (Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist,
                  LlmRole, tensor_addrs)
from kvdd.sim.fabric import samehost

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

DELAY_S = 1.5
TIMEOUT_MS = 600
REPLY_LATE_S = 0.45  # the link reply too: the proof's wait starts with a quarter of the time left

# The acceptor: sends its link reply REPLY_LATE_S late, and its proof and table DELAY_S late (a
# thread of its own, after the link reply).
_OWNER = r"""
import os, sys, threading, time, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost_endpoint, samehost_link
DELAY, REPLY_LATE = float(sys.argv[1]), float(sys.argv[2])
prepare = samehost_link.SameHostPath.prepare
def late_prepare(self, entries):
    prepare(self, entries)
    time.sleep(REPLY_LATE)
samehost_link.SameHostPath.prepare = late_prepare
real = samehost_endpoint.send_message
def send(sock, kind, body=b"", fd=-1):
    if kind == samehost_endpoint.M_REPLY:
        late = os.dup(fd)
        def later():
            time.sleep(DELAY)
            try:
                real(sock, kind, body, late)
            finally:
                os.close(late)
        threading.Thread(target=later, daemon=True).start()
        return
    return real(sock, kind, body, fd)
samehost_endpoint.send_message = send
arena = kvdd.empty(4096, np.uint8)
arena[:] = np.arange(4096) % 251
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, 4096)), tensor_addrs([arena]))
print(dd.listening_port, cid, flush=True)
sys.stdin.readline()
os._exit(0)
"""


@pytest.fixture()
def acceptor() -> Iterator[tuple[int, int]]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(DELAY_S), str(REPLY_LATE_S)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        port, cid = map(int, proc.stdout.readline().split())
        yield port, cid
    finally:
        proc.kill()
        proc.wait(30)



def _pulls_the_owners_pattern(me: LlmDataDist, cid: int) -> None:
    """A pull of the owner's 4096-byte cache (cluster 1) brings its pattern, byte for byte."""
    buf = np.zeros(4096, np.uint8)
    desc = CacheDesc(1, DataType.DT_UINT8, (1, 4096))
    mine = Cache(me.register_kv_cache(desc, tensor_addrs([buf])), (), desc)
    me.pull_kv_cache(CacheIndex(1, cid, 0), mine)
    assert bytes(buf) == bytes((np.arange(4096) % 251).astype(np.uint8))

def test_a_late_proof_does_not_hold_the_link_past_its_timeout(
        acceptor: tuple[int, int]) -> None:
    port, cid = acceptor
    me = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    me.initialize({kvdd.OPTION_DEVICE_ID: "2", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    try:
        t0 = time.monotonic()
        got = me.link_llm_clusters([ClusterInfo(remote_cluster_id=1, remote_ip_infos=(
            IpInfo("127.0.0.1", port),))], TIMEOUT_MS)
        took = time.monotonic() - t0
        assert took < TIMEOUT_MS / 1000 + 0.1, f"the link call took {took:.2f} s"
        assert [int(s) for s in got] == [0]  # made, over TCP
        assert me.backend.link_data_path(1) == "tcp"  # type: ignore[attr-defined]
        _pulls_the_owners_pattern(me, cid)
    finally:
        me.finalize()


# An honest acceptor whose endpoint accepts nothing for now: the state a key holder induces by
# handing it files whose close hangs until the closer is at MAX_PENDING (test_samehost_closer.py).
_STALLED = r"""
import os, sys, time, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost_endpoint
samehost_endpoint.wait_room = lambda timeout_s: (time.sleep(timeout_s), False)[1]
arena = kvdd.empty(4096, np.uint8)
arena[:] = np.arange(4096) % 251
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, 4096)), tensor_addrs([arena]))
print(dd.listening_port, cid, samehost_endpoint.endpoint().name.hex(), flush=True)
sys.stdin.readline()
os._exit(0)
"""


def test_a_full_endpoint_queue_leaves_the_link_its_tcp_reply() -> None:
    """Its queue filled by connects of our uid (no secret needed), the endpoint's connect waited
    2 s, past a link timeout of 1 s: LLM_TIMEOUT after 2.0 s for a link TCP carries; now the
    connect gives up at half the time left (about 0.5 s here, not the whole second) and the link
    is made over TCP within its timeout."""
    proc = subprocess.Popen([sys.executable, "-c", _STALLED], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    queued: list[socket.socket] = []
    me = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    try:
        port_text, cid_text, name = proc.stdout.readline().split()
        port, cid = int(port_text), int(cid_text)
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            try:
                s.connect(bytes.fromhex(name))
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        assert queued  # the queue is full now
        me.initialize({kvdd.OPTION_DEVICE_ID: "2", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        t0 = time.monotonic()
        got = me.link_llm_clusters([ClusterInfo(remote_cluster_id=1, remote_ip_infos=(
            IpInfo("127.0.0.1", port),))], 1000)
        took = time.monotonic() - t0
        assert [int(x) for x in got] == [0] and 0.45 <= took < 0.8, f"{got} after {took:.2f} s"
        assert me.backend.link_data_path(1) == "tcp"  # type: ignore[attr-defined]
        _pulls_the_owners_pattern(me, cid)
    finally:
        for s in queued:
            s.close()
        proc.kill()
        proc.wait(30)
        me.finalize()
