"""The child of :class:`kvdd.testing.process.ProcessHost` (``python -m kvdd.testing._child FD``).

It serves its parent's calls on the socketpair ``FD``, each call in its own thread, on the objects
it made (object 0 makes them from factory paths).  It exits when the parent says so (closing its
objects) or goes away (EOF on the socketpair).
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

for _p in os.environ.get("KVDD_TESTING_PATH", "").split(os.pathsep):
    if _p and _p not in sys.path:
        sys.path.append(_p)

import kvdd  # noqa: E402
from kvdd.testing import process  # noqa: E402
from kvdd.testing.process import PeerError, load_codec  # noqa: E402


class Root:
    """Object 0: makes objects from factory paths and answers questions about the process."""

    def __init__(self, objects: dict[int, Any]) -> None:
        self.objects = objects
        self.ids = itertools.count(1)

    def ping(self) -> int:
        return os.getpid()

    def new(self, factory: str, *args: Any, **kwargs: Any) -> int:
        module, _, name = factory.partition(":")
        fn = getattr(importlib.import_module(module), name)
        oid = next(self.ids)
        self.objects[oid] = fn(*args, **kwargs)
        return oid

    def drop(self, oid: int) -> None:
        self.objects.pop(oid, None)

    def setenv(self, name: str, value: str | None) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _close(obj: Any) -> None:
    for name in ("close", "finalize"):
        fn = getattr(obj, name, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # noqa: BLE001 - the process is ending
                pass
            return


def main(fd: int) -> None:
    conn = Connection(fd)
    encode, decode = load_codec(os.environ.get("KVDD_TESTING_CODEC"))
    objects = process.hosted_objects()
    objects[0] = Root(objects)
    init_path = os.environ.get("KVDD_TESTING_THREAD_INIT")
    thread_init = None
    if init_path:
        module, _, name = init_path.partition(":")
        thread_init = getattr(importlib.import_module(module), name)
    send_lock = threading.Lock()

    def run(cid: int, oid: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if thread_init is not None:
                thread_init()
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
            os._exit(0)  # the parent is gone
        if msg is None:
            break
        threading.Thread(target=run, args=msg, daemon=True).start()
    for oid, obj in sorted(objects.items(), reverse=True):
        if oid:
            _close(obj)
    with send_lock:
        conn.send(None)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
