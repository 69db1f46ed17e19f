"""Simulator peers in a separate process, driven from the test process by RPC.

The test side creates a :class:`PeerProcess` (a child ``python`` running this file, connected by a
private socketpair), then :class:`ProcessNode` objects: proxies of the conformance harness's
``Node`` whose methods run in the child.  Arguments and results are plain picklable values (ints,
kvdd value types, bytes, ``CacheHandle`` sent as a tuple), exactly what the harness promises for
``Node`` methods; kvdd exceptions cross unchanged (they pickle with their status).  The RPC channel is
a local socketpair between two test processes; the simulator's own network protocol never uses
pickle.

Every call has a timeout (a hung peer fails the test instead of hanging it); :meth:`PeerProcess.close`
(also run at interpreter exit for anything left over) stops the child, killing it if needed.  The
child exits by itself when the test process goes away (EOF on the socketpair).

Run as a script, this file is the child: ``python peer_proc.py <fd>``.
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import kvdd
import kvdd.testing as kt
from kvdd import Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, Status

_TESTS_DIR = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("conformance") is None:  # pytest puts tests/ on sys.path for the suite
    sys.path.append(str(_TESTS_DIR))

from conformance import harness  # noqa: E402
from conformance.harness import CacheHandle, Node  # noqa: E402

#: Seconds any single RPC may take before the test fails (transfers are far faster).
CALL_TIMEOUT = 60.0
#: Environment of the child: the backend of its nodes and their NPU (see PeerProcess).
ENV_BACKEND = "KVDD_PEER_BACKEND"
ENV_DEVICE_ID = "KVDD_PEER_DEVICE_ID"
_HANDLE = "__cache_handle__"


def _encode(value: Any) -> Any:
    if isinstance(value, CacheHandle):
        return (_HANDLE, value.owner, value.cluster_id, value.cache_id, value.desc, value.slot,
                value.offsets, value.nbytes)
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_encode(v) for v in value)
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 8 and value[0] == _HANDLE:
        return CacheHandle(*value[1:])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_decode(v) for v in value)
    return value


class PeerError(RuntimeError):
    """A non-kvdd exception raised in the peer process (its type and message)."""


# ---- the child ---------------------------------------------------------------------------------


class _Root:
    """Object 0 of the child: makes nodes and answers questions about the process."""

    def __init__(self, objects: dict[int, Any]) -> None:
        self.objects = objects
        self.ids = itertools.count(1)
        self.released_at: list[float] = []  # monotonic time a held transfer finished

    def ping(self) -> int:
        return os.getpid()

    def now(self) -> float:
        return time.monotonic()  # CLOCK_MONOTONIC: comparable between processes of one host

    def setenv(self, name: str, value: str | None) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def new_node(self, cluster_id: int, role: int, uid: int) -> int:
        # The backend and NPU of this process's nodes (PeerProcess's backend= and device_id=).
        device = os.environ.get(ENV_DEVICE_ID)
        node = Node(cluster_id, role, backend=os.environ.get(ENV_BACKEND, "sim"),
                    device_id=None if device is None else int(device))
        node.uid = uid  # the test process's numbering, so World snapshots stay distinct
        oid = next(self.ids)
        self.objects[oid] = node
        return oid

    def drop(self, oid: int) -> None:
        self.objects.pop(oid, None)

    def can_read(self, pid: int, addr: int) -> bool:
        """Whether process_vm_readv of ``pid`` works from here (ptrace rules)."""
        from kvdd._native import _xproc
        try:
            _xproc.pvm_read_bytes(pid, addr, 1)
        except OSError:
            return False
        return True

    def data_path(self, oid: int, peer_cluster_id: int) -> str:
        node = self.objects[oid]
        entity = node.dd.backend.entities[peer_cluster_id]
        return str(getattr(entity.peer, "data_path", "in_process"))

    def entity_keys(self, oid: int) -> list[int]:
        return sorted(self.objects[oid].dd.backend.entities)

    def hold(self, ms: int) -> None:
        """Make every cross-process read/write of this process sleep ``ms`` after its lease was
        granted (a slow reader holding a lease); 0 restores.  Records when each finished."""
        from kvdd.sim import fabric
        cls: Any = fabric.RemotePeer
        orig = cls.__dict__.get("_kvdd_orig_move") or cls.move
        if ms <= 0:
            cls.move = orig
            return
        root = self

        def slow_move(peer: Any, *args: Any) -> Any:
            time.sleep(ms / 1000.0)
            try:
                return orig(peer, *args)
            finally:
                root.released_at.append(time.monotonic())

        cls._kvdd_orig_move = orig
        cls.move = slow_move

    def released(self) -> list[float]:
        return list(self.released_at)


def _child_main(fd: int) -> None:
    conn = Connection(fd)
    objects: dict[int, Any] = {}
    objects[0] = _Root(objects)
    send_lock = threading.Lock()
    device = os.environ.get(ENV_DEVICE_ID)
    native_device = (int(device) if device is not None else kt.device_ids()[0]) \
        if os.environ.get(ENV_BACKEND) == "native" else None

    def run(cid: int, oid: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if native_device is not None:
                # ACL contexts are per thread and each RPC runs on a new one: make this process's
                # NPU current first, as a CANN program does on every thread that calls the library.
                kt.acl_runtime().activate(native_device)
            target = objects[oid]
            value = getattr(target, method)(*_decode(args), **{k: _decode(v) for k, v in kwargs.items()})
            reply: tuple[Any, ...] = (cid, True, _encode(value))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            if isinstance(exc, kvdd.LLMError):
                reply = (cid, False, exc)
            else:
                reply = (cid, False, PeerError(f"{type(exc).__name__}: {exc}"))
        try:
            with send_lock:
                conn.send(reply)
        except (OSError, EOFError):
            os._exit(0)

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the test process is gone
        if msg is None:
            break
        threading.Thread(target=run, args=msg, daemon=True).start()
    for obj in list(objects.values()):
        if isinstance(obj, Node):
            try:
                obj.close()
            except Exception:  # noqa: BLE001
                pass
    with send_lock:
        conn.send(None)
    os._exit(0)


# ---- the test side ---------------------------------------------------------------------------------


class Call:
    """An RPC in flight (see :meth:`PeerProcess.start`)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.ok = False
        self.value: Any = None

    def result(self, timeout: float = CALL_TIMEOUT) -> Any:
        if not self.event.wait(timeout):
            raise TimeoutError(f"the peer process did not answer within {timeout} s")
        if not self.ok:
            raise self.value
        return self.value

    def done(self) -> bool:
        return self.event.is_set()


_live: weakref.WeakSet[PeerProcess] = weakref.WeakSet()


class PeerProcess:
    """A child Python process hosting simulator nodes (see the module docstring).

    Parameters
    ----------
    env : Mapping[str, str], optional
        Extra environment variables for the child (e.g. ``KVDD_SIM_XPROC``).
    prefix : Sequence[str], optional
        Command prefix, e.g. ``["ip", "netns", "exec", "ns1"]`` to run the child in a network
        namespace.
    backend : str, default "sim"
        Backend of the child's nodes (``"native"``: the conformance suite's native peers).
    device_id : int, optional
        NPU of the child's nodes (their device memory and ``llm.DeviceId``).
    """

    def __init__(self, *, env: Mapping[str, str] | None = None,
                 prefix: Sequence[str] = (), start_timeout: float = CALL_TIMEOUT,
                 backend: str = "sim", device_id: int | None = None) -> None:
        ours, theirs = socket.socketpair()
        self.backend = backend
        self.device_id = device_id
        child_env = dict(os.environ)
        child_env[ENV_BACKEND] = backend
        child_env.pop(ENV_DEVICE_ID, None)
        if device_id is not None:
            child_env[ENV_DEVICE_ID] = str(device_id)
        child_env.update(env or {})
        cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), str(theirs.fileno())]
        self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=child_env,
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._calls: dict[int, Call] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._dead = False
        self._reader = threading.Thread(target=self._read_replies, daemon=True,
                                        name="peer-proc-rpc")
        self._reader.start()
        _live.add(self)
        try:
            self.pid: int = self.call(0, "ping", timeout=start_timeout)
        except BaseException:
            self.close()
            raise

    def _read_replies(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg is None:
                break
            cid, ok, value = msg
            with self._lock:
                call = self._calls.pop(cid, None)
            if call is not None:
                call.ok = ok
                call.value = _decode(value) if ok else value
                call.event.set()
        with self._lock:
            self._dead = True
            calls = list(self._calls.values())
            self._calls.clear()
        for call in calls:
            call.ok = False
            call.value = PeerError("the peer process exited")
            call.event.set()

    def start(self, oid: int, method: str, *args: Any, **kwargs: Any) -> Call:
        """Start an RPC and return at once (the child runs each call in its own thread)."""
        call = Call()
        with self._lock:
            if self._dead:
                call.value = PeerError("the peer process exited")
                call.event.set()
                return call
            cid = next(self._ids)
            self._calls[cid] = call
        msg = (cid, oid, method, _encode(args), {k: _encode(v) for k, v in kwargs.items()})
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, EOFError):
            with self._lock:
                self._calls.pop(cid, None)
            call.value = PeerError("the peer process exited")
            call.event.set()
        return call

    def call(self, oid: int, method: str, *args: Any, timeout: float = CALL_TIMEOUT,
             **kwargs: Any) -> Any:
        return self.start(oid, method, *args, **kwargs).result(timeout)

    def root(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.call(0, method, *args, **kwargs)

    def node(self, cluster_id: int, role: int = kvdd.LlmRole.MIX) -> ProcessNode:
        return ProcessNode(self, cluster_id, role)

    def signal(self, sig: int) -> None:
        """Send `sig` to the child; for SIGSTOP, return only once every thread of it is stopped
        (the group stop is asynchronous: a thread still running could answer one more request)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGSTOP:
                _wait_stopped(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL the child (a peer dying mid-transfer) and reap it."""
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 15.0) -> None:
        """Finalize the child's nodes and stop it; kill it if it does not exit in time."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            try:
                with self._send_lock:
                    self._conn.send(None)
                self.proc.wait(timeout)
            except (OSError, EOFError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # in case a test left it stopped
            self.proc.kill()
            self.proc.wait(10)
        try:
            self._conn.close()
        except OSError:
            pass

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for proc in list(_live):
        proc.close(timeout=5.0)


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


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until every thread of `pid` is in the stopped state ('T' in /proc/PID/task/*/stat)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                      for t in os.listdir(f"/proc/{pid}/task")]
        except (OSError, IndexError):  # a thread ended while we looked, or the process is gone
            if not os.path.exists(f"/proc/{pid}"):
                return
            continue
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")
