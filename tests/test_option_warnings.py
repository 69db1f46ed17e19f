"""Option mistakes upstream accepts in silence get a logged warning; the call's status is kept."""

from __future__ import annotations

import logging

import pytest

import kvdd
from kvdd import OPTION_DEVICE_ID, OPTION_LISTEN_IP_INFO


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvdd.options" and r.levelno == logging.WARNING]


def test_a_typo_d_key_names_the_closest_known_key(caplog: pytest.LogCaptureFixture) -> None:
    with kvdd.LlmDataDist(1, kvdd.LlmRole.PROMPT, backend="sim") as dd:
        dd.initialize({OPTION_DEVICE_ID: "0", "llm.SyncKvCacheWaitTme": "50"})
        assert dd.backend.sync_wait_ms == 1000  # type: ignore[attr-defined]  # ignored, as upstream
    assert warnings(caplog) == ["option 'llm.SyncKvCacheWaitTme' is not one LLM-DataDist reads (ignored, as "
                                "upstream does); did you mean 'llm.SyncKvCacheWaitTime'?"]


def test_the_status_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    # without llm.DeviceId Initialize fails with LLM_PARAM_INVALID; the typo'd key changes nothing
    for options in ({}, {"llm.DevceId": "0"}):
        with kvdd.LlmDataDist(1, kvdd.LlmRole.PROMPT, backend="sim") as dd:
            with pytest.raises(kvdd.LLMParamInvalidError):
                dd.initialize(options)
    assert warnings(caplog) == ["option 'llm.DevceId' is not one LLM-DataDist reads (ignored, as upstream "
                                "does); did you mean 'llm.DeviceId'?"]


@pytest.mark.parametrize("key", [OPTION_DEVICE_ID, "ge.exec.deviceId", "my.own.setting", "llm.X"])
def test_known_and_unrelated_keys_are_quiet(key: str, caplog: pytest.LogCaptureFixture) -> None:
    kvdd.options.check_options({OPTION_DEVICE_ID: "0", key: "0"})
    assert warnings(caplog) == []


@pytest.mark.parametrize("port, low", [(65535, None), (65536, 0), (70000, 4464), (4294967295, 65535)])
def test_a_listen_port_above_65535(port: int, low: int | None, caplog: pytest.LogCaptureFixture) -> None:
    kvdd.options.check_options({OPTION_DEVICE_ID: "0", OPTION_LISTEN_IP_INFO: f"127.0.0.1:{port}"})
    expected = [] if low is None else [
        f"llm.ListenIpInfo port {port} is above 65535: accepted, as upstream does, but the socket uses its "
        f"low 16 bits (port {low})"]
    assert warnings(caplog) == expected


def test_a_listen_port_above_65535_still_listens(caplog: pytest.LogCaptureFixture) -> None:
    with kvdd.LlmDataDist(1, kvdd.LlmRole.PROMPT, backend="sim") as dd:
        dd.initialize({OPTION_DEVICE_ID: "0", OPTION_LISTEN_IP_INFO: "127.0.0.1:65536"})
        assert dd.listen_port is not None  # port 0 after truncation: a free port
    assert len(warnings(caplog)) == 1
