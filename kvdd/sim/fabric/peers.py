"""Peer handles: what a link entity uses to reach the peer (SEMANTICS.md §2.4, §10 rules 2, 5, 9).

* :class:`InProcessPeer` — a peer instance in this process: the copy kernels directly;
* :class:`RemotePeer` — a peer in another process or on another host: leases and DATA frames over
  the link's :class:`~kvdd.sim.fabric.channel.Channel` (or a same-host one-sided path).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Mapping, Sequence

import numpy as np

from ...status import Status
from ..memory import Region, copy_runs
from .channel import Channel
from .hostprobe import Host, pvm_usable, xproc
from .protocol import LinkOwner, LinkOffer, RemoteCache, ServedCache
from .streams import Cursor, Layout
from .wire import F_LEASE, F_READ, F_RELEASE, F_WRITE, PVM_CHUNK, encode_request

logger = logging.getLogger(__name__)

__all__ = ["InProcessPeer", "RemotePeer", "ClientLease", "in_process_peer", "pid_alive"]

S_OK = Status.LLM_SUCCESS
TIMEOUT = Status.LLM_TIMEOUT
NOT_EXIST = Status.LLM_KV_CACHE_NOT_EXIST


class InProcessPeer:
    """A peer instance living in this process: copies go straight through the copy kernels."""

    def __init__(self, peer: LinkOwner, snapshot: dict[int, RemoteCache],
                 entries: Mapping[int, ServedCache]) -> None:
        self.peer = peer
        self.peer_cluster_id = peer.cluster_id
        self.transfer_backend = peer.transfer_backend
        self._snapshot = snapshot
        self._entries = entries  # token -> live entry objects at snapshot time

    def snapshot(self) -> dict[int, RemoteCache]:
        return self._snapshot

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        entry: ServedCache = rc.token  # type: ignore[assignment]
        if not entry.acquire():
            return Status.LLM_KV_CACHE_NOT_EXIST, None
        return Status.LLM_SUCCESS, entry

    def release(self, lease: object) -> None:
        entry: ServedCache = lease  # type: ignore[assignment]
        entry.release()

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        entry: ServedCache = lease  # type: ignore[assignment]
        src = [entry.regions[i] for i in tensors]
        copy_runs(src, dst, src_off, dst_off, length)
        return Status.LLM_SUCCESS

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        entry: ServedCache = lease  # type: ignore[assignment]
        dst = [entry.regions[i] for i in tensors]
        copy_runs(src, dst, src_off, dst_off, length)
        return Status.LLM_SUCCESS

    def close(self) -> None:
        pass


def in_process_peer(peer: LinkOwner) -> InProcessPeer:
    """A handle on ``peer`` (same process) with its caches registered now as the snapshot."""
    snap, entries = peer.snapshot_for_link()
    return InProcessPeer(peer, snap, entries)


class ClientLease:
    __slots__ = ("lease_id", "rc", "deadline")

    def __init__(self, lease_id: int, rc: RemoteCache, deadline: float) -> None:
        self.lease_id = lease_id
        self.rc = rc
        self.deadline = deadline


class RemotePeer:
    """A peer in another process or on another host, reached through a link's connection."""

    def __init__(self, chan: Channel, offer: LinkOffer, snapshot: dict[int, RemoteCache],
                 addrs: dict[int, tuple[int, ...]], host: Host) -> None:
        self._chan = chan
        self.peer_cluster_id = offer.cluster_id
        self.transfer_backend = offer.transfer_backend
        self._snapshot = snapshot
        self._addrs = addrs
        self._pid = host.pid
        self.pvm = pvm_usable(host)
        self._closed = False

    @property
    def data_path(self) -> str:
        """``"process_vm"`` or ``"tcp"`` (for tests and ``kvdd doctor``)."""
        return "process_vm" if self.pvm else "tcp"

    def snapshot(self) -> dict[int, RemoteCache]:
        return self._snapshot

    def acquire(self, rc: RemoteCache, timeout_ms: int) -> tuple[int, object]:
        chan = self._chan
        if chan.peer_finalized:
            return NOT_EXIST, None
        if chan.dead.is_set() or timeout_ms <= 0:  # §10 rule 9: a 0 ms wait always times out
            return TIMEOUT, None
        deadline = time.monotonic() + timeout_ms / 1000.0
        reply = chan.request(F_LEASE, struct.pack("<Q", rc.cache_id), deadline)
        if reply is None:
            return (NOT_EXIST if chan.peer_finalized else TIMEOUT), None
        try:
            status, lease_id = struct.unpack("<IQ", reply)
        except struct.error:
            chan.kill()
            return TIMEOUT, None
        if status != S_OK:
            return status, None
        return S_OK, ClientLease(lease_id, rc, deadline)

    def release(self, lease: object) -> None:
        assert isinstance(lease, ClientLease)
        self._chan.send_oneway(F_RELEASE, struct.pack("<Q", lease.lease_id))

    def read(self, lease: object, tensors: Sequence[int], src_off: np.ndarray,
             dst: Sequence[Region], dst_off: np.ndarray, length: np.ndarray,
             timeout_ms: int) -> int:
        assert isinstance(lease, ClientLease)
        return self.move(lease, tensors, dst, dst_off, src_off, length, False)

    def write(self, lease: object, tensors: Sequence[int], src: Sequence[Region],
              src_off: np.ndarray, dst_off: np.ndarray, length: np.ndarray,
              timeout_ms: int) -> int:
        assert isinstance(lease, ClientLease)
        return self.move(lease, tensors, src, src_off, dst_off, length, True)

    def move(self, lease: ClientLease, tensors: Sequence[int], local: Sequence[Region],
              local_off: np.ndarray, remote_off: np.ndarray, length: np.ndarray,
              write: bool) -> int:
        chan = self._chan
        if chan.dead.is_set():
            return TIMEOUT
        left_ms = int((lease.deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return TIMEOUT
        if self.pvm:
            status = self._move_pvm(lease, tensors, local, local_off, remote_off, length, write,
                                    left_ms)
            if status is not None:
                return status
        layout = Layout(local, local_off, length)
        payload = encode_request(lease.lease_id, tensors, remote_off, length)
        cursor: Cursor | None = None
        if write:
            layout.gather()
            reply = chan.request(F_WRITE, payload, lease.deadline, data=layout)
        else:
            cursor = Cursor(layout)
            reply = chan.request(F_READ, payload, lease.deadline, cursor=cursor)
        if reply is None:
            return TIMEOUT
        try:
            (status,) = struct.unpack("<I", reply)
        except struct.error:
            chan.kill()
            return TIMEOUT
        if status == S_OK and cursor is not None:
            if cursor.left:  # the peer claimed success without sending every byte
                chan.kill()
                return TIMEOUT
            layout.scatter()
        return int(status)

    def _move_pvm(self, lease: ClientLease, tensors: Sequence[int], local: Sequence[Region],
                  local_off: np.ndarray, remote_off: np.ndarray, length: np.ndarray,
                  write: bool, left_ms: int) -> int | None:
        """One-sided copy; None to fall back to TCP (the kernel refused access: EPERM)."""
        assert xproc is not None
        addrs = self._addrs[lease.rc.cache_id]
        remote = [addrs[int(t)] for t in tensors]
        try:
            xproc.pvm_copy(self._pid, local, remote, lease.rc.tensor_nbytes,
                            np.ascontiguousarray(local_off, dtype=np.int64),
                            np.ascontiguousarray(remote_off, dtype=np.int64),
                            np.ascontiguousarray(length, dtype=np.int64), write,
                            timeout_ms=left_ms, chunk=PVM_CHUNK)
        except PermissionError:
            self.pvm = False
            return None
        except ProcessLookupError:  # the peer is gone: certain death
            self._chan.kill()
            return TIMEOUT
        except TimeoutError:
            return TIMEOUT
        except ValueError:
            return Status.LLM_PARAM_INVALID
        except OSError:
            # EFAULT: the peer's memory vanished.  A dying peer closes its sockets right after its
            # memory is torn down: then it is death (TIMEOUT); otherwise the owner freed
            # registered memory, a transport error on hardware (LLM_FAILED).
            wait = max(min((lease.deadline - time.monotonic()), 0.5), 0.0)
            if self._chan.dead.wait(wait) or not pid_alive(self._pid):
                self._chan.kill()
                return TIMEOUT
            return Status.LLM_FAILED
        return S_OK

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._chan.release_local_user()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat.rpartition(b")")[2].split()[:1]
    return bool(state) and state[0] not in (b"Z", b"X", b"x")


# ---- dialling --------------------------------------------------------------------------------------

