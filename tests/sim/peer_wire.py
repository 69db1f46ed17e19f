"""The conformance suite's side of its peer processes (:mod:`peer_proc`, :mod:`peer_child`, on
kvdd's test kit :mod:`kvdd.testing.process`): the child's environment variables and the codec of
arguments and results.

Arguments and results are plain picklable values (ints, kvdd value types, bytes, ``CacheHandle``
sent as a tuple), exactly what the conformance harness promises for ``Node`` methods; kvdd
exceptions cross unchanged (they pickle with their status), any other becomes a :class:`PeerError`.
The RPC channel is a local socketpair between two test processes; the simulator's own network
protocol never uses pickle.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_TESTS_DIR = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("conformance") is None:  # pytest puts tests/ on sys.path for the suite
    sys.path.append(str(_TESTS_DIR))

from conformance.harness import CacheHandle  # noqa: E402

__all__ = ["CALL_TIMEOUT", "ENV_BACKEND", "ENV_DEVICE_ID", "encode", "decode", "PeerError", "Call"]

from kvdd.testing.process import CALL_TIMEOUT, Call, PeerError  # noqa: E402

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
