"""A linked same-host peer that lies in its hello about its caches' addresses and sizes
(kvdd.sim._fastpath + kvdd._native._xproc.SameHostMover, and the Python path's
kvdd.sim.fabric.samehost_path.OneSidedPeer).

The reader cannot know where the peer really keeps a cache: addresses and sizes are the peer's
word.  What it guarantees is that a lie reaches only the attested peer's memory (the copies go
through the peer's ``/proc/<pid>/mem``, so an address that names *our* secret in our own address
space names the peer's memory there), that every local byte touched lies in the run the caller
named (guards around it stay), and that the compiled path and the Python path answer every lie
alike (status, and every byte of both processes).

The lies are set in the reader's view of the link (the values a hostile hello would have
announced: ``RemotePeer``'s snapshot and addresses), against an honest owner in another process.
Both processes map a page at the same fixed address FIXED: the owner's holds 0xC1, ours 0x5E.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvdd
from kvdd import (Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, KvCacheExtParam,
                  LlmDataDist, LlmRole, Status, tensor_addrs)
from kvdd.sim import _fastpath
from kvdd.sim.engine import SimBackend
from kvdd.sim.fabric import samehost
from kvdd.sim.fabric.peers import RemotePeer

def sim(dd: LlmDataDist) -> SimBackend:
    assert isinstance(dd.backend, SimBackend)
    return dd.backend


pytestmark = pytest.mark.skipif(not samehost.availability()[0],
                                reason=samehost.availability()[1])

FIXED = 0x2B0000000000
PAGE = 1 << 16  # FIXED's mapping in both processes
N = 4096  # bytes per cache row (one row, one tensor)
GUARD = 4096

# The honest owner: a [1, N] cache inside guards of 0x77 (its bytes 0x0A), and PAGE bytes of 0xC1
# at FIXED.  "sum" -> digests of the arena and the FIXED page; "reset" restores both.
_OWNER = r"""
import ctypes, hashlib, sys, numpy as np, kvdd
from kvdd import CacheDesc, DataType, LlmDataDist, LlmRole, tensor_addrs
FIXED, PAGE, N, G = (int(a) for a in sys.argv[1:5])
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
assert libc.mmap(FIXED, PAGE, 3, 0x22 | 0x100000, -1, 0) == FIXED
fixed = np.ctypeslib.as_array((ctypes.c_uint8 * PAGE).from_address(FIXED))
arena = np.empty(N + 2 * G, np.uint8)
def reset():
    fixed[:] = 0xC1
    arena[:] = 0x77
    arena[G:G + N] = 0x0A
reset()
dd = LlmDataDist(2, LlmRole.PROMPT, backend="sim")
dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0", kvdd.OPTION_DEVICE_ID: "2"})
cid = dd.register_kv_cache(CacheDesc(1, DataType.DT_UINT8, (1, N)), tensor_addrs([arena[G:G + N]]))
print(dd.listening_port, cid, int(arena.ctypes.data) + G, flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "sum":
        print(hashlib.sha256(arena.tobytes()).hexdigest()[:16],
              hashlib.sha256(fixed.tobytes()).hexdigest()[:16], flush=True)
    elif cmd == "reset":
        reset()
        print("ok", flush=True)
    else:
        break
"""


class World:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(FIXED), str(PAGE), str(N),
                                      str(GUARD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        self.port, self.cid, self.owner_addr = map(int, self.proc.stdout.readline().split())
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        if libc.mmap(FIXED, PAGE, 3, 0x22 | 0x100000, -1, 0) != FIXED:  # our own secret
            pytest.skip("FIXED is taken in this process")
        self.secret = np.ctypeslib.as_array((ctypes.c_uint8 * PAGE).from_address(FIXED))
        self.arena = np.empty(N + 2 * GUARD, np.uint8)
        self.dd = LlmDataDist(1, LlmRole.DECODER, backend="sim")
        self.dd.initialize({kvdd.OPTION_DEVICE_ID: "1",
                            kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        desc = CacheDesc(1, DataType.DT_UINT8, (1, N))
        self.mine = Cache(self.dd.register_kv_cache(
            desc, tensor_addrs([self.arena[GUARD:GUARD + N]])), (), desc)
        info = ClusterInfo(remote_cluster_id=2, remote_ip_infos=(IpInfo("127.0.0.1", self.port),))
        self.dd.link_llm_clusters([info], 10_000)
        assert sim(self.dd).link_data_path(2) == "process_vm"
        peer = sim(self.dd).entities[2].peer
        assert isinstance(peer, RemotePeer)
        self.peer = peer
        self.honest = (peer._snapshot[self.cid], peer._addrs[self.cid])

    def ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def reset(self) -> None:
        self.secret[:] = 0x5E
        self.arena[:] = 0x66
        self.arena[GUARD:GUARD + N] = 0x33
        assert self.ask("reset") == "ok"

    def lie(self, addrs: tuple[int, ...] | None = None, **fields: Any) -> None:
        rc, honest_addrs = self.honest
        self.peer._snapshot[self.cid] = dataclasses.replace(rc, **fields)
        self.peer._addrs[self.cid] = honest_addrs if addrs is None else addrs

    def state(self) -> tuple[str, str, str]:
        """Digests of our arena, our FIXED page and the owner's two."""
        return (hashlib.sha256(self.arena.tobytes()).hexdigest()[:16],
                hashlib.sha256(self.secret.tobytes()).hexdigest()[:16], self.ask("sum"))

    def close(self) -> None:
        self.dd.finalize()
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


ONE = KvCacheExtParam(tensor_num_per_layer=1)


def _call(w: World, op: str, row: int) -> int:
    try:
        if op == "pull":
            w.dd.pull_kv_cache(CacheIndex(2, w.cid, row), w.mine, 0, -1, ONE)
        elif op == "push":
            w.dd.push_kv_cache(w.mine, CacheIndex(2, w.cid, row), 0, -1, ONE)
        elif op == "pull_blocks":
            w.dd.pull_kv_blocks(CacheIndex(2, w.cid, 0), w.mine, [row], [0], ONE)
        else:
            w.dd.push_kv_blocks(w.mine, CacheIndex(2, w.cid, 0), [0], [row], ONE)
    except kvdd.LLMError as exc:
        return int(exc.status)
    return int(Status.LLM_SUCCESS)


def _both_paths(w: World, op: str, row: int) -> tuple[int, tuple[str, str, str], bytes, int]:
    """The call with the compiled path, then with the Python path alone, from the same state:
    the two outcomes must be equal; returns the compiled one and whether it was taken there."""
    out = []
    fast_paths = sim(w.dd).fast_transfers
    taken = 0
    for fast in (True, False):
        w.reset()
        prev = _fastpath.set_enabled(fast)
        before = fast_paths.taken
        try:
            st = _call(w, op, row)
        finally:
            _fastpath.set_enabled(prev)
        if fast:
            taken = fast_paths.taken - before
        out.append((st, w.state(), w.arena[GUARD:GUARD + N].tobytes()))
        if st == Status.LLM_TIMEOUT:  # a broken link: not in these cases
            pytest.fail(f"{op}: LLM_TIMEOUT")
        # our guards and our FIXED page never change
        assert (w.arena[:GUARD] == 0x66).all() and (w.arena[-GUARD:] == 0x66).all()
        assert (w.secret == 0x5E).all()
    assert out[0] == out[1], f"{op}: compiled {out[0][0]:#x} vs python {out[1][0]:#x}"
    return (*out[0], taken)


OPS = ["pull", "push", "pull_blocks", "push_blocks"]


@pytest.mark.parametrize("op", OPS)
def test_an_address_naming_our_memory_reaches_the_peers(world: World, op: str) -> None:
    """The peer says its cache lives at FIXED, where *we* keep a secret: a pull reads the peer's
    page there (0xC1), a push writes the peer's page; our secret is neither read nor written."""
    world.lie(addrs=(FIXED,))
    try:
        st, state, got, taken = _both_paths(world, op, 0)
    finally:
        world.lie()
    assert (st, taken) == (Status.LLM_SUCCESS, 1)  # (taken by the compiled path)
    if op.startswith("pull"):
        assert got == b"\xc1" * N
    else:
        assert got == b"\x33" * N
        world.reset()
        honest_arena, _ = world.ask("sum").split()
        assert state[2].split()[0] == honest_arena  # its registered cache untouched: the lie's own
        assert state[2].split()[1] != world.ask("sum").split()[1]  # its FIXED page got our bytes


@pytest.mark.parametrize("op", OPS)
def test_lying_sizes_move_only_the_callers_run(world: World, op: str) -> None:
    """The peer claims a tensor of 2**62 (or 2**63-1) bytes and 2**40 rows (the real one has 1
    row of N): a row or block far past the real cache reads or writes the peer's memory there or
    fails (its memory, its lie), a block whose end passes the claimed tensor (the block count
    computed near 2**63) is refused; our side moves exactly the caller's N-byte run, guards
    intact; both paths agree."""
    rows = [1, 1 << 20, (1 << 32) - 1]
    if op.endswith("blocks"):
        rows += [(1 << 50), (1 << 51) - 1, 1 << 51, 1 << 52, (1 << 64) - 1]
    for nbytes in (1 << 62, (1 << 63) - 1):
        world.lie(tensor_nbytes=nbytes, batch_size=1 << 40, num_blocks=-1)
        try:
            for row in rows:
                st, _, got, _ = _both_paths(world, op, row)
                assert st in (Status.LLM_SUCCESS, Status.LLM_FAILED,
                              Status.LLM_PARAM_INVALID), hex(st)
                if row * N >= nbytes:
                    assert st == Status.LLM_PARAM_INVALID
        finally:
            world.lie()


@pytest.mark.parametrize("op", OPS)
def test_addresses_that_overflow_are_refused(world: World, op: str) -> None:
    """Addresses whose end passes 2**64 (or 0): refused before any byte moves, by both paths
    alike; 2**63 and above (negative ``pread`` offsets): the peer's kernel half, nothing moves."""
    for addr in ((1 << 64) - N // 2, 0, (1 << 64) - N, 1 << 63):
        world.lie(addrs=(addr,))
        try:
            st, state, got, taken = _both_paths(world, op, 0)
        finally:
            world.lie()
        assert st != Status.LLM_SUCCESS and taken == 0, hex(addr)
        assert got == b"\x33" * N  # nothing landed in our cache
        world.reset()
        assert state[2] == world.ask("sum")  # nor in the peer


@pytest.mark.parametrize("op", OPS)
def test_a_tensor_count_lie_is_not_served_one_sided(world: World, op: str) -> None:
    """Two addresses for a one-tensor cache (or none): the one-sided path does not serve it; the
    call goes over TCP, where the owner answers from its real registration."""
    for addrs in ((world.owner_addr, FIXED), ()):
        world.lie(addrs=addrs)
        try:
            st, _, got, taken = _both_paths(world, op, 0)
        finally:
            world.lie()
        assert (st, taken) == (Status.LLM_SUCCESS, 0)
        if op.startswith("pull"):
            assert got == b"\x0a" * N


@pytest.mark.parametrize("op", OPS)
def test_a_stride_past_int64_goes_to_the_python_path(world: World, op: str) -> None:
    """The hello's row stride is 64 bits unsigned: a peer that claims 2**63 or 2**64-1 bytes gets
    the Python path's answer (the compiled path declines what it cannot hold in int64, never
    raises), with the same bytes in both processes; our guards and FIXED page intact."""
    for stride in (1 << 63, (1 << 64) - 1):
        world.lie(stride_nbytes=stride)
        try:
            st, _, got, _ = _both_paths(world, op, 0)
        finally:
            world.lie()
        assert st == Status.LLM_SUCCESS, hex(stride)
        assert got == (b"\x0a" if op.startswith("pull") else b"\x33") * N
