"""The reference model's vocabulary (see :mod:`tests.property.model`): status numbers (§1) and
element sizes (§5) restated from SEMANTICS.md, the duck-typed inputs, the model's state, and the
§3.2 option parsing.  Imports nothing from ``kvdd``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

# ---- §1 status codes --------------------------------------------------------------------------

SUCCESS = 0
FAILED = 0xFFFFFFFF
_B = 0x5010B000
KV_CACHE_NOT_EXIST = _B + 2
PARAM_INVALID = _B + 5
NOT_YET_LINK = _B + 7
ALREADY_LINK = _B + 8
LINK_FAILED = _B + 9
UNLINK_FAILED = _B + 10
EXIST_LINK = _B + 24
FEATURE_NOT_ENABLED = _B + 25
TIMEOUT = _B + 26

# ---- §5 element sizes, in bits ----------------------------------------------------------------

_BYTES = {0: 4, 1: 2, 2: 1, 3: 4, 4: 1, 6: 2, 7: 2, 8: 4, 9: 8, 10: 8, 11: 8, 12: 1, 13: 16, 14: 1,
          15: 1, 16: 8, 17: 16, 18: 1, 19: 2, 20: 4, 21: 1, 22: 2, 23: 8, 24: 16, 25: 5, 26: 8,
          27: 2, 33: 4, 34: 1, 35: 1, 36: 1, 37: 1}
_BITS = {29: 4, 30: 1, 31: 2, 32: 2, 38: 6, 39: 6, 40: 4, 41: 4}
INT64_MAX = 2**63 - 1


def tensor_bytes(shape: Sequence[int], data_type: int) -> int | None:
    """§2.1 / §3.7 step 8: T, or None where upstream returns PARAM_INVALID."""
    elements = 1
    for d in shape:
        if d <= 0:
            return None
        elements *= d
        if elements > INT64_MAX:
            return None
    if data_type in _BYTES:
        t = elements * _BYTES[data_type]
        return t if t <= INT64_MAX else None
    if data_type in _BITS:
        bits = elements * _BITS[data_type]
        # §5: the bit count is narrowed to int32 before the ceiling division; the property
        # tests keep it far below 2**31, where this is exact.
        if bits >= 2**31:
            raise NotImplementedError("sub-byte tensors of 2**31 bits or more are not modelled")
        return -(-bits // 8)
    return None  # DT_UNDEFINED, reserved 5, >= DT_MAX, negative


# ---- inputs (duck-typed: kvdd's value types fit, and so would any other) -----------------------


class IpInfoLike(Protocol):
    @property
    def ip(self) -> str: ...
    @property
    def port(self) -> int: ...


class ClusterLike(Protocol):
    @property
    def remote_cluster_id(self) -> int: ...
    @property
    def local_ip_infos(self) -> Sequence[IpInfoLike]: ...
    @property
    def remote_ip_infos(self) -> Sequence[IpInfoLike]: ...


class DescLike(Protocol):
    @property
    def num_tensors(self) -> int: ...
    @property
    def data_type(self) -> int: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def placement(self) -> int: ...


class CacheLike(Protocol):
    @property
    def cache_id(self) -> int: ...
    @property
    def cache_desc(self) -> DescLike: ...


class IndexLike(Protocol):
    @property
    def cluster_id(self) -> int: ...
    @property
    def cache_id(self) -> int: ...
    @property
    def batch_index(self) -> int: ...


class ExtLike(Protocol):
    @property
    def src_layer_range(self) -> tuple[int, int]: ...
    @property
    def dst_layer_range(self) -> tuple[int, int]: ...
    @property
    def tensor_num_per_layer(self) -> int: ...


# ---- state ------------------------------------------------------------------------------------


class Arena:
    """The bytes the tests own: ``[base, base + size)`` is readable and writable, the bytes just
    around it are not (guard pages), nothing else is ever addressed."""

    def __init__(self, base: int, data: bytes) -> None:
        self.base = base
        self.mem = bytearray(data)

    def accessible(self, addr: int, n: int) -> bool:
        """kvdd rule 4."""
        return n > 0 and addr >= self.base and addr + n <= self.base + len(self.mem)

    def move(self, dst: int, src: int, n: int) -> None:
        d, s = dst - self.base, src - self.base
        assert 0 <= d and d + n <= len(self.mem) and 0 <= s and s + n <= len(self.mem), "model bug"
        self.mem[d:d + n] = self.mem[s:s + n]  # slice copy first: memmove


@dataclass(eq=False)
class Registration:
    """§2.1: a registered cache on its owner."""

    owner: Instance
    cache_id: int
    n: int
    T: int
    B: int
    addrs: tuple[int, ...]
    alive: bool = True

    @property
    def S(self) -> int:
        return self.T // self.B if self.B else 0

    @property
    def ragged(self) -> bool:  # kvdd rule 10
        return self.S == 0 or self.T % self.S != 0


@dataclass(eq=False)
class Entity:
    """§2.3 a link entity; ``snapshot``: the peer's caches registered before the link (rule 3)."""

    peer: Instance
    address: tuple[str, int]
    snapshot: dict[int, Registration]
    broken: bool = False  # kvdd rule 8


@dataclass(eq=False)
class Instance:
    cluster_id: int
    role: int
    initialized: bool = False
    backend: str = "comm"
    listening: bool = False
    port: int | None = None  # the real port, told by the test (port 0 binds a free one)
    listen_port_text: str | None = None  # comm: normalized port text while listening (§3.4)
    local_engine: str | None = None  # hixl: "ip:port" of Initialize (§3.4 step 5)
    has_comm_res: bool = False
    comm_res_text: str | None = None
    next_cache_id: int = 1
    caches: dict[int, Registration] = field(default_factory=dict)
    published: dict[int, Registration] = field(default_factory=dict)  # §3.7 step 10
    entities: dict[int, Entity] = field(default_factory=dict)
    # hixl: open connections by address, re-pointed entities included (§3.5)
    hixl_addrs: dict[tuple[str, int], Entity] = field(default_factory=dict)

    def reset(self) -> None:
        for reg in self.caches.values():
            reg.alive = False
        self.initialized = False
        self.backend = "comm"
        self.listening = False
        self.port = None
        self.listen_port_text = None
        self.local_engine = None
        self.has_comm_res = False
        self.comm_res_text = None
        self.next_cache_id = 1
        self.caches = {}
        self.published = {}
        self.entities = {}
        self.hixl_addrs = {}


# ---- option parsing (§3.2) ----------------------------------------------------------------------

_WS = " \t\n\r\f\v"


def stream_int(text: str) -> int | None:
    """``std::stringstream >> int``: leading whitespace, a sign, digits, nothing after."""
    t = text.lstrip(_WS)
    body = t[1:] if t[:1] in ("+", "-") else t
    if not body or not body.isascii() or not body.isdigit():
        return None
    return int(t)


def device_id_ok(options: dict[str, str]) -> bool:
    raw = options.get("llm.DeviceId")
    if raw is None or raw == "":
        return False
    for item in raw.split(";"):
        v = stream_int(item)
        if v is None or not -(2**31) <= v < 2**31 or v < 0:
            return False
    v = stream_int(raw)  # re-parsed as one int32 (ge.exec.deviceId)
    return v is not None and 0 <= v < 2**31


def ipv4(ip: str) -> bool:
    parts = ip.split(".")
    if len(parts) != 4:
        return False
    for p in parts:
        if not p or not p.isascii() or not p.isdigit() or len(p) > 3 or int(p) > 255:
            return False
        if len(p) > 1 and p[0] == "0":
            return False  # inet_pton(AF_INET) rejects leading zeros
    return True


def parsed(text: str) -> tuple[str, str]:
    """A valid IPv4 ``llm.ListenIpInfo`` as upstream passes it on: (ip, std::to_string(port))."""
    ip, port = text.split(":")
    v = stream_int(port)
    assert v is not None
    return ip, str(v)


def listen_ok(text: str) -> bool:
    """§3.2 step 4 for the IPv4 forms the tests generate (bracketed IPv6 is not generated)."""
    if "[" in text:
        raise NotImplementedError("IPv6 listen addresses are not modelled")
    parts = text.split(":")
    if len(parts) != 2 or not ipv4(parts[0]):
        return False
    v = stream_int(parts[1])
    return v is not None and 0 <= v <= 0xFFFFFFFF and parts[1] == parts[1].strip(_WS)


def digits(text: str) -> bool:
    return text != "" and text.isascii() and text.isdigit()


def comm_res_ok(text: str | None) -> bool:
    if text is None:
        return True
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("version") in ("1.0", "1.2")
