"""Option values exactly at their documented bounds (SEMANTICS.md §3.2 step 8, §3.2.1).

The neighbours of tests/conformance/test_options_fidelity.py: each case is the last accepted
value or the first refused one, so a check moved by one fails here.
"""

from __future__ import annotations

import pytest

from kvdd import OPTION_DEVICE_ID, OPTION_GLOBAL_RESOURCE_CONFIG, OPTION_LISTEN_IP_INFO, \
    OPTION_TRANSFER_BACKEND

from .harness import FAILED, LOCALHOST, PARAM_INVALID, Node, World, raises

HIXL_LISTEN = {OPTION_DEVICE_ID: "0", OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0",
               OPTION_TRANSFER_BACKEND: "hixl"}


def _channel_pool(max_channel: int) -> str:
    return ('{"channel_pool.max_channel": %d, "channel_pool.high_waterline": 0.9, '
            '"channel_pool.low_waterline": 0.1}' % max_channel)


@pytest.mark.parametrize("max_channel,ok", [(0, False), (3, True), (512, True), (513, False)])
def test_hixl_max_channel_bounds(world: World, max_channel: int, ok: bool) -> None:
    # channel_pool.max_channel is an int in [1, 512] on the comm (adxl) engine of HIXL (3 is the
    # smallest that leaves a channel between waterlines 0.9 and 0.1)
    d: Node = world.dut()
    opts = {**HIXL_LISTEN, OPTION_GLOBAL_RESOURCE_CONFIG: _channel_pool(max_channel)}
    if ok:
        d.initialize_raw(opts)
        assert d.register().cache_id >= 1
    else:
        with raises(PARAM_INVALID):
            d.initialize_raw(opts)
        with raises(FAILED):  # stays uninitialized
            d.register()


def _grc(extra: str) -> dict[str, str]:
    return {**HIXL_LISTEN, OPTION_GLOBAL_RESOURCE_CONFIG: "{" + extra + "}"}


def _accepted(world: World, opts: dict[str, str], ok: bool) -> None:
    d: Node = world.dut()
    if ok:
        d.initialize_raw(opts)
        assert d.register().cache_id >= 1
    else:
        with raises(PARAM_INVALID):
            d.initialize_raw(opts)


@pytest.mark.parametrize("port,ok", [("0", False), ("1", True), ("65535", True), ("65536", False),
                                     ('"http"', False), ("-1", False)])
def test_hixl_comm_resource_listen_port_bounds(world: World, port: str, ok: bool) -> None:
    # comm_resource_config.listen_port: an integer in [1, 65535]
    _accepted(world, _grc(f'"comm_resource_config.listen_port": {port}'), ok)


@pytest.mark.parametrize("value,ok", [('"abc"', False), ("2147483648", False), ("-2147483649", False),
                                      ("8", True)])
def test_hixl_max_channel_must_be_an_int32(world: World, value: str, ok: bool) -> None:
    _accepted(world, _grc(f'"channel_pool.max_channel": {value}, "channel_pool.high_waterline": 0.9, '
                          '"channel_pool.low_waterline": 0.1'), ok)


@pytest.mark.parametrize("low,ok", [("0", False), ("0.0", False), ("0.01", True)])
def test_hixl_waterline_is_above_zero(world: World, low: str, ok: bool) -> None:
    # a waterline in (0, 1): exactly 0 is refused
    _accepted(world, _grc(f'"channel_pool.high_waterline": 0.9, "channel_pool.low_waterline": {low}'), ok)
