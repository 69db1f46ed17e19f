"""A peer process for the façade's tests: one engine per process, so two engines need two processes.

``Peer()`` starts a child (``multiprocessing`` spawn: a fresh interpreter with this process's
``sys.path`` and environment) that runs calls sent to it::

    with Peer() as p:
        assert p.call("kvdd.sim.pypkg.lifecycle.initialize_v2", 1, options) == 0

``call(target, *args, **kwargs)`` imports the module of the dotted ``target``, calls it in the
child and returns its (picklable) result; an exception raised there is raised here.  Functions of
this test folder's modules are reachable by their module name (the folder is on ``sys.path``).
``call_async`` starts a call and returns a :class:`Pending` to ``wait()`` for later (the child
runs one call at a time; another call first waits for the pending one).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import traceback
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

__all__ = ["Peer", "Pending", "PeerError"]

_TIMEOUT_S = 60.0


class PeerError(RuntimeError):
    """The child raised something that cannot be re-raised here, or it died."""


def _resolve(target: str) -> Any:
    module, _, name = target.rpartition(".")
    obj: Any = importlib.import_module(module)
    return getattr(obj, name)


def _serve(conn: Connection) -> None:
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        target, args, kwargs = msg
        try:
            result = (True, _resolve(target)(*args, **kwargs))
        except BaseException as exc:  # sent back to the caller
            try:
                result = (False, exc)
                conn.send(result)
                continue
            except Exception:
                result = (False, PeerError(traceback.format_exc()))
        try:
            conn.send(result)
        except Exception:
            conn.send((False, PeerError(f"unpicklable result of {target}: {traceback.format_exc()}")))


class Pending:
    """A call running in the child."""

    def __init__(self, peer: Peer) -> None:
        self._peer = peer
        self._done = False
        self._value: Any = None

    def wait(self, timeout: float = _TIMEOUT_S) -> Any:
        if not self._done:
            self._value = self._peer._receive(timeout)
            self._done = True
            self._peer._pending = None
        ok, value = self._value
        if not ok:
            raise value
        return value


class Peer:
    """A child process running calls (see the module docstring)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        saved = dict(os.environ)
        if env:
            os.environ.update(env)  # inherited by the spawned child
        try:
            self.process = ctx.Process(target=_serve, args=(child,), daemon=True)
            self.process.start()
        finally:
            if env:
                os.environ.clear()
                os.environ.update(saved)
        child.close()
        self._pending: Pending | None = None

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None
        return pid

    def _receive(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise PeerError(f"the peer did not answer within {timeout} s")
        try:
            return self._conn.recv()
        except EOFError:
            raise PeerError("the peer process died") from None

    def call_async(self, target: str, *args: Any, **kwargs: Any) -> Pending:
        if self._pending is not None:
            self._pending.wait()
        self._conn.send((target, args, kwargs))
        self._pending = Pending(self)
        return self._pending

    def call(self, target: str, *args: Any, **kwargs: Any) -> Any:
        return self.call_async(target, *args, **kwargs).wait()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                if self._pending is not None:
                    self._pending.wait(5.0)
                self._conn.send(None)
            except (OSError, PeerError, BrokenPipeError):
                pass
            self.process.join(5.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5.0)
        self._conn.close()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
