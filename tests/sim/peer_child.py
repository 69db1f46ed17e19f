"""The peer process: run as ``python peer_child.py <fd>`` by :class:`peer_proc.PeerProcess`, it
serves the test process's RPCs (:mod:`peer_wire`) on the socketpair ``fd``, each call in its own
thread, on the conformance harness's ``Node`` objects it makes (object 0, :class:`Root`, makes them
and answers questions about the process).  It exits when the test process says so (finalizing its
nodes) or goes away (EOF on the socketpair).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

if importlib.util.find_spec("peer_wire") is None:  # a script under PYTHONSAFEPATH: add its directory
    sys.path.append(str(Path(__file__).resolve().parent))

import kvdd  # noqa: E402
import kvdd.testing as kt  # noqa: E402
from peer_wire import ENV_BACKEND, ENV_DEVICE_ID, PeerError, decode, encode  # noqa: E402 (sets up conformance)
from conformance.harness import Node  # noqa: E402

__all__ = ["Root", "main"]


class Root:
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


def main(fd: int) -> None:
    conn = Connection(fd)
    objects: dict[int, Any] = {}
    objects[0] = Root(objects)
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
            value = getattr(target, method)(*decode(args), **{k: decode(v) for k, v in kwargs.items()})
            reply: tuple[Any, ...] = (cid, True, encode(value))
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



if __name__ == "__main__":
    main(int(sys.argv[1]))
