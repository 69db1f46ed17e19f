"""Concurrency stress: threads mixing every call on shared simulator instances, checking every byte.

Four instances in this process (clusters 1-3 stay up, cluster 4 finalizes and comes back again and
again).  Worker threads pull, pull blocks, push, push blocks, register and unregister, while a
link-churn thread unlinks and relinks pairs and a lifecycle thread finalizes / re-initializes
cluster 4.  Memory is arranged so that every outcome is checkable although calls interleave:

* source caches are never written (their bytes are constant);
* each worker owns its destination caches (its pull targets at home, its push targets on each
  peer): before a call it marks the target rows, after it they hold exactly the source rows
  (success) or still the mark (any failure moves no bytes, SEMANTICS.md §10 rules 1 and 9), and
  every other byte of the cache is unchanged;
* "churn" caches are registered, pushed into by other workers (with one shared pattern) and
  unregistered; once ``UnregisterKvCache`` returns, no copy may touch the memory any more (§10
  rule 5): the owner checks the bytes stay put afterwards, and every tensor row is either all mark
  or all pattern (no torn copy).

Statuses are checked against what may legitimately happen at that moment (e.g. NOT_YET_LINK while a
link is being churned); an exception of any other kind, a crash, a wrong byte or a deadlock fails
the test (watchdog: see conftest.py).
"""

from __future__ import annotations

import faulthandler
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest

import kvdd
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, DataType, IpInfo, LLMError, Status
from kvdd.sim import faults

from .conftest import stress_seconds

LOCAL = "127.0.0.1"
N, B, S = 2, 4, 64  # 2 tensors of int32 (4, 16): T = 256 B, 4 rows / blocks of 64 B
T = B * S
DESC = CacheDesc(num_tensors=N, data_type=DataType.DT_INT32, shape=(B, S // 4))
U8 = npt.NDArray[np.uint8]
OK = int(Status.LLM_SUCCESS)
NOT_YET_LINK = int(Status.LLM_NOT_YET_LINK)
NOT_EXIST = int(Status.LLM_KV_CACHE_NOT_EXIST)
ALREADY = int(Status.LLM_ALREADY_LINK)
FAILED = int(Status.LLM_FAILED)
LINK_FAILED = int(Status.LLM_LINK_FAILED)
UNLINK_FAILED = int(Status.LLM_UNLINK_FAILED)
TIMEOUT = int(Status.LLM_TIMEOUT)
STABLE = (1, 2, 3)
PHOENIX = 4  # the instance that keeps finalizing and coming back


def tensors(seed: int) -> list[U8]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, T, dtype=np.uint8) for _ in range(N)]


def status_of(fn: Callable[[], object]) -> int:
    try:
        fn()
    except LLMError as exc:
        return int(exc.status)
    return OK


def _random_pairs(rng: random.Random) -> tuple[bool, list[tuple[int, int]]]:
    """(blocks, pairs): half the time 1..B random (src, dst) block pairs with distinct
    destinations, else one (src row, dst row) pair."""
    if rng.random() < 0.5:
        k = rng.randint(1, B)
        sb = [rng.randrange(B) for _ in range(k)]
        db = rng.sample(range(B), k)
        return True, list(zip(sb, db))
    return False, [(rng.randrange(B), rng.randrange(B))]


@dataclass
class Cache_:
    mem: list[U8]
    cache_id: int


@dataclass
class Inst:
    cid: int
    dd: kvdd.LlmDataDist
    src: Cache_ | None = None
    port: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards churn publication
    churn: dict[int, Cache_] = field(default_factory=dict)  # live churn caches by id


class Stress:
    def __init__(self, workers: int, seconds: float, seed: int, faulty: bool = False) -> None:
        self.seconds = seconds
        self.seed = seed
        # with faults: injected transfer timeouts (the link then stays broken until the worker
        # relinks it), failed links and unlinks, all seeded; they move no bytes
        self.faulty = faulty
        self.extra: tuple[int, ...] = (TIMEOUT,) if faulty else ()
        self.errors: list[str] = []
        self.counts: Counter[str] = Counter()
        self.counts_lock = threading.Lock()
        self.stop = threading.Event()
        self.insts: dict[int, Inst] = {}
        self.phoenix_lock = threading.Lock()  # held while cluster 4 is down or coming up
        self.pattern = np.full(S, 0xA5, np.uint8)  # what pushes into churn caches write
        for cid in (*STABLE, PHOENIX):
            dd = kvdd.LlmDataDist(cid, kvdd.LlmRole.MIX, backend="sim")
            self.insts[cid] = Inst(cid, dd)
            self.up(cid)
        # per worker: a pull target at home, a push source at home, a push target on each peer
        self.workers = workers
        self.homes = [STABLE[w % len(STABLE)] for w in range(workers)]
        self.pull_dst: list[Cache_] = []
        self.push_src: list[Cache_] = []
        self.push_dst: list[dict[int, Cache_]] = []
        for w, home in enumerate(self.homes):
            self.pull_dst.append(self.register(home, tensors(1000 + w)))
            self.push_src.append(self.register(home, tensors(2000 + w)))
            self.push_dst.append({p: self.register(p, tensors(3000 + 10 * w + p)) for p in STABLE if p != home})
        for a in STABLE:  # full mesh, each pair once (links are bidirectional)
            for b in STABLE:
                if a < b:
                    self.insts[a].dd.link_llm_clusters([self.cluster(b)])
        self.insts[PHOENIX].dd.link_llm_clusters([self.cluster(1)])

    # -- set-up helpers --------------------------------------------------------------------
    def up(self, cid: int) -> None:
        inst = self.insts[cid]
        inst.dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: f"{LOCAL}:0"})
        port = inst.dd.listen_port
        assert port is not None
        inst.port = port
        inst.src = self.register(cid, tensors(cid))

    def register(self, cid: int, mem: list[U8]) -> Cache_:
        return Cache_(mem, self.insts[cid].dd.register_kv_cache(DESC, kvdd.tensor_addrs(mem)))

    def cluster(self, cid: int) -> ClusterInfo:
        return ClusterInfo(remote_cluster_id=cid, local_ip_infos=(IpInfo(LOCAL),),
                           remote_ip_infos=(IpInfo(LOCAL, self.insts[cid].port),))

    # -- bookkeeping -----------------------------------------------------------------------
    def count(self, what: str, status: int) -> None:
        name = Status(status).name if status in Status._value2member_map_ else str(status)
        with self.counts_lock:
            self.counts[f"{what}:{name}"] += 1

    def fail(self, msg: str) -> None:
        self.errors.append(msg)
        self.stop.set()

    def allow(self, what: str, status: int, allowed: tuple[int, ...]) -> bool:
        self.count(what, status)
        if status not in allowed:
            self.fail(f"{what}: unexpected {kvdd.status_name(status)}")
            return False
        return True

    # -- worker operations -------------------------------------------------------------------
    def op_pull(self, rng: random.Random, w: int) -> None:
        me = self.insts[self.homes[w]]
        peer_id = rng.choice([p for p in (*STABLE, PHOENIX) if p != me.cid])
        peer = self.insts[peer_id]
        src = peer.src
        if src is None:
            return
        dst = self.pull_dst[w]
        blocks, pairs = _random_pairs(rng)
        sb, db = [s for s, _ in pairs], [d for _, d in pairs]
        mark = rng.randrange(256)
        for m in dst.mem:
            for _, d in pairs:
                m[d * S:(d + 1) * S] = mark
        before = [m.copy() for m in dst.mem]
        idx = CacheIndex(peer_id, src.cache_id, 0 if blocks else pairs[0][0])
        if blocks:
            st = status_of(lambda: me.dd.pull_kv_blocks(idx, Cache(cache_id=dst.cache_id), sb, db))
        else:
            st = status_of(lambda: me.dd.pull_kv_cache(idx, Cache(cache_id=dst.cache_id), pairs[0][1]))
        what = f"pull{'_blocks' if blocks else ''}({me.cid}<-{peer_id})"
        # the phoenix may be gone (stale entity: its caches are not found) or not linked yet
        allowed = (OK, NOT_YET_LINK) if peer_id != PHOENIX else (OK, NOT_YET_LINK, NOT_EXIST)
        if not self.allow(what, st, allowed + self.extra):
            return
        if st == TIMEOUT:
            self.relink(me.cid, peer_id)
        expect = [b.copy() for b in before]
        if st == OK:
            for e, s in zip(expect, src.mem):
                for sblk, dblk in pairs:
                    e[dblk * S:(dblk + 1) * S] = s[sblk * S:(sblk + 1) * S]
        for k, (got, want) in enumerate(zip(dst.mem, expect)):
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                self.fail(f"{what} {kvdd.status_name(st)}: tensor {k} wrong at bytes {bad[:8].tolist()}")

    def op_push(self, rng: random.Random, w: int) -> None:
        me = self.insts[self.homes[w]]
        peer_id = rng.choice([p for p in STABLE if p != me.cid])
        src, dst = self.push_src[w], self.push_dst[w][peer_id]
        blocks, pairs = _random_pairs(rng)
        sb, db = [s for s, _ in pairs], [d for _, d in pairs]
        mark = rng.randrange(256)
        for m in dst.mem:
            for _, d in pairs:
                m[d * S:(d + 1) * S] = mark
        before = [m.copy() for m in dst.mem]
        c = Cache(cache_id=src.cache_id, cache_desc=DESC)
        if blocks:
            st = status_of(lambda: me.dd.push_kv_blocks(c, CacheIndex(peer_id, dst.cache_id), sb, db))
        else:
            bs, bd = pairs[0]
            st = status_of(lambda: me.dd.push_kv_cache(c, CacheIndex(peer_id, dst.cache_id, bd), bs))
        what = f"push{'_blocks' if blocks else ''}({me.cid}->{peer_id})"
        if not self.allow(what, st, (OK, NOT_YET_LINK) + self.extra):
            return
        if st == TIMEOUT:
            self.relink(me.cid, peer_id)
        for k, (got, b, s) in enumerate(zip(dst.mem, before, src.mem)):
            want = b.copy()
            if st == OK:
                for sblk, dblk in pairs:
                    want[dblk * S:(dblk + 1) * S] = s[sblk * S:(sblk + 1) * S]
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                self.fail(f"{what} {kvdd.status_name(st)}: tensor {k} wrong at bytes {bad[:8].tolist()}")

    def op_push_churn(self, rng: random.Random, w: int) -> None:
        """Push the shared pattern into some peer's churn cache (it may vanish at any moment)."""
        me = self.insts[self.homes[w]]
        peer = self.insts[rng.choice([p for p in STABLE if p != me.cid])]
        with peer.lock:
            if not peer.churn:
                return
            cache_id = rng.choice(list(peer.churn))
        src = self.push_src[w]
        st = status_of(lambda: me.dd.push_kv_blocks(Cache(cache_id=src.cache_id, cache_desc=DESC),
                                                    CacheIndex(peer.cid, cache_id), [B - 1], [rng.randrange(B)]))
        # pushed from our row B-1, which holds the pattern (set at start): see run()
        self.allow(f"push_churn({me.cid}->{peer.cid})", st, (OK, NOT_YET_LINK, NOT_EXIST) + self.extra)
        if st == TIMEOUT:
            self.relink(me.cid, peer.cid)

    def op_churn(self, rng: random.Random, w: int) -> None:
        """Register a cache, let others push into it a while, unregister, check rule 5."""
        me = self.insts[self.homes[w]]
        mark = np.uint8(rng.randrange(256))
        while mark == self.pattern[0]:
            mark = np.uint8(rng.randrange(256))
        mem = [np.full(T, mark, np.uint8) for _ in range(N)]
        c = self.register(me.cid, mem)
        with me.lock:
            me.churn[c.cache_id] = c
        time.sleep(rng.random() * 0.003)
        with me.lock:
            del me.churn[c.cache_id]
        me.dd.unregister_kv_cache(c.cache_id)
        after = [m.copy() for m in mem]
        time.sleep(0.002)
        for k, (m, a) in enumerate(zip(mem, after)):
            if not np.array_equal(m, a):
                self.fail(f"churn cache {c.cache_id} on {me.cid}: tensor {k} written after unregister (rule 5)")
            for r in range(B):
                row = m[r * S:(r + 1) * S]
                if not (np.all(row == mark) or np.array_equal(row, self.pattern)):
                    self.fail(f"churn cache {c.cache_id} on {me.cid}: torn row {r} of tensor {k}")
        self.count("churn", OK)

    # -- background actors ---------------------------------------------------------------
    def link_churn(self, rng: random.Random) -> None:
        while not self.stop.is_set():
            a, b = rng.sample(STABLE, 2)
            force = rng.random() < 0.3
            st = status_of(lambda: self.insts[a].dd.unlink_llm_clusters([self.cluster(b)], force=force))
            self.allow(f"unlink({a}-{b}{' force' if force else ''})", st,
                       (OK, UNLINK_FAILED) if self.faulty else (OK,))
            time.sleep(rng.random() * 0.002)
            st = status_of(lambda: self.insts[a].dd.link_llm_clusters([self.cluster(b)]))
            self.allow(f"link({a}-{b})", st, (OK, ALREADY, LINK_FAILED) if self.faulty else (OK, ALREADY))
            if st == ALREADY:  # b kept a (force-unlinked) entity for a and a has one again: fine
                pass
            time.sleep(rng.random() * 0.004)

    def phoenix(self, rng: random.Random) -> None:
        p = self.insts[PHOENIX]
        while not self.stop.is_set():
            time.sleep(rng.random() * 0.01)
            src, p.src = p.src, None
            p.dd.finalize()
            del src
            time.sleep(rng.random() * 0.005)
            self.up(PHOENIX)
            st = status_of(lambda: p.dd.link_llm_clusters([self.cluster(rng.choice(STABLE))]))
            self.allow("phoenix link", st, (OK, LINK_FAILED) if self.faulty else (OK,))
            self.count("phoenix", OK)

    def relink(self, a: int, b: int) -> None:
        """After a timeout the link a->b is broken (§10 rule 8): drop it locally and link again."""
        if b == PHOENIX:
            return  # the phoenix relinks itself when it comes back
        st = status_of(lambda: self.insts[a].dd.unlink_llm_clusters([self.cluster(b)], force=True))
        self.allow(f"relink-unlink({a}-{b})", st, (OK, UNLINK_FAILED))
        st = status_of(lambda: self.insts[a].dd.link_llm_clusters([self.cluster(b)]))
        self.allow(f"relink({a}-{b})", st, (OK, ALREADY, LINK_FAILED))

    def worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        ops = [self.op_pull, self.op_pull, self.op_push, self.op_push, self.op_push_churn, self.op_churn]
        while not self.stop.is_set():
            rng.choice(ops)(rng, w)

    def guarded(self, fn: Callable[..., None], *args: object) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - any crash is a test failure
                import traceback

                self.fail(f"{fn.__name__}{args}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return run

    def run(self) -> None:
        injections = []
        if self.faulty:
            injections = [
                faults.inject("transfer", status=Status.LLM_TIMEOUT, probability=0.03, seed=self.seed),
                faults.inject("link", status=Status.LLM_LINK_FAILED, probability=0.1, seed=self.seed + 1),
                faults.inject("unlink", status=Status.LLM_UNLINK_FAILED, probability=0.1, seed=self.seed + 2),
                faults.inject("pull", delay_ms=0.2, probability=0.05, seed=self.seed + 3),
            ]
        try:
            self._run()
        finally:
            for inj in injections:
                inj.remove()

    def _run(self) -> None:
        for w in range(self.workers):  # row B-1 of every push source holds the churn pattern
            for m in self.push_src[w].mem:
                m[(B - 1) * S:] = self.pattern
        threads = [threading.Thread(target=self.guarded(self.worker, w), daemon=True, name=f"worker{w}")
                   for w in range(self.workers)]
        threads.append(threading.Thread(target=self.guarded(self.link_churn, random.Random(self.seed)),
                                        daemon=True, name="link-churn"))
        threads.append(threading.Thread(target=self.guarded(self.phoenix, random.Random(self.seed + 1)),
                                        daemon=True, name="phoenix"))
        for t in threads:
            t.start()
        self.stop.wait(self.seconds)
        self.stop.set()
        deadline = time.monotonic() + 30 + self.seconds
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in threads if t.is_alive()]
        if hung:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            raise AssertionError(f"threads did not finish (deadlock?): {hung}; stacks on stderr")

    def close(self) -> None:
        for inst in self.insts.values():
            inst.dd.finalize()


def run_stress(seconds: float, workers: int, seed: int, faulty: bool = False) -> Counter[str]:
    s = Stress(workers, seconds, seed, faulty)
    try:
        s.run()
    finally:
        if not any("deadlock" in e for e in s.errors):
            s.close()
    assert not s.errors, "\n".join(s.errors[:20])
    moved = sum(v for k, v in s.counts.items() if k.startswith(("pull", "push")) and k.endswith("SUCCESS"))
    assert moved > 0, f"no transfer succeeded: {dict(s.counts)}"
    return s.counts


def test_concurrency_stress(watchdog: float) -> None:
    counts = run_stress(stress_seconds(), workers=6, seed=1)
    print(dict(sorted(counts.items())))


def test_concurrency_stress_with_faults(watchdog: float) -> None:
    counts = run_stress(stress_seconds(), workers=6, seed=4, faulty=True)
    print(dict(sorted(counts.items())))
    assert any(k.endswith("LLM_TIMEOUT") for k in counts), "no injected timeout happened"


@pytest.mark.slow
@pytest.mark.parametrize("seed, faulty", [(2, False), (3, True)])
def test_concurrency_stress_long(watchdog: float, seed: int, faulty: bool) -> None:
    counts = run_stress(stress_seconds(slow=True), workers=8, seed=seed, faulty=faulty)
    print(dict(sorted(counts.items())))
