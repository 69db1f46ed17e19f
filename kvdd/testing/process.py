"""Objects in another Python process, driven by RPC: peers of a test that live elsewhere.

A :class:`ProcessHost` starts a child ``python`` (``python -m kvdd.testing._child``) connected by
a private socketpair and makes objects there from a factory path (``"module:callable"``); a
:class:`RemoteObject` proxies one of them: ``obj.register_kv_cache(desc, addrs)`` runs in the
child, in its own thread, and returns the result or raises the exception.  kvdd's exceptions cross
unchanged (they pickle with their status); any other exception becomes a :class:`PeerError` naming
its type and message.

Every call has a timeout (a hung peer fails the test instead of hanging it); :meth:`close` (also run
at interpreter exit for anything left over) stops the child, killing it if needed, and the child
exits by itself when its parent goes away (EOF on the socketpair).  The channel is a socketpair
between two processes of the same test run; kvdd's own network protocol never uses pickle.

Arguments and results must pickle.  A ``codec`` (``"module:object"`` with ``encode`` and
``decode`` functions, importable in both processes) can turn other values into picklable ones.
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["CALL_TIMEOUT", "PeerError", "Call", "ProcessHost", "RemoteObject", "load_codec",
           "hosted_objects"]

#: Seconds any single call may take by default before the caller gets TimeoutError.
CALL_TIMEOUT = 60.0
_ENV_CODEC = "KVDD_TESTING_CODEC"
_ENV_THREAD_INIT = "KVDD_TESTING_THREAD_INIT"
_ENV_PATH = "KVDD_TESTING_PATH"

#: In a host's child: the objects it made, by id (0 is its root); empty elsewhere.
_HOSTED: dict[int, Any] = {}


def hosted_objects() -> dict[int, Any]:
    """In a :class:`ProcessHost`'s child, the objects it hosts by id (factories that make or look
    up other objects use it); an empty dict in any other process."""
    return _HOSTED


class PeerError(RuntimeError):
    """An exception other than kvdd's, raised in the other process (its type and message)."""


class Call:
    """A call in flight (see :meth:`ProcessHost.start`)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.ok = False
        self.value: Any = None

    def result(self, timeout: float = CALL_TIMEOUT) -> Any:
        """The call's result; raises its exception, or TimeoutError after ``timeout`` seconds."""
        if not self.event.wait(timeout):
            raise TimeoutError(f"the peer process did not answer within {timeout} s")
        if not self.ok:
            raise self.value
        return self.value

    def done(self) -> bool:
        return self.event.is_set()


Codec = tuple[Callable[[Any], Any], Callable[[Any], Any]]


def _identity(value: Any) -> Any:
    return value


def load_codec(path: str | None) -> Codec:
    """``(encode, decode)`` of the codec at ``"module:object"`` (identity when None)."""
    if not path:
        return _identity, _identity
    module, _, name = path.partition(":")
    obj = getattr(importlib.import_module(module), name) if name else importlib.import_module(module)
    return obj.encode, obj.decode


_live: weakref.WeakSet[ProcessHost] = weakref.WeakSet()


class ProcessHost:
    """A child Python process that hosts objects for the calling process.

    Parameters
    ----------
    env : Mapping[str, str], optional
        Extra environment variables of the child (e.g. ``KVDD_SIM_FAULTS``).
    prefix : Sequence[str], optional
        Command prefix, e.g. ``["ip", "netns", "exec", "ns1"]`` to run the child in a network
        namespace.
    codec : str, optional
        ``"module:object"`` whose ``encode``/``decode`` convert arguments and results.
    sys_path : Sequence[str], optional
        Directories appended to the child's ``sys.path`` before it imports anything (where the
        factories and the codec live, e.g. a test suite's folder).
    thread_init : str, optional
        ``"module:callable"`` the child runs (without arguments) at the start of every call's
        thread, e.g. to make a device context current on it.
    start_timeout : float, default CALL_TIMEOUT
        Seconds the child may take to start.

    Attributes
    ----------
    pid : int
        The child's process id.
    """

    def __init__(self, *, env: Mapping[str, str] | None = None, prefix: Sequence[str] = (),
                 codec: str | None = None, sys_path: Sequence[str] = (),
                 thread_init: str | None = None, start_timeout: float = CALL_TIMEOUT) -> None:
        ours, theirs = socket.socketpair()
        child_env = dict(os.environ)
        child_env.update(env or {})
        for name, value in ((_ENV_CODEC, codec), (_ENV_THREAD_INIT, thread_init),
                            (_ENV_PATH, os.pathsep.join(sys_path))):
            child_env.pop(name, None)
            if value:
                child_env[name] = value
        for p in sys_path:
            if p not in sys.path:
                sys.path.append(p)
        self._encode, self._decode = load_codec(codec)
        cmd = [*prefix, sys.executable, "-m", "kvdd.testing._child", str(theirs.fileno())]
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
                                        name="kvdd-testing-rpc")
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
                call.value = self._decode(value) if ok else value
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
        """Start ``method`` of object ``oid`` and return at once (each call runs in its own
        thread of the child); 0 is the child's root object."""
        call = Call()
        with self._lock:
            if self._dead:
                call.value = PeerError("the peer process exited")
                call.event.set()
                return call
            cid = next(self._ids)
            self._calls[cid] = call
        enc = self._encode
        msg = (cid, oid, method, enc(args), {k: enc(v) for k, v in kwargs.items()})
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
        """Run ``method`` of object ``oid`` in the child and return its result."""
        return self.start(oid, method, *args, **kwargs).result(timeout)

    def new(self, factory: str, *args: Any, **kwargs: Any) -> RemoteObject:
        """Make ``factory(*args, **kwargs)`` in the child (``"module:callable"``)."""
        return RemoteObject(self, self.call(0, "new", factory, *args, **kwargs))

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child; for SIGSTOP, return only once every thread of it stopped."""
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
        """Close the child's objects (their ``close``, else ``finalize``) and stop it; kill it if
        it does not exit in time."""
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

    def __enter__(self) -> ProcessHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteObject:
    """An object in a :class:`ProcessHost`'s child: ``obj.method(...)`` runs there."""

    def __init__(self, host: ProcessHost, oid: int) -> None:
        self.host, self.oid = host, oid

    def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT, **kwargs: Any) -> Any:
        return self.host.call(self.oid, method, *args, timeout=timeout, **kwargs)

    def start(self, method: str, *args: Any, **kwargs: Any) -> Call:
        return self.host.start(self.oid, method, *args, **kwargs)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)

    def drop(self) -> None:
        """Forget the object in the child (after closing it)."""
        if self.host.alive:
            self.host.call(0, "drop", self.oid)


@atexit.register
def _close_all() -> None:
    for host in list(_live):
        host.close(timeout=5.0)


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is in the stopped state (``T`` in /proc/PID/task/*/stat)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            states = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # a thread ended while we looked, or the process is gone
            if not os.path.exists(f"/proc/{pid}"):
                return
            continue
        if all(s in ("T", "t") for s in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {pid} did not stop within {timeout_s} s")
