"""The end of the same-host proof, each side facing a peer that holds the key and misbehaves there
(kvdd.sim.fabric.samehost.finish_proof, samehost_link.extension_accept, SameHostPath.abandon,
SameHostPath.acquire).

The acceptor's lease table goes to the initiator attached already, with the acceptor's proof; the
initiator's table, sent once it checked that proof, is the last message, and the initiator's link
call returns as soon as it is sent.  So:

* an acceptor that shuts the proof's connection right after its table left makes the handover of
  ours fail before our reads open: the link goes on over TCP at once;
* a proof that fails after the tables were exchanged and our reads opened (the acceptor counted in
  flight on every slot of our table) leaves the path at once: the link goes on over TCP, and our
  mappings of the acceptor's kvdd.empty memory are dropped on the unmapper thread right away, not
  when the collector frees the reader;
* an acceptor that never reads our table does not hold our link call, nor our reads of it;
* an initiator that withholds its table holds none of the acceptor's transfers past their timeout:
  they wait for that table at most half of their timeout and at most SETUP_TIMEOUT_S after our
  table left, then go over TCP with the exact bytes, within the timeout they started with.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import kvdd
from kvdd import (Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LlmDataDist,
                  LlmRole, tensor_addrs)
from kvdd._native import _xproc
from kvdd.sim.fabric import samehost, samehost_close, samehost_path

from hostile.hog import HOG_READER

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

N = 64 << 20  # the acceptor's cache (kvdd.empty, every page touched)

# The acceptor.  "closed": shuts the proof's connection as soon as its table left, and lets its
# link reply go only then (so our table's handover fails whatever the threads' timing);
# "quiet": never reads our table (its endpoint's last step sleeps); "hog": its reader enters every
# slot of our table (the test makes our side's proof fail after its reads opened).
_OWNER = HOG_READER + r"""
import os, socket, sys, threading, time, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost_endpoint, samehost_link
N, MODE = int(sys.argv[1]), sys.argv[2]
if MODE == "hog":
    samehost_link.OneSidedPeer = HogReader
elif MODE == "closed":
    gone = threading.Event()
    real = samehost_endpoint.send_message
    def send(sock, kind, body=b"", fd=-1):
        real(sock, kind, body, fd)
        if kind == samehost_endpoint.M_REPLY:
            sock.shutdown(socket.SHUT_RDWR)
            gone.set()
    samehost_endpoint.send_message = send
    prepare = samehost_link.SameHostPath.prepare
    def held_prepare(self, entries):
        prepare(self, entries)
        gone.wait(5)  # (the reply leaves after the shutdown)
    samehost_link.SameHostPath.prepare = held_prepare
else:
    samehost_endpoint.Endpoint._final = lambda self, proof: time.sleep(30)
arena = kvdd.empty(N, np.uint8)
arena[:] = np.arange(N, dtype=np.uint64).astype(np.uint8)
dd = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "1"})
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)), tensor_addrs([arena]))
print(dd.listening_port, cid, flush=True)
sys.stdin.readline()
os._exit(0)
"""


@pytest.fixture(params=["closed", "quiet", "hog"])
def acceptor(request: pytest.FixtureRequest
             ) -> Iterator[tuple[int, int, str, subprocess.Popen[str]]]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(N), request.param],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        port, cid = map(int, proc.stdout.readline().split())
        yield port, cid, request.param, proc
    finally:
        proc.kill()
        proc.wait(30)


def test_the_end_of_the_proof_never_holds_the_link_nor_keeps_maps_of_a_failed_one(
        acceptor: tuple[int, int, str, subprocess.Popen[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    port, cid, mode, proc = acceptor
    me = LlmDataDist(2, LlmRole.DECODER, backend="sim")
    me.initialize({kvdd.OPTION_DEVICE_ID: "2", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    desc = CacheDesc(1, DataType.DT_UINT8, (1, 4096))
    mine = np.full(4096, 0x5A, np.uint8)
    cache = Cache(me.register_kv_cache(desc, tensor_addrs([mine])), (), desc)
    before = _xproc.peer_map_totals()
    collecting = gc.isenabled()
    gc.disable()  # (the collector would free an abandoned reader at a time of its own)
    opened: list[object] = []
    if mode == "hog":  # our side: the proof fails at its last check, after our reads opened
        real_init = samehost_path.OneSidedPeer.__init__

        def init(self: samehost_path.OneSidedPeer, link: samehost.SameHostLink) -> None:
            real_init(self, link)
            opened.append(self.mover.maps)

        monkeypatch.setattr(samehost_path.OneSidedPeer, "__init__", init)
        monkeypatch.setattr(samehost.SameHostLink, "alive", lambda self: False)
    try:
        t0 = time.monotonic()
        me.link_llm_clusters([ClusterInfo(remote_cluster_id=1,
                                          remote_ip_infos=(IpInfo("127.0.0.1", port),))], 1000)
        took = time.monotonic() - t0
        monkeypatch.undo()
        path = me.backend.link_data_path(1)  # type: ignore[attr-defined]
        assert took < 0.5, f"{mode}: the link call took {took:.2f} s"
        if mode == "quiet":
            assert path == "process_vm"
        else:
            assert path == "tcp"
            assert samehost_close.unmaps_idle(10)
            assert _xproc.peer_map_totals() == before  # nothing of the acceptor's stays mapped
        if mode == "hog":  # (the acceptor's memory was mapped, and is no more)
            assert len(opened) == 1 and opened[0] is not None
        me.pull_kv_cache(CacheIndex(1, cid, 0), cache, size=4096)
        assert (mine == np.arange(4096, dtype=np.uint64).astype(np.uint8)).all()
    finally:
        if collecting:
            gc.enable()
        proc.kill()  # (first: our finalize would wait for a living hog's counts, bounded)
        proc.wait(30)
        me.finalize()


# The initiator: withholds its own table (proves the key, takes ours, never sends its table, and
# keeps the proof's connection open), and its reader counts itself in flight on every slot of our
# table; links to the acceptor given on its command line, then waits.
_WITHHOLDER = HOG_READER + r"""
import os, socket, sys, numpy as np, kvdd
from kvdd import CacheDesc, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost, samehost_link
samehost_link.OneSidedPeer = HogReader
real = samehost.send_message
def send(sock, kind, body=b"", fd=-1):
    if kind != samehost.M_FINAL:
        real(sock, kind, body, fd)
samehost.send_message = send
kept = []
socket.socket.shutdown = lambda self, how: None
samehost_link.close_socket = kept.append
arena = np.arange(4096, dtype=np.uint64).astype(np.uint8) ^ 0x3C
dd = LlmDataDist(2, LlmRole.DECODER, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "2"})
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, 4096)), tensor_addrs([arena]))
dd.link_llm_clusters([ClusterInfo(remote_cluster_id=1,
                                  remote_ip_infos=(IpInfo("127.0.0.1", int(sys.argv[1])),))], 5000)
print(cid, dd.backend.link_data_path(1), flush=True)
sys.stdin.readline()
os._exit(0)
"""


@pytest.mark.parametrize("wait_ms, stopped, waited", [
    (1000, False, (0.45, 0.7)),  # half of the timeout
    (10_000, False, (1.0, 2.1)),  # until SETUP_TIMEOUT_S (2 s) after our table left
    (1000, True, None),  # the withholder stopped: LLM_TIMEOUT, by the timeout
], ids=["half-timeout", "setup-timeout", "stopped"])
def test_an_initiator_withholding_its_table_holds_no_transfer_past_its_timeout(
        wait_ms: int, stopped: bool, waited: tuple[float, float] | None) -> None:
    """... and our table was attached to it before it went: an unregister waits for its count."""
    me = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
    me.initialize({kvdd.OPTION_DEVICE_ID: "1", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0",
                   kvdd.OPTION_SYNC_CACHE_WAIT_TIME: str(wait_ms)})
    desc = CacheDesc(1, DataType.DT_UINT8, (1, 4096))
    mine = np.zeros(4096, np.uint8)
    cache = Cache(me.register_kv_cache(desc, tensor_addrs([mine])), (), desc)
    proc = subprocess.Popen([sys.executable, "-c", _WITHHOLDER, str(me.listening_port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        cid, its_path = proc.stdout.readline().split()
        assert its_path == "process_vm"  # its reads of us: our table went to it, attached
        if stopped:
            proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        if waited is None:
            with pytest.raises(kvdd.LLMError) as info:
                me.pull_kv_cache(CacheIndex(2, int(cid), 0), cache, size=4096)
            took = time.monotonic() - t0
            assert info.value.status == kvdd.Status.LLM_TIMEOUT
            assert took < wait_ms / 1000 + 0.1, f"the pull took {took:.3f} s"
            assert (mine == 0).all()
        else:
            me.pull_kv_cache(CacheIndex(2, int(cid), 0), cache, size=4096)
            took = time.monotonic() - t0
            assert waited[0] < took < waited[1], f"the pull took {took:.3f} s"
            assert (mine == (np.arange(4096, dtype=np.uint64).astype(np.uint8) ^ 0x3C)).all()
        assert me.backend.link_data_path(2) == "tcp"  # type: ignore[attr-defined]
        unregister = threading.Thread(target=me.unregister_kv_cache, args=(cache.cache_id,))
        unregister.start()
        unregister.join(0.5)
        assert unregister.is_alive()  # (a table not attached yet would not be waited for)
        proc.kill()
        unregister.join(5)  # the reader exited: nothing counts any more
        assert not unregister.is_alive()
    finally:
        proc.kill()
        proc.wait(30)
        me.finalize()
