"""Links and transfers between processes and hosts (kvdd.sim.fabric; SEMANTICS.md §2.3-2.4,
§3.3, §3.5-3.6, §10 rules 2, 5, 6, 8, 9, 13).

The node under test ("D") lives in this process; its peers ("P") live in a separate Python process
(:mod:`peer_proc`), reached only through the simulator's fabric: authenticated TCP connections for
links, control and data (the same-host one-sided path has its own tests, ``tests/hostile/test_samehost*``
and the bench).  Every successful transfer is checked byte for byte over every arena of both processes
(the harness's reference model), so bytes outside the targets are checked too.  Tests that kill or
stop a peer get their own process.  Nothing here asserts on speed; the time bounds are "no hang"
bounds, far above what the operations take.

This file: the process_vm kernel, links, data paths and link semantics; test_fabric_leases.py:
leases, dead and silent peers; test_fabric_server.py: the server under hostile input, independent
processes and hosts, handshake extensions, the owner's streaming."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvdd
from kvdd import DataType, LlmRole, Status
from kvdd._native import _xproc

from conformance.checked import (
    pull_blocks_checked,
    pull_cache_checked,
    push_blocks_checked,
    push_cache_checked,
)
from conformance.harness import (
    ALREADY_LINK,
    KV_CACHE_NOT_EXIST,
    LINK_FAILED,
    NOT_YET_LINK,
    TIMEOUT,
    CacheHandle,
    Node,
    Spec,
    World,
    link,
    raises,
    register,
    unlink,
)
from peer_proc import PeerProcess
from fabric_world import (
    S,
    WAIT,
    xproc,
    proc,
    world,
    setup_pair,
    d_path,
    expected_paths,
)

# ---- the process_vm kernel (kvdd._native._xproc) ------------------------------------------------


def _arena(n: int, seed: int) -> tuple[np.ndarray, Any]:
    from kvdd._native._copy import Region
    a = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return a, Region(int(a.ctypes.data), n, a)


@pytest.mark.parametrize("write", [False, True])
def test_pvm_copy_runs_exact(write: bool) -> None:
    """pvm_copy on this very process: runs k outer, j inner, bytes outside untouched."""
    from kvdd._native._copy import Region
    local, _ = _arena(4 * 1024, 1)
    remote, _ = _arena(4 * 1024, 2)
    loc = [Region(int(local.ctypes.data) + k * 1024, 1024, local) for k in range(4)]
    rem = [int(remote.ctypes.data) + k * 1024 for k in (3, 1, 2, 0)]
    lo, ro, ln = (np.array(v, np.int64) for v in ([0, 100, 1000], [512, 0, 1020], [100, 300, 4]))
    exp_local, exp_remote = local.copy(), remote.copy()
    for k, rk in enumerate((3, 1, 2, 0)):
        for j in range(3):
            a, b = k * 1024 + int(lo[j]), rk * 1024 + int(ro[j])
            if write:
                exp_remote[b:b + ln[j]] = exp_local[a:a + ln[j]]
            else:
                exp_local[a:a + ln[j]] = exp_remote[b:b + ln[j]]
    n = _xproc.pvm_copy(os.getpid(), loc, rem, 1024, lo, ro, ln, write, chunk=4096)
    assert n == 4 * 404
    assert np.array_equal(local, exp_local) and np.array_equal(remote, exp_remote)


def test_pvm_copy_errors() -> None:
    import mmap
    local, reg = _arena(8192, 3)
    before = local.copy()
    one = np.array([0], np.int64)
    with pytest.raises(ValueError):  # remote run past the remote tensor: nothing moves
        _xproc.pvm_copy(os.getpid(), [reg], [int(local.ctypes.data)], 100, one, one,
                        np.array([101], np.int64), False)
    with pytest.raises(ValueError):  # local run past the local region
        _xproc.pvm_copy(os.getpid(), [reg], [int(local.ctypes.data)], 1 << 20,
                        np.array([8000], np.int64), one, np.array([300], np.int64), False)
    assert np.array_equal(local, before)
    # EFAULT after a partial transfer: the second run's remote page is not mapped
    m = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    buf = np.frombuffer(m, dtype=np.uint8)
    base = int(buf.ctypes.data)
    gap = mmap.mmap(-1, mmap.PAGESIZE)
    addr_gap = int(np.frombuffer(gap, dtype=np.uint8).ctypes.data)
    del buf
    gap.close()  # unmapped now
    with pytest.raises(OSError) as info:
        _xproc.pvm_copy(os.getpid(), [reg, reg], [base, addr_gap], 4096, one, one,
                        np.array([64], np.int64), False)
    assert info.value.errno == 14 and "after 64 bytes" in str(info.value)  # EFAULT
    assert not local[:64].any() and np.array_equal(local[64:], before[64:])  # the partial part
    before = local.copy()
    m.close()
    # ESRCH: a process that no longer exists
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        _xproc.pvm_copy(child.pid, [reg], [base], 64, one, one, np.array([8], np.int64), False)
    # a deadline checked between system calls
    _big, breg = _arena(1 << 22, 4)
    with pytest.raises(TimeoutError):
        _xproc.pvm_copy(os.getpid(), [breg], [int(local.ctypes.data)], 8192, np.array(
            [0] * 512, np.int64), np.array([0] * 512, np.int64), np.array([8192] * 512, np.int64),
            False, timeout_ms=0, chunk=4096)
    assert np.array_equal(local, before)


# ---- link, data path, every transfer kind in both directions -----------------------------------


def test_link_uses_the_expected_data_path(world: World, proc: PeerProcess, xproc: str) -> None:
    d, p, dh, ph = setup_pair(world)
    assert link(d, p) == [S]
    d_to_p, p_to_d = expected_paths(xproc, proc)
    assert d_path(d, 1) == d_to_p
    assert p.data_path(2) == p_to_d  # comm: the acceptor has an entity for D's real id
    assert p.entity_keys() == [2]
    pull_cache_checked(world, d, ph, dh)


Kind = Callable[[World, Node, CacheHandle, CacheHandle], None]


def _pull_cache(w: World, caller: Node, mine: CacheHandle, theirs: CacheHandle) -> None:
    pull_cache_checked(w, caller, theirs, mine, batch_index=1, src_batch=2)


def _pull_blocks(w: World, caller: Node, mine: CacheHandle, theirs: CacheHandle) -> None:
    pull_blocks_checked(w, caller, theirs, mine, [0, 1, 3, 2], [3, 0, 1, 1])


def _push_cache(w: World, caller: Node, mine: CacheHandle, theirs: CacheHandle) -> None:
    push_cache_checked(w, caller, mine, theirs, src_batch_index=1, dst_batch=3)


def _push_blocks(w: World, caller: Node, mine: CacheHandle, theirs: CacheHandle) -> None:
    push_blocks_checked(w, caller, mine, theirs, [1, 2, 0], [0, 3, 2])


KINDS: dict[str, Kind] = {"pull_cache": _pull_cache, "pull_blocks": _pull_blocks,
                          "push_cache": _push_cache, "push_blocks": _push_blocks}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("caller", ["initiator", "acceptor"])
@pytest.mark.parametrize("initiator", ["here", "peer"])
def test_transfer_kinds_both_directions(world: World, kind: str, caller: str,
                                        initiator: str) -> None:
    """D links to P or P links to D (comm: bidirectional); then the initiator or the acceptor
    pulls / pushes; every byte of both processes is checked."""
    d, p, dh, ph = setup_pair(world, d_listen=initiator == "peer")
    init: Node = d if initiator == "here" else p
    acc: Node = p if initiator == "here" else d
    assert link(init, acc) == [S]
    who = init if caller == "initiator" else acc
    mine, theirs = (dh, ph) if who is d else (ph, dh)
    KINDS[kind](world, who, mine, theirs)
    KINDS[kind](world, who, mine, theirs)  # a second transfer over the same link


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_large_rows_and_layer_ranges(world: World, kind: str) -> None:
    """Rows of 256 KiB (the TCP path sends / receives them in place rather than staging them) and
    a layer range; both directions."""
    big = Spec(n=4, dtype=DataType.DT_INT32, shape=(4, 65536))
    d, p, dh, ph = setup_pair(world, spec=big)
    assert link(d, p) == [S]
    KINDS[kind](world, d, dh, ph)
    KINDS[kind](world, p, ph, dh)
    e = kvdd.KvCacheExtParam(src_layer_range=(1, 1), dst_layer_range=(0, 0), tensor_num_per_layer=2)
    if kind == "pull_cache":
        pull_cache_checked(world, d, ph, dh, ext_param=e, src_batch=3)
    elif kind == "push_blocks":
        push_blocks_checked(world, p, ph, dh, [3], [0], ext_param=e)


def test_many_small_runs(world: World) -> None:
    """4096 one-block runs of 64 bytes (staged through one buffer on the TCP path)."""
    spec = Spec(n=2, dtype=DataType.DT_UINT8, shape=(8192, 64))
    d, p, dh, ph = setup_pair(world, spec=spec)
    assert link(d, p) == [S]
    rng = random.Random(7)
    src = list(range(0, 8192, 2))
    dst = rng.sample(range(8192), len(src))
    pull_blocks_checked(world, d, ph, dh, src, dst)
    push_blocks_checked(world, d, dh, ph, dst, src)


# ---- link semantics across processes ---------------------------------------------------------


def test_visibility_snapshot_at_link_time(world: World) -> None:
    """§2.4 / rule 3: caches registered after the link are not found over it (either side)."""
    d, p, dh, ph = setup_pair(world)
    assert link(d, p) == [S]
    late_p = register(p, Spec())
    late_d = register(d, Spec())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(late_p.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        p.pull_kv_cache(late_d.index(), ph.cache())
    pull_cache_checked(world, d, ph, dh)
    assert unlink(d, p) == [S]
    assert link(d, p) == [S]
    pull_cache_checked(world, d, late_p, dh)
    pull_cache_checked(world, p, late_d, ph)


def test_unregistered_remote_cache_is_not_found(world: World) -> None:
    """Rule 2: an unregistered cache of the peer is not found (never read)."""
    d, p, dh, ph = setup_pair(world)
    assert link(d, p) == [S]
    p.unregister(ph.cache_id)
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_cache(dh.cache(), ph.index())


def test_already_link_unlink_relink(world: World) -> None:
    d, p, dh, ph = setup_pair(world)
    assert link(d, p) == [S]
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p)
    assert p.entity_keys() == [2]
    assert unlink(d, p) == [S]  # non-force: P drops its entity for D too (§3.6)
    assert p.entity_keys() == []
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(NOT_YET_LINK):
        p.pull_kv_cache(dh.index(), ph.cache())
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)
    push_blocks_checked(world, p, ph, dh, [0], [1])


def test_force_unlink_is_local(world: World) -> None:
    """§3.6: a force unlink never tells the peer; P's entity for D keeps working."""
    d, p, dh, ph = setup_pair(world)
    assert link(d, p) == [S]
    assert unlink(d, p, force=True) == [S]
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(), dh.cache())
    assert p.entity_keys() == [2]
    pull_cache_checked(world, p, dh, ph)
    # linking again: D has no entity (force link), P replaces its stale one
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)
    pull_cache_checked(world, p, dh, ph)


def test_wrong_remote_cluster_id_relinks(world: World) -> None:
    """§7.18: keyed by real ids; a wrong remote_cluster_id force-relinks every time."""
    d, p, dh, ph = setup_pair(world)
    assert link(d, p, remote_cluster_id=9) == [S]
    assert link(d, p, remote_cluster_id=9) == [S]
    pull_cache_checked(world, d, ph, dh)
    pull_cache_checked(world, p, dh, ph)


def test_hixl_is_one_way(world: World) -> None:
    """§2.3: on hixl only the initiator has an entity, keyed by the user-supplied id."""
    d, p, dh, ph = setup_pair(world, "hixl")
    assert link(d, p, remote_cluster_id=5) == [S]
    assert p.entity_keys() == []
    pull_cache_checked(world, d, ph, dh, index=ph.index(cluster_id=5))
    push_cache_checked(world, d, dh, ph, index=ph.index(cluster_id=5))
    with world.rejects(NOT_YET_LINK):
        p.pull_kv_cache(dh.index(), ph.cache())
    with raises(ALREADY_LINK, rets=[Status.LLM_ALREADY_LINK]):
        link(d, p, remote_cluster_id=6)
    assert unlink(d, p, remote_cluster_id=5) == [S]  # local only
    with world.rejects(NOT_YET_LINK):
        d.pull_kv_cache(ph.index(cluster_id=5), dh.cache())
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph, dh)


def test_backend_mismatch_fails_to_link(world: World) -> None:
    p = world.peer(1, LlmRole.PROMPT)
    p.initialize(listen=True, transfer="hixl")
    d = world.dut(2, LlmRole.DECODER)
    d.initialize()
    with raises(LINK_FAILED, rets=[Status.LLM_LINK_FAILED]):
        link(d, p)


def test_peer_finalize_caches_not_found(world: World) -> None:
    """A peer that finalized says so: its caches are not found (KV_CACHE_NOT_EXIST), both ways."""
    d, p, dh, ph = setup_pair(world)
    assert link(d, p) == [S]
    p.finalize()
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(KV_CACHE_NOT_EXIST):
        d.push_kv_blocks(dh.cache(), ph.index(), [0], [0])
    # the stale entity stays until unlinked (§3.3); relinking a fresh P works
    p.initialize(listen=True)
    ph2 = register(p, Spec())
    assert unlink(d, p, force=True) == [S]
    assert link(d, p) == [S]
    pull_cache_checked(world, d, ph2, dh)


def test_local_finalize_with_links(world: World) -> None:
    d, p, dh, ph = setup_pair(world)
    assert link(d, p) == [S]
    d.finalize()
    with world.rejects(KV_CACHE_NOT_EXIST):  # D finalized: P's stale entity finds nothing
        p.pull_kv_cache(dh.index(), ph.cache())
    d.initialize()
    dh2 = register(d, Spec())
    assert link(d, p) == [S]  # P force-relinks (D has no entity)
    pull_cache_checked(world, p, dh2, ph)


def test_sync_wait_zero_times_out(world: World) -> None:
    """Rule 9: llm.SyncKvCacheWaitTime=0 → every transfer that must wait for another process times
    out; the link is then broken (rule 8)."""
    d, p, dh, ph = setup_pair(world, d_extra={WAIT: "0"})
    assert link(d, p) == [S]
    with world.unchanged(), pytest.raises(kvdd.LLMTimeoutError, match="SyncKvCacheWaitTime is 0"):
        d.pull_kv_cache(ph.index(), dh.cache())
    with world.rejects(TIMEOUT):
        d.push_kv_cache(dh.cache(), ph.index())


def test_concurrent_links_in_both_directions(world: World) -> None:
    """Transfers over different links run in parallel (rule 5); two peers, both directions."""
    d, p, dh, ph = setup_pair(world, d_listen=True)
    p2 = world.peer(3, LlmRole.PROMPT)
    p2.initialize()
    p2h = register(p2, Spec())
    assert link(d, p) == [S]
    assert link(p2, d) == [S]
    errors: list[BaseException] = []

    def loop(fn: Callable[[], None]) -> None:
        try:
            for _ in range(20):
                fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(f,)) for f in (
        lambda: d.pull_kv_cache(ph.index(1), dh.cache(), 1),
        lambda: p.push_kv_cache(ph.cache(), dh.index(2), 3),
        lambda: p2.pull_kv_blocks(dh.index(), p2h.cache(), [0], [3]),
    )]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # the final state is well defined: check it with one more checked transfer each
    pull_cache_checked(world, d, ph, dh, batch_index=1, src_batch=1)
    pull_blocks_checked(world, p2, dh, p2h, [0], [3])
