"""Kill a peer process at random points of a transfer; the survivor must cope.

A child process (``peer_child.py``) runs a listening simulator instance with a source cache of a
known pattern.  The survivor (this process) links to it, starts a large transfer (pull, pull
blocks, push or push blocks, over ``process_vm_readv/writev`` or the TCP data path) and the child is
SIGKILLed after a random delay.  Then, per SEMANTICS.md §10:

* the transfer returns LLM_SUCCESS (it finished first: exact bytes) or LLM_TIMEOUT (rule 2: the
  owner cannot be reached), and returns as soon as the death is certain, not after
  ``llm.SyncKvCacheWaitTime`` (20 s here);
* no byte outside the transfer's targets changed (rule 9; guard bytes surround every tensor);
* every later transfer over that link returns LLM_TIMEOUT at once (rule 8); a non-force unlink
  cannot reach the peer (LLM_UNLINK_FAILED), linking to its dead port fails (LLM_LINK_FAILED), a
  force unlink succeeds;
* the survivor's other link (to an in-process peer) is unaffected, and it links to a new child.

Needs the cross-process fabric: skipped, with the reason, while a link to another process fails.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LLMError, Status

from .conftest import PROFILE

LOCAL = "127.0.0.1"
N, ROWS, ROW = 4, 4, 1 << 20  # 4 tensors of 4 rows x 1 MiB: pulling all blocks moves 16 MiB
T = ROWS * ROW
GUARD = 4096
DESC = CacheDesc(num_tensors=N, data_type=DataType.DT_UINT8, shape=(ROWS, ROW))
CHILD = os.path.join(os.path.dirname(__file__), "peer_child.py")
WAIT_MS = 20000
U8 = npt.NDArray[np.uint8]
KINDS = ("pull_kv_cache", "pull_kv_blocks", "push_kv_cache", "push_kv_blocks")


def pattern(seed: int) -> list[U8]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, T, dtype=np.uint8) for _ in range(N)]


@dataclass
class Child:
    cid: int
    seed: int
    proc: subprocess.Popen[str]
    port: int
    src_id: int
    dst_id: int

    def cluster(self) -> ClusterInfo:
        return ClusterInfo(remote_cluster_id=self.cid, local_ip_infos=(IpInfo(LOCAL),),
                           remote_ip_infos=(IpInfo(LOCAL, self.port),))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


def spawn(cid: int, seed: int, faults_env: str | None = None) -> Child:
    env = dict(os.environ)
    env.pop("KVDD_SIM_FAULTS", None)
    if faults_env is not None:
        env["KVDD_SIM_FAULTS"] = faults_env
    proc = subprocess.Popen([sys.executable, CHILD, str(cid), str(N), str(ROWS), str(ROW), str(seed)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""))
    reader.start()
    reader.join(60)
    if not line or not line[0].startswith("ready"):
        proc.kill()
        raise RuntimeError(f"peer child did not start: {line!r}")
    _, port, src_id, dst_id = line[0].split()
    return Child(cid, seed, proc, int(port), int(src_id), int(dst_id))


class Survivor:
    """This process's instance (cluster 1) plus an in-process peer (cluster 2) it stays linked to."""

    def __init__(self) -> None:
        self.dd = kvdd.LlmDataDist(1, kvdd.LlmRole.DECODER, backend="sim")
        self.dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_SYNC_CACHE_WAIT_TIME: str(WAIT_MS)})
        stride = T + GUARD
        self.arena = np.zeros(GUARD + N * stride, np.uint8)
        self.mem = [self.arena[GUARD + k * stride:GUARD + k * stride + T] for k in range(N)]
        self.cache_id = self.dd.register_kv_cache(DESC, kvdd.tensor_addrs(self.mem))
        self.src = pattern(999)
        self.src_id = self.dd.register_kv_cache(DESC, kvdd.tensor_addrs(self.src))
        self.buddy = kvdd.LlmDataDist(2, kvdd.LlmRole.PROMPT, backend="sim")
        self.buddy.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"{LOCAL}:0"})
        self.buddy_mem = pattern(2)
        self.buddy_id = self.buddy.register_kv_cache(DESC, kvdd.tensor_addrs(self.buddy_mem))
        port = self.buddy.listen_port
        assert port is not None
        self.dd.link_llm_clusters([ClusterInfo(remote_cluster_id=2, local_ip_infos=(IpInfo(LOCAL),),
                                               remote_ip_infos=(IpInfo(LOCAL, port),))])

    def guards_intact(self) -> bool:
        stride = T + GUARD
        return all(not self.arena[k * stride:k * stride + GUARD].any() for k in range(N + 1)) and \
            not self.arena[GUARD + N * stride - GUARD:].any()

    def transfer(self, kind: str, child: Child, rows: list[int]) -> Callable[[], None]:
        dd = self.dd
        if kind == "pull_kv_cache":
            return lambda: dd.pull_kv_cache(CacheIndex(child.cid, child.src_id, rows[0]),
                                            Cache(cache_id=self.cache_id), rows[0])
        if kind == "pull_kv_blocks":
            return lambda: dd.pull_kv_blocks(CacheIndex(child.cid, child.src_id), Cache(cache_id=self.cache_id),
                                             rows, rows)
        src = Cache(cache_id=self.src_id, cache_desc=DESC)
        if kind == "push_kv_cache":
            return lambda: dd.push_kv_cache(src, CacheIndex(child.cid, child.dst_id, rows[0]), rows[0])
        return lambda: dd.push_kv_blocks(src, CacheIndex(child.cid, child.dst_id), rows, rows)

    def buddy_pull_works(self) -> None:
        self.dd.pull_kv_cache(CacheIndex(2, self.buddy_id, 3), Cache(cache_id=self.cache_id), 3)
        for got, want in zip(self.mem, self.buddy_mem):
            assert np.array_equal(got[3 * ROW:], want[3 * ROW:])

    def close(self) -> None:
        self.dd.finalize()
        self.buddy.finalize()


def status_of(fn: Callable[[], object]) -> int:
    try:
        fn()
    except LLMError as exc:
        return int(exc.status)
    return int(Status.LLM_SUCCESS)


@pytest.fixture(scope="module")
def xproc() -> Iterator[None]:
    """Skip unless this build links to a simulator instance in another process."""
    child = spawn(50, 50)
    try:
        with kvdd.LlmDataDist(51, kvdd.LlmRole.DECODER, backend="sim") as dd:
            dd.initialize({kvdd.OPTION_DEVICE_ID: "0"})
            try:
                dd.link_llm_clusters([child.cluster()], timeout_ms=5000)
            except LLMError as exc:
                pytest.skip(f"kvdd.sim.fabric cannot link to another process in this build ({exc})")
    finally:
        child.close()
    yield


def kill_round(rng: random.Random, sv: Survivor, child: Child, path: str) -> str:
    kind = rng.choice(KINDS)
    assert sv.dd.link_llm_clusters([child.cluster()]) == [Status.LLM_SUCCESS]
    rows = sorted(rng.sample(range(ROWS), rng.randint(1, ROWS))) if kind.endswith("blocks") else [rng.randrange(ROWS)]
    # the same transfer undisturbed first: the data path works, and how long it takes
    t0 = time.monotonic()
    sv.transfer(kind, child, rows)()
    clean = time.monotonic() - t0
    if kind.startswith("pull"):
        want = pattern(child.seed)
        for g, w in zip(sv.mem, want):
            assert all(np.array_equal(g[r * ROW:(r + 1) * ROW], w[r * ROW:(r + 1) * ROW]) for r in rows), \
                "clean pull: wrong bytes"
    mark = rng.randrange(1, 256)
    for m in sv.mem:
        m[:] = mark
    result: list[tuple[int, float]] = []

    def run() -> None:
        t = time.monotonic()
        st = status_of(sv.transfer(kind, child, rows))
        result.append((st, time.monotonic() - t))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    time.sleep(rng.uniform(0, clean))  # mostly while bytes move
    child.kill()
    th.join(WAIT_MS / 1000 + 30)
    assert not th.is_alive(), f"{kind} did not return after the peer died (hang)"
    st, took = result[0]
    what = f"{kind} rows {rows} over {path} (undisturbed: {clean * 1000:.1f} ms)"
    assert st in (Status.LLM_SUCCESS, Status.LLM_TIMEOUT), f"{what}: {kvdd.status_name(st)}"
    assert took < WAIT_MS / 2000, f"{what}: took {took:.1f}s; a dead peer must be noticed at once (rule 2)"
    assert sv.guards_intact(), f"{what}: bytes outside the tensors changed"
    if kind.startswith("pull"):
        want = pattern(child.seed)
        for k, (got, w) in enumerate(zip(sv.mem, want)):
            for r in range(ROWS):
                seg = got[r * ROW:(r + 1) * ROW]
                if r not in rows:
                    assert (seg == mark).all(), f"{what}: tensor {k} row {r} is not a target but changed"
                elif st == Status.LLM_SUCCESS:
                    assert np.array_equal(seg, w[r * ROW:(r + 1) * ROW]), f"{what}: wrong bytes"
    else:
        assert all((m == mark).all() for m in sv.mem), f"{what}: a push changed local memory it does not target"
    # afterwards: the link is broken / the peer unreachable, fast
    for later in KINDS:
        t = time.monotonic()
        assert status_of(sv.transfer(later, child, [0])) == Status.LLM_TIMEOUT, f"{later} after the kill"
        assert time.monotonic() - t < WAIT_MS / 2000
    assert status_of(lambda: sv.dd.unlink_llm_clusters([child.cluster()])) == Status.LLM_UNLINK_FAILED
    assert status_of(lambda: sv.dd.link_llm_clusters([child.cluster()])) in (Status.LLM_LINK_FAILED,
                                                                             Status.LLM_ALREADY_LINK)
    assert sv.dd.unlink_llm_clusters([child.cluster()], force=True) == [Status.LLM_SUCCESS]
    assert status_of(lambda: sv.dd.link_llm_clusters([child.cluster()])) == Status.LLM_LINK_FAILED
    sv.buddy_pull_works()
    return f"{kind}:{kvdd.Status(st).name}:{path}:clean={clean * 1000:.1f}ms:took={took * 1000:.1f}ms"


def kill_rounds(rounds: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    rng = random.Random(seed)
    sv = Survivor()
    seen = []
    try:
        for i in range(rounds):
            path = "tcp" if i % 2 else "auto"
            monkeypatch.setenv("KVDD_SIM_XPROC", path)
            # every other pair of rounds the child serves slowly (serve=1 faults in its environment):
            # a wide window to die in while it grants, gathers or receives
            slow = "transfer:delay_ms=20:bandwidth=400M:serve=1" if i % 4 >= 2 else None
            if slow:
                path += "+slow"
            child = spawn(100 + i, seed * 1000 + i, slow)
            try:
                seen.append(kill_round(rng, sv, child, path))
            finally:
                child.close()
        # the survivor is still whole: a fresh child links and transfers
        child = spawn(99, 7)
        try:
            sv.dd.link_llm_clusters([child.cluster()])
            sv.dd.pull_kv_cache(CacheIndex(99, child.src_id, 1), Cache(cache_id=sv.cache_id), 1)
            want = pattern(7)
            assert all(np.array_equal(g[ROW:2 * ROW], w[ROW:2 * ROW]) for g, w in zip(sv.mem, want))
        finally:
            child.close()
    finally:
        t = time.monotonic()
        sv.close()
        assert time.monotonic() - t < 10, "finalize took too long after peers died"
    return seen


def test_peer_killed_mid_transfer(xproc: None, watchdog: float, monkeypatch: pytest.MonkeyPatch) -> None:
    print(kill_rounds(4, 1, monkeypatch))


@pytest.mark.slow
def test_peer_killed_mid_transfer_long(xproc: None, watchdog: float, monkeypatch: pytest.MonkeyPatch) -> None:
    print(kill_rounds(40 if PROFILE == "long" else 20, 2, monkeypatch))


def test_serving_side_faults_reach_other_processes(xproc: None, watchdog: float,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer process started with ``KVDD_SIM_FAULTS='...:serve=1'`` serves slowly: a caller whose
    llm.SyncKvCacheWaitTime is shorter than the injected delay times out (and its link is broken,
    §10 rule 8); a patient caller gets exact bytes.  Nothing is injected into the caller.  Over
    TCP: the same-host one-sided path needs no serving (tests/hostile/test_samehost_link.py)."""
    monkeypatch.setenv("KVDD_SIM_XPROC", "tcp")
    child = spawn(60, 60, "transfer:delay_ms=400:serve=1")
    callers = []
    try:
        for cid, wait in ((61, "100"), (62, "10000")):
            dd = kvdd.LlmDataDist(cid, kvdd.LlmRole.DECODER, backend="sim")
            callers.append(dd)
            dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_SYNC_CACHE_WAIT_TIME: wait})
        mems = [[np.zeros(T, np.uint8) for _ in range(N)] for _ in callers]
        ids = [dd.register_kv_cache(DESC, kvdd.tensor_addrs(m)) for dd, m in zip(callers, mems)]
        for dd in callers:
            dd.link_llm_clusters([child.cluster()])
        hasty, patient = callers
        idx = CacheIndex(60, child.src_id, 2)
        assert status_of(lambda: hasty.pull_kv_cache(idx, Cache(cache_id=ids[0]), 2)) == Status.LLM_TIMEOUT
        assert all(not m.any() for m in mems[0])
        assert status_of(lambda: hasty.pull_kv_cache(idx, Cache(cache_id=ids[0]), 2)) == Status.LLM_TIMEOUT
        patient.pull_kv_cache(idx, Cache(cache_id=ids[1]), 2)
        want = pattern(60)
        for got, w in zip(mems[1], want):
            assert np.array_equal(got[2 * ROW:3 * ROW], w[2 * ROW:3 * ROW])
            assert not got[:2 * ROW].any() and not got[3 * ROW:].any()
    finally:
        for dd in callers:
            dd.finalize()
        child.close()
