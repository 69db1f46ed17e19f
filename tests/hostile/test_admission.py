"""Which connection a full listener table gives up (kvdd.sim.fabric.admission.FairTable), exactly at
and one past each bound."""

from __future__ import annotations

import random

import pytest

from kvdd.sim.fabric.admission import FairTable, source_of


def test_a_source_at_its_share_gives_up_its_own_oldest_idle_entry() -> None:
    t: FairTable[str] = FairTable(total=10, per_source=3)
    assert t.add("a1", "A") == [] and t.add("a2", "A") == [] and t.add("a3", "A") == []
    t.progressed("a1")  # a1 made progress: the idle a2 goes first
    assert t.add("a4", "A") == ["a2"]
    assert t.add("a5", "A") == ["a3"]
    assert t.add("a6", "A") == ["a4"]
    assert t.count("A") == 3 and "a1" in t
    t.progressed("a5")
    t.progressed("a6")  # every entry progressed: the oldest of them goes
    assert t.add("a7", "A") == ["a1"]


def test_a_full_table_takes_from_the_largest_source_never_a_smaller_one() -> None:
    t: FairTable[str] = FairTable(total=6, per_source=5)
    for i in range(5):
        assert t.add(f"f{i}", "flood") == []
    assert t.add("legit", "L") == []  # exactly at the bound: nothing given up
    assert len(t) == 6
    for i in range(5, 50):  # the flood keeps coming: it evicts only itself
        evicted = t.add(f"f{i}", "flood")
        assert evicted == [f"f{i - 5}"], evicted
        assert "legit" in t
    assert t.add("other", "O") == ["f45"]  # one past the bound: from the largest source
    assert t.count("L") == 1 and t.count("O") == 1 and t.count("flood") == 4


def test_removal_and_counts_stay_consistent_under_random_use() -> None:
    rng = random.Random(5)
    t: FairTable[int] = FairTable(total=32, per_source=8)
    live: dict[int, str] = {}
    for i in range(20000):
        op = rng.random()
        if op < 0.6:
            src = f"s{rng.randrange(6)}"
            for gone in t.add(i, src):
                assert live.pop(gone) is not None
            live[i] = src
        elif op < 0.8 and live:
            k = rng.choice(list(live))
            assert t.remove(k)
            del live[k]
        elif live:
            t.progressed(rng.choice(list(live)))
        assert len(t) == len(live) <= 32
        for src in {*live.values()}:
            assert t.count(src) == sum(1 for s in live.values() if s == src) <= 8
    assert not t.remove(-1)


def test_oldest_is_insertion_order() -> None:
    t: FairTable[str] = FairTable(total=4, per_source=4)
    t.add("x", "A")
    t.add("y", "B")
    t.progressed("x")
    assert t.oldest() == "x"
    t.remove("x")
    assert t.oldest() == "y"


@pytest.mark.parametrize("address, source", [
    (("10.1.2.3", 5000), "10.1.2.3"),
    (("::ffff:10.1.2.3", 5000, 0, 0), "10.1.2.3"),
    (("2001:db8:1:2:aaaa::1", 5000, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:2:bbbb::9", 6000, 0, 0), "2001:db8:1:2::/64"),  # one /64: one source
    (("fe80::1%eth0", 1, 0, 2), "fe80::/64"),
    ("", "local"),  # an AF_UNIX peer (accept gives no address)
    ((), "local"),
    ("/run/kvdd.sock", "local"),  # an AF_UNIX path
    (None, "local"),
])
def test_sources(address: object, source: str) -> None:
    assert source_of(address) == source


def test_a_full_table_evicts_the_oldest_idle_entry_of_the_largest_sources() -> None:
    """Against a model: when the table is full, the entry given up is the oldest idle one (by
    the time it was added) of all the sources tied for the most entries, else the one of them
    that progressed first, whatever the sources' names hash to (random use, 20,000 steps)."""
    rng = random.Random(11)
    t: FairTable[int] = FairTable(total=24, per_source=6)
    added: dict[int, tuple[str, int]] = {}  # entry -> (source, time added)
    moved: dict[int, int] = {}  # entry -> time it progressed
    clock = 0
    for i in range(20000):
        clock += 1
        op = rng.random()
        if op < 0.6:
            src = f"10.{rng.randrange(40)}.0.{rng.randrange(3)}"
            expected = None
            mine = [e for e, (s, _) in added.items() if s == src]
            if len(mine) < 6 and len(added) >= 24:
                counts: dict[str, int] = {}
                for s, _ in added.values():
                    counts[s] = counts.get(s, 0) + 1
                top = max(counts.values())
                tied = [e for e, (s, _) in added.items() if counts[s] == top]
                idle = [e for e in tied if e not in moved]
                expected = (min(idle, key=lambda e: added[e][1]) if idle
                            else min(tied, key=lambda e: moved[e]))
            evicted = t.add(i, src)
            if expected is not None:
                assert evicted == [expected], (i, evicted, expected)
            for gone in evicted:
                del added[gone]
                moved.pop(gone, None)
            added[i] = (src, clock)
        elif op < 0.75 and added:
            k = rng.choice(list(added))
            assert t.remove(k)
            del added[k]
            moved.pop(k, None)
        elif added:
            k = rng.choice(list(added))
            t.progressed(k)
            moved.setdefault(k, clock)
        assert len(t) == len(added) <= 24


@pytest.mark.parametrize("total,per_source,ok", [
    (1, 1, True), (5, 1, True), (5, 5, True),  # the smallest share, a share of the whole table
    (5, 0, False), (5, -1, False), (5, 6, False),  # no share, a share one past the table
])
def test_a_table_needs_a_share_between_one_and_its_size(total: int, per_source: int,
                                                        ok: bool) -> None:
    if ok:
        t: FairTable[str] = FairTable(total, per_source)
        assert (t.total, t.per_source, len(t)) == (total, per_source, 0)
    else:
        with pytest.raises(ValueError, match="need 0 < per_source <= total"):
            FairTable(total, per_source)


def test_progress_of_an_entry_no_longer_held_changes_nothing() -> None:
    t: FairTable[str] = FairTable(total=2, per_source=2)
    t.add("a1", "A")
    t.add("a2", "A")
    t.progressed("gone")  # evicted or removed meanwhile (the listener's loop may still report it)
    assert t.remove("a1") and not t.remove("a1")
    t.progressed("a1")
    assert t.items() == ["a2"] and t.count("A") == 1
    assert t.add("a3", "A") == [] and t.add("a4", "A") == ["a2"]  # a2 is still the idle oldest
