"""Rate-limited warnings for what a peer can cause (a flood of bad handshakes must not flood logs)."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["warn_limited", "WARN_INTERVAL_S"]

WARN_INTERVAL_S = 10.0  # at most one warning per kind and logger in this time

_lock = threading.Lock()
_last: dict[tuple[str, str], tuple[float, int]] = {}


def warn_limited(logger: logging.Logger, kind: str, msg: str, *args: object) -> None:
    """``logger.warning(msg, *args)`` at most once per WARN_INTERVAL_S for ``kind``; the next
    warning says how many were suppressed in between."""
    now = time.monotonic()
    key = (logger.name, kind)
    with _lock:
        last, suppressed = _last.get(key, (-WARN_INTERVAL_S, 0))
        if now - last < WARN_INTERVAL_S:
            _last[key] = (last, suppressed + 1)
            return
        _last[key] = (now, 0)
    if suppressed:
        msg += " (%d similar warnings suppressed)"
        args = (*args, suppressed)
    logger.warning(msg, *args)
