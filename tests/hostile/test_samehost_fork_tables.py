"""A forked child never revokes its parent's lease tables: the table made ahead for the parent's
next link and the tables the parent serves are mappings of memfds the child shares (MAP_SHARED),
so closing or evicting them in the child would close them in the parent (its peers' reads of it
silently over TCP).  The child forgets them."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole
from kvdd.sim.engine import SimBackend
from kvdd.sim.fabric import samehost_spare as spare
from kvdd.sim.fabric import samehost_tables as tables
from kvdd.sim.fabric.samehost_path import ServedTable

pytest.importorskip("kvdd._native._xproc")

_DESC = CacheDesc(1, DataType.DT_UINT8, (1, 4096))


@pytest.fixture
def owner() -> Iterator[SimBackend]:
    mem = np.zeros(2 * 4096, np.uint8)
    dd = LlmDataDist(7, LlmRole.PROMPT, backend="sim")
    dd.initialize({"llm.ListenIpInfo": "127.0.0.1:0", "llm.DeviceId": "0"})
    for i in range(2):
        dd.register_kv_cache(_DESC, [int(mem.ctypes.data) + i * 4096])
    backend = dd.backend
    assert isinstance(backend, SimBackend)
    yield backend
    dd.finalize()
    spare.drop(id(backend))


def _in_child(work: object) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work()  # type: ignore[operator]
        except BaseException:
            code = 1
        os._exit(code)
    _pid, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_child_leaves_the_parents_table_made_ahead_open(owner: SimBackend) -> None:
    spare.make(owner, owner.snapshot_for_link()[1])
    table = spare._ahead[id(owner)][1]
    assert table.table.header()[2] == 0

    def child() -> None:  # the instance's id reused there: its link finds the table stale
        assert spare.take(owner, {}) is None and spare.held() == 0
        spare.make(owner, owner.snapshot_for_link()[1])
        spare.drop(id(owner))

    assert _in_child(child) == 0
    assert table.table.header()[2] == 0  # still open in the parent
    _views, entries = owner.snapshot_for_link()
    got = spare.take(owner, entries)
    assert got is table
    got.close()


def test_a_child_never_evicts_the_parents_served_tables(owner: SimBackend,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _views, entries = owner.snapshot_for_link()
    table = ServedTable(entries)
    with tables._lock:
        tables._tables.append(table)
    try:
        def child() -> None:  # the child serves the same reader beyond the bound: an eviction
            monkeypatch.setattr(tables, "MAX_TABLES_PER_READER", 0)
            tables.sweep()
            assert tables.live_tables() == 0

        assert _in_child(child) == 0
        assert table.table.header()[2] == 0 and not table.revoked
    finally:
        with tables._lock:
            tables._tables.remove(table)
        table.close(wait=False)
