"""Two-sided pulls (an engine that is not remote-cache-accessible): the peer looks the source up
live in its own maps, checks, answers its status; key consumption; a peer that vanishes
(docs/spec/PYPKG.md §4.4 two-sided table, §4.5, §4.6, §9.6)."""

from __future__ import annotations

import importlib
import os
import signal
import struct
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import twosided_support as ts
from engine_support import (FEATURE_NOT_ENABLED, HOST, NO, NOT_EXIST, PARAM_INVALID, S_OK,
                            TIMEOUT, Mem, blocks_key, cache_key, expect_blocks, free_port, id_key,
                            link, pull, pull_param, unlink)
from kvdd.sim.fabric import wire
from kvdd.sim.pypkg import pools, twosided
from kvdd.sim.pypkg.instance import EXTENSION, Claim
from kvdd.sim.pypkg.lifecycle import Engine
from peer import Peer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hostile"))
rawpeer: Any = importlib.import_module("rawpeer")  # tests/hostile's raw fabric peer

S = 64  # bytes per row / block in these tests


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    """(decoder D = cluster 1, prompt P = cluster 2 with a device pool), D linked to P."""
    p, d = ts.engine(2, pool=True), ts.engine(1, pool=True)
    link(d, p)
    yield d, p
    unlink(d, p)
    d.instance.finalize()
    p.instance.finalize()


def rows(mem: Mem, k: int, first: int, count: int, stride: int = S) -> np.ndarray:
    return mem.tensors[k][first * stride:(first + count) * stride]


# ---- blocks pull: identity (req_id, model_id) only, live ----------------------------------------
def test_blocks_pull_resolves_the_identity_live_and_moves_exact_blocks(pair: Any) -> None:
    d, p = pair
    src = Mem(2, 4, S, seed=3)
    ts.register(p, src, True, [blocks_key(0, 5)])  # registered after the link: seen (no snapshot)
    dst = Mem(2, 4, S)
    before = dst.copy()
    did = ts.register(d, dst, True)
    assert pull(d, did, blocks_key(2, 5), pull_param([0, 1, 3], [1, 2, 0])) == S_OK
    expect_blocks(dst.tensors, before, src.tensors, [(0, 1), (1, 2), (3, 0)], S)
    # an unknown model id; a cache id cannot address a blocks source (identity (2**64-1, 0))
    assert pull(d, did, blocks_key(2, 6), pull_param([0], [0])) == NOT_EXIST
    assert pull(d, did, id_key(2, 1), pull_param([0], [0])) == NOT_EXIST
    expect_blocks(dst.tensors, before, src.tensors, [(0, 1), (1, 2), (3, 0)], S)


def test_blocks_pull_peer_checks_max_src_block_and_tensor_count(pair: Any) -> None:
    d, p = pair
    src = Mem(2, 4, S, seed=3)
    ts.register(p, src, True, [blocks_key(0, 0)])
    dst = Mem(2, 8, S)
    before = dst.copy()
    did = ts.register(d, dst, True)
    assert pull(d, did, blocks_key(2, 0), pull_param([4], [0])) == PARAM_INVALID  # src 4 >= N 4
    assert pull(d, did, blocks_key(2, 0), pull_param([3], [7])) == S_OK  # exactly the last block
    expect_blocks(dst.tensors, before, src.tensors, [(3, 7)], S)
    three = Mem(3, 4, S)
    tid = ts.register(d, three, True)
    assert pull(d, tid, blocks_key(2, 0), pull_param([0], [0])) == PARAM_INVALID  # 2 vs 3 tensors
    assert not any(t.any() for t in three.tensors)
    one = Mem(1, 4, S)
    oid = ts.register(d, one, True)
    assert pull(d, oid, blocks_key(2, 0), pull_param([0], [0])) == PARAM_INVALID  # 2 vs 1 tensor
    assert not one.tensors[0].any()


def test_blocks_pull_block_bound_is_the_source_block_count_with_the_local_stride(pair: Any) -> None:
    d, p = pair
    src = Mem(2, 4, 2 * S, seed=5)  # N = 4 blocks of 2S
    ts.register(p, src, True, [blocks_key(0, 1)])
    dst = Mem(2, 2, S)  # blocks of S: the block size of the copy
    before = dst.copy()
    did = ts.register(d, dst, True)
    assert pull(d, did, blocks_key(2, 1), pull_param([4], [0])) == PARAM_INVALID  # 4 >= N
    assert all((a == b).all() for a, b in zip(dst.tensors, before))
    assert pull(d, did, blocks_key(2, 1), pull_param([3], [1])) == S_OK  # bytes [3S, 4S)
    expect_blocks(dst.tensors, before, src.tensors, [(3, 1)], S)


# ---- cache_id >= 0: the key bound to (id, batch), else the entry by id with batch < B -----------
def test_cache_id_reads_the_row_and_a_batch_past_b_does_not_exist(pair: Any) -> None:
    d, p = pair
    src = Mem(2, 3, S, seed=4)
    sid = ts.register(p, src, False)
    dst = Mem(2, 2, S, seed=9)
    before = dst.copy()
    did = ts.register(d, dst, False)
    assert pull(d, did, id_key(2, sid, 2), pull_param(batch=1)) == S_OK  # row 2 -> row 1
    for k in range(2):
        assert (rows(dst, k, 1, 1) == rows(src, k, 2, 1)).all()
        assert (rows(dst, k, 0, 1) == before[k][:S]).all()
    assert pull(d, did, id_key(2, sid, 3), pull_param()) == NOT_EXIST  # batch 3 == B
    assert pull(d, did, id_key(2, sid + 10, 0), pull_param()) == NOT_EXIST
    assert pull(d, did, id_key(2, 1 << 63, 0), pull_param()) == PARAM_INVALID  # past int64
    assert all((a[:S] == b[:S]).all() for a, b in zip(dst.tensors, before))


def test_cache_id_row_bound_to_a_key_is_that_key_and_consumes_it(pair: Any) -> None:
    d, p = pair
    oid, src = ts.allocate(p, 2, S, 2, [cache_key(0, 10), cache_key(0, 11)], seed=6)
    dst = Mem(2, 1, S)
    did = ts.register(d, dst, False)
    assert pull(d, did, id_key(2, oid, 1), pull_param()) == S_OK  # (oid, 1) is key 11
    assert all((dst.tensors[k] == rows(src, k, 1, 1)).all() for k in range(2))
    assert sorted(p.instance.cache_table.req_keys) == [(10, 0)]
    # the row is no longer bound to a key: the entry by id still serves it
    assert pull(d, did, id_key(2, oid, 1), pull_param()) == S_OK
    assert sorted(p.instance.cache_table.req_keys) == [(10, 0)]


# ---- CacheKey: prefix map if the prefix is valid, else the req map; offset = position x S -------
def test_cache_key_offset_is_the_key_position_times_the_source_stride(pair: Any) -> None:
    d, p = pair
    src = Mem(2, 3, 2 * S, seed=7)  # R.S = 2S
    ts.register(p, src, False, [cache_key(0, NO, 0), cache_key(0, 21), cache_key(0, NO, 0, 31)])
    dst = Mem(2, 2, S)  # L.S = S
    before = dst.copy()
    did = ts.register(d, dst, False)
    assert pull(d, did, cache_key(2, 21), pull_param(batch=1)) == S_OK
    for k in range(2):
        assert (dst.tensors[k][S:2 * S] == src.tensors[k][2 * S:3 * S]).all()  # position 1 x 2S
        assert (dst.tensors[k][:S] == before[k][:S]).all()
    assert pull(d, did, cache_key(2, NO, 0, 31), pull_param()) == S_OK  # prefix: position 2
    assert all((dst.tensors[k][:S] == src.tensors[k][4 * S:5 * S]).all() for k in range(2))
    assert pull(d, did, cache_key(2, 22), pull_param()) == NOT_EXIST
    assert pull(d, did, cache_key(2, NO, 0, 32), pull_param()) == NOT_EXIST
    # registered: never consumed
    assert pull(d, did, cache_key(2, 21), pull_param()) == S_OK
    assert (21, 0) in p.instance.cache_table.req_keys


def test_pull_size_above_the_source_stride_is_refused_by_the_peer(pair: Any) -> None:
    d, p = pair
    src = Mem(1, 2, S, seed=8)
    ts.register(p, src, False, [cache_key(0, 40)])
    dst = Mem(1, 1, 2 * S)
    did = ts.register(d, dst, False)
    assert pull(d, did, cache_key(2, 40), pull_param(size=S + 1)) == PARAM_INVALID
    assert not dst.tensors[0].any()
    assert pull(d, did, cache_key(2, 40), pull_param(size=S)) == S_OK  # exactly R.S
    assert (dst.tensors[0][:S] == src.tensors[0][:S]).all() and not dst.tensors[0][S:].any()


def test_host_to_host_is_not_enabled_and_host_needs_a_device_pool(pair: Any) -> None:
    d, p = pair
    src = Mem(1, 2, S, seed=8)
    ts.register(p, src, False, [cache_key(0, 50)], placement=HOST)
    dst = Mem(1, 1, S)
    did = ts.register(d, dst, False, placement=HOST)
    assert pull(d, did, cache_key(2, 50), pull_param()) == FEATURE_NOT_ENABLED
    assert not dst.tensors[0].any()
    dev = Mem(1, 1, S)
    assert pull(d, ts.register(d, dev, False), cache_key(2, 50), pull_param()) == S_OK  # H -> D
    assert (dev.tensors[0] == src.tensors[0][:S]).all()
    nopool, q = ts.engine(3), ts.engine(4)
    try:
        link(nopool, q)
        ts.register(q, src, False, [cache_key(0, 50)])
        hid = ts.register(nopool, Mem(1, 1, S), False, placement=HOST)
        assert pull(nopool, hid, cache_key(4, 50), pull_param()) == PARAM_INVALID  # local check
    finally:
        nopool.instance.finalize()
        q.instance.finalize()


# ---- consumption: owned caches through a non-prefix key; not registered ones --------------------
def test_owned_cache_key_is_consumed_after_the_pull(pair: Any) -> None:
    d, p = pair
    oid, src = ts.allocate(p, 2, S, 2, [cache_key(0, 60), cache_key(0, 61)], seed=11)
    dst = Mem(2, 1, S)
    did = ts.register(d, dst, False)
    assert pull(d, did, cache_key(2, 61), pull_param()) == S_OK
    assert all((dst.tensors[k] == rows(src, k, 1, 1)).all() for k in range(2))
    assert pull(d, did, cache_key(2, 61), pull_param()) == NOT_EXIST  # consumed on the peer
    assert (60, 0) in p.instance.cache_table.req_keys
    # a registered cache's key is never consumed, also on a peer that has owned caches
    reg = Mem(2, 1, S, seed=15)
    ts.register(p, reg, False, [cache_key(0, 65)])
    assert pull(d, did, cache_key(2, 65), pull_param()) == S_OK
    assert pull(d, did, cache_key(2, 65), pull_param()) == S_OK
    assert all((dst.tensors[k] == reg.tensors[k]).all() for k in range(2))
    # a failed pull does not consume
    big = Mem(2, 1, 2 * S)
    bid = ts.register(d, big, False)
    assert pull(d, bid, cache_key(2, 60), pull_param(size=S + 1)) == PARAM_INVALID
    assert (60, 0) in p.instance.cache_table.req_keys
    # the last reference: deallocate, then the pull consumes the last key and frees the cache
    assert pools.deallocate(p, oid) == 0
    assert pull(d, did, cache_key(2, 60), pull_param()) == S_OK
    deadline = time.monotonic() + 5
    while oid in p.instance.caches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert oid not in p.instance.caches


def test_with_layer_ranges_the_key_goes_once_every_tensor_was_pulled(pair: Any) -> None:
    d, p = pair
    oid, src = ts.allocate(p, 1, S, 4, [cache_key(0, 70)], seed=12)  # 2 layers of 2 tensors
    dst = Mem(4, 1, S)
    did = ts.register(d, dst, False)
    assert pull(d, did, cache_key(2, 70), pull_param(src=range(1, 2), dst=range(1, 2))) == S_OK
    assert (70, 0) in p.instance.cache_table.req_keys
    assert pull(d, did, cache_key(2, 70), pull_param(src=range(1, 2), dst=range(0, 1))) == S_OK
    assert (70, 0) in p.instance.cache_table.req_keys  # tensors 2, 3 twice: 0, 1 still due
    assert pull(d, did, cache_key(2, 70), pull_param(src=range(0, 1), dst=range(0, 1))) == S_OK
    assert (70, 0) not in p.instance.cache_table.req_keys
    assert all((dst.tensors[k] == src.tensors[k]).all() for k in range(4))


def test_prefix_key_and_blocks_pull_never_consume(pair: Any) -> None:
    d, p = pair
    _oid, src = ts.allocate(p, 2, S, 1, [cache_key(0, NO, 0, 80), cache_key(0, 80)], seed=13)
    dst = Mem(1, 1, S)
    did = ts.register(d, dst, False)
    assert pull(d, did, cache_key(2, NO, 0, 80), pull_param()) == S_OK
    assert pull(d, did, cache_key(2, NO, 0, 80), pull_param()) == S_OK
    assert (dst.tensors[0] == src.tensors[0][:S]).all()
    assert (80, 0) in p.instance.cache_table.prefix_keys
    assert (80, 0) in p.instance.cache_table.req_keys  # the same identity as a req key stays
    blocks = Mem(1, 2, S, seed=2)
    ts.register(p, blocks, True, [blocks_key(0, 3)])
    bdst = Mem(1, 2, S)
    assert pull(d, ts.register(d, bdst, True), blocks_key(2, 3), pull_param([1], [0])) == S_OK
    assert pull(d, ts.register(d, bdst, True), blocks_key(2, 3), pull_param([0], [1])) == S_OK
    assert (bdst.tensors[0] == blocks.tensors[0][[*range(S, 2 * S), *range(S)]]).all()


def test_cache_to_blocks_from_an_owned_cache_consumes_its_key(pair: Any) -> None:
    d, p = pair
    _oid, src = ts.allocate(p, 2, 2 * S, 2, [cache_key(0, 90), cache_key(0, 91)], seed=14)
    dst = Mem(2, 4, S)  # blocks of S bytes
    before = dst.copy()
    did = ts.register(d, dst, True)
    assert pull(d, did, cache_key(2, 91), pull_param([], [3, 1])) == S_OK
    for k in range(2):
        want = before[k].copy()
        want[3 * S:4 * S] = src.tensors[k][2 * S:3 * S]  # row 1 starts at 1 x R.S = 2S
        want[1 * S:2 * S] = src.tensors[k][3 * S:4 * S]
        assert (dst.tensors[k] == want).all()
    assert (91, 0) not in p.instance.cache_table.req_keys


# ---- across processes --------------------------------------------------------------------------
@pytest.fixture(params=["process_vm", "tcp"])
def remote(request: pytest.FixtureRequest) -> Iterator[tuple[Peer, Engine]]:
    """A peer process serving two-sided pulls (cluster 2), linked from this process (cluster 1);
    with and without the link's same-host data path (two-sided leases always go over TCP)."""
    port = free_port()
    env = {"KVDD_SIM_XPROC": "tcp"} if request.param == "tcp" else None
    with Peer(env=env) as peer:
        peer.call("twosided_support.serve", 2, port)
        d = ts.engine(1, wait_ms=500)
        assert ts.link_to(d, 2, port) == S_OK
        yield peer, d
        d.instance.finalize()
        if peer.process.is_alive():
            peer.call("twosided_support.finalize")


def test_across_processes_blocks_and_cache_key_with_consumption(remote: Any) -> None:
    peer, d = remote
    peer.call("twosided_support.register_blocks", 2, 4, S, 5, 0)
    dst = Mem(2, 4, S)
    before = dst.copy()
    did = ts.register(d, dst, True)
    assert pull(d, did, blocks_key(2, 0), pull_param([0, 1], [1, 2])) == S_OK
    src = [np.frombuffer(b, np.uint8) for b in peer.call("twosided_support.tensors", 0)]
    expect_blocks(dst.tensors, before, src, [(0, 1), (1, 2)], S)
    assert pull(d, did, blocks_key(2, 0), pull_param([4], [0])) == PARAM_INVALID
    peer.call("twosided_support.allocate_cache", 2, 2, 2 * S, 7, [10, 11])
    c = Mem(2, 1, 2 * S)
    cid = ts.register(d, c, False)
    assert pull(d, cid, cache_key(2, 11), pull_param()) == S_OK
    owned = [np.frombuffer(b, np.uint8) for b in peer.call("twosided_support.tensors", 1)]
    assert all((c.tensors[k] == owned[k][2 * S:]).all() for k in range(2))
    assert peer.call("twosided_support.keys") == [(10, 0), (NO, 0)]
    assert pull(d, cid, cache_key(2, 11), pull_param()) == NOT_EXIST
    assert pull(d, cid, cache_key(2, 10), pull_param(size=2 * S + 1)) == PARAM_INVALID
    assert peer.call("twosided_support.keys") == [(10, 0), (NO, 0)]


def test_a_peer_that_stops_answering_gives_timeout_within_the_wait(remote: Any) -> None:
    peer, d = remote
    peer.call("twosided_support.register_blocks", 1, 2, S, 5, 0)
    dst = Mem(1, 2, S)
    did = ts.register(d, dst, True)
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert pull(d, did, blocks_key(2, 0), pull_param([0], [0])) == TIMEOUT
        assert time.monotonic() - t0 < 0.5 + 1.0
        assert not dst.tensors[0].any()
    finally:
        os.kill(peer.pid, signal.SIGCONT)


# ---- the peer's side given anything: a malformed or hostile request -----------------------------
def test_the_peer_refuses_malformed_requests_and_serves_only_inside_its_entry(pair: Any) -> None:
    d, p = pair
    src = Mem(1, 2, S, seed=16)
    ts.register(p, src, True, [blocks_key(0, 0)])
    inst = p.instance
    assert inst.resolve_lease(b"short")[:2] == (PARAM_INVALID, None)
    req = twosided.REQUEST.pack(-1, 0, NO, NO, 0, 1, 0, 1, 0, 0, S, 0, 1)  # block size 0
    assert inst.resolve_lease(req)[:2] == (PARAM_INVALID, None)
    req = twosided.REQUEST.pack(-1, 0, NO, NO, 0, 1, S, 1, 0, 0, S, 1, 1)
    status, entry, answer, _ = inst.resolve_lease(req)
    assert status == S_OK and entry is not None
    assert twosided.ANSWER.unpack(answer) == (1, 2 * S, S, 2, 0)
    # a lease on that entry reads only inside its tensors
    peer = d.instance.entities[2].peer
    status, lease, _ = peer.acquire_resolved(req, 1000)
    assert status == S_OK
    out = Mem(1, 2, S)
    regions = d.instance.caches[ts.register(d, out, True)].regions
    try:
        for off, n, tensor in ((S + 1, S, 0), (0, S, 1), (-1, 2, 0)):  # past the end, tensor, start
            got = peer.read(lease, [tensor], np.array([off]), regions, np.array([0]),
                            np.array([n]), 1000)
            assert got == PARAM_INVALID
        assert not out.tensors[0].any()
    finally:
        peer.release(lease)
    ra = ts.engine(5)
    ra.instance.remote_accessible = True  # a one-sided engine serves no two-sided request
    try:
        ts.register(ra, src, True, [blocks_key(0, 0)])
        assert ra.instance.resolve_lease(req)[:2] == (NOT_EXIST, None)
    finally:
        ra.instance.finalize()



def _closed(s: Any, timeout: float = 5.0) -> bool:
    """True when the peer closed ``s`` within ``timeout`` (discarding input)."""
    s.settimeout(timeout)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if not s.recv(1 << 20):
                return True
    except ConnectionResetError:
        return True
    except OSError:
        return False
    return False


def _resolved_lease(s: Any, request: bytes, req: int) -> tuple[int, int, bytes]:
    s.sendall(rawpeer.frame(wire.F_LEASE, struct.pack("<Q", 0) + request, req))
    while True:
        ftype, rreq, body = rawpeer.read_frame(s)
        if ftype == wire.F_LEASE_REPLY and rreq == req:
            status, lease_id = struct.unpack_from("<IQ", body)
            return status, lease_id, body[12:]


def test_a_raw_peer_gets_nothing_unless_linked_and_only_inside_the_entry() -> None:
    p = ts.engine(2)
    try:
        src = Mem(1, 2, S, seed=17)
        ts.register(p, src, True, [blocks_key(0, 0)])
        port = p.instance.listen_port
        req = twosided.REQUEST.pack(-1, 0, NO, NO, 0, 1, S, 1, 0, 0, S, 1, 1)
        ask = rawpeer.frame(wire.F_LEASE, struct.pack("<Q", 0) + req, 1)
        with rawpeer.connect(port) as s:  # before authentication
            s.sendall(ask)
            assert _closed(s)
        with rawpeer.connect(port) as s:  # authenticated, never linked
            rawpeer.authenticate(s)
            s.sendall(ask)
            assert _closed(s)
        claim = {EXTENSION: Claim(9, False).encode()}
        s, _snap = rawpeer.link(port, 9, extensions=claim)
        with s:
            other = twosided.REQUEST.pack(-1, 0, NO, NO, 1, 1, S, 1, 0, 0, S, 1, 1)
            assert _resolved_lease(s, other, 2)[:2] == (NOT_EXIST, 0)
            status, lease_id, answer = _resolved_lease(s, req, 3)
            assert status == S_OK and lease_id != 0
            assert twosided.ANSWER.unpack(answer) == (1, 2 * S, S, 2, 0)
            for tensors, off, n in (([0], S + 1, S), ([1], 0, 1), ([0], 2 * S, 1)):
                body = wire.encode_request(lease_id, tensors, np.array([off]),
                                           np.array([n]))
                s.sendall(rawpeer.frame(wire.F_READ, body, 4))
                ftype, rreq, done = rawpeer.read_frame(s)
                assert (ftype, rreq, struct.unpack("<I", done)[0]) == (wire.F_DONE, 4,
                                                                       PARAM_INVALID)
            body = wire.encode_request(lease_id, [0], np.array([S]), np.array([S]))
            s.sendall(rawpeer.frame(wire.F_READ, body, 5))
            ftype, rreq, data = rawpeer.read_frame(s)
            assert ftype == wire.F_DATA and data == src.tensors[0][S:].tobytes()
    finally:
        p.instance.finalize()
