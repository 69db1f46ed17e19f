"""The engine of CANN's Python package across processes: the published cache table (types, N,
flags, req keys), bytes of pulls and pushes, the snapshot rule, a hostile peer, a peer that
vanishes (docs/spec/PYPKG.md §4.1, §4.4-§4.9; checklist §7.5 items 14, 18, 21, 22)."""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from engine_support import (NO, NOT_EXIST, PARAM_INVALID, S_OK, TIMEOUT, Mem, blocks_key,
                            cache_key, expect_blocks, free_port, id_key, link_to, process_options,
                            pull_param)
from kvdd.sim.fabric import KIND_BLOCKS, KIND_CACHE
from kvdd.sim.pypkg import lifecycle, process_wrapper
from kvdd.sim.pypkg.wrapper import SimWrapper
from peer import Peer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hostile"))
rawpeer: Any = importlib.import_module("rawpeer")  # tests/hostile's raw fabric peer

CACHES = [
    {"n": 2, "rows": 6, "row_bytes": 32, "seed": 1, "keys": [blocks_key(0, 0)]},  # id 1
    {"n": 2, "rows": 6, "row_bytes": 32, "seed": 2, "keys": [blocks_key(0, 0)]},  # id 2 wins
    {"n": 2, "rows": 4, "row_bytes": 32, "seed": 3, "blocks": False,  # id 3
     "keys": [cache_key(0, NO, 2), cache_key(0, 11, 2), cache_key(0, NO, 2, prefix=9)]},
    {"n": 2, "rows": 6, "row_bytes": 32, "seed": 4, "keys": [blocks_key(0, 7)], "ra": False},
]


@pytest.fixture(scope="module", params=["process_vm", "tcp"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Peer, int, str]]:
    """The serving peer; both data paths (same-host one-sided reads/writes, and TCP)."""
    port = free_port()
    env = {"KVDD_SIM_XPROC": "tcp"} if request.param == "tcp" else None
    with Peer(env=env) as p:
        assert p.call("engine_support.serve", 1, port, CACHES) == [1, 2, 3, 4]
        yield p, port, request.param
        p.call("engine_support.finalize")


@pytest.fixture
def w(server: tuple[Peer, int, str]) -> Iterator[SimWrapper]:
    wrapper = process_wrapper()
    wrapper.finalize_v2()
    assert wrapper.initialize_v2(2, process_options(None)) == S_OK
    assert link_to(1, server[1]) == S_OK
    yield wrapper
    wrapper.finalize_v2()


def snapshot() -> dict[int, object]:
    engine = lifecycle.current()
    assert engine is not None
    return engine.instance.entities[1].peer.snapshot()  # type: ignore[return-value]


def remote(server: tuple[Peer, int, str], index: int) -> list[np.ndarray]:
    return [np.frombuffer(b, np.uint8) for b in server[0].call("engine_support.tensors", index)]


def test_table_published_across_processes(w: SimWrapper, server: tuple[Peer, int, str]) -> None:
    engine = lifecycle.current()
    assert engine is not None and engine.instance.link_data_path(1) == server[2]
    snap = snapshot()
    b1, b2, c3, h4 = (snap[i] for i in (1, 2, 3, 4))
    assert (b1.kind, b1.blocks, b1.batch_size, b1.stride_nbytes, b1.keys) == (KIND_BLOCKS, 6, 1, 32, ())  # type: ignore[attr-defined]
    assert b2.keys == ((NO, 0, 0),)  # type: ignore[attr-defined]
    assert (c3.kind, c3.batch_size, c3.blocks, c3.keys) == (KIND_CACHE, 4, 0, ((11, 2, 1),))  # type: ignore[attr-defined]
    assert not h4.remote_accessible and h4.keys == ((NO, 7, 0),)  # type: ignore[attr-defined]
    assert all(snap[i].remote_accessible for i in (1, 2, 3))  # type: ignore[attr-defined]


def test_blocks_last_wins_and_runs_bytes(w: SimWrapper, server: tuple[Peer, int, str]) -> None:
    """§7.5-14 and -18 across processes: the second cache with model 0; exact runs and bytes."""
    mem = Mem(2, 12, 32)
    did = w.register_cache(mem.desc(True), mem.addrs, [], True)[1][0]
    src = remote(server, 1)
    before = mem.copy()
    pairs = list(zip([0, 1, 4, 5, 3], [1, 2, 4, 6, 9]))
    assert w.pull_cache_v2(did, blocks_key(1, 0), pull_param([s for s, _ in pairs],
                                                             [d for _, d in pairs])) == S_OK
    expect_blocks(mem.tensors, before, src, pairs, 32)
    assert w.pull_cache_v2(did, blocks_key(1, 7), pull_param([0], [0])) == PARAM_INVALID
    assert w.pull_cache_v2(did, id_key(1, 4), pull_param((), [0])) == PARAM_INVALID
    assert w.pull_cache_v2(did, blocks_key(1, 3), pull_param([0], [0])) == NOT_EXIST
    expect_blocks(mem.tensors, before, src, pairs, 32)


def test_cache_key_c2b_and_pull_cache_rows(w: SimWrapper, server: tuple[Peer, int, str]) -> None:
    """C2B by CacheKey (req 11, model 2); §7.5-22 across processes: row b of every remote tensor."""
    src = remote(server, 2)
    blocks = Mem(2, 8, 32)
    bid = w.register_cache(blocks.desc(True), blocks.addrs, [], True)[1][0]
    before = blocks.copy()
    assert w.pull_cache_v2(bid, cache_key(1, 11, 2), pull_param((), [6, 3])) == S_OK
    expect_blocks(blocks.tensors, before, src, [(0, 6), (1, 3)], 32)
    assert w.pull_cache_v2(bid, cache_key(1, 11, 9), pull_param((), [0])) == NOT_EXIST
    assert w.pull_cache_v2(bid, cache_key(1, 9, 2), pull_param((), [0])) == NOT_EXIST  # prefix unpublished
    rows = Mem(2, 2, 32)
    rid = w.register_cache(rows.desc(False), rows.addrs, [], True)[1][0]
    before = rows.copy()
    assert w.pull_cache_v2(rid, id_key(1, 3, batch=2), pull_param(batch=1)) == S_OK
    expect_blocks(rows.tensors, before, src, [(2, 1)], 32)
    assert w.pull_cache_v2(rid, id_key(1, 3, batch=2), pull_param(batch=1, size=33)) == PARAM_INVALID


def test_push_blocks_across_processes(w: SimWrapper, server: tuple[Peer, int, str]) -> None:
    mem = Mem(2, 6, 32, seed=8)
    sid = w.register_cache(mem.desc(True), mem.addrs, [], True)[1][0]
    before = remote(server, 1)  # cache 2 holds model 0 now: its bytes are index 1
    cfg: tuple[int, int, int, list[int], int, int, int, int, int, int] = (sid, 0, 0, [], 1, 0, 0, 1, 0, 2)
    assert w.transfer_cache_v2(0, cfg, (0, [5, 0, 1], [2, 3, 4])) == S_OK
    expect_blocks(remote(server, 1), [b.copy() for b in before], mem.tensors,
                  [(5, 2), (0, 3), (1, 4)], 32)


def test_snapshot_rule_across_processes(w: SimWrapper, server: tuple[Peer, int, str]) -> None:
    """§7.5-21: a cache the peer registers after our link is invisible until we relink."""
    mem = Mem(2, 6, 32)
    did = w.register_cache(mem.desc(True), mem.addrs, [], True)[1][0]
    late = server[0].call("engine_support.register_more",
                          {"n": 2, "rows": 6, "row_bytes": 32, "seed": 6, "keys": [blocks_key(0, 5)]})
    assert late == 5
    assert w.pull_cache_v2(did, blocks_key(1, 5), pull_param([0], [0])) == NOT_EXIST
    assert (mem.tensors[0] == 0).all()
    assert w.unlink_clusters_v2([(1, 0, [], [])], 1000, True)[0] == S_OK
    assert link_to(1, server[1]) == S_OK
    assert w.pull_cache_v2(did, blocks_key(1, 5), pull_param([4], [0])) == S_OK
    src = remote(server, 4)
    assert mem.tensors[1][:32].tobytes() == src[1][128:160].tobytes()
    assert (mem.tensors[1][32:] == 0).all()


def test_hostile_peer_cannot_lease_a_cache_that_is_not_remote_accessible(
        server: tuple[Peer, int, str]) -> None:
    """A peer that ignores the flag asks the owner for a lease on cache 4 directly: refused."""
    s, snap = rawpeer.link(server[1], 77)
    try:
        assert 4 not in snap  # listed only in the table extras, never with addresses
        assert rawpeer.lease(s, 4)[0] == NOT_EXIST
        assert rawpeer.lease(s, 1, req=2)[0] == S_OK
    finally:
        s.close()


def test_peer_vanishing_mid_transfer_times_out() -> None:
    """A pull in flight when the owner dies returns LLM_TIMEOUT within SyncKvCacheWaitTime (the
    owner, on the TCP data path, is slowed so that the pull is in flight when it is killed)."""
    w = process_wrapper()
    w.finalize_v2()
    port = free_port()
    slow = {"KVDD_SIM_FAULTS": "pull_blocks:delay_ms=3000:serve=1", "KVDD_SIM_XPROC": "tcp"}
    p = Peer(env=slow)
    try:
        assert p.call("engine_support.serve", 1, port, CACHES[:1]) == [1]
        assert w.initialize_v2(2, process_options(None, wait_ms=1500)) == S_OK
        assert link_to(1, port) == S_OK
        mem = Mem(2, 6, 32)
        did = w.register_cache(mem.desc(True), mem.addrs, [], True)[1][0]
        got: list[int] = []
        t0 = time.monotonic()
        th = threading.Thread(target=lambda: got.append(
            w.pull_cache_v2(did, blocks_key(1, 0), pull_param([0], [0]))))
        th.start()
        time.sleep(0.3)
        p.process.kill()
        th.join(10)
        elapsed = time.monotonic() - t0
        # the death is noticed at once (connection reset), well before the 1.5 s wait would end
        assert got == [TIMEOUT] and elapsed < 1.4
        assert all((t == 0).all() for t in mem.tensors)
    finally:
        w.finalize_v2()
        p.close()


def test_two_sided_engines_across_processes() -> None:
    """Two-sided engines: a pull needs the peer's device-side handler (FEATURE_NOT_ENABLED after
    the request is built); transfer_cache_async's raw-address write lands in the peer's tensor
    (mapped onto a cache it serves) and is refused outside one."""
    w = process_wrapper()
    w.finalize_v2()
    port = free_port()
    # KVDD_SIM_FAULTS reaches the peer's façade calls by name: its first registration fails
    env = {"KVDD_SIM_FAULTS": "register_blocks_cache:status=LLM_DEVICE_OUT_OF_MEMORY:count=1"}
    with Peer(env=env) as p:
        spec = {"n": 2, "rows": 4, "row_bytes": 16, "keys": [blocks_key(0, 0)]}
        assert p.call("engine_support.serve", 1, port, [spec, spec], ra=False) == [-0x5010B00E, 2]
        try:
            assert w.initialize_v2(2, process_options(None, ra=False)) == S_OK
            assert link_to(1, port) == S_OK
            mem = Mem(2, 4, 16, seed=5)
            sid = w.register_cache(mem.desc(False), mem.addrs, [], True)[1][0]
            assert w.pull_cache_v2(sid, id_key(1, 2), pull_param()) == 0x5010B019
            assert (mem.tensors[0] != 0).any()
            remote_addrs = p.call("engine_support.addresses", 1)
            cfg = (sid, 2, 0, [remote_addrs[1] + 48, remote_addrs[0]], 1, 0, 0, 0, 0, 2)
            assert w.transfer_cache_v2(0, cfg, (0, [], [])) == S_OK
            got = remote((p, port, ""), 1)
            want = [np.zeros(64, np.uint8), np.zeros(64, np.uint8)]
            want[1][48:64] = mem.tensors[0][32:48]
            want[0][0:16] = mem.tensors[1][32:48]
            assert all((g == x).all() for g, x in zip(got, want))
            bad = (sid, 2, 0, [remote_addrs[1] + 49, remote_addrs[0]], 1, 0, 0, 0, 0, 2)
            assert w.transfer_cache_v2(0, bad, (0, [], [])) == PARAM_INVALID
            assert all((g == x).all() for g, x in zip(remote((p, port, ""), 1), want))
        finally:
            w.finalize_v2()
            p.call("engine_support.finalize")


def test_table_extras_wire_round_trip_and_malformed() -> None:
    """The table extras after a hello's extensions: absent for a C++-face table (no byte added),
    decoded into the views; a peer's malformed extras close the connection (ProtocolError)."""
    from kvdd.sim.fabric import RemoteCache, wire

    plain = {1: RemoteCache(1, 2, 64, 4, 16, False, 1)}
    w = wire.Writer()
    wire.encode_table_extras(w, {1: object()}, plain)  # type: ignore[dict-item]
    assert bytes(w.buf) == b""
    views = {1: RemoteCache(1, 2, 64, 1, 16, False, 1, KIND_BLOCKS, 4, True, ((NO, 3, 0),)),
             2: RemoteCache(2, 1, 32, 2, 16, False, 2, KIND_CACHE, 0, False, ((7, 1, 1),))}
    w = wire.Writer()
    wire.encode_table_extras(w, {1: object()}, views)  # type: ignore[dict-item]
    snap = {1: RemoteCache(1, 2, 64, 1, 16, False, 1)}
    wire.decode_table_extras(wire.Reader(bytes(w.buf)), snap)
    assert snap[1] == views[1] and snap[2] == views[2]
    good = bytes(w.buf)
    for bad_snap in ({}, {1: RemoteCache(1, 2, 64, 2, 32, False, 1)}):  # 1 not served / differs
        with pytest.raises(wire.ProtocolError):
            wire.decode_table_extras(wire.Reader(good), dict(bad_snap))
    with pytest.raises(wire.ProtocolError):  # a key count past the payload
        wire.decode_table_extras(wire.Reader(good[:-4]), {1: RemoteCache(1, 2, 64, 1, 16, False, 1)})
    twice = bytearray(good)
    twice[0:4] = (3).to_bytes(4, "little")
    with pytest.raises(wire.ProtocolError):  # three records announced, two present
        wire.decode_table_extras(wire.Reader(bytes(twice)), {1: RemoteCache(1, 2, 64, 1, 16, False, 1)})
