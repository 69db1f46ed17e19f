"""Option keys of ``LlmDataDist::Initialize``/``SetRole`` and their parsing: one table.

SEMANTICS.md §3.2 (Initialize), §3.4 (SetRole), §3.5 (link-time ``llm.LocalCommRes``).  The
constants have the C++ names and values.  :data:`OPTION_RULES` holds, for every option upstream
parses, where it is parsed (the *scope*: which upstream component reads it, in which order), the
upstream parse function, what it accepts and what an empty value means; :func:`parse_option`
applies a rule.  The simulator (:mod:`kvdd.sim.options`) drives Initialize and SetRole through this
table; the native backend leaves parsing to the real library.  A failing parse raises
:class:`OptionError` carrying the status upstream returns.
"""

from __future__ import annotations

import difflib
import logging
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from . import option_json
from .status import PARAM_INVALID, Status

__all__ = [
    "OPTION_LISTEN_IP_INFO",
    "OPTION_DEVICE_ID",
    "OPTION_SYNC_CACHE_WAIT_TIME",
    "OPTION_BUF_POOL_CFG",
    "OPTION_ENABLE_SET_ROLE",
    "OPTION_LOCAL_COMM_RES",
    "OPTION_TRANSFER_BACKEND",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OPTION_LISTEN_IP",
    "OPTION_LISTEN_PORT",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_LINK_TOTAL_TIME",
    "OPTION_LINK_RETRY_COUNT",
    "OPTION_MEM_POOL_CONFIG",
    "OPTION_HOST_MEM_POOL_CONFIG",
    "ENV_RDMA_TRAFFIC_CLASS",
    "ENV_RDMA_SERVICE_LEVEL",
    "OptionError",
    "OptionRule",
    "OPTION_RULES",
    "rule",
    "parse_option",
    "to_number",
    "check_options",
    "known_option_keys",
    "warn_option_mistakes",
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
#: Internal keys upstream derives from ``llm.ListenIpInfo``; a user may pass them (§3.4 step 7).
OPTION_LISTEN_IP = "llm.ListenIp"
OPTION_LISTEN_PORT = "llm.ListenPort"
#: Undocumented options upstream parses (§3.2 steps 8, 9).
OPTION_RDMA_TRAFFIC_CLASS = "llm.RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "llm.RdmaServiceLevel"
OPTION_LINK_TOTAL_TIME = "llm.LinkTotalTime"
OPTION_LINK_RETRY_COUNT = "llm.LinkRetryCount"
OPTION_MEM_POOL_CONFIG = "llm.MemPoolConfig"
OPTION_HOST_MEM_POOL_CONFIG = "llm.HostMemPoolConfig"
#: Environment fallbacks of the hixl backend for an absent or empty RDMA option (§3.2 step 8).
ENV_RDMA_TRAFFIC_CLASS = "HCCL_RDMA_TC"
ENV_RDMA_SERVICE_LEVEL = "HCCL_RDMA_SL"


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
    warn_option_mistakes(out)
    return out


_log = logging.getLogger(__name__)


def known_option_keys() -> frozenset[str]:
    """Every option key some upstream component reads (:data:`OPTION_RULES` and the
    ``OPTION_*`` constants)."""
    return frozenset({r.key for r in OPTION_RULES} | {v for k, v in globals().items()
                                                       if k.startswith("OPTION_") and isinstance(v, str)})


def warn_option_mistakes(options: Mapping[str, str]) -> None:
    """Log a warning for what upstream accepts in silence but is most likely a mistake.

    * a key no component reads that is close to one that is read (``llm.DevceId``): upstream
      ignores it, so the call keeps its status; the warning names the closest known key
      (:func:`difflib.get_close_matches`);
    * an ``llm.ListenIpInfo`` port above 65535: accepted upstream (SEMANTICS.md §3.2 step 4),
      the socket layer keeps its low 16 bits.
    """
    known = known_option_keys()
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
            if close:
                _log.warning("option %r is not one LLM-DataDist reads (ignored, as upstream does); "
                             "did you mean %r?", key, close[0])
    listen = options.get(OPTION_LISTEN_IP_INFO)
    if listen is not None:
        port_text = listen.rsplit(":", 1)[-1].strip()
        if port_text.isdigit() and 65535 < int(port_text) <= 0xFFFFFFFF:
            _log.warning("%s port %s is above 65535: accepted, as upstream does, but the socket "
                         "uses its low 16 bits (port %d)", OPTION_LISTEN_IP_INFO, port_text,
                         int(port_text) & 0xFFFF)


# -- ToNumber ------------------------------------------------------------------------------------

# ``std::stringstream ss(text); ss >> value;`` then ``!ss.fail() && ss.eof()``: optional leading
# whitespace, an optional sign, ASCII digits, and nothing after them.
_INT_RE = re.compile(r"[ \t\n\r\f\v]*([+-]?)([0-9]+)\Z")

#: C integer types by name: (bits, signed).
_CTYPES = {"int32": (32, True), "uint32": (32, False), "int64": (64, True), "uint64": (64, False)}


def to_number(text: str, ctype: str) -> int | None:
    """Upstream's ``ToNumber<T>`` (llm_utils.h ``LLMUtils::ToNumber``, hixl_utils.h ``ToNumber``).

    A stream extraction that must consume the whole string: leading whitespace and a ``+`` are
    tolerated, trailing whitespace or characters are not.  Returns None where upstream returns
    ``LLM_PARAM_INVALID`` (unparsable or out of the range of ``ctype``).  For an unsigned ``ctype``
    the libstdc++ stream accepts a ``-`` sign and negates modulo 2**bits (``"-1"`` is the maximum).
    """
    m = _INT_RE.match(text)
    if m is None:
        return None
    bits, signed = _CTYPES[ctype]
    negative = m.group(1) == "-"
    magnitude = int(m.group(2))
    if signed:
        value = -magnitude if negative else magnitude
        return value if -(1 << (bits - 1)) <= value < (1 << (bits - 1)) else None
    if magnitude >= 1 << bits:
        return None
    return (-magnitude) % (1 << bits) if negative else magnitude


def _number(ctype: str, lo: int | None = None, hi: int | None = None,
            multiple_of: int = 1) -> Callable[[str, str], int]:
    def parse(key: str, text: str) -> int:
        value = to_number(text, ctype)
        if value is None:
            raise OptionError(f"option {key}={text!r} is not a whole {ctype}")
        if (lo is not None and value < lo) or (hi is not None and value > hi) or value % multiple_of:
            extra = f" and a multiple of {multiple_of}" if multiple_of > 1 else ""
            raise OptionError(f"option {key}={text!r} must be in [{lo}, {hi}]{extra}")
        return value
    return parse


# -- the other parse functions -----------------------------------------------------------------


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


def _split(text: str, delim: str) -> list[str]:
    """hixl_utils.cc ``Split``: getline items, plus an empty item after a trailing delimiter."""
    return text.split(delim)


def _device_ids(key: str, text: str) -> list[int]:
    if text == "":
        raise OptionError(f"option {key} is empty")
    ids: list[int] = []
    for item in _split(text, ";"):
        value = to_number(item, "int32")
        if value is None:
            raise OptionError(f"option {key}={text!r}: {item!r} is not an int32")
        if value < 0:
            raise OptionError(f"option {key}={text!r}: device id must be >= 0")
        ids.append(value)
    return ids


def _listen_ip_info(key: str, value: str) -> tuple[str, int]:
    lb, rb = value.find("["), value.find("]")
    if lb != -1 and rb != -1 and lb < rb:
        colon = value.find(":", rb)
        parts = [value[lb + 1: rb]] + ([] if colon == -1 else [value[colon + 1:]])
    else:
        parts = _split(value, ":")  # empty items count ("1.2.3.4::80" is 3 items)
    if len(parts) != 2:
        raise OptionError(f"option {key}={value!r}: expected ip:port or [ip]:port")
    ip, port_text = parts
    if not (is_ipv4_literal(ip) or is_ipv6_literal(ip)):
        raise OptionError(f"option {key}={value!r}: {ip!r} is not an IPv4/IPv6 literal")
    port = to_number(port_text, "int64")
    if port is None or not 0 <= port <= 0xFFFFFFFF:
        raise OptionError(f"option {key}={value!r}: invalid port {port_text!r}")
    return ip, port


def _transfer_backend(key: str, text: str) -> str:
    if text != "hixl":
        raise OptionError(f"option {key}={text!r}: only 'hixl' is supported")
    return text


def _digits_atoi(key: str, text: str) -> int:
    if text == "" or not all("0" <= c <= "9" for c in text):
        raise OptionError(f"option {key}={text!r} must be digits only")
    value = int(text)
    if value > 2**31 - 1:
        # atoi overflow is undefined upstream; kvdd rule 14: malformed -> PARAM_INVALID.
        raise OptionError(f"option {key}={text!r} does not fit an int32")
    return value


def _text(key: str, text: str) -> str:
    return text


def _json(check: Callable[[str], object]) -> Callable[[str, str], object]:
    def parse(key: str, text: str) -> object:
        try:
            return check(text)
        except ValueError as exc:
            raise OptionError(f"option {key}: {exc}") from None
    return parse


# -- the table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptionRule:
    """How upstream parses one option in one place (SEMANTICS.md §3.2, §3.4, §3.5).

    ``scope`` names where: ``initialize`` (llm_datadist_impl.cc), ``factory`` (engine creation),
    ``comm`` / ``hixl`` (the transfer engine's Initialize; ``hixl_comm_engine`` the HIXL comm engine's
    own read), ``cache`` (DataCacheEngine),
    ``set_role_comm`` / ``set_role_hixl`` (SwitchRole), ``link_comm`` (rank-table generation).
    ``parse(key, text)`` returns the value or raises :class:`OptionError`.  ``empty`` says what an
    empty string means; ``env`` names the environment variable read when the value is absent or
    empty (hixl RDMA options only).
    """

    key: str
    scope: str
    parse: Callable[[str, str], object]
    upstream: str
    accepts: str
    empty: str
    env: str | None = None
    status: int = PARAM_INVALID


_R = OptionRule
_TO_NUMBER = "llm_utils.h LLMUtils::ToNumber"
_HIXL_TO_NUMBER = "hixl_utils.h ToNumber"

#: Every option the simulator parses, in upstream's order within each scope.
OPTION_RULES: tuple[OptionRule, ...] = (
    _R(OPTION_DEVICE_ID, "initialize", _device_ids,
       "llm_utils.cc LLMUtils::ParseDeviceId (vector overload), items by " + _TO_NUMBER + "<int32_t>",
       "';'-separated int32 items, each >= 0; absent -> empty list -> invalid", "invalid"),
    _R(OPTION_LISTEN_IP_INFO, "initialize", _listen_ip_info,
       "llm_utils.cc LLMUtils::ParseListenIpInfo; port by " + _TO_NUMBER + "<int64_t>",
       "ip:port or [ip]:port, inet_pton literal, port in [0, 4294967295]", "invalid"),
    _R(OPTION_TRANSFER_BACKEND, "factory", _transfer_backend,
       "transfer_engine.cc TransferEngineFactory::Create", "exactly 'hixl'; absent -> comm", "invalid"),
    _R("ge.exec.deviceId", "factory", _number("int32"),
       "llm_utils.cc LLMUtils::ParseDeviceId (single), " + _TO_NUMBER + "<int32_t>",
       "one int32 (Initialize copies llm.DeviceId here, so '0;1' fails)", "invalid"),
    _R(OPTION_RDMA_TRAFFIC_CLASS, "comm", _number("uint32"),
       "comm_link_manager.cc CommLinkManager::Initialize and link_msg_handler.cc "
       "LinkMsgHandler::Initialize, " + _TO_NUMBER + "<uint32_t>", "uint32, no range", "invalid"),
    _R(OPTION_RDMA_SERVICE_LEVEL, "comm", _number("uint32"),
       "comm_link_manager.cc CommLinkManager::Initialize and link_msg_handler.cc "
       "LinkMsgHandler::Initialize, " + _TO_NUMBER + "<uint32_t>", "uint32, no range", "invalid"),
    _R(OPTION_LINK_TOTAL_TIME, "comm", _number("int32"),
       "comm_link_manager.cc CommLinkManager::Initialize, " + _TO_NUMBER + "<int32_t>",
       "int32, no range", "invalid"),
    _R(OPTION_LINK_RETRY_COUNT, "comm", _number("int32", 1, 100),
       "comm_link_manager.cc CommLinkManager::Initialize, " + _TO_NUMBER + "<int32_t>",
       "int32 in [1, 100]", "invalid"),
    _R(OPTION_LOCAL_COMM_RES, "comm", _text,
       "link_msg_handler.cc LinkMsgHandler::Initialize (stored, not parsed)",
       "any text; checked at link time", "absent (generated from llm.ListenIp when present)"),
    _R(OPTION_LISTEN_PORT, "comm", _number("uint32"),
       "llm_link_manager.cc LLMLinkManager::Initialize, " + _TO_NUMBER + "<uint32_t>",
       "uint32 (socket keeps the low 16 bits); needs llm.ListenIp", "invalid"),
    _R(OPTION_LISTEN_PORT, "hixl", _number("uint32"),
       "hixl_transfer_engine.cc HixlTransferEngine::Initialize, " + _TO_NUMBER + "<uint32_t>",
       "uint32; llm.ListenIp and llm.ListenPort both mandatory", "invalid"),
    _R(OPTION_RDMA_TRAFFIC_CLASS, "hixl", _number("int32", 0, 255, 4),
       "hixl_options.cc HixlOptions::ParseRdmaOptions, " + _HIXL_TO_NUMBER + "<int32_t>",
       "int32 in [0, 255], a multiple of 4", "absent (environment fallback)", ENV_RDMA_TRAFFIC_CLASS),
    _R(OPTION_RDMA_SERVICE_LEVEL, "hixl", _number("int32", 0, 7),
       "hixl_options.cc HixlOptions::ParseRdmaOptions, " + _HIXL_TO_NUMBER + "<int32_t>",
       "int32 in [0, 7]", "absent (environment fallback)", ENV_RDMA_SERVICE_LEVEL),
    _R(OPTION_GLOBAL_RESOURCE_CONFIG, "hixl", _json(option_json.global_resource_config),
       "hixl_options.cc HixlOptions::ParseGlobalResourceConfig (nlohmann::json)",
       "a JSON object; known keys range-checked", "skipped"),
    _R(OPTION_GLOBAL_RESOURCE_CONFIG, "hixl_comm_engine", _json(option_json.adxl_engine_config),
       "adxl_inner_engine.cc AdxlInnerEngine::LoadGlobalResourceConfig (LoadJsonConfig, "
       "ParseChannelPoolConfig, ParseCommResourceListenPortConfig), " + _TO_NUMBER,
       "parsed again (comm engine only): channel_pool.max_channel [1, 512] with both waterlines, "
       "waterlines in (0, 1), comm_resource_config.listen_port [1, 65535]", "invalid"),
    _R(OPTION_LOCAL_COMM_RES, "hixl", _json(option_json.any_json),
       "engine_factory.cc EngineFactory::CreateEngine (nlohmann::json::parse)",
       "valid JSON (read from local_comm_res_path when absent or empty)", "absent"),
    _R(OPTION_SYNC_CACHE_WAIT_TIME, "cache", _digits_atoi,
       "llm_utils.cc LLMUtils::ParserWaitTimeInfo (IsPositiveInteger, std::atoi)",
       "ASCII digits only, value in ms (kvdd: <= INT32_MAX); default 1000", "invalid"),
    _R(OPTION_MEM_POOL_CONFIG, "cache", _json(option_json.mem_pool_config),
       "data_cache_engine.cc ParseMemoryPoolConfig (nlohmann::json)",
       "{memory_size: unsigned, page_shift: unsigned in [10, 31)}, size >> shift < UINT32_MAX", "invalid"),
    _R(OPTION_HOST_MEM_POOL_CONFIG, "cache", _json(option_json.mem_pool_config),
       "data_cache_engine.cc ParseMemoryPoolConfig (nlohmann::json)",
       "as llm.MemPoolConfig", "invalid"),
    _R(OPTION_LISTEN_IP_INFO, "set_role", _listen_ip_info,
       "llm_utils.cc LLMUtils::ParseListenIpInfo (llm_datadist_impl.cc SetRole)",
       "as at Initialize", "invalid"),
    _R(OPTION_LISTEN_PORT, "set_role_comm", _number("uint32"),
       "llm_link_manager.cc LLMLinkManager::SwitchRole, " + _TO_NUMBER + "<uint32_t>",
       "uint32, compared with the stored text; needs llm.ListenIp", "invalid"),
    _R(OPTION_LISTEN_PORT, "set_role_hixl", _number("uint32"),
       "hixl_transfer_engine.cc HixlTransferEngine::SwitchRole, " + _TO_NUMBER + "<uint32_t>",
       "uint32; compared as ip:to_string(port) when llm.ListenIp is also given", "invalid"),
    _R(OPTION_LOCAL_COMM_RES, "link_comm", _json(option_json.comm_res_version),
       "rank_table_generator.cc RankTableGeneratorFactory::Create (nlohmann::json)",
       "<= 64 KiB, JSON with a string 'version' of '1.0' or '1.2'", "absent (generated)"),
)

_BY_SCOPE = {(r.scope, r.key): r for r in OPTION_RULES}


def rule(scope: str, key: str) -> OptionRule:
    """The rule for ``key`` in ``scope`` (KeyError when upstream does not parse it there)."""
    return _BY_SCOPE[(scope, key)]


def parse_option(scope: str, key: str, options: Mapping[str, str],
                 environ: Mapping[str, str] | None = None) -> object | None:
    """Apply the rule for ``key`` in ``scope`` to ``options``: None when absent (or empty where
    an empty value counts as absent), else the parsed value; :class:`OptionError` on failure."""
    r = rule(scope, key)
    text = options.get(key)
    if r.env is not None and not text:
        text = (environ or {}).get(r.env) or None
        key = key if text is None else f"{key} (from ${r.env})"
    if text is None or (text == "" and r.empty != "invalid"):
        return None
    return r.parse(key, text)


# -- the public parse functions (used by tests and the simulator) ------------------------------


def parse_device_id(options: Mapping[str, str]) -> int:
    """``llm.DeviceId`` as upstream parses it (SEMANTICS.md §3.2 step 3, then the single-int32
    re-parse of ``ge.exec.deviceId``): one int32 >= 0."""
    raw = options.get(OPTION_DEVICE_ID)
    if raw is None:
        raise OptionError(f"option {OPTION_DEVICE_ID} can not be empty")
    ids = _device_ids(OPTION_DEVICE_ID, raw)
    if len(ids) != 1:
        raise OptionError(
            f"option {OPTION_DEVICE_ID}={raw!r}: one device per process (multi-device unsupported)")
    return ids[0]


def parse_listen_ip_info(value: str) -> tuple[str, int]:
    """``llm.ListenIpInfo`` (SEMANTICS.md §3.2 step 4): ``"ip:port"`` or ``"[ipv6]:port"``.

    Returns ``(ip, port)``; the port is the int64 value in ``[0, 4294967295]`` as accepted upstream
    (the socket layer later keeps its low 16 bits).
    """
    return _listen_ip_info(OPTION_LISTEN_IP_INFO, value)


def parse_sync_wait_time(options: Mapping[str, str]) -> int:
    """``llm.SyncKvCacheWaitTime`` in ms (default 1000): non-empty, ASCII digits only, atoi."""
    raw = options.get(OPTION_SYNC_CACHE_WAIT_TIME)
    return 1000 if raw is None else _digits_atoi(OPTION_SYNC_CACHE_WAIT_TIME, raw)
