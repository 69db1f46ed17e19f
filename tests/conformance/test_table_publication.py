"""Cache-table publication: SEMANTICS.md §3.7 step 10 and §7.23 — peers read the last cache table
that fit 1 MiB; in kvdd's visibility model (§2.4), a link sees the caches of the last table that fit
when the link was created."""

from __future__ import annotations

from kvdd import CacheDesc, CacheIndex, DataType, Status

from . import reference as ref
from .checked import (
    pull_cache_checked,
)
from .harness import (
    KV_CACHE_NOT_EXIST,
    PARAM_INVALID,
    Node,
    World,
    raises,
)

S = Status.LLM_SUCCESS
# One cache of N_BIG tensors makes the table 8 bytes too big (24 + 64 + 8n > 1 MiB).
N_BIG = (ref.CACHE_TABLE_LIMIT - ref.cache_table_bytes([0])) // 8 + 1
DESC = CacheDesc(num_tensors=10, data_type=DataType.DT_INT32, shape=(4, 16))


def _overflow(d: Node) -> int:
    """Register a cache whose table does not fit: PARAM_INVALID, the entry stays; its id."""
    assert ref.cache_table_bytes([10, N_BIG]) > ref.CACHE_TABLE_LIMIT
    _, addrs = d.alloc(256, 1)
    with raises(PARAM_INVALID):
        d.register_addrs(CacheDesc(num_tensors=N_BIG, data_type=DataType.DT_INT32, shape=(4, 16)),
                         addrs * N_BIG)  # identical (addr, T): registered once
    return 2


def test_peers_read_the_last_table_that_fit(world: World, transfer: str) -> None:
    p = world.peer(1)
    p.initialize(listen=True, transfer=transfer)
    d = world.dut(2)
    d.initialize(listen=True, transfer=transfer)
    ph = p.register()
    dh = d.register()  # id 1: published
    big = _overflow(d)  # id 2: inserted, table too big, not published
    _, addrs = d.alloc(256, 10)
    with raises(PARAM_INVALID):  # id 3: inserted while the table is still too big
        d.register_addrs(DESC, addrs)
    hidden = CacheIndex(cluster_id=2, cache_id=3)
    port = d.listen_port
    assert port
    assert p.link(port, 2) == [S]
    pull_cache_checked(world, p, dh, ph)  # the published cache is read
    with world.rejects(KV_CACHE_NOT_EXIST):  # the unpublished one is not found
        p.pull_kv_cache(hidden, ph.cache())
    d.unregister(big)  # the table fits again and is published with id 3 ...
    with world.rejects(KV_CACHE_NOT_EXIST):  # ... but this link keeps the table of its creation
        p.pull_kv_cache(hidden, ph.cache())
    assert p.unlink(port, 2) == [S]
    assert p.link(port, 2) == [S]
    p.pull_kv_cache(hidden, ph.cache())  # a new link reads the new table


def test_table_of_link_creation_without_overflow(world: World, transfer: str) -> None:
    # The baseline of the rule (§2.4): a cache registered after the link is not found over it.
    p = world.peer(1)
    p.initialize(listen=True, transfer=transfer)
    d = world.dut(2)
    d.initialize(listen=True, transfer=transfer)
    ph = p.register()
    port = d.listen_port
    assert port
    assert p.link(port, 2) == [S]
    dh = d.register()
    with world.rejects(KV_CACHE_NOT_EXIST):
        p.pull_kv_cache(dh.index(), ph.cache())
