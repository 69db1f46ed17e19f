"""kvdd/options.py's table and ToNumber (SEMANTICS.md §3.2.1)."""

from __future__ import annotations

import pytest

from kvdd import Status
from kvdd.option_json import GlobalResourceConfig, SignedInt, adxl_engine_config, loads
from kvdd.options import OPTION_RULES, OptionError, parse_option, rule, to_number


@pytest.mark.parametrize("text,ctype,expected", [
    ("0", "int32", 0), (" +7", "int32", 7), ("\n-7", "int32", -7), ("2147483647", "int32", 2**31 - 1),
    ("-2147483648", "int32", -(2**31)), ("2147483648", "int32", None), ("7 ", "int32", None),
    ("7\n", "int32", None), ("", "int32", None), ("+", "int32", None), ("+-1", "int32", None),
    ("0x1", "int32", None), ("1e3", "int32", None), ("١", "int32", None),
    ("4294967295", "uint32", 2**32 - 1), ("4294967296", "uint32", None), ("-1", "uint32", 2**32 - 1),
    ("-0", "uint32", 0), ("-4294967295", "uint32", 1), ("-4294967296", "uint32", None),
    ("4294967295", "int64", 2**32 - 1), ("9223372036854775808", "int64", None),
])
def test_to_number(text: str, ctype: str, expected: int | None) -> None:
    assert to_number(text, ctype) == expected


def test_every_rule_names_its_upstream_function() -> None:
    seen = set()
    for r in OPTION_RULES:
        assert (r.scope, r.key) not in seen, f"duplicate rule {r.scope} {r.key}"
        seen.add((r.scope, r.key))
        assert r.upstream and r.accepts and r.empty
        assert r.status == Status.LLM_PARAM_INVALID
        assert rule(r.scope, r.key) is r


def test_parse_option_empty_and_environment() -> None:
    # hixl RDMA: empty = absent, then the environment variable with the same checks
    assert parse_option("hixl", "llm.RdmaTrafficClass", {"llm.RdmaTrafficClass": ""}, {}) is None
    assert parse_option("hixl", "llm.RdmaTrafficClass", {}, {"HCCL_RDMA_TC": "8"}) == 8
    with pytest.raises(OptionError) as info:
        parse_option("hixl", "llm.RdmaTrafficClass", {}, {"HCCL_RDMA_TC": "9"})
    assert info.value.status == Status.LLM_PARAM_INVALID and "HCCL_RDMA_TC" in str(info.value)
    # the comm parse of the same key reads no environment and has no range
    assert parse_option("comm", "llm.RdmaTrafficClass", {"llm.RdmaTrafficClass": "9"}) == 9
    assert parse_option("hixl", "llm.GlobalResourceConfig", {"llm.GlobalResourceConfig": ""}) is None
    assert parse_option("hixl", "llm.GlobalResourceConfig",
                        {"llm.GlobalResourceConfig": '{"local_comm_res_path": "/x"}'}) \
        == GlobalResourceConfig("/x")
    with pytest.raises(OptionError):  # empty is invalid where the rule says so
        parse_option("cache", "llm.SyncKvCacheWaitTime", {"llm.SyncKvCacheWaitTime": ""})


def test_loads_classifies_numbers_as_nlohmann() -> None:
    doc = loads('{"u": 5, "s": -5, "z": -0, "f": 5.0, "e": 1e2, "big": 18446744073709551616}')
    assert isinstance(doc, dict)
    assert type(doc["u"]) is int and type(doc["s"]) is SignedInt and type(doc["z"]) is SignedInt
    assert type(doc["f"]) is float and type(doc["e"]) is float and type(doc["big"]) is float
    for bad in ("NaN", '{"x": Infinity}', "", "{} x"):
        with pytest.raises(ValueError):
            loads(bad)


@pytest.mark.parametrize("max_channel,why", [
    ("2147483647", "channel_pool.max_channel must be in [1, 512]"),  # the int32 maximum: in range?
    ("2147483648", "channel_pool.max_channel is not an int32"),  # one past it
    ("-2147483648", "channel_pool.max_channel must be in [1, 512]"),  # the int32 minimum
    ("-2147483649", "channel_pool.max_channel is not an int32"),  # one below it
    ("0", "channel_pool.max_channel must be in [1, 512]"),  # one below the range: its own check
    ("1", "high_waterline must leave at least one channel above low_waterline"),  # in range
])
def test_comm_engine_max_channel_refusals_name_the_check_that_refused(max_channel: str,
                                                                      why: str) -> None:
    # the comm (adxl) engine's checks in order: an int32, then [1, 512], then the waterlines
    text = ('{"channel_pool.max_channel": %s, "channel_pool.high_waterline": 0.9, '
            '"channel_pool.low_waterline": 0.1}' % max_channel)
    with pytest.raises(ValueError) as info:
        adxl_engine_config(text)
    assert str(info.value) == why
