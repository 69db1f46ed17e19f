"""What one run needs: the demo's constants, :class:`DemoOptions` and the LLM-DataDist options."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from .. import OPTION_DEVICE_ID, OPTION_LISTEN_IP_INFO, OPTION_SYNC_CACHE_WAIT_TIME, OPTION_TRANSFER_BACKEND
from .errors import DemoError
from .geometry import Geometry

__all__ = ["Address", "DECODE_CLUSTER_ID", "DemoOptions", "JSON_SCHEMA", "LINK_TIMEOUT_MS",
           "PREFILL_CLUSTER_ID", "PROTOCOL", "SYNC_WAIT_MS", "datadist_options", "ipv4"]

PROTOCOL = 1
JSON_SCHEMA = "kvdd.demo/1"
PREFILL_CLUSTER_ID = 1
DECODE_CLUSTER_ID = 2
#: llm.SyncKvCacheWaitTime (ms): per-transfer timeout; generous so that large caches over a slow
#: cross-process or cross-host link do not time out (the upstream default is 1000 ms).
SYNC_WAIT_MS = 60000
#: timeout_ms of the demo's LinkLlmClusters / UnlinkLlmClusters calls.
LINK_TIMEOUT_MS = 10000

#: (host, port).
Address = tuple[str, int]


@dataclass(frozen=True)
class DemoOptions:
    """Everything one run needs (both sides derive the same geometry from the same options)."""

    geometry: Geometry
    backend: str = "sim"  # "sim", "native" or "auto" (API.md's backend=None rule)
    transfer_backend: str = "comm"  # "comm" (HCCL, default) or "hixl"
    seed: int = 0
    timeout: float = 60.0  # seconds one side waits for the other
    listen: Address = ("127.0.0.1", 0)  # prefill's llm.ListenIpInfo
    control_port: int | None = None  # prefill's control port; None: listen port + 1 (0 when that is 0)
    connect: Address | None = None  # decode: the prefill's LLM-DataDist address
    decode_listen: Address | None = None  # decode's llm.ListenIpInfo (hixl); None: its control-socket IP, port 0
    progress: bool = False
    api: str = "kvdd"  # "kvdd" (kvdd's own LlmDataDist) or "llm_datadist" (CANN's Python package's calls)
    link: str = "clusters"  # --api llm_datadist: "clusters" (link_clusters) or "rank-table" (link + query)

    @property
    def backend_arg(self) -> str | None:
        return None if self.backend == "auto" else self.backend

    def prefill_control_port(self) -> int:
        if self.control_port is not None:
            return self.control_port
        return self.listen[1] + 1 if self.listen[1] else 0

    def decode_control_address(self) -> Address:
        assert self.connect is not None
        if self.control_port is not None:
            return (self.connect[0], self.control_port)
        if not self.connect[1]:
            raise DemoError("--connect needs the prefill's real port (not 0)")
        return (self.connect[0], self.connect[1] + 1)


def datadist_options(listen: Address | None, transfer_backend: str) -> dict[str, str]:
    opts = {OPTION_DEVICE_ID: "0", OPTION_SYNC_CACHE_WAIT_TIME: str(SYNC_WAIT_MS)}
    if listen is not None:
        host = f"[{listen[0]}]" if ":" in listen[0] else listen[0]
        opts[OPTION_LISTEN_IP_INFO] = f"{host}:{listen[1]}"
    if transfer_backend == "hixl":
        opts[OPTION_TRANSFER_BACKEND] = "hixl"
    return opts


def _is_ipv4_literal(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET, host)
    except OSError:
        return False
    return True


def ipv4(host: str) -> str:
    """An IPv4 literal for ``host`` (ClusterInfo takes IPv4 literals only, SEMANTICS.md §3.5)."""
    if _is_ipv4_literal(host):
        return host
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        raise DemoError(f"cannot resolve {host!r} to an IPv4 address (LLM-DataDist links need IPv4)") from None
