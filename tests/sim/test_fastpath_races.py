"""Memory safety of the compiled transfer path under concurrency.

Unregister, unlink and Finalize race with compiled copies from another thread: once the call that
removes a cache returns, no byte of its memory may be read or written any more (the racing thread
keeps calling until it is refused); nothing hangs; every lease count ends at 0."""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import pytest

import kvdd
from kvdd import Cache, CacheIndex, ClusterInfo, IpInfo, KvCacheExtParam, LlmRole
from kvdd.sim.entries import CacheEntry

from fastpath_support import fast
from test_fastpath_equivalence import LOCALHOST, Side, link, make_side

#: tests of the compiled path force it on (they pass with KVDD_SIM_FAST_PATH=0 too)
pytestmark = pytest.mark.usefixtures("compiled_path_on")

MiB = 1 << 20
BIG = (1, 8 * MiB)  # one row of 8 MiB per tensor: a copy long enough to run without the GIL
N = 4


@pytest.fixture
def big() -> Iterator[tuple[Side, Side, int, int]]:
    p, d = make_side(1, LlmRole.PROMPT), make_side(2, LlmRole.DECODER)
    try:
        rid = p.register(N, BIG)
        lid = d.register(N, BIG)
        link(d, p)
        yield p, d, rid, lid
    finally:
        d.dd.finalize()
        p.dd.finalize()


class Hammer:
    """Calls `call` in a thread until it raises; counts the successes."""

    def __init__(self, call: Callable[[], None]) -> None:
        self.call = call
        self.ok = 0
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                self.call()
                self.ok += 1
                if self.ok >= 2:
                    self.started.set()
        except BaseException as exc:  # the refusal that ends the loop (checked by the test)
            self.error = exc
            self.started.set()

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the racing transfer hangs"


def _entry(side: Side, cid: int) -> CacheEntry:
    entry = side.dd.backend.caches[cid]  # type: ignore[attr-defined]
    assert isinstance(entry, CacheEntry)
    return entry


def _pull(d: Side, rid: int, lid: int) -> Callable[[], None]:
    return lambda: d.dd.pull_kv_cache(CacheIndex(1, rid, 0), Cache(lid))


def _pull_blocks(d: Side, rid: int, lid: int) -> Callable[[], None]:
    return lambda: d.dd.pull_kv_blocks(CacheIndex(1, rid, 0), Cache(lid), [0], [0])


def _push(d: Side, rid: int, lid: int) -> Callable[[], None]:
    return lambda: d.dd.push_kv_cache(d.cache(lid), CacheIndex(1, rid, 0))


def _push_blocks(d: Side, rid: int, lid: int) -> Callable[[], None]:
    return lambda: d.dd.push_kv_blocks(d.cache(lid), CacheIndex(1, rid, 0), [0], [0], KvCacheExtParam())


CALLS = {"pull": (_pull, True), "pull_blocks": (_pull_blocks, True), "push": (_push, False),
         "push_blocks": (_push_blocks, False)}


@pytest.mark.parametrize("kind", sorted(CALLS))
@pytest.mark.parametrize("which", ["source", "destination"])
def test_unregister_waits_for_compiled_copies(big: tuple[Side, Side, int, int], kind: str, which: str) -> None:
    p, d, rid, lid = big
    make, pull = CALLS[kind]
    src, src_id, dst, dst_id = (p, rid, d, lid) if pull else (d, lid, p, rid)
    src.arenas[src_id][:] = 0x11
    dst.arenas[dst_id][:] = 0
    taken = fast(d).taken
    h = Hammer(make(d, rid, lid))
    assert h.started.wait(30) and h.error is None
    gone, gone_id = (src, src_id) if which == "source" else (dst, dst_id)
    table = _entry(gone, gone_id).table
    gone.dd.unregister_kv_cache(gone_id)
    assert table.closed and table.inflight == 0  # unregister returned: no lease, no copy
    gone.arenas[gone_id][:] = 0x22  # a later copy would move 0x22 (source) or overwrite it (dst)
    h.join()
    assert isinstance(h.error, kvdd.LLMKvCacheNotExistError)
    assert fast(d).taken - taken >= 2  # the copies raced were compiled ones
    if which == "source":
        assert not (dst.arenas[dst_id] == 0x22).any()
    else:
        assert (dst.arenas[dst_id] == 0x22).all()
    survivor = dst if which == "source" else src
    assert _entry(survivor, dst_id if which == "source" else src_id).inflight == 0


@pytest.mark.parametrize("who", ["owner", "caller"])
def test_finalize_races_compiled_copies(big: tuple[Side, Side, int, int], who: str) -> None:
    p, d, rid, lid = big
    p.arenas[rid][:] = 0x11
    h = Hammer(_pull(d, rid, lid))
    assert h.started.wait(30) and h.error is None
    side, cid = (p, rid) if who == "owner" else (d, lid)
    table = _entry(side, cid).table
    side.dd.finalize()
    assert table.closed and table.inflight == 0
    side.arenas[cid][:] = 0x22
    h.join()
    assert isinstance(h.error, kvdd.LLMError)
    if who == "owner":
        assert not (d.arenas[lid] == 0x22).any()
    else:
        assert (d.arenas[lid] == 0x22).all()
    side.dd.initialize({kvdd.OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0", kvdd.OPTION_DEVICE_ID: "9"})


def test_unlink_races_compiled_copies(big: tuple[Side, Side, int, int]) -> None:
    p, d, rid, lid = big
    hs = [Hammer(_pull(d, rid, lid)), Hammer(_push_blocks(d, rid, lid))]
    for h in hs:
        assert h.started.wait(30) and h.error is None
    entity = d.dd.backend.entities[1]  # type: ignore[attr-defined]
    d.dd.unlink_llm_clusters([ClusterInfo(remote_cluster_id=1,
                                          remote_ip_infos=(IpInfo(LOCALHOST, p.dd.listening_port),))])
    assert entity.peer.closed and not entity.lock.locked()
    for h in hs:
        h.join()
        assert isinstance(h.error, kvdd.LLMNotYetLinkError)
    assert _entry(p, rid).inflight == 0 and _entry(d, lid).inflight == 0


def test_many_threads_share_the_leases(big: tuple[Side, Side, int, int]) -> None:
    """Four threads transfer over one link and the same caches; the owner unregisters: every lease
    count ends at 0 and every thread is refused."""
    p, d, rid, lid = big
    hs = [Hammer(make(d, rid, lid)) for make, _ in CALLS.values()]
    for h in hs:
        assert h.started.wait(30) and h.error is None
    p.dd.unregister_kv_cache(rid)
    for h in hs:
        h.join()
        assert isinstance(h.error, kvdd.LLMKvCacheNotExistError)
    assert _entry(d, lid).inflight == 0


class Interrupts:
    """SIGINTs (``_thread.interrupt_main``) every few ms from another thread, raised as
    KeyboardInterrupt only inside :meth:`call` (once per call), so none escapes the test."""

    def __init__(self) -> None:
        self.mode = "off"  # "raise": the next SIGINT raises (then "hold"); otherwise ignored
        self.raised = 0

    def _handler(self, signum: int, frame: object) -> None:
        if self.mode == "raise":
            self.mode = "hold"
            raise KeyboardInterrupt

    def call(self, fn: Callable[[], None]) -> None:
        try:
            self.mode = "raise"
            fn()
            self.mode = "hold"
        except KeyboardInterrupt:
            self.raised += 1
        self.mode = "hold"

    def run(self, calls: list[Callable[[], None]], seconds: float) -> int:
        stop = threading.Event()

        def interrupter() -> None:
            while not stop.is_set():
                time.sleep(0.002)
                _thread.interrupt_main()

        old = signal.signal(signal.SIGINT, self._handler)
        t = threading.Thread(target=interrupter, daemon=True)
        t.start()
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and self.raised < 20:
                for fn in calls:
                    self.call(fn)
        finally:
            self.mode = "off"
            stop.set()
            t.join()
            time.sleep(0.02)
            signal.signal(signal.SIGINT, old)
        return self.raised


def test_keyboard_interrupt_during_large_compiled_copies(big: tuple[Side, Side, int, int]) -> None:
    """SIGINT while the main thread runs large compiled copies: the KeyboardInterrupt comes out of
    a call, no lease or link lock is left held, and unregister then returns."""
    p, d, rid, lid = big
    assert Interrupts().run([_pull(d, rid, lid), _push(d, rid, lid), _pull_blocks(d, rid, lid)], 3) > 0
    entity = d.dd.backend.entities[1]  # type: ignore[attr-defined]
    assert not entity.lock.locked()
    assert _entry(p, rid).inflight == 0 and _entry(d, lid).inflight == 0
    done = threading.Event()

    def unregister() -> None:
        p.dd.unregister_kv_cache(rid)
        done.set()

    threading.Thread(target=unregister, daemon=True).start()
    assert done.wait(10), "unregister hangs on a lease an interrupt leaked"


# ---- references and memory over many calls ---------------------------------------------------------

def test_no_reference_or_memory_growth_over_many_compiled_calls() -> None:
    p, d = make_side(1, LlmRole.PROMPT), make_side(2, LlmRole.DECODER)
    try:
        rid = p.register(4, (8, 64))
        lid = d.register(4, (8, 64))
        link(d, p)
        idx, blk, cache = CacheIndex(1, rid, 3), CacheIndex(1, rid, 0), Cache(lid)
        src, dst, ext = [1, 2, 5], [0, 1, 7], KvCacheExtParam((0, 0), (1, 1), 2)
        desc_cache = d.cache(lid)
        link_entity: object = d.dd.backend.entities[1]  # type: ignore[attr-defined]
        objs: list[object] = [idx, blk, cache, src, dst, ext, desc_cache, _entry(p, rid), _entry(d, lid),
                              _entry(p, rid).table, _entry(d, lid).table, link_entity]

        def round_() -> None:
            d.dd.pull_kv_cache(idx, cache, 2, 16)
            d.dd.pull_kv_cache(idx, cache, 2, -1, ext)
            d.dd.pull_kv_blocks(blk, cache, src, dst)
            d.dd.push_kv_cache(desc_cache, idx, 1)
            d.dd.push_kv_blocks(desc_cache, blk, tuple(src), tuple(dst), ext)

        taken = fast(d).taken
        for _ in range(200):
            round_()
        assert fast(d).taken - taken == 1000
        refs = [sys.getrefcount(o) for o in objs]
        tracemalloc.start()
        try:
            snap0 = tracemalloc.take_snapshot()
            for _ in range(2000):
                round_()
            snap1 = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        assert [sys.getrefcount(o) for o in objs] == refs
        growth = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        assert growth < 64 * 1024, f"{growth} bytes more after 10000 compiled calls"
    finally:
        d.dd.finalize()
        p.dd.finalize()


def test_keyboard_interrupt_while_waiting_for_a_busy_link(big: tuple[Side, Side, int, int]) -> None:
    """Another thread's large copies hold the link lock; the main thread's compiled call blocks on
    it and is interrupted there: it must not release a lock it does not hold or leak a lease."""
    p, d, rid, lid = big
    h = Hammer(_pull(d, rid, lid))
    assert h.started.wait(30)
    assert Interrupts().run([lambda: d.dd.push_kv_cache(d.cache(lid), CacheIndex(1, rid, 0))], 2) > 0
    p.dd.unregister_kv_cache(rid)  # returns: no lease leaked
    h.join()
    assert isinstance(h.error, kvdd.LLMKvCacheNotExistError)
    assert _entry(d, lid).inflight == 0
    assert not d.dd.backend.entities[1].lock.locked()  # type: ignore[attr-defined]


def test_no_reference_leaks_on_the_decline_paths() -> None:
    """The compiled path called directly with calls it declines at each stage (argument types,
    local checks, remote lookup under the link lock, the remote checks): no argument keeps a
    reference and the link lock is free after each."""
    p, d = make_side(1, LlmRole.PROMPT), make_side(2, LlmRole.DECODER)
    try:
        rid = p.register(4, (8, 64))
        lid = d.register(4, (8, 64))
        link(d, p)
        f = fast(d)
        ok, gone, row9 = CacheIndex(1, rid, 0), CacheIndex(1, 999, 0), CacheIndex(1, rid, 9)
        cache, bad_cache = Cache(lid), Cache(12345)
        src, dst, far = [0, 1], [2, 3], [2**40]
        ext, bad_ext = KvCacheExtParam((0, 0), (0, 0), 2), KvCacheExtParam((0, 0), (0, 0), 3)
        objs: list[object] = [ok, gone, row9, cache, bad_cache, src, dst, far, ext, bad_ext]
        declines: list[Callable[[], object]] = [
            lambda: f.pull_kv_cache(ok, cache, 0, -1, bad_ext), lambda: f.pull_kv_cache(gone, cache),
            lambda: f.pull_kv_cache(row9, cache), lambda: f.pull_kv_cache(ok, bad_cache),
            lambda: f.pull_kv_blocks(ok, cache, src, far), lambda: f.pull_kv_blocks(gone, cache, src, dst),
            lambda: f.pull_kv_blocks(ok, cache, far, dst, ext), lambda: f.push_kv_cache(d.cache(lid), row9),
            lambda: f.push_kv_cache(d.cache(lid), gone, 0, -1, ext), lambda: f.push_kv_blocks(d.cache(lid), ok, src, far),
            lambda: f.push_kv_blocks(d.cache(lid), gone, src, dst), lambda: f.push_kv_blocks(bad_cache, ok, src, dst),
        ]
        entity = d.dd.backend.entities[1]  # type: ignore[attr-defined]
        for call in declines:
            assert call() is False
        refs = [sys.getrefcount(o) for o in objs]
        declined = f.declined
        for _ in range(500):
            for call in declines:
                call()
        assert f.declined - declined == 500 * len(declines)
        assert [sys.getrefcount(o) for o in objs] == refs
        assert not entity.lock.locked()
    finally:
        d.dd.finalize()
        p.dd.finalize()
