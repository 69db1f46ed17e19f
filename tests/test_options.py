"""Option keys and option parsing (kvdd/options.py) against SEMANTICS.md §3.2 and §6 #2-#4, #7, #11.

Every parse failure must carry LLM_PARAM_INVALID (0x5010B005), the status upstream returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest

import kvdd
from kvdd.options import (
    OptionError,
    check_options,
    parse_device_id,
    parse_listen_ip_info,
    parse_sync_wait_time,
)

PARAM_INVALID = 0x5010B005

# API.md: module constants with the C++ names and values.
OPTION_CONSTANTS = {
    "OPTION_LISTEN_IP_INFO": "llm.ListenIpInfo",
    "OPTION_DEVICE_ID": "llm.DeviceId",
    "OPTION_SYNC_CACHE_WAIT_TIME": "llm.SyncKvCacheWaitTime",
    "OPTION_BUF_POOL_CFG": "llm.BufPoolCfg",
    "OPTION_ENABLE_SET_ROLE": "llm.EnableSwitchRole",
    "OPTION_LOCAL_COMM_RES": "llm.LocalCommRes",
    "OPTION_TRANSFER_BACKEND": "llm.TransferBackend",
    "OPTION_GLOBAL_RESOURCE_CONFIG": "llm.GlobalResourceConfig",
}


@pytest.mark.parametrize(("name", "value"), list(OPTION_CONSTANTS.items()))
def test_option_constants(name: str, value: str) -> None:
    assert getattr(kvdd, name) == value
    assert name in kvdd.__all__


# --- mapping checks ---------------------------------------------------------------------------


def test_check_options_accepts_str_mappings() -> None:
    assert check_options({"llm.DeviceId": "0"}) == {"llm.DeviceId": "0"}
    assert check_options(MappingProxyType({"a": "b"})) == {"a": "b"}
    assert check_options({}) == {}
    got = check_options({"k": ""})
    assert type(got) is dict and got == {"k": ""}


@pytest.mark.parametrize(
    "bad",
    [
        {b"llm.DeviceId": "0"},
        {1: "0"},
        {None: "0"},
        {"llm.DeviceId": 0},
        {"llm.DeviceId": b"0"},
        {"llm.DeviceId": None},
        {"llm.DeviceId": True},
        {"ok": "0", "llm.ListenIpInfo": ("127.0.0.1", 0)},
        [("llm.DeviceId", "0")],          # not a mapping
        "llm.DeviceId=0",
        42,
    ],
)
def test_check_options_rejects_non_str_keys_and_values(bad: Any) -> None:
    with pytest.raises(TypeError):
        check_options(bad)


# --- llm.DeviceId (§3.2 step 3; §6 #2-#4) ---------------------------------------------------------


def _dev(value: str | None) -> int:
    opts: Mapping[str, str] = {} if value is None else {"llm.DeviceId": value}
    return parse_device_id(opts)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0),
        ("1", 1),
        ("7", 7),
        ("2147483647", 2147483647),   # int32 max
        (" 1", 1),                    # leading whitespace tolerated (stringstream)
        ("\t 3", 3),
        ("+1", 1),                    # leading '+' tolerated
        ("01", 1),
        ("-0", 0),                    # parses as 0, which is >= 0
    ],
)
def test_device_id_accepted(value: str, expected: int) -> None:
    assert _dev(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        None,              # #2 absent
        "",                # #3 empty
        "-1",              # #3 negative
        "abc",             # #3 not a number
        "0;",              # #3 trailing empty item
        ";0",              # leading empty item
        "0;1",             # #4 multi-device: fails the single-int32 re-parse
        "1;1",
        "1 ",              # trailing whitespace rejected
        "1a",
        "1.0",
        "0x1",
        "2147483648",      # not an int32
        "-2147483649",
        "+",
        "-",
        " ",
        "١",               # non-ASCII digit
    ],
)
def test_device_id_rejected(value: str | None) -> None:
    with pytest.raises(OptionError) as info:
        _dev(value)
    assert info.value.status == PARAM_INVALID


# --- llm.ListenIpInfo (§3.2 step 4; §6 #7) ---------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ip", "port"),
    [
        ("127.0.0.1:26000", "127.0.0.1", 26000),
        ("127.0.0.1:0", "127.0.0.1", 0),                    # port 0 accepted
        ("0.0.0.0:1", "0.0.0.0", 1),
        ("[::1]:26000", "::1", 26000),                      # #7 bracketed IPv6
        ("[fe80::1:2]:80", "fe80::1:2", 80),
        ("[::ffff:1.2.3.4]:80", "::ffff:1.2.3.4", 80),
        ("[127.0.0.1]:80", "127.0.0.1", 80),                # brackets around an IPv4 literal
        ("1.1.1.1:65535", "1.1.1.1", 65535),
        ("1.1.1.1:65536", "1.1.1.1", 65536),                # > 65535 accepted (truncated later)
        ("1.1.1.1:4294967295", "1.1.1.1", 4294967295),      # upper bound
        ("1.1.1.1: 80", "1.1.1.1", 80),                     # leading whitespace (stringstream)
        ("1.1.1.1:+80", "1.1.1.1", 80),                     # leading '+'
        ("1.1.1.1:080", "1.1.1.1", 80),
        ("1.1.1.1:-0", "1.1.1.1", 0),                       # int64 -0 is 0, in range
        ("[::1]: 7", "::1", 7),
    ],
)
def test_listen_ip_info_accepted(value: str, ip: str, port: int) -> None:
    assert parse_listen_ip_info(value) == (ip, port)


@pytest.mark.parametrize(
    "value",
    [
        "127.0.0.1",                 # #7 no port
        "localhost:26000",           # #7 hostname
        "::1:26000",                 # #7 bare IPv6
        "1.1.1.1:-1",                # #7 negative port
        "1.1.1.1:4294967296",        # above the upper bound
        "1.1.1.1:99999999999999999999",  # not an int64
        "1.1.1.1:",                  # empty port
        ":80",                       # empty ip
        "",
        ":",
        "1.1.1.1::80",               # split on ':' gives 3 parts
        "1.1.1.1:80:90",
        "1.1.1.1:80 ",               # trailing whitespace
        "1.1.1.1:8o",
        "1.1.1.1:0x50",
        "1.1.1.1:80.0",
        " 1.1.1.1:80",               # ip with whitespace is not an inet_pton literal
        "256.1.1.1:80",
        "1.1.1:80",
        "[::1]",                     # brackets without a port
        "[::1]:",
        "[::1]:-1",
        "[::1]:4294967296",
        "[localhost]:80",
        "[]:80",
        "[::1]:80:90",
        "[1.1.1.1:80",               # no closing bracket: split on ':'
    ],
)
def test_listen_ip_info_rejected(value: str) -> None:
    with pytest.raises(OptionError) as info:
        parse_listen_ip_info(value)
    assert info.value.status == PARAM_INVALID


# --- llm.SyncKvCacheWaitTime (§3.2 step 9; §6 #11; §10 rule 14) ----------------------------------


def _wait(value: str | None) -> int:
    opts: Mapping[str, str] = {} if value is None else {"llm.SyncKvCacheWaitTime": value}
    return parse_sync_wait_time(opts)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 1000),        # default 1000 ms
        ("0", 0),            # #11 "0" accepted
        ("5", 5),
        ("1000", 1000),
        ("0005", 5),
        ("2147483647", 2147483647),
    ],
)
def test_sync_wait_time_accepted(value: str | None, expected: int) -> None:
    assert _wait(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "abc", "-5", "", "+5",           # #11
        " 5", "5 ", "5.0", "5ms", "1e3", "0x10",
        "５",                            # non-ASCII digit
        "99999999999999999999",          # oversized: kvdd rule 14 (malformed -> PARAM_INVALID)
    ],
)
def test_sync_wait_time_rejected(value: str) -> None:
    with pytest.raises(OptionError) as info:
        _wait(value)
    assert info.value.status == PARAM_INVALID
