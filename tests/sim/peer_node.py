"""Conformance-harness nodes living in a peer process (:class:`peer_proc.PeerProcess`): every method
of :class:`ProcessNode` is an RPC; :func:`process_peer_factory` and :func:`process_world` give the
conformance suite and the fabric tests peers there."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import kvdd
import kvdd.testing as kt
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, Status

from peer_wire import Call, PeerError  # sets up the conformance import
from conformance import harness
from conformance.harness import CacheHandle, Node

if TYPE_CHECKING:
    from peer_proc import PeerProcess

__all__ = ["ProcessNode", "process_peer_factory", "process_world"]


class ProcessNode(Node):
    """A harness ``Node`` living in a :class:`PeerProcess`: every method is an RPC.

    ``dd`` does not exist here (peers are reached only through their methods)."""

    def __init__(self, proc: PeerProcess, cluster_id: int, role: int = kvdd.LlmRole.MIX) -> None:
        self.uid = next(harness._uids)
        self.device_id = kt.device_ids()[0] if proc.device_id is None else proc.device_id
        self._cluster_id = cluster_id
        self.handles: list[CacheHandle] = []
        self._closed = False
        self.proc = proc
        self.oid: int = proc.root("new_node", cluster_id, int(role), self.uid)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.proc.call(self.oid, method, *args, **kwargs)

    def start(self, method: str, *args: Any, **kwargs: Any) -> Call:
        """Start one of this node's methods asynchronously."""
        return self.proc.start(self.oid, method, *args, **kwargs)

    def data_path(self, peer_cluster_id: int) -> str:
        """``process_vm`` / ``tcp`` / ``in_process``: how this node reaches that peer."""
        path: str = self.proc.root("data_path", self.oid, peer_cluster_id)
        return path

    def entity_keys(self) -> list[int]:
        keys: list[int] = self.proc.root("entity_keys", self.oid)
        return keys

    # -- identity / lifecycle -----------------------------------------------------------------
    @property
    def listen_port(self) -> int | None:
        port: int | None = self.proc.call(self.oid, "__getattribute__", "listen_port")
        return port

    @property
    def backend_name(self) -> str:
        return self.proc.backend

    def initialize(self, *, listen: bool = False, transfer: str = "comm",
                   device_id: str | None = None,
                   extra: Mapping[str, str] | None = None) -> None:
        self._call("initialize", listen=listen, transfer=transfer, device_id=device_id,
                   extra=dict(extra or {}))

    def initialize_raw(self, options: Mapping[str, str]) -> None:
        self._call("initialize_raw", dict(options))

    def finalize(self) -> None:
        self._call("finalize")

    def set_role(self, role: int, options: Mapping[str, str] | None = None) -> None:
        self._call("set_role", role, None if options is None else dict(options))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.proc.alive:
                try:
                    self._call("close", timeout=30.0)
                    self.proc.root("drop", self.oid)
                except (PeerError, TimeoutError):
                    pass

    # -- memory --------------------------------------------------------------------------------
    def alloc(self, nbytes: int, n: int, fill: int | None = None) -> tuple[int, list[int]]:
        slot, addrs = self._call("alloc", nbytes, n, fill)
        return int(slot), list(addrs)

    def register(self, num_tensors: int = harness.DEFAULT_N, dtype: int = harness.DEFAULT_DTYPE,
                 shape: Sequence[int] = harness.DEFAULT_SHAPE,
                 placement: int = kvdd.CachePlacement.DEVICE,
                 fill: int | None = None) -> CacheHandle:
        h: CacheHandle = self._call("register", num_tensors, int(dtype), tuple(shape),
                                    int(placement), fill)
        self.handles.append(h)
        return h

    def register_again(self, h: CacheHandle) -> CacheHandle:
        h2: CacheHandle = self._call("register_again", h)
        self.handles.append(h2)
        return h2

    def register_addrs(self, desc: CacheDesc, addrs: Sequence[int]) -> int:
        cache_id: int = self._call("register_addrs", desc, list(addrs))
        return cache_id

    def unregister(self, cache_id: int) -> None:
        self._call("unregister", cache_id)

    def snapshot(self) -> dict[int, bytes]:
        snap: dict[int, bytes] = self._call("snapshot")
        return snap

    def tensor_addr(self, h: CacheHandle, k: int) -> int:
        addr: int = self._call("tensor_addr", h, k)
        return addr

    def tensor_bytes(self, h: CacheHandle, k: int) -> bytes:
        data: bytes = self._call("tensor_bytes", h, k)
        return data

    # -- links -----------------------------------------------------------------------------------
    def link_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int = 1000) -> list[Status]:
        rets: list[Status] = self._call("link_clusters", list(clusters), timeout_ms)
        return rets

    def unlink_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int = 1000,
                        force: bool = False) -> list[Status]:
        rets: list[Status] = self._call("unlink_clusters", list(clusters), timeout_ms, force)
        return rets

    # -- transfers ---------------------------------------------------------------------------------
    def pull_kv_cache(self, src: CacheIndex, dst: Cache, batch_index: int = 0, size: int = -1,
                      ext_param: KvCacheExtParam | None = None) -> None:
        self._call("pull_kv_cache", src, dst, batch_index, size, ext_param)

    def pull_kv_blocks(self, src: CacheIndex, dst: Cache, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> None:
        self._call("pull_kv_blocks", src, dst, list(src_blocks), list(dst_blocks), ext_param)

    def push_kv_cache(self, src: Cache, dst: CacheIndex, src_batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None) -> None:
        self._call("push_kv_cache", src, dst, src_batch_index, size, ext_param)

    def push_kv_blocks(self, src: Cache, dst: CacheIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> None:
        self._call("push_kv_blocks", src, dst, list(src_blocks), list(dst_blocks), ext_param)


def process_peer_factory(proc: PeerProcess) -> tuple[Callable[[int, int], Node], Callable[[], None]]:
    """A ``peer_factory`` for the conformance suite making peers in ``proc``, and a cleanup
    that closes the nodes it made."""
    made: list[ProcessNode] = []

    def make(cluster_id: int, role: int) -> Node:
        node = ProcessNode(proc, cluster_id, role)
        made.append(node)
        return node

    def cleanup() -> None:
        for node in reversed(made):
            node.close()

    return make, cleanup


@contextmanager
def process_world(proc: PeerProcess) -> Iterator[harness.World]:
    """A conformance :class:`~conformance.harness.World` on the simulator whose peers live in
    ``proc``; at the end every node it made is closed (the world's nodes last made first)."""
    make, cleanup = process_peer_factory(proc)
    world = harness.World("sim", make)
    try:
        yield world
    finally:
        for node in reversed(world.nodes):
            node.close()
        cleanup()

