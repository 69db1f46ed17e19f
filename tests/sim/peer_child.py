"""What the conformance suite's peer processes host (made there by :class:`peer_proc.PeerProcess`
through kvdd's test kit, :class:`kvdd.testing.process.ProcessHost`): :class:`Helper`, which makes the
harness's ``Node`` objects and answers questions about the process, and the per-call thread set-up
of native peers.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

if importlib.util.find_spec("peer_wire") is None:  # imported by path in the child: add its directory
    sys.path.append(str(Path(__file__).resolve().parent))

import kvdd.testing as kt  # noqa: E402
from kvdd.testing.process import hosted_objects  # noqa: E402
from peer_wire import ENV_BACKEND, ENV_DEVICE_ID  # noqa: E402 (sets up conformance)
from conformance.harness import Node  # noqa: E402

__all__ = ["Helper", "activate_device"]


class Helper:
    """Makes nodes (hosted objects) and answers questions about the peer process."""

    def __init__(self) -> None:
        self.released_at: list[float] = []  # monotonic time a held transfer finished

    def now(self) -> float:
        return time.monotonic()  # CLOCK_MONOTONIC: comparable between processes of one host

    def setenv(self, name: str, value: str | None) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def new_node(self, cluster_id: int, role: int, uid: int) -> int:
        # The backend and NPU of this process's nodes (PeerProcess's backend= and device_id=).
        device = os.environ.get(ENV_DEVICE_ID) or None
        node = Node(cluster_id, role, backend=os.environ.get(ENV_BACKEND, "sim"),
                    device_id=None if device is None else int(device))
        node.uid = uid  # the test process's numbering, so World snapshots stay distinct
        objects = hosted_objects()
        oid = max(objects) + 1
        objects[oid] = node
        return oid

    def drop(self, oid: int) -> None:
        hosted_objects().pop(oid, None)

    def can_read(self, pid: int, addr: int) -> bool:
        """Whether process_vm_readv of ``pid`` works from here (ptrace rules)."""
        from kvdd._native import _xproc
        try:
            _xproc.pvm_read_bytes(pid, addr, 1)
        except OSError:
            return False
        return True

    def data_path(self, oid: int, peer_cluster_id: int) -> str:
        node = hosted_objects()[oid]
        entity = node.dd.backend.entities[peer_cluster_id]
        return str(getattr(entity.peer, "data_path", "in_process"))

    def entity_keys(self, oid: int) -> list[int]:
        return sorted(hosted_objects()[oid].dd.backend.entities)

    def hold(self, ms: int) -> None:
        """Make every cross-process read/write of this process sleep ``ms`` after its lease was
        granted (a slow reader holding a lease): before a READ's answer is read (a READ goes
        with its LEASE), or before the transfer is sent; 0 restores.  Records when each
        finished."""
        from kvdd.sim import fabric
        cls: Any = fabric.RemotePeer
        origs = cls.__dict__.get("_kvdd_orig_seams") or {name: getattr(cls, name)
                                                         for name in ("move", "receive")}
        if ms <= 0:
            for name, orig in origs.items():
                setattr(cls, name, orig)
            return
        helper = self

        def slowed(orig: Any) -> Any:
            def slow(peer: Any, *args: Any) -> Any:
                time.sleep(ms / 1000.0)
                try:
                    return orig(peer, *args)
                finally:
                    helper.released_at.append(time.monotonic())
            return slow

        cls._kvdd_orig_seams = origs
        for name, orig in origs.items():
            setattr(cls, name, slowed(orig))

    def released(self) -> list[float]:
        return list(self.released_at)


def activate_device() -> None:
    """Run at the start of every call's thread: a native peer's NPU becomes current on it (ACL
    contexts are per thread, as in a CANN program that calls the library from several threads)."""
    if os.environ.get(ENV_BACKEND) != "native":
        return
    device = os.environ.get(ENV_DEVICE_ID) or None
    kt.acl_runtime().activate(int(device) if device is not None else kt.device_ids()[0])
