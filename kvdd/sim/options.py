"""The simulator's checks of option values beyond :mod:`kvdd.options` (SEMANTICS.md §3.2, §3.4, §3.5).

Each function raises :class:`kvdd.options.OptionError` carrying the status upstream returns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ..options import OptionError

__all__ = ["port_text", "check_mem_pool_config", "check_comm_options", "valid_comm_res"]


def valid_comm_res(text: str) -> bool:
    """``llm.LocalCommRes`` at link time (§3.5): a JSON object with version 1.0 or 1.2."""
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("version") in ("1.0", "1.2")


def port_text(listen_text: str) -> str:
    """The port part of an ``llm.ListenIpInfo`` text (SetRole compares it, §3.4)."""
    rb = listen_text.find("]")
    if listen_text.find("[") != -1 and rb != -1:
        colon = listen_text.find(":", rb)
        return listen_text[colon + 1:]
    parts = [p for p in listen_text.split(":") if p]
    return parts[-1] if parts else ""


def check_mem_pool_config(key: str, text: str) -> None:
    """§3.2 step 9: ``{"memory_size": unsigned, "page_shift": [10, 31)}`` with
    ``memory_size >> page_shift < UINT32_MAX``; anything else is PARAM_INVALID."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise OptionError(f"option {key} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise OptionError(f"option {key} must be a JSON object")
    size = doc.get("memory_size")
    if type(size) is not int or not 0 <= size < 2**64:
        raise OptionError(f"option {key}: memory_size must be an unsigned integer")
    shift = doc.get("page_shift", 16)
    if type(shift) is not int or not 10 <= shift < 31:
        raise OptionError(f"option {key}: page_shift must be in [10, 31)")
    if (size >> shift) >= 2**32 - 1:
        raise OptionError(f"option {key}: memory_size >> page_shift must be < UINT32_MAX")


def check_comm_options(options: Mapping[str, str]) -> None:
    """Comm engine options (§3.2 step 8); malformed → PARAM_INVALID (kvdd rule 14)."""
    for key, lo, hi in (("llm.RdmaTrafficClass", 0, 2**32 - 1), ("llm.RdmaServiceLevel", 0, 2**32 - 1),
                        ("llm.LinkTotalTime", -(2**31), 2**31 - 1), ("llm.LinkRetryCount", 1, 100)):
        raw = options.get(key)
        if raw is None:
            continue
        try:
            value = int(raw.strip()) if raw.strip().lstrip("+-").isdigit() else None
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise OptionError(f"option {key}={raw!r} must be an integer in [{lo}, {hi}]")
