"""The compiled path of in-process transfers: PullKvCache, PullKvBlocks, PushKvCache and PushKvBlocks
between two simulator instances of one process, from the facade's arguments to the copy kernels.

The Python path (:mod:`kvdd.datadist` -> :mod:`kvdd.sim.pulls` / :mod:`kvdd.sim.pushes` ->
:mod:`kvdd.sim.transfers`) touches a few hundred Python objects per call; right after a large copy
has evicted them from the CPU caches that cost 30-70 us per call (150-270 us for a 78-tensor block
pull), as much as a sixth of an 8 MiB copy (docs/benchmarks.md, "The compiled call path").

This path **accepts** a call only when it can show, from C values, that the call passes every check
of the facade and of SEMANTICS.md §3.10 - §3.13 as kvdd.sim implements them (the comments
name the steps), that the link's peer is an instance of this process, that no fault injection
is armed, and that DEBUG call records are off (:mod:`kvdd.calllog`: a dictionary lookup here; with
them on, the facade records every call and runs it on the Python path). It then takes the same locks and leases as :func:`kvdd.sim.transfers.run` and copies
through the region tables of both caches (:class:`kvdd._native._copy.RegionTable`), whose kernels
check every run against every region again. A peer in another process on this host whose link
uses the one-sided same-host path is taken too: the same checks, then the link reader's lease,
copy and release in C (:class:`kvdd._native._xproc.SameHostMover`, which checks every run again). Anything else, including every call that fails, it
**declines** having done nothing, and the Python path runs: statuses, exceptions and their order
come from the Python path alone. Whether a call is accepted never changes what it does; tests run
random calls with this path on and off and compare statuses and bytes
(tests/sim/test_fastpath.py).

Accepted calls: block lists of 1 to MAX_PAIRS (65,536) pairs (``list``/``tuple`` of ``int``; more
than 256 are planned in heap memory), exact argument types
(``CacheIndex``, ``Cache``, ``KvCacheExtParam`` or None, ``int``), caches whose indices and strides
keep every byte offset below 2**63.
"""

import os

cimport cython
from cpython.long cimport PyLong_AsUnsignedLongLong
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport int64_t, uint64_t

from kvdd._native._copy cimport RegionTable, byte_plan, copy_table_runs, group_runs
from kvdd._native._xproc cimport SameHostMover, forget_failure

from kvdd.sim.checks import REQUEST_LIMIT
from kvdd.sim.fabric.peers import InProcessPeer, RemotePeer
from kvdd.sim.faults import injections as _injections
from kvdd.calllog import DEBUG, known_off
from kvdd.types import Cache, CacheIndex, CachePlacement, KvCacheExtParam

__all__ = ["ENV_VAR", "FastTransfers", "MAX_PAIRS", "set_enabled"]

#: ``KVDD_SIM_FAST_PATH=0`` (or ``false``, ``off``, ``no``) in the environment when kvdd is imported
#: turns the compiled path off (every call then takes the Python path: to compare, or to step
#: through the checks in a debugger).
ENV_VAR = "KVDD_SIM_FAST_PATH"

#: The most block pairs an accepted block call has (larger requests take the Python path, whose
#: long-list planning is compiled too: kvdd._native._runs). A 2 MiB transfer request holds fewer
#: runs than this (§3.11 step 8).
MAX_PAIRS = 1 << 16

cdef object _IN_PROCESS = object()  # a link's route (FastTransfers._route): an instance of this process

cdef bint _enabled = os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")
cdef dict _calls_known_off = known_off  # the call logger's cached answers: {DEBUG: False} when off
cdef object _DEBUG = DEBUG
cdef int64_t _request_limit = REQUEST_LIMIT
cdef int64_t _device = int(CachePlacement.DEVICE)
cdef uint64_t _U32 = 1 << 32
cdef int64_t _BLOCK_MAX = 1 << 31  # local stride bound of block plans (offsets then stay < 2**63)


def set_enabled(bint on):
    """Turn the compiled path on or off for every instance of this process (tests and diagnosis:
    with it off every call takes the Python path); returns the previous setting."""
    global _enabled
    cdef bint prev = _enabled
    _enabled = on
    return prev


cdef struct Ext:
    int64_t s0, s1, d0, d1, t


cdef bint _ext(object ext, Ext *e, bint equal_len) except -1:
    """The layer ranges of `ext` (None: all layers, 2 tensors per layer) if it is valid (§2.5
    CheckKvCacheExtParam; `equal_len`: both ranges of one length) and of the exact type."""
    if ext is None:
        e.s0 = e.s1 = e.d0 = e.d1 = -1
        e.t = 2
        return True
    if type(ext) is not KvCacheExtParam:
        return False
    sr = ext.src_layer_range
    dr = ext.dst_layer_range
    if (type(sr) is not tuple or type(dr) is not tuple or len(sr) != 2 or len(dr) != 2
            or not _int(sr[0], I32_MIN, I32_MAX, &e.s0) or not _int(sr[1], I32_MIN, I32_MAX, &e.s1)
            or not _int(dr[0], I32_MIN, I32_MAX, &e.d0) or not _int(dr[1], I32_MIN, I32_MAX, &e.d1)
            or not _int(ext.tensor_num_per_layer, 0, 255, &e.t)):
        return False
    if not (e.s0 >= -1 and e.s1 >= -1 and e.s0 <= e.s1 and e.d0 >= -1 and e.d1 >= -1 and e.d0 <= e.d1):
        return False
    if e.t <= 0:
        return False
    return not equal_len or e.s1 - e.s0 == e.d1 - e.d0


cdef bint _int(object v, int64_t lo, int64_t hi, int64_t *out) except -1:
    """`v` into `out` if it is an int in [lo, hi] (fields are inside their C++ widths unless set past
    the types' validation: then decline, never raise)."""
    if type(v) is not int or not lo <= v <= hi:
        return False
    out[0] = v
    return True


cdef int64_t I32_MIN = -(1 << 31), I32_MAX = (1 << 31) - 1, I64_MAX = (1 << 63) - 1
# not the literal -(1 << 63): C reads 9223372036854775808 as an unsigned constant (a warning)
cdef int64_t I64_MIN = -I64_MAX - 1


cdef bint _index(object idx, int64_t *cache_id, int64_t *row) except -1:
    """A CacheIndex's cache id (int64) and row (uint32), or False."""
    return _int(idx.cache_id, I64_MIN, I64_MAX, cache_id) and _int(idx.batch_index, 0, _U32 - 1, row)


cdef bint _blocks(object seq, Py_ssize_t n, uint64_t *out) except -1:
    """The `n` items of a list or tuple as uint64, or False when one is not an int in [0, 2**64)."""
    cdef Py_ssize_t i
    for i in range(n):
        item = seq[i]
        if type(item) is not int or item < 0:
            return False
        try:
            out[i] = PyLong_AsUnsignedLongLong(item)
        except OverflowError:
            return False
    return True


cdef enum:
    SMALL_PAIRS = 256  # block requests up to this many pairs are planned in a stack buffer
    COLUMNS = 10       # uint64 words per pair: 2 for the pairs, 5 for the runs, 3 for the byte plan


cdef struct Runs:
    Py_ssize_t G
    uint64_t *s0       # first source block of each run (G of each column)
    uint64_t *d0
    uint64_t *ln       # blocks
    uint64_t *s_last
    uint64_t *d_last
    uint64_t d_max
    int64_t *so        # the byte plan
    int64_t *do
    int64_t *nb
    int64_t s_end      # largest so + nb
    int64_t d_end
    void *heap         # the columns of a request of more than SMALL_PAIRS pairs (freed by the caller)


cdef bint _byte_plan(Runs *r, int64_t block, int64_t tail) noexcept:
    """§3.11 step 11 / §3.13's byte runs (kvdd._native._copy.byte_plan: the last run `tail` bytes
    when `tail` > 0, the §3.11 quirk); False (decline) when an index or the block size is too large
    for the offsets to stay exact below 2**63."""
    cdef uint64_t total, s_end, d_end
    if block <= 0 or block >= _BLOCK_MAX:
        return False
    if byte_plan(r.s0, r.d0, r.ln, r.G, block, tail, r.so, r.do, r.nb, &total, &s_end, &d_end):
        return False
    r.s_end = <int64_t>s_end
    r.d_end = <int64_t>d_end
    return True


cdef bint _runs(object src_blocks, object dst_blocks, Runs *r, uint64_t *small) except -1:
    """§3.11 step 7 / §3.13: the pairs (equal-length lists or tuples of 1..MAX_PAIRS ints in
    [0, 2**64)) grouped into runs, in `small` (SMALL_PAIRS x COLUMNS words) or in ``r.heap``,
    which the caller frees; False: not an accepted block list."""
    r.heap = NULL
    if (type(src_blocks) is not list and type(src_blocks) is not tuple) or (
            type(dst_blocks) is not list and type(dst_blocks) is not tuple):
        return False
    cdef Py_ssize_t n = len(src_blocks)
    if n < 1 or n > MAX_PAIRS or len(dst_blocks) != n:
        return False
    cdef uint64_t *buf = small
    if n > SMALL_PAIRS:
        r.heap = PyMem_RawMalloc(<size_t>n * COLUMNS * sizeof(uint64_t))
        if r.heap == NULL:
            return False
        buf = <uint64_t *>r.heap
    cdef uint64_t *s = buf
    cdef uint64_t *d = buf + n
    if not _blocks(src_blocks, n, s) or not _blocks(dst_blocks, n, d):
        return False
    r.s0, r.d0, r.ln, r.s_last, r.d_last = buf + 2 * n, buf + 3 * n, buf + 4 * n, buf + 5 * n, buf + 6 * n
    r.so = <int64_t *>(buf + 7 * n)
    r.do = <int64_t *>(buf + 8 * n)
    r.nb = <int64_t *>(buf + 9 * n)
    r.G = group_runs(s, d, n, r.s0, r.d0, r.ln, r.s_last, r.d_last, &r.d_max)
    return True


cdef bint _push_plan(object desc, const Ext *e, int64_t *ls0, int64_t *L, int64_t *ld0) except -1:
    """§3.12 steps 5-6 (kvdd.sim.pushes._push_prologue, _push_plan): the first source layer, the
    layer count and the first destination layer; False (decline) when pushing all layers of a cache
    whose descriptor names no tensors."""
    cdef int64_t t = e.t, u
    if e.s0 >= 0:
        ls0[0], L[0], ld0[0] = e.s0, e.s1 - e.s0 + 1, e.d0
        return True
    if not _int(desc.num_tensors, 1, _U32 - 1, &u):
        return False
    ls0[0], L[0], ld0[0] = 0, (0 if u < t else (u // t - 1 if u % t == 0 else u // t)) + 1, 0
    return True


cdef struct Pull:  # what PullKvCache steps 4-11 leave for the rest of a pull
    int64_t n, B, S  # the local cache
    int64_t K, l_first, r_first  # the tensors moved: K from l_first (local), r_first (remote)
    bint lists  # layer ranges given (else every tensor, the remote count must match)


cdef struct Push:  # what a push's plan and steps a-d leave for the rest of it
    int64_t n, B, S  # the local cache
    int64_t t, ls0, L, ld0  # tensors per layer; first source layer, layer count, first dst layer
    int64_t remote_layers


@cython.final
cdef class FastTransfers:
    """The compiled transfer path of one :class:`kvdd.sim.engine.SimBackend` (see the module notes).

    Each method takes the facade's arguments and returns True when it moved the bytes (the call
    succeeded), False when it declined (nothing happened: take the Python path).
    ``taken`` / ``declined`` count the calls since the instance was made; ``enabled = False`` turns
    the path off for this instance only (the benchmarks' like-for-like references).
    """

    cdef object backend
    cdef readonly uint64_t taken
    cdef readonly uint64_t declined
    cdef public bint enabled  # this instance's switch (set_enabled: the whole process's)

    def __cinit__(self, backend):
        self.backend = backend
        self.enabled = True

    cdef inline bint _no(self):
        self.declined += 1
        return False

    cdef bint _move(self, object entity, object route, object local, object rc, bint pull,
                    Py_ssize_t l_first, Py_ssize_t r_first, Py_ssize_t K, const int64_t *l_off,
                    const int64_t *r_off, const int64_t *ln, Py_ssize_t J) except -1:
        """:func:`kvdd.sim.transfers.run` for an in-process peer (entity.lock held): the leases on
        both caches (their region tables' counts: what CacheEntry.acquire and InProcessPeer.acquire
        take), then one copy between the tables; False (nothing moved) where run would refuse.
        For a peer in another process on this host, the same through the link's one-sided path
        (:class:`kvdd._native._xproc.SameHostMover`: ``route``, from :meth:`_route`)."""
        if route is not _IN_PROCESS:
            return self._move_one_sided(entity, <SameHostMover?>route, local, rc, pull, l_first,
                                        r_first, K, l_off, r_off, ln, J)
        if _injections.armed or entity.broken or entity.peer.closed:  # faults.on_transfer; rule 8
            return False
        cdef RegionTable lt = local.table, rt = rc.token.table
        if not lt.take():
            return False
        try:
            if not rt.take():
                return False
            try:
                if pull:
                    copy_table_runs(rt, r_first, lt, l_first, K, r_off, l_off, ln, J)
                else:
                    copy_table_runs(lt, l_first, rt, r_first, K, l_off, r_off, ln, J)
            finally:
                rt.give()
        finally:
            lt.give()
        self.taken += 1
        return True

    cdef bint _move_one_sided(self, object entity, SameHostMover mover, object local, object rc,
                              bint pull, Py_ssize_t l_first, Py_ssize_t r_first, Py_ssize_t K,
                              const int64_t *l_off, const int64_t *r_off, const int64_t *ln,
                              Py_ssize_t J) except -1:
        """:func:`kvdd.sim.transfers.run` for a peer reached by the same-host one-sided path
        (entity.lock held): RemotePeer.acquire's checks, then the lease, copy and release of
        OneSidedPeer in C.  A copy that timed out (or was aborted, or whose peer is gone) breaks
        the link as run does, then declines: the Python path answers LLM_TIMEOUT at once; a copy
        that failed otherwise declines and the Python path runs the call (and reports it).

        ``mover`` is the link's as :meth:`_route` found it before ``entity.lock`` was taken: a
        link closed since (unlink, the owner's finalize) is declined by the mover itself (its
        reader unusable, its lease table's state words set), a copy racing the close is waited
        for by it (the mover's copy count, the owner's in-flight count)."""
        if _injections.armed or entity.broken:  # faults.on_transfer; kvdd rule 8
            return False
        cdef int r = mover.move(rc, entity.peer.addresses(rc.cache_id), local.table, pull,
                                l_first, r_first, K, l_off, r_off, ln, J, self.backend.sync_wait_ms)
        if r == 1:
            self.taken += 1
            return True
        if r == -2:
            entity.broken = True
        return False

    cdef object _route(self, object entity):
        """How the link's peer is reached: ``_IN_PROCESS`` (an instance of this process), the
        link's compiled one-sided same-host copy (a ``SameHostMover``), or None (declined)."""
        peer = entity.peer
        if type(peer) is InProcessPeer:
            return _IN_PROCESS
        if type(peer) is RemotePeer:
            return peer.one_sided()  # None: unlinked, the owner finalized, or TCP
        return None

    cdef bint _in_process(self, object idx) except -1:
        """Whether the link to ``idx.cluster_id`` reaches an instance of this process (or one on
        this host through the one-sided path): checked before a block list is read, so that a TCP
        call does not parse its block list twice (once here to decline)."""
        entity = self.backend.entities.get(idx.cluster_id)
        return entity is not None and self._route(entity) is not None

    cdef object _pull_link(self, object idx, object dst_cache, const Ext *e, int64_t bi, Pull *p):
        """PullKvCache steps 4-8, 10, 11 (kvdd.sim.pulls._pull_common without 9) for local row
        `bi`: ``(local entry, link entity, route)`` with `p` filled, or None (decline)."""
        b = self.backend
        cluster = idx.cluster_id
        if cluster == b.cluster_id:  # 6
            return None
        local = b.caches.get(dst_cache.cache_id)  # 7
        if local is None:
            return None
        p.n, p.B, p.S = local.n, local.B, local.S
        if bi >= p.B:  # 8
            return None
        p.lists = e.s0 >= 0 and e.d0 >= 0  # 4
        p.K, p.l_first, p.r_first = p.n, 0, 0
        if p.lists:  # 10
            p.K = (e.d1 - e.d0 + 1) * e.t
            p.l_first = e.d0 * e.t
            p.r_first = e.s0 * e.t
            if (p.n % e.t != 0 or p.K > p.n or p.l_first + p.K > p.n
                    or (e.s1 - e.s0 + 1) * e.t != p.K):
                return None
        entity = b.entities.get(cluster)  # 11
        if entity is None or p.K <= 0:
            return None
        route = self._route(entity)
        return None if route is None else (local, entity, route)

    cdef object _push_link(self, object src_cache, object idx, int64_t cache_id, const Ext *e, Push *q):
        """A push's plan (§3.12 steps 5-6) and steps a-d (kvdd.sim.pushes._push_layers):
        ``(local entry, link entity, remote cache, route)`` with `q` filled, or None (decline)."""
        q.t = e.t
        if not _push_plan(src_cache.cache_desc, e, &q.ls0, &q.L, &q.ld0):
            return None
        b = self.backend
        local = b.caches.get(src_cache.cache_id)  # a
        if local is None:
            return None
        entity = b.entities.get(idx.cluster_id)  # b
        if entity is None:
            return None
        route = self._route(entity)
        if route is None:
            return None
        rc = entity.peer.snapshot().get(cache_id) if cache_id > 0 else None  # c
        if rc is None:
            return None
        q.n, q.B, q.S = local.n, local.B, local.S
        q.remote_layers = rc.num_tensors // q.t
        if q.ld0 < 0 or q.ld0 >= q.remote_layers:  # d
            return None
        return local, entity, rc, route

    cdef bint _push_layers_pass(self, object local, object rc, const Push *q) except -1:
        """The checks of a push's layers that do not depend on what is moved (entity.lock held):
        f and g of layer 0, kvdd rule 10, and no later layer failing d or f
        (kvdd.sim.pushes._layers_passing)."""
        return not (q.ls0 >= q.n // q.t or q.n % q.t != 0 or local.ragged or rc.ragged
                    or q.L > q.remote_layers - q.ld0 or q.L > q.n // q.t - q.ls0)

    def pull_kv_cache(self, src_cache_index, dst_cache, batch_index=0, size=-1, ext_param=None):
        """PullKvCache (§3.10) if accepted: see the class notes."""
        cdef Ext e
        cdef Pull p
        cdef int64_t bi, cache_id, row, rn, stride, rT, nbytes, l_off, r_off
        forget_failure()  # a failed copy's record lives for its own call only
        if not (_enabled and self.enabled) or _calls_known_off.get(_DEBUG) is not False:
            return False
        if (type(src_cache_index) is not CacheIndex or type(dst_cache) is not Cache
                or not _int(batch_index, 0, _U32 - 1, &bi) or type(size) is not int
                or not _ext(ext_param, &e, False) or not _index(src_cache_index, &cache_id, &row)):
            return self._no()  # the facade's argument checks
        if not self.backend.initialized:  # 1
            return self._no()
        if not (size == -1 or 0 < size < (1 << 62)):  # 2
            return self._no()
        nbytes = size if size > 0 else -1
        link = self._pull_link(src_cache_index, dst_cache, &e, bi, &p)  # 4-8, 10, 11 (3, 5: _ext)
        if link is None or (nbytes > 0 and nbytes > p.S):  # 9
            return self._no()
        local, entity, route = link
        if 120 + 16 * (p.K + 2) > _request_limit:  # 12
            return self._no()
        lock = entity.lock
        lock.acquire()
        try:
            rc = entity.peer.snapshot().get(cache_id) if cache_id > 0 else None  # 13
            if rc is None:
                return self._no()
            rn = rc.num_tensors
            # a peer's hello gives S as 64 bits unsigned: past int64 the Python path decides
            if not _int(rc.stride_nbytes, 0, I64_MAX, &stride):
                return self._no()
            rT = rc.tensor_nbytes
            if nbytes < 0:  # 15
                nbytes = p.S
            if (not p.lists and rn != p.n) or nbytes > stride:  # 14, 15
                return self._no()
            if local.ragged or rc.ragged or p.r_first + p.K > rn:  # kvdd rules 10 and 1 (§7.8)
                return self._no()
            # kvdd rule 1: row x (local) S + nbytes inside the remote tensor, without overflow
            if nbytes > rT or row > (rT - nbytes) // p.S:
                return self._no()
            l_off = bi * p.S
            r_off = row * p.S
            if self._move(entity, route, local, rc, True, p.l_first, p.r_first, p.K, &l_off, &r_off, &nbytes, 1):
                return True
            return self._no()
        finally:
            lock.release()

    def pull_kv_blocks(self, src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param=None):
        """PullKvBlocks (§3.11) if accepted: see the class notes."""
        cdef Ext e
        cdef Runs r
        cdef uint64_t small[SMALL_PAIRS * COLUMNS]
        forget_failure()  # a failed copy's record lives for its own call only
        if not (_enabled and self.enabled) or _calls_known_off.get(_DEBUG) is not False:
            return False
        r.heap = NULL
        try:
            if (type(src_cache_index) is not CacheIndex or type(dst_cache) is not Cache
                    or not self._in_process(src_cache_index)
                    or not _ext(ext_param, &e, False) or not _runs(src_blocks, dst_blocks, &r, small)):
                return self._no()  # the facade's argument checks (3, 4, 5: _ext, _runs)
            return self._pull_blocks(src_cache_index, dst_cache, &e, &r)
        finally:
            PyMem_RawFree(r.heap)

    cdef bint _pull_blocks(self, object idx, object dst_cache, const Ext *e, Runs *r) except -1:
        cdef Pull p
        cdef int64_t cache_id, row, rn, rT, longest = 0
        cdef Py_ssize_t i
        if not _index(idx, &cache_id, &row) or not self.backend.initialized or row != 0:  # 1, 2
            return self._no()
        link = self._pull_link(idx, dst_cache, e, 0, &p)  # 6: PullKvCache 4-8, 10, 11
        if link is None:
            return self._no()
        local, entity, route = link
        if 120 + 16 * (p.K + 2 * r.G) > _request_limit:  # 8
            return self._no()
        for i in range(r.G):  # 9
            if r.d0[i] >= <uint64_t>p.B or r.d_last[i] >= <uint64_t>p.B:
                return self._no()
        lock = entity.lock
        lock.acquire()
        try:
            rc = entity.peer.snapshot().get(cache_id) if cache_id > 0 else None  # 10
            if rc is None:
                return self._no()
            rn = rc.num_tensors
            rT = rc.tensor_nbytes
            if (not p.lists and rn != p.n) or p.S <= 0:
                return self._no()
            for i in range(r.G):  # 11: each run's first source block below the remote block count
                # (the block count without rT + S - 1, which overflows for rT near 2**63)
                if r.s0[i] >= <uint64_t>(rT // p.S + (1 if rT % p.S else 0)):
                    return self._no()
                if <int64_t>r.ln[i] > longest:
                    longest = r.ln[i]
            if longest > rT // p.S:  # 11: longest x S <= remote T
                return self._no()
            if local.ragged or rc.ragged or p.r_first + p.K > rn:  # kvdd rules 10 and 1
                return self._no()
            if not _byte_plan(r, p.S, rT % p.S) or r.s_end > rT:  # the §3.11 tail quirk; kvdd rule 1
                return self._no()
            if self._move(entity, route, local, rc, True, p.l_first, p.r_first, p.K, r.do, r.so, r.nb, r.G):
                return True
            return self._no()
        finally:
            lock.release()

    def push_kv_blocks(self, src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param=None):
        """PushKvBlocks (§3.13) if accepted: see the class notes."""
        cdef Ext e
        cdef Runs r
        cdef uint64_t small[SMALL_PAIRS * COLUMNS]
        forget_failure()  # a failed copy's record lives for its own call only
        if not (_enabled and self.enabled) or _calls_known_off.get(_DEBUG) is not False:
            return False
        r.heap = NULL
        try:
            if (type(src_cache) is not Cache or type(dst_cache_index) is not CacheIndex
                    or not self._in_process(dst_cache_index)
                    or not _ext(ext_param, &e, True) or not _runs(src_blocks, dst_blocks, &r, small)):
                return self._no()  # the facade's argument checks (3, 4, 6: _runs, _ext)
            return self._push_blocks(src_cache, dst_cache_index, &e, &r)
        finally:
            PyMem_RawFree(r.heap)

    cdef bint _push_blocks(self, object src_cache, object idx, const Ext *e, Runs *r) except -1:
        cdef Push q
        cdef int64_t cache_id, row
        cdef Py_ssize_t i
        if not _index(idx, &cache_id, &row):
            return self._no()
        if (not self.backend.initialized or src_cache.cache_desc.placement != _device
                or row != 0):  # 1, 2, 5
            return self._no()
        link = self._push_link(src_cache, idx, cache_id, e, &q)  # 6, 7, a-d
        if link is None:
            return self._no()
        local, entity, rc, route = link
        lock = entity.lock
        lock.acquire()
        try:
            # every planned layer passes: layer 0's checks e-h and kvdd rules 10 and 1, and no later
            # layer fails d or f
            if r.d_max >= <uint64_t>rc.batch_size or not self._push_layers_pass(local, rc, &q):  # e, ...
                return self._no()
            for i in range(r.G):  # h: source blocks below the local block count
                if r.s0[i] >= <uint64_t>q.B or r.s_last[i] >= <uint64_t>q.B:
                    return self._no()
            # kvdd rule 1 (block = local S, §7.4)
            if not _byte_plan(r, q.S, 0) or r.d_end > rc.tensor_nbytes:
                return self._no()
            if self._move(entity, route, local, rc, False, q.ls0 * q.t, q.ld0 * q.t, q.L * q.t, r.so, r.do, r.nb, r.G):
                return True
            return self._no()
        finally:
            lock.release()

    def push_kv_cache(self, src_cache, dst_cache_index, src_batch_index=0, size=-1, ext_param=None):
        """PushKvCache (§3.12) if accepted: see the class notes."""
        cdef Ext e
        cdef Push q
        cdef int64_t sbi, cache_id, bd, stride, rT, l_off, r_off
        forget_failure()  # a failed copy's record lives for its own call only
        if not (_enabled and self.enabled) or _calls_known_off.get(_DEBUG) is not False:
            return False
        if (type(src_cache) is not Cache or type(dst_cache_index) is not CacheIndex
                or not _int(src_batch_index, 0, _U32 - 1, &sbi) or type(size) is not int
                or not _ext(ext_param, &e, True) or not _index(dst_cache_index, &cache_id, &bd)):
            return self._no()  # the facade's argument checks (4: _ext)
        if (not self.backend.initialized or src_cache.cache_desc.placement != _device
                or size != -1):  # 1, 2, 3
            return self._no()
        link = self._push_link(src_cache, dst_cache_index, cache_id, &e, &q)  # 5, 6, a-d
        if link is None:
            return self._no()
        local, entity, rc, route = link
        lock = entity.lock
        lock.acquire()
        try:
            # every planned layer passes (kvdd.sim.pushes._layers_passing): layer 0's e-h ...
            if bd >= rc.batch_size or sbi >= q.B or not self._push_layers_pass(local, rc, &q):  # e, h, ...
                return self._no()
            if not _int(rc.stride_nbytes, 0, I64_MAX, &stride):  # (as in pull_kv_cache)
                return self._no()
            rT = rc.tensor_nbytes
            if q.S > rT or (stride > 0 and bd > (rT - q.S) // stride):  # kvdd rule 1: bd x R.S + L.S <= R.T
                return self._no()
            l_off = sbi * q.S  # exactly L.S bytes of the source row at the remote row's offset (§7.5)
            r_off = bd * stride
            if self._move(entity, route, local, rc, False, q.ls0 * q.t, q.ld0 * q.t, q.L * q.t, &l_off, &r_off, &q.S, 1):
                return True
            return self._no()
        finally:
            lock.release()
