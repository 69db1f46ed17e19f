"""The acceptor's lease table made ahead of the peer's proof (``samehost_link._Tables``).

The acceptor makes its table from the link reply's snapshot once the reply is sent, so the
proof does not wait for it.  What that must not change: the table names exactly the caches the
reply announced (never one registered later), a cache unregistered between the reply and the
proof is revoked when the proven reader is attached (no one-sided copy ever starts on it), and
every table made is closed when the proof never comes (no fd kept)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.samehost_link import SameHostPath, _Tables
from kvdd.sim.fabric.samehost_path import STATE_UNREGISTERED
from shared_support import FakeServedCache as FakeEntry

_xproc = pytest.importorskip("kvdd._native._xproc")


@dataclass
class FakeOwner:
    """A LinkOwner whose snapshot is ``entries`` (what a proof-time snapshot would see)."""

    entries: dict[int, FakeEntry]
    initialized: bool = True
    calls: int = 0

    def snapshot_for_link(self) -> tuple[dict[int, object], dict[int, FakeEntry]]:
        self.calls += 1
        return {}, dict(self.entries)


def _labels(fd: int, slots: int) -> list[int]:
    table = _xproc.LeaseTable(fd, slots)
    return [table.load(i, 2) for i in range(slots)]


def _own_link() -> samehost.SameHostLink:
    return samehost.SameHostLink(os.getpid(), os.getuid(), _xproc.pidfd_open(os.getpid()))


def test_the_prepared_table_names_the_replys_caches_not_later_ones() -> None:
    a, b, later = FakeEntry(3), FakeEntry(5), FakeEntry(9)
    owner = FakeOwner({3: a, 5: b, 9: later})  # 9 registered after the reply
    tables = _Tables(owner)  # type: ignore[arg-type]
    tables.prepare({3: a, 5: b})  # type: ignore[dict-item]
    fd, slots = tables.make()
    try:
        assert slots == 2 and _labels(fd, slots) == [3, 5]
        assert owner.calls == 0  # no second snapshot
        assert len(tables.made) == 1
    finally:
        os.close(fd)
        tables.close()


def test_without_preparing_the_proof_takes_the_snapshot_of_its_moment() -> None:
    owner = FakeOwner({3: FakeEntry(3), 5: FakeEntry(5), 9: FakeEntry(9)})
    tables = _Tables(owner)  # type: ignore[arg-type]
    fd, slots = tables.make()
    try:
        assert slots == 3 and _labels(fd, slots) == [3, 5, 9] and owner.calls == 1
        tables.prepare({3: owner.entries[3]})  # type: ignore[dict-item]  # too late: no second table
        assert len(tables.made) == 1
    finally:
        os.close(fd)
        tables.close()


def test_a_cache_unregistered_between_reply_and_proof_is_revoked_at_attach() -> None:
    a, b = FakeEntry(3), FakeEntry(5)
    tables = _Tables(FakeOwner({3: a, 5: b}))  # type: ignore[arg-type]
    tables.prepare({3: a, 5: b})  # type: ignore[dict-item]
    b.registered = False  # unregistered before the peer proved itself
    fd, slots = tables.make()
    os.close(fd)
    table = tables.made[-1]
    try:
        table.attach(_own_link(), 1000)
        assert table.table.state(1) == STATE_UNREGISTERED  # no copy may start on it
        assert table.table.state(0) == 0 and a.drains and not b.drains
    finally:
        tables.close()
    assert table.closed and not a.drains


def test_tables_given_up_are_closed_and_none_is_made_after() -> None:
    a = FakeEntry(3)
    tables = _Tables(FakeOwner({3: a}))  # type: ignore[arg-type]
    tables.prepare({3: a})  # type: ignore[dict-item]
    made = tables.made[-1]
    tables.close()  # the proof never came (the endpoint forgot the session)
    assert made.closed
    tables.prepare({3: a})  # type: ignore[dict-item]  # (a late reply-side call)
    assert tables.made == [made]
    first = _Tables(FakeOwner({3: a}))  # type: ignore[arg-type]
    first.close()  # given up before the reply side prepared
    first.prepare({3: a})  # type: ignore[dict-item]
    assert first.made == []


def test_a_closed_path_prepares_nothing() -> None:
    a = FakeEntry(3)
    tables = _Tables(FakeOwner({3: a}))  # type: ignore[arg-type]
    path = SameHostPath()
    path._prepare = tables.prepare
    path.close()  # e.g. the link was refused after the extension was accepted
    path.prepare({3: a})  # type: ignore[dict-item]
    assert tables.made == []
    path2 = SameHostPath()
    path2._prepare = tables.prepare
    path2.prepare({3: a})  # type: ignore[dict-item]
    assert len(tables.made) == 1
    tables.close()
