"""Instances a test talks to, in its own process or in another one, and the caches it registers.

* :func:`register_cache` registers memory for a cache on an instance of this process, the way the
  backend needs it (numpy memory on the simulator, ACL device memory on an Atlas node; see
  :mod:`kvdd.testing`), and returns a :class:`RegisteredCache` whose bytes the test can read and
  write.
* :class:`LocalPeer` is an initialized, listening instance of this process; :class:`RemotePeer` is
  the same in a child process (:class:`kvdd.testing.process.ProcessHost`): the other side of a
  link whose transfers cross processes as in a real deployment.  Both follow the :class:`Peer`
  protocol, so a test reads the same either way.

The pytest plugin (:mod:`kvdd.testing.pytest_plugin`) builds its fixtures from these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

import kvdd

from . import allocate_cache, device_ids
from .process import ProcessHost, RemoteObject

__all__ = ["RegisteredCache", "PeerCache", "Peer", "LocalPeer", "RemotePeer", "register_cache",
           "listen_options", "LOCALHOST"]

LOCALHOST = "127.0.0.1"


def listen_options(backend: str, *, listen: bool = True) -> dict[str, str]:
    """Initialize options of a test instance: its device, and a listener on a free loopback port."""
    opts = {kvdd.OPTION_DEVICE_ID: str(device_ids()[0] if backend == "native" else 0)}
    if listen:
        opts[kvdd.OPTION_LISTEN_IP_INFO] = f"{LOCALHOST}:0"
    return opts


class RegisteredCache:
    """A cache registered on an instance of this process, and its memory.

    Attributes
    ----------
    cache_id : int
        What ``register_kv_cache`` returned.
    desc : kvdd.CacheDesc
    cache : kvdd.Cache
        The cache as transfers name it locally (``pull_kv_blocks(..., dst_cache=c.cache)``).
    memory : kvdd.testing.CacheMemory
        Its tensors (``read(k)``/``write(k, data)``).
    """

    def __init__(self, dd: kvdd.LlmDataDist, desc: kvdd.CacheDesc, backend: str,
                 fill: int | None, device_id: int = 0) -> None:
        self.memory = allocate_cache(desc, backend=backend, device_id=device_id)
        if fill is not None:
            for k in range(desc.num_tensors):
                self.memory.write(k, _pattern(fill, k, desc.tensor_nbytes))
        addrs = self.memory.tensor_addrs()
        self._dd, self.desc = dd, desc
        self.cache_id = dd.register_kv_cache(desc, addrs)
        self.cache = kvdd.Cache(self.cache_id, [int(a) for a in addrs], desc)

    def read(self, tensor: int) -> bytes:
        """Every byte of tensor ``tensor`` (``desc.tensor_nbytes`` bytes)."""
        return bytes(self.memory.read(tensor))

    def write(self, tensor: int, data: bytes) -> None:
        """Overwrite tensor ``tensor`` with ``data`` (exactly ``desc.tensor_nbytes`` bytes)."""
        self.memory.write(tensor, data)

    def close(self) -> None:
        """Unregister the cache (if its instance is still initialized) and free its memory."""
        try:
            self._dd.unregister_kv_cache(self.cache_id)
        except kvdd.LLMError:
            pass
        self.memory.free()


def _pattern(fill: int, tensor: int, nbytes: int) -> bytes:
    """Bytes that differ per tensor and per position, seeded by ``fill``."""
    rng = np.random.default_rng([fill, tensor])
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def register_cache(dd: kvdd.LlmDataDist, desc: kvdd.CacheDesc, *, backend: str,
                   fill: int | None = None) -> RegisteredCache:
    """Allocate and register a cache on ``dd`` (memory as ``backend`` needs it).

    Parameters
    ----------
    dd : kvdd.LlmDataDist
        An initialized instance of this process.
    desc : kvdd.CacheDesc
        ``num_tensors`` tensors of ``desc.tensor_nbytes`` bytes each.
    backend : str
        ``"sim"`` (numpy memory) or ``"native"`` (ACL device memory for DEVICE placement).
    fill : int, optional
        Seed of pseudo-random contents (each tensor different); None leaves zeros.

    Raises
    ------
    kvdd.LLMError
        What ``register_kv_cache`` raises.
    """
    device = device_ids()[0] if backend == "native" else 0
    return RegisteredCache(dd, desc, backend, fill, device)


@dataclass(frozen=True)
class PeerCache:
    """A cache registered on a :class:`Peer`: how the other side of a link names it."""

    cluster_id: int
    cache_id: int
    desc: kvdd.CacheDesc

    def index(self, batch_index: int = 0) -> kvdd.CacheIndex:
        """The ``CacheIndex`` a linked instance pulls from or pushes to."""
        return kvdd.CacheIndex(self.cluster_id, self.cache_id, batch_index)


class Peer(Protocol):
    """An initialized, listening instance a test links to (here or in another process)."""

    cluster_id: int

    @property
    def port(self) -> int:
        """The port it listens on (loopback)."""
        ...

    def register_cache(self, desc: kvdd.CacheDesc, fill: int | None = None) -> PeerCache: ...

    def read(self, cache: PeerCache, tensor: int) -> bytes: ...

    def write(self, cache: PeerCache, tensor: int, data: bytes) -> None: ...

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Any method of its ``kvdd.LlmDataDist`` (e.g. ``"unregister_kv_cache"``)."""
        ...

    def cluster_info(self) -> kvdd.ClusterInfo:
        """The ``ClusterInfo`` that links to it."""
        ...

    def close(self) -> None: ...


class LocalPeer:
    """A :class:`Peer` in this process (also what a :class:`RemotePeer`'s child hosts).

    Parameters
    ----------
    cluster_id, role : int
    backend : str, default "sim"
    options : Mapping[str, str], optional
        Extra Initialize options (over a device id and a listener on ``127.0.0.1:0``).
    """

    def __init__(self, cluster_id: int, role: int = kvdd.LlmRole.PROMPT, backend: str = "sim",
                 options: Mapping[str, str] | None = None) -> None:
        self.cluster_id, self.backend = cluster_id, backend
        self.dd = kvdd.LlmDataDist(cluster_id, role, backend=backend)
        self.dd.initialize({**listen_options(backend), **(options or {})})
        self._caches: dict[int, RegisteredCache] = {}

    @property
    def port(self) -> int:
        return self.dd.listening_port

    def register_cache(self, desc: kvdd.CacheDesc, fill: int | None = None) -> PeerCache:
        mem = register_cache(self.dd, desc, backend=self.backend, fill=fill)
        self._caches[mem.cache_id] = mem
        return PeerCache(self.cluster_id, mem.cache_id, desc)

    def read(self, cache: PeerCache, tensor: int) -> bytes:
        return self._caches[cache.cache_id].read(tensor)

    def write(self, cache: PeerCache, tensor: int, data: bytes) -> None:
        self._caches[cache.cache_id].write(tensor, data)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.dd, method)(*args, **kwargs)

    def cluster_info(self) -> kvdd.ClusterInfo:
        return kvdd.ClusterInfo(remote_cluster_id=self.cluster_id,
                                remote_ip_infos=[kvdd.IpInfo(LOCALHOST, self.port)],
                                local_ip_infos=[kvdd.IpInfo(LOCALHOST, 0)])

    def close(self) -> None:
        """Finalize the instance, then free its caches' memory."""
        self.dd.finalize()
        for mem in self._caches.values():
            mem.close()
        self._caches.clear()


class RemotePeer:
    """A :class:`Peer` in a child process (its transfers cross processes through the fabric).

    Parameters are those of :class:`LocalPeer`; ``env`` adds environment variables to the child
    (e.g. ``KVDD_SIM_FAULTS`` to make the peer misbehave).
    """

    def __init__(self, cluster_id: int, role: int = kvdd.LlmRole.PROMPT, backend: str = "sim",
                 options: Mapping[str, str] | None = None, *,
                 env: Mapping[str, str] | None = None) -> None:
        self.cluster_id, self.backend = cluster_id, backend
        self.host = ProcessHost(env=env)
        try:
            self._obj: RemoteObject = self.host.new("kvdd.testing.peers:LocalPeer", cluster_id,
                                                    int(role), backend, dict(options or {}))
            self._port: int = self._obj.call("__getattribute__", "port")
        except BaseException:
            self.host.close()
            raise

    @property
    def pid(self) -> int:
        return self.host.pid

    @property
    def port(self) -> int:
        return self._port

    def register_cache(self, desc: kvdd.CacheDesc, fill: int | None = None) -> PeerCache:
        result: PeerCache = self._obj.call("register_cache", desc, fill)
        return result

    def read(self, cache: PeerCache, tensor: int) -> bytes:
        data: bytes = self._obj.call("read", cache, tensor)
        return data

    def write(self, cache: PeerCache, tensor: int, data: bytes) -> None:
        self._obj.call("write", cache, tensor, data)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._obj.call("call", method, *args, **kwargs)

    def cluster_info(self) -> kvdd.ClusterInfo:
        return kvdd.ClusterInfo(remote_cluster_id=self.cluster_id,
                                remote_ip_infos=[kvdd.IpInfo(LOCALHOST, self.port)],
                                local_ip_infos=[kvdd.IpInfo(LOCALHOST, 0)])

    def close(self) -> None:
        """Finalize the instance and stop the child process."""
        try:
            if self.host.alive:
                self._obj.call("close")
        finally:
            self.host.close()
