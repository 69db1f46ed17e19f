"""The JSON-valued options as upstream parses them with nlohmann::json (SEMANTICS.md §3.2, §3.5).

:func:`loads` reads JSON the way nlohmann::json classifies it: a number without ``-`` that fits
uint64 is *unsigned*, one with ``-`` that fits int64 is a (signed) *integer*, anything else (a
fraction, an exponent, a magnitude beyond 64 bits) is a *float*; ``NaN``/``Infinity`` are not JSON.
Each checker raises :class:`ValueError` saying why upstream returns ``LLM_PARAM_INVALID``;
:mod:`kvdd.options` turns that into an :class:`kvdd.options.OptionError`.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass

__all__ = ["SignedInt", "loads", "any_json", "mem_pool_config", "global_resource_config",
           "GlobalResourceConfig", "read_local_comm_res_file", "comm_res_version",
           "adxl_engine_config", "selects_hixl_cs", "COMM_RES_LIMIT", "LOCAL_COMM_RES_FILE_LIMIT"]

#: rank_table_device_json.h ``kMaxCommResSizeInBytes``: a comm resource at link time (bytes).
COMM_RES_LIMIT = 64 * 1024
#: hixl_options.cc ``kMaxLocalCommResFileSizeBytes``: the ``local_comm_res_path`` file (bytes).
LOCAL_COMM_RES_FILE_LIMIT = 1024 * 1024
_UINT32_MAX = 2**32 - 1


class SignedInt(int):
    """A JSON number written with a ``-`` sign (nlohmann ``number_integer``, not unsigned)."""


def _parse_int(text: str) -> int | float:
    value = int(text)
    if text.startswith("-"):
        return SignedInt(value) if value >= -(2**63) else float(text)
    return value if value < 2**64 else float(text)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> object:
    """Parse ``text`` as nlohmann::json::parse would accept it (ValueError otherwise)."""
    try:
        return json.loads(text, parse_int=_parse_int, parse_constant=_no_constant)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None


def _is_unsigned(value: object) -> bool:
    return type(value) is int


def _is_integer(value: object) -> bool:
    return type(value) in (int, SignedInt)


def any_json(text: str) -> object:
    """Any JSON document (engine_factory.cc ``CreateEngine`` parses ``LocalCommRes``)."""
    return loads(text)


def mem_pool_config(text: str) -> tuple[int, int]:
    """``llm.MemPoolConfig`` / ``llm.HostMemPoolConfig`` (data_cache_engine.cc
    ``ParseMemoryPoolConfig``): ``(memory_size, page_shift)``."""
    doc = loads(text)
    if not isinstance(doc, dict) or "memory_size" not in doc:
        raise ValueError("needs an object with memory_size")
    size = doc["memory_size"]
    if not _is_unsigned(size):
        raise ValueError("memory_size is not an unsigned integer")
    shift = 16
    if "page_shift" in doc:
        shift = doc["page_shift"]
        if not _is_unsigned(shift):
            raise ValueError("page_shift is not an unsigned integer")
        if not 10 <= shift < 31:
            raise ValueError(f"page_shift ({shift}) out of range [10, 31)")
    if (size >> shift) >= _UINT32_MAX:
        raise ValueError(f"memory_size ({size}) >> page_shift ({shift}) must be < UINT32_MAX")
    return size, shift


_STREAM_INT = re.compile(r"[ \t\n\r\f\v]*([+-]?[0-9]+)\Z")


def _json_to_int64(name: str, value: object) -> int:
    """json_utils.h ``JsonToNumber<int64_t>``: a string by the full-parse ToNumber, else a JSON
    integer converted to int64 (an unsigned value above INT64_MAX wraps)."""
    if isinstance(value, str):
        m = _STREAM_INT.match(value)
        if m is None or not -(2**63) <= int(m.group(1)) < 2**63:
            raise ValueError(f"{name}: {value!r} is not a whole int64")
        return int(m.group(1))
    if not _is_integer(value):
        raise ValueError(f"{name}: expected an integer, got {json.dumps(value)}")
    assert isinstance(value, int)
    return (int(value) + 2**63) % 2**64 - 2**63


def _in_range(doc: dict[str, object], name: str, lo: int, hi: int) -> int | None:
    """hixl_options.cc ``ParseIntegerFieldInRange``: absent -> None; else in [lo, hi]."""
    if name not in doc:
        return None
    value = _json_to_int64(name, doc[name])
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _bool(doc: dict[str, object], name: str) -> bool | None:
    if name not in doc:
        return None
    value = doc[name]
    if type(value) is not bool:
        raise ValueError(f"{name} must be a boolean")
    return value


@dataclass(frozen=True)
class GlobalResourceConfig:
    """What the simulator keeps of a valid ``llm.GlobalResourceConfig``."""

    local_comm_res_path: str | None
    protocol_desc: bool = False  # a non-empty comm_resource_config.protocol_desc


def global_resource_config(text: str) -> GlobalResourceConfig:
    """``llm.GlobalResourceConfig`` on hixl (hixl_options.cc ``ParseGlobalResourceConfigJson``):
    a JSON object; the known keys are type- and range-checked; unknown keys are ignored."""
    doc = loads(text)
    if not isinstance(doc, dict):
        raise ValueError("GlobalResourceConfig must be a JSON object")
    # ParseFabricMemoryConfig: the nested object first, then the dotted keys (which override)
    stream_num = None
    unfold = None
    nested = doc.get("fabric_memory")
    for scope, prefix in ((nested, ""), (doc, "fabric_memory.")):
        if not isinstance(scope, dict):
            continue
        _in_range(scope, prefix + "max_capacity", 1, 1024)  # TB
        _in_range(scope, prefix + "start_address", 0, 1024)  # TB
        stream_num = _in_range(scope, prefix + "task_stream_num", 1, 8) or stream_num
        flag = _bool(scope, prefix + "enable_aicpu_unfold")
        unfold = unfold if flag is None else flag
    if (unfold is None or unfold) and stream_num is not None and stream_num != 1:
        raise ValueError("aicpu_unfold mode only supports fabric_memory.task_stream_num=1")
    # ParseConnectPoolConfig
    _in_range(doc, "connect_pool.thread_num", 1, 64)
    _in_range(doc, "connect_pool.task_queue_capacity", 1, 65535)
    # ParseCommResourceConfig
    protocol_desc = False
    if "comm_resource_config.protocol_desc" in doc:
        desc = doc["comm_resource_config.protocol_desc"]
        if not isinstance(desc, str) and not (isinstance(desc, list)
                                              and all(isinstance(d, str) for d in desc)):
            raise ValueError("comm_resource_config.protocol_desc must be a string or a list of strings")
        protocol_desc = isinstance(desc, str) or bool(desc)
    _in_range(doc, "comm_resource_config.listen_port", 1, 65535)
    _in_range(doc, "comm_resource_config.qos", 0, 7)
    _in_range(doc, "comm_resource_config.max_active_channels", 1, _UINT32_MAX)
    # ParseLocalCommResPath
    path = None
    if "local_comm_res_path" in doc:
        path = doc["local_comm_res_path"]
        if not isinstance(path, str):
            raise ValueError("local_comm_res_path must be a string")
        if path == "":
            raise ValueError("local_comm_res_path must be a non-empty file path")
    return GlobalResourceConfig(path, protocol_desc)


def selects_hixl_cs(local_comm_res: str | None, grc: GlobalResourceConfig | None) -> bool:
    """engine_factory.cc ``CreateEngine`` on a non-V5 SoC: the HixlCS engine when the LocalCommRes
    is a JSON object with ``"version": "1.3"`` or a protocol_desc is configured, else the comm
    engine (adxl)."""
    if local_comm_res:
        doc = loads(local_comm_res)
        if isinstance(doc, dict) and doc.get("version") == "1.3":
            return True
    return grc is not None and grc.protocol_desc


_STREAM_DOUBLE = re.compile(r"[ \t\n\r\f\v]*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")
_MAX_CHANNEL = 512  # adxl_utils.h kDefaultMaxChannel


def _flat(value: object) -> str:
    """adxl_utils.cc ``JsonValueToString``: a string as is, anything else as ``dump()``."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def adxl_engine_config(text: str) -> None:
    """The comm (adxl) engine's own read of ``llm.GlobalResourceConfig`` (adxl_inner_engine.cc
    ``LoadGlobalResourceConfig``): present means parsed again, so an **empty** value fails here;
    top-level values flattened to text; ``channel_pool.max_channel`` an int32 in [1, 512],
    ``channel_pool.high_waterline`` / ``low_waterline`` doubles in (0, 1) that leave at least one
    channel between the marks (max_channel only together with both), and
    ``comm_resource_config.listen_port`` a uint32 in [1, 65535]."""
    doc = loads(text)  # LoadJsonConfig: a parse error (also of "") is PARAM_INVALID
    flat = {k: _flat(v) for k, v in doc.items()} if isinstance(doc, dict) else {}
    max_channel = _MAX_CHANNEL
    if "channel_pool.max_channel" in flat:
        m = _STREAM_INT.match(flat["channel_pool.max_channel"])
        if m is None or not -(2**31) <= int(m.group(1)) < 2**31:
            raise ValueError("channel_pool.max_channel is not an int32")
        max_channel = int(m.group(1))
        if max_channel < 1:
            raise ValueError(f"channel_pool.max_channel must be in [1, {_MAX_CHANNEL}]")
        if max_channel > _MAX_CHANNEL:
            raise ValueError(f"channel_pool.max_channel must be in [1, {_MAX_CHANNEL}]")
    ratios: list[float] = []
    for name in ("channel_pool.high_waterline", "channel_pool.low_waterline"):
        if name in flat:
            if _STREAM_DOUBLE.match(flat[name]) is None:
                raise ValueError(f"{name} is not a number")
            ratio = float(flat[name])
            if not 0.0 < ratio < 1.0:
                raise ValueError(f"{name} must be in (0, 1)")
            ratios.append(ratio)
    if len(ratios) == 2:
        high = max(int(max_channel * ratios[0]), 1)
        low = max(int(max_channel * ratios[1]), 1)
        if high - low < 1:
            raise ValueError("high_waterline must leave at least one channel above low_waterline")
    elif "channel_pool.max_channel" in flat:
        raise ValueError("channel_pool.max_channel needs both waterlines")
    if "comm_resource_config.listen_port" in flat:
        m = _STREAM_INT.match(flat["comm_resource_config.listen_port"])
        # global_resource_config() (HixlOptions) refuses, first, every value outside [1, 65535]:
        # removing or widening this check changes nothing (narrowing it does: tested)
        if m is None or not 1 <= int(m.group(1)) <= 65535:  # mutation: equivalent(skip, or -> and, 1 -> 0, 65535 -> 65536)
            raise ValueError("comm_resource_config.listen_port must be in [1, 65535]")


def read_local_comm_res_file(path: str) -> str:
    """hixl_options.cc ``ResolveLocalCommResFromFile``: ``realpath`` must resolve, the target must
    be a regular file of 1 byte to 1 MiB; its content becomes ``LocalCommRes``."""
    try:
        resolved = os.path.realpath(path, strict=True)
        fd = os.open(resolved, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"local_comm_res_path {path!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"local_comm_res_path {path!r} is not a regular file")
        if not 0 < st.st_size <= LOCAL_COMM_RES_FILE_LIMIT:
            raise ValueError(f"local_comm_res_path {path!r}: size {st.st_size} not in [1, 1 MiB]")
        data = os.read(fd, st.st_size)
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="surrogateescape")


def comm_res_version(text: str) -> str:
    """A comm resource at link time on comm (rank_table_generator.cc
    ``RankTableGeneratorFactory::Create``): <= 64 KiB, a JSON object whose string ``version`` is
    ``"1.0"`` or ``"1.2"``.  Returns the version."""
    if len(text.encode("utf-8", errors="surrogateescape")) > COMM_RES_LIMIT:
        raise ValueError(f"comm resource exceeds {COMM_RES_LIMIT} bytes")
    doc = loads(text)
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(version, str):
        raise ValueError("comm resource needs a string 'version'")
    if version not in ("1.0", "1.2"):
        raise ValueError(f"comm resource version {version!r} is not 1.0 or 1.2")
    return version
