"""Option keys of ``LlmDataDist::Initialize``/``SetRole`` and their parsing (SEMANTICS.md §3.2).

The constants have the C++ names and values.  The parse functions reproduce upstream's checks and
are shared by backends that implement the semantics themselves (the simulator); each returns the
parsed value or raises :class:`OptionError` carrying the status upstream returns.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping

from .status import Status

__all__ = [
    "OPTION_LISTEN_IP_INFO",
    "OPTION_DEVICE_ID",
    "OPTION_SYNC_CACHE_WAIT_TIME",
    "OPTION_BUF_POOL_CFG",
    "OPTION_ENABLE_SET_ROLE",
    "OPTION_LOCAL_COMM_RES",
    "OPTION_TRANSFER_BACKEND",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OptionError",
    "check_options",
    "parse_device_id",
    "parse_listen_ip_info",
    "parse_sync_wait_time",
    "is_ipv4_literal",
    "is_ipv6_literal",
]

OPTION_LISTEN_IP_INFO = "llm.ListenIpInfo"
OPTION_DEVICE_ID = "llm.DeviceId"
OPTION_SYNC_CACHE_WAIT_TIME = "llm.SyncKvCacheWaitTime"
OPTION_BUF_POOL_CFG = "llm.BufPoolCfg"
OPTION_ENABLE_SET_ROLE = "llm.EnableSwitchRole"
OPTION_LOCAL_COMM_RES = "llm.LocalCommRes"
OPTION_TRANSFER_BACKEND = "llm.TransferBackend"
OPTION_GLOBAL_RESOURCE_CONFIG = "llm.GlobalResourceConfig"


class OptionError(Exception):
    """An option value upstream rejects; ``status`` is what the C++ call returns."""

    def __init__(self, message: str, status: int = Status.LLM_PARAM_INVALID) -> None:
        super().__init__(message)
        self.status = status


def check_options(options: object, name: str = "options") -> dict[str, str]:
    """Return ``options`` as a dict after checking it is a mapping of str to str (TypeError)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"{name} must be a mapping of str to str, not {type(options).__name__}")
    out: dict[str, str] = {}
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be str, got {type(key).__name__}")
        if not isinstance(value, str):
            raise TypeError(f"{name}[{key!r}] must be str, got {type(value).__name__}")
        out[key] = value
    return out


# std::stringstream >> int32 semantics: optional leading whitespace, optional sign, digits, and
# nothing after them (upstream checks the stream reached its end).
_INT_RE = re.compile(r"[ \t\n\r\f\v]*([+-]?[0-9]+)\Z")


def _parse_int_stream(text: str) -> int | None:
    m = _INT_RE.match(text)
    return int(m.group(1)) if m else None


def parse_device_id(options: Mapping[str, str]) -> int:
    """``llm.DeviceId`` as upstream parses it (SEMANTICS.md §3.2 step 3): a single int32 >= 0."""
    raw = options.get(OPTION_DEVICE_ID)
    if raw is None:
        raise OptionError(f"option {OPTION_DEVICE_ID} can not be empty")
    if raw == "":
        raise OptionError(f"option {OPTION_DEVICE_ID} is empty")
    ids: list[int] = []
    for item in raw.split(";"):
        value = _parse_int_stream(item)
        if value is None or not -(2**31) <= value < 2**31:
            raise OptionError(f"option {OPTION_DEVICE_ID}={raw!r}: {item!r} is not an int32")
        if value < 0:
            raise OptionError(f"option {OPTION_DEVICE_ID}={raw!r}: device id must be >= 0")
        ids.append(value)
    if len(ids) != 1:
        # the raw value is re-parsed later as a single int32 (ge.exec.deviceId)
        raise OptionError(
            f"option {OPTION_DEVICE_ID}={raw!r}: one device per process (multi-device unsupported)"
        )
    return ids[0]


def parse_listen_ip_info(value: str) -> tuple[str, int]:
    """``llm.ListenIpInfo`` (SEMANTICS.md §3.2 step 4): ``"ip:port"`` or ``"[ipv6]:port"``.

    Returns ``(ip, port)``; the port is the int64 value in ``[0, 4294967295]`` as accepted upstream
    (the socket layer later keeps its low 16 bits).
    """
    lb, rb = value.find("["), value.find("]")
    if lb != -1 and rb != -1 and lb < rb:
        ip = value[lb + 1 : rb]
        colon = value.find(":", rb)
        if colon == -1:
            raise OptionError(f"option {OPTION_LISTEN_IP_INFO}={value!r}: expected [ip]:port")
        parts = [ip, value[colon + 1 :]]
    else:
        parts = value.split(":")  # like upstream's Split: empty items count ("1.2.3.4::80" is 3)
        if len(parts) != 2:
            raise OptionError(f"option {OPTION_LISTEN_IP_INFO}={value!r}: expected ip:port")
    ip, port_text = parts
    if not (is_ipv4_literal(ip) or is_ipv6_literal(ip)):
        raise OptionError(
            f"option {OPTION_LISTEN_IP_INFO}={value!r}: {ip!r} is not an IPv4/IPv6 literal"
        )
    port = _parse_int_stream(port_text)
    if port is None or not 0 <= port <= 0xFFFFFFFF:
        raise OptionError(f"option {OPTION_LISTEN_IP_INFO}={value!r}: invalid port {port_text!r}")
    return ip, port


def is_ipv4_literal(ip: str) -> bool:
    """``inet_pton(AF_INET, ip)`` succeeds (dotted quad, no hostnames)."""
    try:
        socket.inet_pton(socket.AF_INET, ip)
    except (OSError, ValueError):
        return False
    return True


def is_ipv6_literal(ip: str) -> bool:
    """``inet_pton(AF_INET6, ip)`` succeeds."""
    try:
        socket.inet_pton(socket.AF_INET6, ip)
    except (OSError, ValueError):
        return False
    return True


def parse_sync_wait_time(options: Mapping[str, str]) -> int:
    """``llm.SyncKvCacheWaitTime`` in ms (default 1000): non-empty, ASCII digits only, atoi."""
    raw = options.get(OPTION_SYNC_CACHE_WAIT_TIME)
    if raw is None:
        return 1000
    if raw == "" or not all("0" <= c <= "9" for c in raw):
        raise OptionError(f"option {OPTION_SYNC_CACHE_WAIT_TIME}={raw!r} must be digits only")
    value = int(raw)
    if value > 2**31 - 1:
        # atoi overflow is undefined upstream; kvdd rule 14: malformed -> PARAM_INVALID.
        raise OptionError(f"option {OPTION_SYNC_CACHE_WAIT_TIME}={raw!r} does not fit an int32")
    return value
