"""A lease's states on its owner (kvdd.sim.fabric.leases.Lease): once dropped — released by the
peer, expired, revoked by an unregister, or its connection gone — it serves no new copy, releases
its cache entry exactly once (after the last copy in progress), and schedules nothing more."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from kvdd import Status

from kvdd.sim.fabric import leases, watchdog, wire
from kvdd.sim.fabric.leases import Lease
from shared_support import FakeServedCache


class Chan:
    def __init__(self) -> None:
        self.forgotten: list[tuple[int, bool]] = []

    def forget_lease(self, lease_id: int, revoked: bool = False) -> Lease | None:
        self.forgotten.append((lease_id, revoked))
        return None

    def kill(self) -> None:
        pass


def _lease() -> tuple[Lease, FakeServedCache, Chan]:
    entry, chan = FakeServedCache(), Chan()
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


def test_a_drop_during_a_copy_keeps_the_expiry_until_the_copy_ends() -> None:
    """A lease revoked or released while a copy runs under it keeps its expiry timer (the
    bound on that copy); the last user's unuse cancels it; without a copy, a drop cancels it."""
    lease, entry, _ = _lease()
    lease.timer = watchdog.WATCHDOG.schedule(60.0, lambda: None)
    assert lease.use()
    assert lease.drop() is True  # a copy in progress
    assert lease.timer.alive and entry.releases == 0
    lease.unuse()
    assert not lease.timer.alive and entry.releases == 1
    idle, _, _ = _lease()
    idle.timer = watchdog.WATCHDOG.schedule(60.0, lambda: None)
    assert idle.drop() is False
    assert not idle.timer.alive


class _RacingChan(Chan):
    """A server thread that looked the lease up before the expiry forgot it, starting its copy
    just as the lease is forgotten."""

    def __init__(self) -> None:
        super().__init__()
        self.lease: Lease | None = None
        self.started: list[bool] = []
        self.killed = 0

    def forget_lease(self, lease_id: int, revoked: bool = False) -> Lease | None:
        assert self.lease is not None
        self.started.append(self.lease.use())
        return super().forget_lease(lease_id, revoked)

    def kill(self) -> None:
        self.killed += 1


def test_an_expiry_racing_a_copys_start_stops_that_copy() -> None:
    """The expiry reads whether a copy runs as it drops the lease: a copy that started while
    the lease was being forgotten is stopped (its connection closed), not left unbounded."""
    entry, chan = FakeServedCache(), _RacingChan()
    lease = Lease(7, entry, chan)  # type: ignore[arg-type]
    chan.lease = lease
    lease.expire()
    assert chan.started == [True] and chan.killed == 1
    lease.unuse()
    assert entry.releases == 1


class Owner:
    initialized = True


def test_a_closed_connection_grants_no_lease() -> None:
    table = leases.LeaseTable(Chan())
    served = FakeServedCache()
    owner: Any = Owner()
    entries: Any = {3: served}
    payload = struct.pack("<Q", 3)
    status, lease_id = struct.unpack("<IQ", table.grant(owner, entries, payload, 1000, 1))
    assert status == Status.LLM_SUCCESS and lease_id > 0
    table.take_all(close=True)  # the connection died
    status, lease_id = struct.unpack("<IQ", table.grant(owner, entries, payload, 1000, 1))
    assert (status, lease_id) == (Status.LLM_TIMEOUT, 0)
    assert served.acquired == 2 and served.releases == 1  # the refused lease released its entry


class Resolver:
    """An owner that resolves a lease request to one served entry (two-sided pulls)."""

    def __init__(self, served: FakeServedCache, initialized: bool = True,
                 status: int = Status.LLM_SUCCESS) -> None:
        self.served, self.initialized, self.status = served, initialized, status

    def resolve_lease(self, request: bytes) -> tuple[int, Any, bytes, None]:
        if self.status != Status.LLM_SUCCESS:
            return self.status, None, b"why", None
        return Status.LLM_SUCCESS, self.served, b"extra", None


def _resolved(table: leases.LeaseTable, owner: Any) -> tuple[int, int, bytes]:
    payload = struct.pack("<Q", 0) + b"request"  # cache id 0 and a request: the owner resolves it
    answer = table.grant(owner, {}, payload, 1000, 1)
    status, lease_id = struct.unpack_from("<IQ", answer)
    return status, lease_id, answer[12:]


def test_a_resolved_lease_needs_an_initialized_resolving_owner() -> None:
    served = FakeServedCache()
    assert _resolved(leases.LeaseTable(Chan()), Resolver(served, initialized=False))[:2] == \
        (Status.LLM_KV_CACHE_NOT_EXIST, 0)
    assert _resolved(leases.LeaseTable(Chan()), Owner())[:2] == (Status.LLM_KV_CACHE_NOT_EXIST, 0)
    status, lease_id, extra = _resolved(leases.LeaseTable(Chan()), Resolver(served))
    assert status == Status.LLM_SUCCESS and lease_id > 0 and extra == b"extra"
    # the owner's refusal and its answer reach the peer; nothing is acquired
    assert _resolved(leases.LeaseTable(Chan()), Resolver(served, status=Status.LLM_PARAM_INVALID)) == \
        (Status.LLM_PARAM_INVALID, 0, b"why")
    assert served.acquired == 1


def test_resolved_leases_count_against_the_cap() -> None:
    served = FakeServedCache()
    table = leases.LeaseTable(Chan())
    owner = Resolver(served)
    for _ in range(wire.MAX_LEASES):
        assert _resolved(table, owner)[0] == Status.LLM_SUCCESS
    assert _resolved(table, owner)[:2] == (Status.LLM_FAILED, 0)  # the 65th
    assert served.acquired == wire.MAX_LEASES


def _lease_on(table: leases.LeaseTable, owner: Any, entries: Any, cache_id: int) -> tuple[int, int]:
    answer = table.grant(owner, entries, struct.pack("<Q", cache_id), 1000, 1)
    status, lease_id = struct.unpack("<IQ", answer)
    return status, lease_id


def test_a_full_lease_table_still_answers_not_exist_for_an_unknown_cache() -> None:
    """The checks of a LEASE in their order: a cache not visible over the link is
    LLM_KV_CACHE_NOT_EXIST whatever the connection holds; only a lease that would be granted
    meets the MAX_LEASES cap (LLM_FAILED), and one below the cap is still granted."""
    table = leases.LeaseTable(Chan())
    served = FakeServedCache()
    owner: Any = Owner()
    entries: Any = {3: served}
    for _ in range(wire.MAX_LEASES - 1):
        assert _lease_on(table, owner, entries, 3)[0] == Status.LLM_SUCCESS
    status, lease_id = _lease_on(table, owner, entries, 3)  # the last one below the cap
    assert status == Status.LLM_SUCCESS and lease_id == wire.MAX_LEASES
    assert _lease_on(table, owner, entries, 4) == (Status.LLM_KV_CACHE_NOT_EXIST, 0)  # unknown
    assert _lease_on(table, owner, entries, 3) == (Status.LLM_FAILED, 0)  # known: the cap
    assert served.acquired == wire.MAX_LEASES  # the refusals acquired nothing
    table.forget(1)  # one lease ends: room for one more
    assert _lease_on(table, owner, entries, 3)[0] == Status.LLM_SUCCESS


@pytest.mark.parametrize("held", [0, wire.MAX_LEASES])
def test_an_owner_no_longer_initialized_grants_no_lease_on_a_served_cache(held: int) -> None:
    """Finalize marks the owner uninitialized before its connections close: a LEASE arriving
    then, on a cache still in the link's table, is LLM_KV_CACHE_NOT_EXIST (with a full lease
    table too: not the cap's LLM_FAILED), and acquires nothing."""
    table = leases.LeaseTable(Chan())
    served = FakeServedCache()
    owner: Any = Owner()
    entries: Any = {3: served}
    for _ in range(held):
        assert _lease_on(table, owner, entries, 3)[0] == Status.LLM_SUCCESS
    finalizing: Any = Owner()
    finalizing.initialized = False
    assert _lease_on(table, finalizing, entries, 3) == (Status.LLM_KV_CACHE_NOT_EXIST, 0)
    assert table.grant_small(finalizing, entries, 3) == (Status.LLM_KV_CACHE_NOT_EXIST, None)
    assert served.acquired == held


def _read_status(table: leases.LeaseTable, lease_id: int) -> int:
    zero = np.zeros(1, np.int64)
    return table.check_runs(lease_id, zero, zero, zero)[0]


def test_revoked_lease_ids_are_remembered_up_to_max_revoked() -> None:
    """A READ under a lease revoked by an unregister gets LLM_KV_CACHE_NOT_EXIST; the connection
    remembers the last MAX_REVOKED revoked ids, exactly: the oldest beyond them is forgotten and
    answered as an expired lease (LLM_TIMEOUT)."""
    table = leases.LeaseTable(Chan())
    owner: Any = Owner()
    entries: Any = {3: FakeServedCache()}
    ids = []
    for _ in range(leases.MAX_REVOKED + 1):
        status, lease_id = _lease_on(table, owner, entries, 3)
        assert status == Status.LLM_SUCCESS
        assert table.forget(lease_id, revoked=True) is not None
        ids.append(lease_id)
        if len(ids) == leases.MAX_REVOKED:  # exactly MAX_REVOKED: all remembered
            assert _read_status(table, ids[0]) == Status.LLM_KV_CACHE_NOT_EXIST
    assert _read_status(table, ids[0]) == Status.LLM_TIMEOUT  # the oldest, forgotten
    for lease_id in ids[1:]:
        assert _read_status(table, lease_id) == Status.LLM_KV_CACHE_NOT_EXIST
    assert _read_status(table, ids[-1] + 1) == Status.LLM_TIMEOUT  # never granted
