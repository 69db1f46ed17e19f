"""Shared helpers of the lifecycle and link tests (run here and, through ``peer.Peer``, in peers)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvdd.sim.pypkg import lifecycle, links

LOCALHOST = 0x0100007F  # 127.0.0.1 as LLMClusterInfo sends it (little-endian u32)
S_OK = 0
FAILED = 0xFFFFFFFF
PARAM_INVALID = 0x5010B005
NOT_YET_LINK = 0x5010B007
ALREADY_LINK = 0x5010B008
LINK_FAILED = 0x5010B009
UNLINK_FAILED = 0x5010B00A
EXIST_LINK = 0x5010B018
FEATURE_NOT_ENABLED = 0x5010B019
KV_CACHE_NOT_EXIST = 0x5010B002
OK, PREPARING, FAILED_STATE = 0, 1, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def listening(port: int) -> bool:
    """Something accepts TCP connections on 127.0.0.1:port."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def options(role: str = "Prompt", port: int | None = None, ra: str | None = "1",
            **extra: str) -> dict[str, str]:
    """Derived options as ``LLMDataDist.init`` passes them (PYPKG.md §2.2)."""
    out = {"llm.Role": role, "llm.EnableCacheManager": "1", "ge.exec.deviceId": "0",
           "llm.MemoryUtilization": "0.95"}
    if ra is not None:
        out["llm.EnableRemoteCacheAccessible"] = ra
    if port is not None:
        out.update({"llm.listenIpInfo": f"127.0.0.1:{port}", "llm.ListenIp": "127.0.0.1",
                    "llm.ListenPort": str(port)})
    out.update({k.replace("_", "."): v for k, v in extra.items()})
    return out


def cluster(remote_id: int, port: int, local: bool = True) -> tuple[int, int, list[tuple[int, int]],
                                                                      list[tuple[int, int]]]:
    """A ClusterTuple naming 127.0.0.1:port (and 127.0.0.1 as the local IP)."""
    return (remote_id, 0, [(LOCALHOST, 0)] if local else [], [(LOCALHOST, port)])


def rank_table(n: int = 2) -> str:
    """A version 1.0 rank table of ``n`` devices, ranks 0..n-1, device_ip 10.0.0.<rank+1>."""
    return json.dumps({"version": "1.0", "server_count": "1", "status": "completed",
                       "server_list": [{"server_id": "10.0.0.100", "device": [
                           {"device_id": str(r), "device_ip": f"10.0.0.{r + 1}", "rank_id": str(r)}
                           for r in range(n)]}]})


# -- called in peers ------------------------------------------------------------------------------
def init(cluster_id: int, opts: dict[str, str]) -> int:
    return lifecycle.initialize_v2(cluster_id, opts)


def fin() -> None:
    lifecycle.finalize_v2()


def entities() -> list[int]:
    """The cluster ids this engine has link entities for."""
    engine = lifecycle.current()
    assert engine is not None
    return sorted(engine.instance.entities)


def engine_state() -> dict[str, Any]:
    engine = lifecycle.current()
    if engine is None:
        return {}
    return {"cluster_id": engine.cluster_id, "remote_accessible": engine.remote_accessible,
            "sync_wait_ms": engine.sync_wait_ms, "transfer_backend": engine.transfer_backend,
            "listen_port": engine.instance.listen_port}


def pending(cluster_id: int) -> bool:
    engine = lifecycle.current()
    assert engine is not None
    return engine.link_pending(cluster_id)


def wait_status(comm_id: int, timeout_s: float = 30.0) -> tuple[int, int]:
    """``query_register_mem_status`` until it is not PREPARING (or the time is up)."""
    end = time.monotonic() + timeout_s
    while True:
        got = links.query_register_mem_status(comm_id)
        if got[0] != S_OK or got[1] != PREPARING or time.monotonic() > end:
            return got
        time.sleep(0.02)


def rank_link(comm_name: str, members: Sequence[tuple[int, int]], table: str) -> tuple[int, int]:
    return links.link(comm_name, members, table)


@contextmanager
def engine(cluster_id: int, opts: dict[str, str]) -> Iterator[None]:
    """An engine in this process for the block (finalized after it)."""
    assert lifecycle.initialize_v2(cluster_id, opts) == S_OK, lifecycle.last_error_detail()
    try:
        yield
    finally:
        lifecycle.finalize_v2()


def state_garbage(value: bytes) -> None:
    """Make this process state ``value`` as its ``llm_datadist`` handshake entry (a hostile or
    broken peer)."""
    from kvdd.sim import fabric
    from kvdd.sim.pypkg import instance

    def offer(session: Any, owner: Any) -> bytes | None:
        return value if session.initiator else None

    fabric.register_extension(instance.EXTENSION, offer, lambda session, v: None)


def state_normally() -> None:
    """Undo :func:`state_garbage`."""
    from kvdd.sim.pypkg import instance
    instance.register_extension()
