"""Hardware limits that CANN's documentation states but its code does not check (PYPKG.md §8.5):
kvdd does not enforce them either; it logs one WARNING per limit per process on the
``LLM_DATADIST`` logger, naming the limit, so code that would fail on an Atlas node is noticed
off hardware (PYPKG.md §9.5).  The rank-table limits (members per domain, concurrent builds) are
the engine's to report.
"""

from __future__ import annotations

import threading

from ..utils.log import logger

__all__ = ["RegistrationLimits", "MAX_REGISTERED_ADDRS", "DEVICE_ALIGNMENT", "MAX_DEVICE_BYTES",
           "MAX_HOST_BYTES", "reset_warnings"]

#: registered addresses across register_cache and register_blocks_cache (CacheManager docs)
MAX_REGISTERED_ADDRS = 240
#: device memory alignment HCCS device-to-device transfers need
DEVICE_ALIGNMENT = 2 * 1024 * 1024
#: registered device memory per process
MAX_DEVICE_BYTES = 50 * 1024**3
#: registered host memory per process
MAX_HOST_BYTES = 1024**4

_warned: set[str] = set()
_lock = threading.Lock()


def _warn_once(limit: str, message: str) -> None:
    with _lock:
        if limit in _warned:
            return
        _warned.add(limit)
    logger.warning("kvdd does not enforce this hardware limit of CANN's documentation: %s", message)


def reset_warnings() -> None:
    """Forget which limits were reported (tests)."""
    with _lock:
        _warned.clear()


class RegistrationLimits:
    """Live registrations of one CacheManager, checked against the documented limits."""

    def __init__(self) -> None:
        self._addrs: dict[int, int] = {}
        self._device_bytes: dict[int, int] = {}
        self._host_bytes: dict[int, int] = {}

    def registered(self, cache_id: int, addrs: list[int], device: bool, nbytes: int | None) -> None:
        """Record a successful registration and report any limit it exceeds."""
        self._addrs[cache_id] = len(addrs)
        total = sum(self._addrs.values())
        if total > MAX_REGISTERED_ADDRS:
            _warn_once("addrs", f"at most {MAX_REGISTERED_ADDRS} registered addresses per process "
                                f"(now {total})")
        if device and any(a % DEVICE_ALIGNMENT for a in addrs):
            _warn_once("alignment", "device cache addresses 2 MiB-aligned for HCCS device-to-device "
                                    "transfers")
        if nbytes is not None:
            (self._device_bytes if device else self._host_bytes)[cache_id] = nbytes
            if sum(self._device_bytes.values()) > MAX_DEVICE_BYTES:
                _warn_once("device_bytes", "at most 50 GB of registered device memory")
            if sum(self._host_bytes.values()) > MAX_HOST_BYTES:
                _warn_once("host_bytes", "at most 1 TB of registered host memory")

    def unregistered(self, cache_id: int) -> None:
        """Forget a registration."""
        self._addrs.pop(cache_id, None)
        self._device_bytes.pop(cache_id, None)
        self._host_bytes.pop(cache_id, None)
