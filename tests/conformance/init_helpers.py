"""Options and checks shared by the Initialize, Finalize and SetRole conformance tests
(test_initialize.py, test_lifecycle.py)."""

from __future__ import annotations

import socket

import pytest

import kvdd.testing as kt
from kvdd import (
    OPTION_DEVICE_ID,
    OPTION_LISTEN_IP_INFO,
    OPTION_TRANSFER_BACKEND,
)

from .harness import (
    FAILED,
    LOCALHOST,
    Node,
    World,
    listen_address,
    raises,
)

DEV = {OPTION_DEVICE_ID: str(kt.device_ids()[0])}
LISTEN0 = {OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0"}
HIXL = {OPTION_TRANSFER_BACKEND: "hixl"}
#: For tests that check the port bound for port 0, which the real library cannot report.
NEEDS_PORT0 = pytest.mark.needs_bound_port


def listen_any(world: World) -> dict[str, str]:
    """``llm.ListenIpInfo`` on some free port: port 0 on sim, a pre-chosen one on native."""
    return {OPTION_LISTEN_IP_INFO: listen_address(world.backend)}


def free_port_v6() -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        port: int = s.getsockname()[1]
    return port


def is_listening(port: int, host: str = LOCALHOST) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def assert_initialized(d: Node) -> None:
    # An initialized instance registers (id 1 on a fresh one); an uninitialized one returns FAILED.
    assert d.register().cache_id >= 1


def assert_uninitialized(d: Node) -> None:
    with raises(FAILED):
        d.register()
