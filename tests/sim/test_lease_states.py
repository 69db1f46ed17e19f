"""A lease's states on its owner (kvdd.sim.fabric.leases.Lease): once dropped — released by the
peer, expired, revoked by an unregister, or its connection gone — it serves no new copy, releases
its cache entry exactly once (after the last copy in progress), and schedules nothing more."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from kvdd import Status

from kvdd.sim.fabric import leases, watchdog
from kvdd.sim.fabric.leases import Lease


class Entry:
    """A served cache entry that counts its releases."""

    def __init__(self) -> None:
        self.releases = 0

    def release(self) -> None:
        self.releases += 1


class Chan:
    def __init__(self) -> None:
        self.forgotten: list[tuple[int, bool]] = []

    def forget_lease(self, lease_id: int, revoked: bool = False) -> Lease | None:
        self.forgotten.append((lease_id, revoked))
        return None

    def kill(self) -> None:
        pass


def _lease() -> tuple[Lease, Entry, Chan]:
    entry, chan = Entry(), Chan()
    return Lease(7, entry, chan), entry, chan  # type: ignore[arg-type]


def test_a_dropped_lease_serves_no_new_copy() -> None:
    lease, entry, _ = _lease()
    assert lease.use()
    lease.unuse()
    lease.drop()
    assert not lease.use()
    assert entry.releases == 1


def test_drop_releases_once_and_only_after_the_copy_in_progress() -> None:
    lease, entry, _ = _lease()
    assert lease.use()  # a copy in progress
    lease.drop()
    assert entry.releases == 0  # waited for
    lease.drop()  # a second drop (expiry racing a release) changes nothing
    assert entry.releases == 0
    lease.unuse()  # the copy ends: now released
    assert entry.releases == 1
    lease.drop()
    assert entry.releases == 1


def test_drop_runs_the_unwatch_callback_once() -> None:
    lease, _, _ = _lease()
    calls: list[int] = []
    lease.unwatch = lambda: calls.append(1)
    lease.drop()
    lease.drop()
    assert calls == [1]


def test_revoke_soon_after_drop_schedules_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduled: list[float] = []
    monkeypatch.setattr(watchdog.WATCHDOG, "schedule", lambda s, fn: scheduled.append(s))
    lease, entry, chan = _lease()
    lease.revoke_soon()
    assert scheduled == [leases.REVOKE_GRACE_S]
    lease.drop()
    lease.revoke_soon()
    assert scheduled == [leases.REVOKE_GRACE_S] and entry.releases == 1


def test_revoke_forgets_the_lease_as_revoked_and_drops_it() -> None:
    lease, entry, chan = _lease()
    lease.revoke()
    assert chan.forgotten == [(7, True)] and entry.releases == 1 and not lease.use()


class Owner:
    initialized = True


class Served(Entry):
    """A served cache that counts acquisitions too."""

    def __init__(self) -> None:
        super().__init__()
        self.acquired = 0

    def acquire(self) -> bool:
        self.acquired += 1
        return True

    def add_drain(self, fn: object) -> bool:
        return True

    def remove_drain(self, fn: object) -> None:
        pass


def test_a_closed_connection_grants_no_lease() -> None:
    table = leases.LeaseTable(Chan())
    served = Served()
    owner: Any = Owner()
    entries: Any = {3: served}
    payload = struct.pack("<Q", 3)
    status, lease_id = struct.unpack("<IQ", table.grant(owner, entries, payload, 1000))
    assert status == Status.LLM_SUCCESS and lease_id > 0
    table.take_all(close=True)  # the connection died
    status, lease_id = struct.unpack("<IQ", table.grant(owner, entries, payload, 1000))
    assert (status, lease_id) == (Status.LLM_TIMEOUT, 0)
    assert served.acquired == 2 and served.releases == 1  # the refused lease released its entry
