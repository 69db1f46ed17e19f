"""Simulator peers in a separate process, driven from the test process by RPC.

The test side creates a :class:`PeerProcess` (a child ``python`` running :mod:`peer_child`,
connected by a private socketpair), then :class:`peer_node.ProcessNode` objects: proxies of the
conformance harness's ``Node`` whose methods run in the child (the RPC and its codec:
:mod:`peer_wire`).

Every call has a timeout (a hung peer fails the test instead of hanging it); :meth:`PeerProcess.close`
(also run at interpreter exit for anything left over) stops the child, killing it if needed.  The
child exits by itself when the test process goes away (EOF on the socketpair).
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import kvdd

from peer_wire import CALL_TIMEOUT, ENV_BACKEND, ENV_DEVICE_ID, Call, PeerError, decode, encode
from peer_node import ProcessNode

__all__ = ["PeerProcess"]

#: The child's script.
_CHILD = Path(__file__).resolve().parent / "peer_child.py"


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
        cmd = [*prefix, sys.executable, str(_CHILD), str(theirs.fileno())]
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
                call.value = decode(value) if ok else value
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
        msg = (cid, oid, method, encode(args), {k: encode(v) for k, v in kwargs.items()})
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

