"""Conformance-suite harness: ``Node`` (one LlmDataDist + the memory behind its caches) and ``World``.

A ``Node`` owns an ``LlmDataDist`` and one *arena* per registered cache: ``GUARD`` bytes, then
each tensor (padded to ``ALIGN``) followed by ``GUARD`` bytes.  Arenas are :mod:`kvdd.testing`
buffers of the node's backend: host memory on the simulator, ACL device memory (``aclrtMalloc``,
filled and read back with ``aclrtMemcpy``) for ``DEVICE`` caches on native, so every byte check
below takes the path it takes on an Atlas node.  Every arena is filled with a distinct
deterministic pseudo-random pattern, so a transfer that writes the wrong bytes, or any byte outside
its targets (including the guard bytes between and around tensors: kvdd rule 1), is detected by
comparing whole arenas against the reference model.

Tests never touch a peer's numpy arrays: they go through ``Node`` methods whose arguments and
results are plain picklable values (ints, kvdd value types, bytes), so that a later mode can run
peers in another process (``KVDD_PEER=process``) and turn these methods into RPC calls.  The node
under test ("D") is the only one tests may reach through ``.dd`` directly.
"""

from __future__ import annotations

import importlib
import itertools
import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvdd
import kvdd.testing as kt
from kvdd import (
    Cache,
    CacheDesc,
    CacheIndex,
    CachePlacement,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LlmRole,
    Status,
)

from . import reference as ref
from .reference import Bytes

GUARD = 64
ALIGN = 64
#: The IP every node listens on and links to (``$KVDD_TEST_IP``, default 127.0.0.1; on an Atlas
#: node the host address LLM-DataDist should use).
LOCALHOST = os.environ.get("KVDD_TEST_IP", "127.0.0.1")

#: The default cache of SEMANTICS.md §6: 10 tensors, DT_INT32, shape (4, 16): T=256, B=4, S=64.
DEFAULT_N = 10
DEFAULT_DTYPE = DataType.DT_INT32
DEFAULT_SHAPE: tuple[int, ...] = (4, 16)

_uids = itertools.count(1)


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def free_port() -> int:
    """A TCP port on ``LOCALHOST`` that nothing listens on (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCALHOST, 0))
        port: int = s.getsockname()[1]
    return port


def port_reported(backend: str) -> bool:
    """Whether ``listen_port`` of a ``backend`` node tells which port ``...:0`` bound: on the
    simulator, and on a native build against kvdd's simulated CANN root unless its hook is off
    (``KVDD_TESTDOUBLE_PORT_HOOK=0``); never on a real CANN install."""
    if backend == "sim":
        return True
    try:
        cfg = importlib.import_module("kvdd._build_config")
    except ImportError:
        return False
    return bool(cfg.NATIVE_TEST_DOUBLE) and os.environ.get("KVDD_TESTDOUBLE_PORT_HOOK") != "0"


def listen_address(backend: str) -> str:
    """The ``llm.ListenIpInfo`` a node of ``backend`` listens on: port 0 where the bound port is
    reported (:func:`port_reported`), else a free port chosen beforehand (so that the suite, on an
    Atlas node and in CI's run "as on an Atlas node", never needs the port 0 bound)."""
    return f"{LOCALHOST}:{0 if port_reported(backend) else free_port()}"


# -- expected errors ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Err:
    """An expected failure: the exact exception class and its ``.status``."""

    cls: type[kvdd.LLMError]
    status: int

    def __str__(self) -> str:
        return f"{self.cls.__name__}({Status(self.status).name})"


PARAM_INVALID = Err(kvdd.LLMParamInvalidError, Status.LLM_PARAM_INVALID)
FAILED = Err(kvdd.LLMError, Status.LLM_FAILED)
KV_CACHE_NOT_EXIST = Err(kvdd.LLMKvCacheNotExistError, Status.LLM_KV_CACHE_NOT_EXIST)
NOT_YET_LINK = Err(kvdd.LLMNotYetLinkError, Status.LLM_NOT_YET_LINK)
ALREADY_LINK = Err(kvdd.LLMAlreadyLinkError, Status.LLM_ALREADY_LINK)
LINK_FAILED = Err(kvdd.LLMLinkFailedError, Status.LLM_LINK_FAILED)
UNLINK_FAILED = Err(kvdd.LLMUnlinkFailedError, Status.LLM_UNLINK_FAILED)
EXIST_LINK = Err(kvdd.LLMExistLinkError, Status.LLM_EXIST_LINK)
FEATURE_NOT_ENABLED = Err(kvdd.LLMFeatureNotEnabledError, Status.LLM_FEATURE_NOT_ENABLED)
TIMEOUT = Err(kvdd.LLMTimeoutError, Status.LLM_TIMEOUT)

_UNSET: list[int] = [-12345]


@contextmanager
def raises(err: Err, *, rets: Sequence[int] | None = _UNSET) -> Iterator[None]:
    """Assert the block raises exactly ``err.cls`` with ``.status == err.status`` (and ``.rets``)."""
    with pytest.raises(kvdd.LLMError) as info:
        yield
    exc = info.value
    assert type(exc) is err.cls, f"expected {err}, got {type(exc).__name__}: {exc}"
    assert exc.status == err.status, (
        f"expected status {Status(err.status).name}, got {exc.status!r}: {exc}")
    if rets is not _UNSET:
        expected = None if rets is None else [int(r) for r in rets]
        got = None if exc.rets is None else [int(r) for r in exc.rets]
        assert got == expected, f"rets: expected {expected}, got {got} ({exc})"


# -- caches -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheHandle:
    """A cache registered by some node, plus where its tensors live in that node's arena."""

    owner: int  # Node.uid of the owner
    cluster_id: int  # owner's cluster id
    cache_id: int
    desc: CacheDesc
    slot: int  # arena number inside the owner
    offsets: tuple[int, ...]  # byte offset of tensor k inside the arena
    nbytes: int  # T, computed by the reference model

    @property
    def geom(self) -> ref.Geom:
        return ref.geom(self.desc.num_tensors, int(self.desc.data_type), self.desc.shape)

    def cache(self, *, num_tensors: int | None = None, placement: int | None = None,
              id_only: bool = False) -> Cache:
        """The ``Cache`` struct a caller passes for this cache (pull reads only the id; push also
        reads ``cache_desc.placement`` and ``.num_tensors``, §3.12)."""
        if id_only:
            return Cache(cache_id=self.cache_id)
        d = self.desc
        desc = CacheDesc(
            num_tensors=d.num_tensors if num_tensors is None else num_tensors,
            data_type=d.data_type, shape=d.shape,
            placement=d.placement if placement is None else placement)
        return Cache(cache_id=self.cache_id, cache_desc=desc)

    def index(self, batch_index: int = 0, *, cluster_id: int | None = None,
              cache_id: int | None = None) -> CacheIndex:
        """The ``CacheIndex`` a peer uses to name this cache."""
        return CacheIndex(self.cluster_id if cluster_id is None else cluster_id,
                          self.cache_id if cache_id is None else cache_id, batch_index)


def cluster(port: int, remote_cluster_id: int, *, ip: str = LOCALHOST,
            local_ip: bool = True) -> ClusterInfo:
    """A ``ClusterInfo`` for a peer at ip:port.  ``local_ip`` adds one local IpInfo (needed on the
    comm backend by an instance with neither listen ip nor LocalCommRes, §3.5 b; ignored
    otherwise)."""
    return ClusterInfo(
        remote_cluster_id=remote_cluster_id,
        remote_ip_infos=(IpInfo(ip, port),),
        local_ip_infos=(IpInfo(LOCALHOST, 0),) if local_ip else (),
    )


# -- nodes --------------------------------------------------------------------------------------


class Node:
    """One ``LlmDataDist`` instance and the memory behind its caches.

    All public methods take and return picklable values so that a peer can live in another
    process (``KVDD_PEER=process``).  ``dd`` is only for the node under test.  ``device_id`` is the
    NPU of the node's device memory and its default ``llm.DeviceId`` (default: the first id of
    ``$KVDD_TEST_DEVICE_IDS``).
    """

    def __init__(self, cluster_id: int, role: int = LlmRole.MIX, *, backend: str = "sim",
                 device_id: int | None = None) -> None:
        self.uid = next(_uids)
        self._cluster_id = cluster_id
        self.device_id = kt.device_ids()[0] if device_id is None else device_id
        self.dd = kvdd.LlmDataDist(cluster_id, role, backend=backend)
        self._arenas: list[kt.Buffer] = []
        self.handles: list[CacheHandle] = []  # every handle this node returned (for diagnostics)
        self._closed = False
        self.listen_ip_info: str | None = None  # llm.ListenIpInfo of the last initialize()

    # -- identity / lifecycle ------------------------------------------------------------------
    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def listen_port(self) -> int | None:
        return self.dd.listen_port

    @property
    def backend_name(self) -> str:
        return self.dd.backend_name

    def options(self, *, listen: bool = False, transfer: str = "comm",
                device_id: str | None = None,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
        opts = {kvdd.OPTION_DEVICE_ID: str(self.device_id) if device_id is None else device_id}
        if listen or transfer == "hixl":
            opts[kvdd.OPTION_LISTEN_IP_INFO] = listen_address(self.backend_name)
        if transfer == "hixl":
            opts[kvdd.OPTION_TRANSFER_BACKEND] = "hixl"
        elif transfer != "comm":
            raise ValueError(transfer)
        opts.update(extra or {})
        return opts

    def initialize(self, *, listen: bool = False, transfer: str = "comm",
                   device_id: str | None = None,
                   extra: Mapping[str, str] | None = None) -> None:
        """Initialize with ``llm.DeviceId`` (default: the node's device) and, when listening or on
        hixl (which requires it), ``llm.ListenIpInfo`` (:func:`listen_address`, kept in
        ``listen_ip_info``)."""
        opts = self.options(listen=listen, transfer=transfer, device_id=device_id, extra=extra)
        self.listen_ip_info = opts.get(kvdd.OPTION_LISTEN_IP_INFO)
        self.dd.initialize(opts)

    def initialize_raw(self, options: Mapping[str, str]) -> None:
        self.dd.initialize(options)

    def finalize(self) -> None:
        self.dd.finalize()

    def set_role(self, role: int, options: Mapping[str, str] | None = None) -> None:
        self.dd.set_role(role, options)

    def close(self) -> None:
        """Finalize, then free the node's memory (once the library has forgotten it)."""
        if not self._closed:
            self._closed = True
            self.dd.finalize()
            for arena in self._arenas:
                arena.free()

    # -- memory --------------------------------------------------------------------------------
    def _new_arena(self, t: int, n: int, fill: int | None,
                   placement: int = CachePlacement.DEVICE) -> tuple[int, tuple[int, ...]]:
        pitch = _round_up(max(t, 1), ALIGN) + GUARD
        size = GUARD + n * pitch
        seed = [self._cluster_id, self.uid, len(self._arenas)] + ([] if fill is None else [fill])
        pattern = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
        arena = kt.allocate(size, backend=self.backend_name, placement=placement,
                            device_id=self.device_id)
        arena.write(pattern)
        self._arenas.append(arena)
        return len(self._arenas) - 1, tuple(GUARD + k * pitch for k in range(n))

    def alloc(self, nbytes: int, n: int, fill: int | None = None) -> tuple[int, list[int]]:
        """A filled arena (device memory on native) for ``n`` tensors of ``nbytes``: (slot,
        tensor addresses)."""
        slot, offsets = self._new_arena(nbytes, n, fill)
        base = self._arenas[slot].address
        return slot, [base + o for o in offsets]

    def register(self, num_tensors: int = DEFAULT_N, dtype: int = DEFAULT_DTYPE,
                 shape: Sequence[int] = DEFAULT_SHAPE, placement: int = CachePlacement.DEVICE,
                 fill: int | None = None) -> CacheHandle:
        """Allocate fresh pattern-filled memory and register it; returns the handle."""
        desc = CacheDesc(num_tensors=num_tensors, data_type=dtype, shape=tuple(shape),
                         placement=placement)
        t = ref.tensor_nbytes(dtype, shape)
        slot, offsets = self._new_arena(t, num_tensors, fill, placement)
        cache_id = self.dd.register_kv_cache(desc, self._arenas[slot].addrs(offsets, t))
        h = CacheHandle(self.uid, self._cluster_id, cache_id, desc, slot, offsets, t)
        self.handles.append(h)
        return h

    def register_again(self, h: CacheHandle) -> CacheHandle:
        """Register the very same memory (same addresses, same desc) once more (§3.7 step 9)."""
        assert h.owner == self.uid
        cache_id = self.dd.register_kv_cache(h.desc, self._arenas[h.slot].addrs(h.offsets, h.nbytes))
        h2 = CacheHandle(self.uid, self._cluster_id, cache_id, h.desc, h.slot, h.offsets,
                         h.nbytes)
        self.handles.append(h2)
        return h2

    def register_addrs(self, desc: CacheDesc, addrs: Sequence[int]) -> int:
        """Raw RegisterKvCache with plain integer addresses."""
        return self.dd.register_kv_cache(desc, list(addrs))

    def unregister(self, cache_id: int) -> None:
        self.dd.unregister_kv_cache(cache_id)

    def snapshot(self) -> dict[int, bytes]:
        """Every arena of this node (tensors and guards), by slot."""
        return {slot: a.read().tobytes() for slot, a in enumerate(self._arenas)}

    def tensor_addr(self, h: CacheHandle, k: int) -> int:
        """Address of tensor ``k`` of ``h`` (meaningful only for nodes in this process)."""
        assert h.owner == self.uid
        return self._arenas[h.slot].address + h.offsets[k]

    def tensor_bytes(self, h: CacheHandle, k: int) -> bytes:
        assert h.owner == self.uid
        return self._arenas[h.slot].read(h.offsets[k], h.nbytes).tobytes()

    # -- links -----------------------------------------------------------------------------------
    def link_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int = 1000) -> list[Status]:
        return self.dd.link_llm_clusters(list(clusters), timeout_ms)

    def unlink_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int = 1000,
                        force: bool = False) -> list[Status]:
        return self.dd.unlink_llm_clusters(list(clusters), timeout_ms, force)

    def link(self, port: int, remote_cluster_id: int, *, local_ip: bool = True,
             timeout_ms: int = 1000) -> list[Status]:
        return self.link_clusters([cluster(port, remote_cluster_id, local_ip=local_ip)],
                                  timeout_ms)

    def unlink(self, port: int, remote_cluster_id: int, *, force: bool = False,
               timeout_ms: int = 1000) -> list[Status]:
        return self.unlink_clusters([cluster(port, remote_cluster_id)], timeout_ms, force)

    # -- transfers (thin pass-throughs, so a peer can be the caller) ------------------------------
    def pull_kv_cache(self, src: CacheIndex, dst: Cache, batch_index: int = 0, size: int = -1,
                      ext_param: KvCacheExtParam | None = None) -> None:
        self.dd.pull_kv_cache(src, dst, batch_index, size, ext_param)

    def pull_kv_blocks(self, src: CacheIndex, dst: Cache, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> None:
        self.dd.pull_kv_blocks(src, dst, src_blocks, dst_blocks, ext_param)

    def push_kv_cache(self, src: Cache, dst: CacheIndex, src_batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None) -> None:
        self.dd.push_kv_cache(src, dst, src_batch_index, size, ext_param)

    def push_kv_blocks(self, src: Cache, dst: CacheIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> None:
        self.dd.push_kv_blocks(src, dst, src_blocks, dst_blocks, ext_param)


def link(a: Node, b: Node, *, remote_cluster_id: int | None = None) -> list[Status]:
    """``a`` links to ``b`` (which must listen)."""
    port = b.listen_port
    assert port, "the linked-to node must listen"
    return a.link(port, b.cluster_id if remote_cluster_id is None else remote_cluster_id)


def unlink(a: Node, b: Node, *, force: bool = False,
           remote_cluster_id: int | None = None) -> list[Status]:
    port = b.listen_port
    assert port, "the unlinked node must listen"
    return a.unlink(port, b.cluster_id if remote_cluster_id is None else remote_cluster_id,
                    force=force)


# -- memory snapshots ---------------------------------------------------------------------------


@dataclass
class Snapshot:
    """All arenas of all nodes of a world: ``{(node uid, slot): uint8 array}``."""

    arenas: dict[tuple[int, int], Bytes] = field(default_factory=dict)

    def copy(self) -> Snapshot:
        return Snapshot({k: v.copy() for k, v in self.arenas.items()})

    def tensors(self, h: CacheHandle) -> list[Bytes]:
        """Writable views of the tensors of ``h`` inside this snapshot."""
        a = self.arenas[(h.owner, h.slot)]
        return [a[o:o + h.nbytes] for o in h.offsets]


def _describe(key: tuple[int, int], pos: int, handles: Sequence[CacheHandle]) -> str:
    for h in handles:
        if (h.owner, h.slot) == key:
            for k, o in enumerate(h.offsets):
                if o <= pos < o + h.nbytes:
                    return f"cache {h.cache_id} of cluster {h.cluster_id}, tensor {k}, byte {pos - o}"
            return f"guard/padding byte {pos} of the arena of cache {h.cache_id} (cluster {h.cluster_id})"
    return f"arena {key}, byte {pos}"


class World:
    """All nodes of one test: the node under test (``dut``) and its peers (``peer``: simulator
    nodes in this process, or with ``KVDD_PEER=process`` nodes of the backend under test, each
    in its own process)."""

    def __init__(self, backend: str, peer_factory: Callable[[int, int], Node]) -> None:
        self.backend = backend
        self._peer_factory = peer_factory
        self.nodes: list[Node] = []
        self._duts = 0

    def dut(self, cluster_id: int = 2, role: int = LlmRole.DECODER) -> Node:
        """The node under test (backend of the ``backend`` fixture).  At most one per test unless
        the backend is the simulator (several native instances per process: kvdd_sim_only)."""
        self._duts += 1
        if self._duts > 1 and self.backend != "sim":
            raise AssertionError("a second instance of the backend under test: mark the test "
                                 "kvdd_sim_only")
        node = Node(cluster_id, role, backend=self.backend)
        self.nodes.append(node)
        return node

    def peer(self, cluster_id: int = 1, role: int = LlmRole.PROMPT) -> Node:
        """A peer made by the ``peer_factory`` (see the class docstring)."""
        node = self._peer_factory(cluster_id, role)
        self.nodes.append(node)
        return node

    def snapshot(self) -> Snapshot:
        snap = Snapshot()
        for node in self.nodes:
            for slot, data in node.snapshot().items():
                snap.arenas[(node.uid, slot)] = np.frombuffer(data, dtype=np.uint8).copy()
        return snap

    def assert_memory(self, expected: Snapshot, what: str = "") -> None:
        """Every byte of every arena equals ``expected`` (targets and everything else)."""
        actual = self.snapshot()
        handles = [h for node in self.nodes for h in node.handles]
        # Arenas allocated after ``expected`` was taken are new harness memory: not compared.
        assert expected.arenas.keys() <= actual.arenas.keys()
        for key, exp in expected.arenas.items():
            got = actual.arenas[key]
            if not np.array_equal(exp, got):
                diff = np.flatnonzero(exp != got)
                first = int(diff[0])
                raise AssertionError(
                    f"{what}memory differs from the reference model at {len(diff)} byte(s); "
                    f"first: {_describe(key, first, handles)} "
                    f"(expected {int(exp[first])}, got {int(got[first])})")

    @contextmanager
    def rejects(self, err: Err, *, rets: Sequence[int] | None = _UNSET) -> Iterator[None]:
        """The block raises ``err`` and no byte of any node changes."""
        before = self.snapshot()
        with raises(err, rets=rets):
            yield
        self.assert_memory(before, f"after a rejected call ({err}): ")

    @contextmanager
    def unchanged(self) -> Iterator[None]:
        before = self.snapshot()
        yield
        self.assert_memory(before, "after a call that must not move bytes: ")


def ext(src: tuple[int, int] = (-1, -1), dst: tuple[int, int] = (-1, -1),
        t: int = 2) -> KvCacheExtParam:
    return KvCacheExtParam(src_layer_range=src, dst_layer_range=dst, tensor_num_per_layer=t)


def pair(world: World, transfer: str = "comm", *, d_listen: bool = False) -> tuple[Node, Node]:
    """SEMANTICS.md §6's setup: P (sim, cluster 1, listening on 127.0.0.1:0) and D (the node under
    test, cluster 2; listening only on hixl, which requires it, or when ``d_listen``).  Both are
    initialized, nothing is registered or linked yet (register first: §2.4 visibility)."""
    p = world.peer(1, LlmRole.PROMPT)
    p.initialize(listen=True, transfer=transfer)
    d = world.dut(2, LlmRole.DECODER)
    d.initialize(listen=d_listen, transfer=transfer)
    return d, p


@dataclass(frozen=True)
class Spec:
    """What to register: ``num_tensors`` tensors of ``shape``/``dtype`` (default: §6's cache)."""

    n: int = DEFAULT_N
    dtype: int = DEFAULT_DTYPE
    shape: tuple[int, ...] = DEFAULT_SHAPE
    placement: int = CachePlacement.DEVICE


def register(node: Node, spec: Spec) -> CacheHandle:
    return node.register(spec.n, spec.dtype, spec.shape, spec.placement)


def linked(world: World, transfer: str = "comm", dspec: Spec = Spec(),
           pspec: Spec = Spec()) -> tuple[Node, Node, CacheHandle, CacheHandle]:
    """§6's setup, registered then linked (D -> P): returns (d, p, D's cache, P's cache)."""
    d, p = pair(world, transfer)
    ph = register(p, pspec)
    dh = register(d, dspec)
    assert link(d, p) == [Status.LLM_SUCCESS]
    return d, p, dh, ph
