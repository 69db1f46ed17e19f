"""The RPC between the test process and a peer process (:mod:`peer_proc`, :mod:`peer_child`): the
child's environment variables, the codec of arguments and results, and a call in flight.

Arguments and results are plain picklable values (ints, kvdd value types, bytes, ``CacheHandle``
sent as a tuple), exactly what the conformance harness promises for ``Node`` methods; kvdd
exceptions cross unchanged (they pickle with their status), any other becomes a :class:`PeerError`.
The RPC channel is a local socketpair between two test processes; the simulator's own network
protocol never uses pickle.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

_TESTS_DIR = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("conformance") is None:  # pytest puts tests/ on sys.path for the suite
    sys.path.append(str(_TESTS_DIR))

from conformance.harness import CacheHandle  # noqa: E402

__all__ = ["CALL_TIMEOUT", "ENV_BACKEND", "ENV_DEVICE_ID", "encode", "decode", "PeerError", "Call"]

#: Seconds any single RPC may take before the test fails (transfers are far faster).
CALL_TIMEOUT = 60.0
#: Environment of the child: the backend of its nodes and their NPU (see PeerProcess).
ENV_BACKEND = "KVDD_PEER_BACKEND"
ENV_DEVICE_ID = "KVDD_PEER_DEVICE_ID"
_HANDLE = "__cache_handle__"


def encode(value: Any) -> Any:
    """An argument or result as sent: ``CacheHandle`` objects (also inside lists and tuples) as tuples."""
    if isinstance(value, CacheHandle):
        return (_HANDLE, value.owner, value.cluster_id, value.cache_id, value.desc, value.slot,
                value.offsets, value.nbytes)
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(encode(v) for v in value)
    return value


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, tuple) and len(value) == 8 and value[0] == _HANDLE:
        return CacheHandle(*value[1:])
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v) for v in value)
    return value


class PeerError(RuntimeError):
    """A non-kvdd exception raised in the peer process (its type and message)."""


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

