"""``LlmDataDist.listening_port``: the listen port as a plain ``int`` (docs/spec/API.md)."""

from __future__ import annotations

import socket

import pytest

import kvdd


def test_listening_port_is_the_bound_port_and_accepts_connections() -> None:
    with kvdd.LlmDataDist(1, kvdd.LlmRole.PROMPT, backend="sim") as dd:
        with pytest.raises(RuntimeError, match="not listening"):
            dd.listening_port  # noqa: B018 - not initialized yet
        dd.initialize({kvdd.OPTION_DEVICE_ID: "0", kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        port = dd.listening_port
        assert type(port) is int and 0 < port < 65536
        assert port == dd.listen_port
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # something really listens there
        dd.finalize()
        assert dd.listen_port is None
        with pytest.raises(RuntimeError, match="not listening"):
            dd.listening_port  # noqa: B018


def test_listening_port_raises_without_a_listen_address() -> None:
    with kvdd.LlmDataDist(2, kvdd.LlmRole.DECODER, backend="sim") as dd:
        dd.initialize({kvdd.OPTION_DEVICE_ID: "1"})
        assert dd.listen_port is None
        with pytest.raises(RuntimeError, match="OPTION_LISTEN_IP_INFO"):
            dd.listening_port  # noqa: B018
