"""The acceptor's end of the same-host proof racing the rest of its process
(kvdd.sim.fabric.samehost_link: ``on_proven`` against ``on_link(None)``; our reads opened against
the link's close).

* The proof given up (the initiator closed its proof connection) while the thread that answers
  the proof attaches our lease table: the table used to be closed under the attach (its drain hooks
  then outlived it on the cache) and the path was left waiting for a reader that would not come
  (every transfer of ours on that link waited half its timeout, ``link_data_path`` 2 s).  Now the
  give-up waits for the attach and ends both: the path stops waiting at once, and the table,
  attached, is closed with the path.
* Our reads of the initiator open after its link call returned (its table is the last message):
  a finalize right then used to return while our reader of its memory was still being built, which
  then mapped the initiator's memory after the finalize.  Now the close waits for a reader being
  built, at most ``OPENING_WAIT_S`` (the kernel can hold a build: ``pidfd_getfd`` on a peer in
  ``execve``), and a reader finished later is closed unused."""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time

import pytest

import numpy as np

import kvdd
from kvdd import CacheDesc, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole, tensor_addrs
from kvdd.sim.fabric import samehost, samehost_link, samehost_path, samehost_tables

from shared_support import FakeServedCache

pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

# The initiator: connects to the endpoint and proves the session key; closes at a line on stdin.
_INITIATOR = r"""
import socket, sys
from kvdd.sim.fabric.samehost import M_HELLO, proof_of, send_message, session_id
class Session: pass
s = Session()
s.key, s.transcript, s.channel = bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3]), b""
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect(bytes.fromhex(sys.argv[1]))
send_message(c, M_HELLO, session_id(s) + proof_of(s, b"initiator"))
print("sent", flush=True)
sys.stdin.readline()
c.close()
print("closed", flush=True)
sys.stdin.readline()
"""


class _Session:
    def __init__(self) -> None:
        self.key = secrets.token_bytes(32)
        self.transcript = secrets.token_bytes(32)
        self.initiator = False
        self.channel = b""


class _Owner:
    transfer_backend = "comm"
    initialized = True
    sync_wait_ms = 1000

    def __init__(self, entries: dict[int, FakeServedCache]) -> None:
        self.entries = entries

    def snapshot_for_link(self) -> tuple[None, dict[int, FakeServedCache]]:
        return None, self.entries


def test_a_give_up_during_the_attach_neither_leaks_the_table_nor_leaves_transfers_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ep = samehost.endpoint()
    s = _Session()
    assert ep.expect(s)
    state = samehost_link._LinkState(None, samehost.offer(), 1000)
    assert samehost_link._put(False, s, state)
    entries = {1: FakeServedCache(cache_id=7)}
    assert samehost_link.extension_offer(s, _Owner(entries)) is not None  # type: ignore[arg-type]
    path = state.path
    real = samehost_tables.serve
    attached = threading.Event()
    go_on = threading.Event()

    def slow_serve(table: object, link: object, wait_ms: int) -> bool:
        ok = real(table, link, wait_ms)  # type: ignore[arg-type]
        attached.set()
        go_on.wait(5)  # (the attach made long: the give-up comes meanwhile)
        return ok

    monkeypatch.setattr(samehost_link, "serve", slow_serve)
    child = subprocess.Popen([sys.executable, "-c", _INITIATOR, ep.name.hex(), s.key.hex(),
                              s.transcript.hex()],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    answering = threading.Thread(target=path.prepare, args=(entries,))
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 5
        while ep.held()["proven"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        answering.start()  # the link decided: this thread answers the proof (on_proven)
        assert attached.wait(5)
        child.stdin.write("close\n")
        child.stdin.flush()  # the endpoint's worker: the proof ended -> on_link(None)
        assert child.stdout.readline().strip() == "closed"
        time.sleep(0.2)
        go_on.set()
        answering.join(5)
        t0 = time.monotonic()
        assert path.name == "tcp"
        assert time.monotonic() - t0 < 0.1  # no reader is awaited any more
        assert len(entries[1].drains) == 1  # our table, attached, is still served...
        path.close()
        assert entries[1].drains == []  # ...until the path closes it
    finally:
        go_on.set()
        if answering.ident is not None:
            answering.join(5)
        path.close()
        child.kill()
        child.wait(30)


# The initiator: a cache in kvdd.empty memory; links to the acceptor on its command line, says so,
# then waits.
_LINKER = r"""
import sys, numpy as np, kvdd
from kvdd import CacheDesc, ClusterInfo, DataType, IpInfo, LlmDataDist, LlmRole, tensor_addrs
arena = kvdd.empty(1 << 20, np.uint8)
arena[:] = 7
dd = LlmDataDist(2, LlmRole.DECODER, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "2"})
dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, 1 << 20)), tensor_addrs([arena]))
dd.link_llm_clusters([ClusterInfo(remote_cluster_id=1,
                                  remote_ip_infos=(IpInfo("127.0.0.1", int(sys.argv[1])),))], 5000)
print("linked", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("build_s", [0.03, 1.0], ids=["within-the-wait", "held-past-it"])
def test_a_finalize_during_a_readers_build_waits_for_it_within_its_bound(
        monkeypatch: pytest.MonkeyPatch, build_s: float) -> None:
    started: list[float] = []
    built: list[tuple[float, samehost_path.OneSidedPeer]] = []
    real_init = samehost_path.OneSidedPeer.__init__

    def slow_init(self: samehost_path.OneSidedPeer, link: samehost.SameHostLink) -> None:
        started.append(time.monotonic())
        time.sleep(build_s)  # (our reader of the initiator's memory, made slow to build)
        real_init(self, link)
        built.append((time.monotonic(), self))

    monkeypatch.setattr(samehost_path.OneSidedPeer, "__init__", slow_init)
    me = LlmDataDist(1, LlmRole.PROMPT, backend="sim")
    me.initialize({kvdd.OPTION_DEVICE_ID: "1", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
    mine = kvdd.empty(4096, np.uint8)
    me.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, 4096)), tensor_addrs([mine]))
    child = subprocess.Popen([sys.executable, "-c", _LINKER, str(me.listening_port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "linked"
        deadline = time.monotonic() + 5
        while not started:  # (its table came: our reader is being built)
            assert time.monotonic() < deadline
            time.sleep(0.001)
        t0 = time.monotonic()
        me.finalize()
        finalized = time.monotonic()
        time.sleep(build_s + 0.3)  # (a build still running ends meanwhile)
        assert len(built) == 1
        when, reader = built[0]
        if build_s < samehost_link.OPENING_WAIT_S:
            assert when <= finalized, "the finalize returned before the reader was built"
        else:
            assert finalized - t0 < samehost_link.OPENING_WAIT_S + 0.15  # its bound, not the build's
            assert when > finalized and not reader.usable  # finished later: closed unused
    finally:
        child.kill()
        child.wait(30)
        me.finalize()
