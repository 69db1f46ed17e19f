"""The default transfer time limit: llm.SyncKvCacheWaitTime unset means 1000 ms (SEMANTICS.md §3.2
step 9, data_cache_engine.cc), measured against a peer that stopped answering."""

from __future__ import annotations

import signal
import time

from kvdd import Status

from conformance.harness import TIMEOUT, World, link, raises
from fabric_world import own_proc, own_world, setup_pair, xproc  # noqa: F401  (fixtures)
from peer_proc import PeerProcess


def test_unset_wait_time_times_out_after_one_second(own_world: World, own_proc: PeerProcess) -> None:
    d, p, dh, ph = setup_pair(own_world)  # no llm.SyncKvCacheWaitTime on either side
    assert link(d, p) == [Status.LLM_SUCCESS]
    own_proc.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with raises(TIMEOUT):
            d.dd.pull_kv_cache(ph.index(), dh.cache())
        elapsed = time.monotonic() - t0
    finally:
        own_proc.signal(signal.SIGCONT)
    assert 0.95 <= elapsed < 1.9, elapsed  # 1000 ms, not 500, not 2000
