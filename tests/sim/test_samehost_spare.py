"""The acceptor's lease table for its next same-host link, made ahead (``samehost_spare``): taken
only by a link that serves exactly the caches it was made for, closed when stale, dropped when
the instance's listener closes, never made for an instance that is not initialized."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole
from kvdd.sim.engine import SimBackend
from kvdd.sim.fabric import samehost_spare as spare

pytest.importorskip("kvdd._native._xproc")

_DESC = CacheDesc(1, DataType.DT_UINT8, (1, 4096))
Acceptor = tuple[LlmDataDist, SimBackend, np.ndarray]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def acceptor() -> Iterator[Acceptor]:
    mem = np.zeros(4 * 4096, np.uint8)
    dd = LlmDataDist(7, LlmRole.PROMPT, backend="sim")
    dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "llm.DeviceId": "0"})
    for i in range(2):
        dd.register_kv_cache(_DESC, [int(mem.ctypes.data) + i * 4096])
    backend = dd.backend
    assert isinstance(backend, SimBackend)
    yield dd, backend, mem
    dd.finalize()
    spare.drop(id(backend))


def test_a_table_made_ahead_is_taken_by_a_link_serving_exactly_its_caches(acceptor: Acceptor) -> None:
    _dd, owner, _mem = acceptor
    before = _fds()
    spare.make(owner, owner.snapshot_for_link()[1])
    spare.make(owner, owner.snapshot_for_link()[1])  # one at most
    assert spare.held() == 1 and _fds() == before + 1  # its memfd (no shareable memory: no records)
    _views, entries = owner.snapshot_for_link()
    table = spare.take(owner, entries)
    assert table is not None and [e.cache_id for e in table.entries] == list(entries)
    assert spare.held() == 0 and spare.take(owner, entries) is None  # taken once
    table.close()
    assert _fds() == before


def test_a_stale_table_is_closed_and_not_taken(acceptor: Acceptor) -> None:
    dd, owner, mem = acceptor
    before = _fds()
    spare.make(owner, owner.snapshot_for_link()[1])
    dd.register_kv_cache(_DESC, [int(mem.ctypes.data) + 2 * 4096])  # one cache more since
    _views, entries = owner.snapshot_for_link()
    assert len(entries) == 3
    assert spare.take(owner, entries) is None
    assert spare.held() == 0 and _fds() == before  # closed
    spare.make(owner, owner.snapshot_for_link()[1])
    table = spare.take(owner, dict(reversed(list(entries.items()))))  # the same caches, reordered
    assert table is None and _fds() == before


def test_the_listener_closing_drops_it_and_nothing_is_made_for_a_finalized_instance(acceptor: Acceptor) -> None:
    dd, owner, _mem = acceptor
    before = _fds()
    spare.make(owner, owner.snapshot_for_link()[1])
    assert spare.held() == 1
    dd.finalize()  # closes the listener, which drops what was kept for the instance's next links
    assert spare.held() == 0
    spare.make(owner, owner.snapshot_for_link()[1])  # not initialized any more
    assert spare.held() == 0 and _fds() <= before


def test_finalize_drops_a_table_made_after_the_listener_stopped(acceptor: Acceptor) -> None:
    # a handshake worker makes the next link's table after its reply; the listener may have
    # stopped by then (SetRole without a listen port: the instance stays initialized), so the
    # listener's end cannot drop it: finalize must
    dd, owner, _mem = acceptor
    before = _fds()
    dd.set_role(LlmRole.DECODER, {})  # stops listening (drops what was kept)
    assert owner.listener is None and spare.held() == 0
    spare.make(owner, owner.snapshot_for_link()[1])  # (the worker of a link served before, finishing late)
    assert spare.held() == 1
    dd.finalize()
    assert spare.held() == 0 and _fds() <= before
