"""DEBUG records of :class:`kvdd.LlmDataDist` calls, through the standard :mod:`logging` module.

Logger :data:`CALL_LOGGER` (``"kvdd.calls"``) gets one DEBUG record per call, after it returns or
raises::

    kvdd.calls: DEBUG: PullKvBlocks cluster=2 peer=1 bytes=3670016 status=LLM_SUCCESS 0.412 ms

``cluster`` is the calling instance's cluster id, ``peer`` the other instance's (transfers; ``-``
otherwise), ``bytes`` what the call asks to move per its arguments and the local cache's
registration (transfers; the tensors' total for RegisterKvCache; ``-`` when not known), ``status``
the LLM status name, or the Python exception's class for an argument error, and the time in
milliseconds.  kvdd configures no handler (a library must not): enable the records with
``logging.basicConfig(level=logging.DEBUG)`` or ``logging.getLogger("kvdd.calls").setLevel(...)``
plus a handler, or ``kvdd -vv`` on the command line.

Off (the default), an in-process transfer on the simulator's compiled path costs one C-level
dictionary lookup (the logger's cached ``isEnabledFor(DEBUG)`` answer, :data:`known_off`, read by
:mod:`kvdd.sim._fastpath`, which declines every call while the records are on); every other call
one ``isEnabledFor`` check.  Nothing is formatted or timed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .status import LLMError
from .types import KvCacheExtParam

__all__ = ["CALL_LOGGER", "DEBUG", "cache_bytes", "is_enabled", "known_off", "layer_tensors", "peer_of", "peers_of", "traced",
           "tracing", "transfer_bytes"]

#: The logger of the call records.
CALL_LOGGER = logging.getLogger("kvdd.calls")
DEBUG = logging.DEBUG
#: ``is_enabled(DEBUG)``: whether a call is recorded (the logger's own test, authoritative).
is_enabled = CALL_LOGGER.isEnabledFor
#: The logger's cache of its ``isEnabledFor`` answers (CPython keeps one per logger and clears it
#: on every level change): ``known_off.get(DEBUG) is False`` only while the logger's last answer
#: for DEBUG, still valid, was "off".  The compiled transfer path reads it and declines otherwise,
#: so the facade asks :data:`is_enabled` on the Python path.  A logger without that cache gives an
#: empty dict: every transfer then takes the Python path.
_cache = getattr(CALL_LOGGER, "_cache", None)
known_off: dict[int, bool] = _cache if isinstance(_cache, dict) else {}

_state = threading.local()
R = TypeVar("R")


def tracing() -> bool:
    """Whether this thread is inside a traced call (its inner run must not trace again)."""
    return getattr(_state, "busy", False)


def layer_tensors(ext: KvCacheExtParam | None, which: int, num_tensors: int) -> int:
    """Tensors a transfer touches on one side: all, or the layer range's (SEMANTICS.md §2.5);
    ``which`` 0 is ``src_layer_range``, 1 ``dst_layer_range``."""
    if ext is None:
        return num_tensors
    first, last = ext.src_layer_range if which == 0 else ext.dst_layer_range
    if first == -1:
        return num_tensors
    return max(0, last - first + 1) * ext.tensor_num_per_layer


def traced(name: str, cluster: int, peer: object, nbytes: int | None, run: Callable[..., R], *args: object) -> R:
    """Run ``run(*args)`` (the call itself) and log one DEBUG record for it.

    The caller passes its bound method and arguments, never a closure: a lambda in the method
    would make its arguments closure cells, a cost on every call even with DEBUG off.

    Parameters
    ----------
    name : str
        The C++ name of the call (``"PullKvCache"``).
    cluster : int
        The calling instance's cluster id.
    peer : object
        The other side's cluster id (``"1,3"`` for a link call; None: none or not known).
    nbytes : int or None
        Bytes the call asks to move (None: not known).
    run : callable
        The call (the same method, which then runs untraced); its result is returned and its
        exception re-raised unchanged.
    *args : object
        Its arguments.
    """
    _state.busy = True
    status = "LLM_SUCCESS"
    t0 = time.perf_counter()
    try:
        return run(*args)
    except LLMError as exc:
        status = exc.status.name
        raise
    except BaseException as exc:
        status = type(exc).__name__
        raise
    finally:
        ms = (time.perf_counter() - t0) * 1e3
        _state.busy = False
        CALL_LOGGER.debug("%s cluster=%d peer=%s bytes=%s status=%s %.3f ms", name, cluster,
                          "-" if peer is None else peer, "-" if nbytes is None else nbytes, status, ms)


def transfer_bytes(geometry: dict[int, tuple[int, int]], cache: object, units: object, size: object,
                   ext: object, which: int) -> int | None:
    """Bytes a transfer asks to move: ``units`` rows or blocks (or one row of ``size`` bytes per
    tensor, ``-1``: the stride) of the local cache's tensors in the layer range; None when the
    local cache was not registered through this instance or an argument is malformed (the call
    itself reports that)."""
    try:
        stride, num_tensors = geometry[getattr(cache, "cache_id")]
        tensors = layer_tensors(ext if isinstance(ext, KvCacheExtParam) else None, which, num_tensors)
        if units is None:  # one row of `size` bytes per tensor
            per = stride if size == -1 else int(size)  # type: ignore[call-overload]
            return per * tensors
        return len(units) * stride * tensors  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def peer_of(index: object) -> int | None:
    """The peer cluster id of a transfer's CacheIndex (None when malformed: the call says why)."""
    cluster = getattr(index, "cluster_id", None)
    return cluster if isinstance(cluster, int) else None


def peers_of(clusters: object) -> str | None:
    """``"1,3"``: the remote cluster ids of a link call (None when malformed)."""
    try:
        return ",".join(str(c.remote_cluster_id) for c in clusters)  # type: ignore[attr-defined]
    except (TypeError, AttributeError):
        return None


def cache_bytes(cache_desc: object) -> int | None:
    """The bytes of all tensors a RegisterKvCache describes (None when malformed)."""
    try:
        return int(cache_desc.tensor_nbytes) * int(cache_desc.num_tensors)  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return None
