"""``LLMRole``, ``LLMClusterInfo`` and ``LlmConfig`` / ``LLMConfig`` (PYPKG.md §1.2, §2.1, §5.4).

``LlmConfig`` builds the option dict that :meth:`kvdd.llm_datadist.LLMDataDist.init` takes: every
setter validates (``TypeError`` / ``ValueError`` for type and C-range errors,
``LLMException(LLM_PARAM_INVALID)`` for semantic ones) and :meth:`LlmConfig.generate_options`
writes upstream's keys into one dict that accumulates across calls.
"""

from __future__ import annotations

import json
import socket
import struct
from enum import IntEnum
from typing import Any

from .status import raise_if_false
from .utils.utils import (
    INT32_MAX,
    check_inner,
    check_int32,
    UINT32_MAX,
    check_dict,
    check_isinstance,
    check_uint16,
    check_uint32,
    check_uint64,
)

__all__ = ["LLMRole", "LLMClusterInfo", "LlmConfig", "LLMConfig", "ip_to_int"]


class LLMRole(IntEnum):
    """Role of an LLM-DataDist instance (PYPKG.md §1.2); ``str()`` is ``"LLMRole.NAME"``."""

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else format(int(self), spec)


def ip_to_int(ip: str) -> int:
    """An IPv4 string (any form ``socket.inet_aton`` accepts, e.g. ``"127.1"``) packed
    little-endian: first octet in the lowest byte (PYPKG.md §5.4).

    Raises
    ------
    RuntimeError
        The string is not an IPv4 address.
    """
    try:
        packed = socket.inet_aton(ip)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"ip '{ip}' is invalid: {exc}") from None
    value: int = struct.unpack("<I", packed)[0]
    return value


def _ip_port(ip: Any, port: Any) -> tuple[int, int]:
    check_isinstance("ip", ip, (str, int), allow_none=False)
    check_uint16("port", port)
    return (ip_to_int(ip) if isinstance(ip, str) else ip, port)


class LLMClusterInfo:
    """A peer to link with ``link_clusters`` / ``unlink_clusters`` (PYPKG.md §3.4, §5.4).

    ``remote_cluster_id`` (uint64, initially None) names the peer; IPs are kept as little-endian
    packed ints with their ports.  ``remote_role_type`` is stored but never sent to the engine.
    """

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """The peer's cluster id (uint64; ``TypeError`` / ``ValueError`` in the setter)."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        check_uint64("remote_cluster_id", value)
        self._remote_cluster_id = value

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """The peer's role (``LLMRole`` or int); informational only."""
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int | None) -> None:
        check_isinstance("remote_role_type", value, (LLMRole, int))
        self._remote_role_type = value

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """``[(ip_int, port), ...]`` appended by :meth:`append_local_ip_info` (no setter; the
        list itself, as upstream)."""
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """``[(ip_int, port), ...]`` appended by :meth:`append_remote_ip_info` (no setter; the
        list itself, as upstream)."""
        return self._remote_ip_info_list

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local address: ``ip`` an IPv4 string or a packed int, ``port`` uint16.

        Raises ``TypeError`` / ``ValueError`` for types and ranges, ``RuntimeError`` for an
        unparsable IP string (PYPKG.md §5.4)."""
        self._local_ip_info_list.append(_ip_port(ip, port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add a remote (listening) address; as :meth:`append_local_ip_info`."""
        self._remote_ip_info_list.append(_ip_port(ip, port))

    def __repr__(self) -> str:
        return (f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id}, "
                f"remote_role_type={self._remote_role_type}, "
                f"local_ip_info_list={self._local_ip_info_list}, "
                f"remote_ip_info_list={self._remote_ip_info_list})")


_UNSET: Any = object()


class LlmConfig:
    """Options for :meth:`kvdd.llm_datadist.LLMDataDist.init` (CANN ``LLMConfig``, PYPKG.md §2.1).

    Every attribute validates in its setter; :meth:`generate_options` emits upstream's option
    keys (``ge.exec.deviceId``, ``llm.SyncKvCacheWaitTime``, ``llm.listenIpInfo``, ...) into the
    same dict object on every call, so keys accumulate and are never removed.  A fresh config
    emits ``{"llm.MemoryUtilization": "0.95"}``.
    """

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._ge_options: dict[str, str] = {}
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._sync_kv_timeout: int | str | None = None
        self._deploy_res_path: str | None = ""
        self._buf_pool_cfg: str | None = ""
        self._mem_pool_cfg: str | None = ""
        self._host_mem_pool_cfg: str | None = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._listen_ip_info: str | None = ""
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None
        self._enable_switch_role: bool | None = False
        self._cluster_info = ""
        self._output_max_size: int | None = None
        self._mem_utilization: float = 0.95

    # -- generation ---------------------------------------------------------------------------

    def generate_options(self) -> dict[str, str]:
        """Write the configured keys into :attr:`options` and return that same dict.

        ``ge_options`` pairs come first, so explicit attributes override same-named keys; keys
        written by an earlier call stay (PYPKG.md §2.1)."""
        opts = self._options
        for key, value in self._ge_options.items():
            opts[key] = value
        if self._device_id is not None:
            if isinstance(self._device_id, int):
                opts["ge.exec.deviceId"] = str(self._device_id)
                opts["ge.session_device_id"] = str(self._device_id)
            else:
                if not self._device_id:
                    raise IndexError("device_id is an empty list: set at least one device id.")
                opts["ge.session_device_id"] = str(self._device_id[0])
                opts["ge.exec.deviceId"] = ";".join(str(d) for d in self._device_id)
        if self._sync_kv_timeout is not None:
            opts["llm.SyncKvCacheWaitTime"] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            opts["llm.deployResPath"] = self._deploy_res_path
        self._gen_cache_manager_options(opts)
        if self._cluster_info:
            opts["llm.ClusterInfo"] = self._cluster_info
        if self._output_max_size is not None:
            opts["llm.OutputMaxSize"] = str(self._output_max_size)
        if self._enable_switch_role:
            opts["llm.EnableSwitchRole"] = "1"
        opts["llm.MemoryUtilization"] = str(self._mem_utilization)
        return opts

    def gen_options(self) -> dict[str, str]:
        """Same as :meth:`generate_options`."""
        return self.generate_options()

    def _gen_cache_manager_options(self, opts: dict[str, str]) -> None:
        if self._buf_pool_cfg:
            opts["llm.BufPoolCfg"] = self._buf_pool_cfg
        if self._mem_pool_cfg:
            opts["llm.MemPoolConfig"] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            opts["llm.HostMemPoolConfig"] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            opts["llm.EnableCacheManager"] = "1" if self._enable_cache_manager else "0"
        if self._enable_remote_cache_accessible is not None:
            opts["llm.EnableRemoteCacheAccessible"] = "1" if self._enable_remote_cache_accessible else "0"
        if self._listen_ip_info:
            opts["llm.listenIpInfo"] = self._listen_ip_info
        if self._link_total_time is not None:
            opts["llm.LinkTotalTime"] = str(self._link_total_time)
        if self._link_retry_count is not None:
            opts["llm.LinkRetryCount"] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            opts["llm.RdmaTrafficClass"] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            opts["llm.RdmaServiceLevel"] = str(self._rdma_service_level)
        if self._local_comm_res is not None:
            opts["llm.LocalCommRes"] = self._local_comm_res
        if self._transfer_backend is not None:
            opts["llm.TransferBackend"] = self._transfer_backend
        if self._global_resource_config is not None:
            opts["llm.GlobalResourceConfig"] = self._global_resource_config

    @property
    def options(self) -> dict[str, str]:
        """The accumulated option dict (read-only attribute; the dict itself is live)."""
        return self._options

    # -- attributes ---------------------------------------------------------------------------

    @property
    def ge_options(self) -> dict[str, str]:
        """Raw option pairs copied first by :meth:`generate_options`; the getter returns the live
        dict, so ``cfg.ge_options[k] = v`` adds a key without validation."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, value: dict[str, str]) -> None:
        check_dict("ge_options", value, str, str, allow_none=False)
        self._ge_options = value

    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        """Device id (int >= 0, int32) or a list/tuple of them; emits ``ge.exec.deviceId`` and
        ``ge.session_device_id``. Negative -> LLM_PARAM_INVALID, > int32 -> ValueError."""
        return self._device_id

    @device_id.setter
    def device_id(self, value: int | list[int] | tuple[int, ...] | None) -> None:
        # as upstream: every item's type first, then every sign (PARAM_INVALID), then every int32
        # range (ValueError); None and an empty list pass the type checks (None then fails the
        # sign comparison with TypeError, an empty list fails in generate_options)
        check_isinstance("device_id", value, (int, list, tuple))
        ids: list[Any] = list(value) if isinstance(value, (list, tuple)) else [value]
        if isinstance(value, (list, tuple)):
            check_inner("device_id", ids, int)
        elif value is None:
            raise TypeError("device_id only supports int, list or tuple, but got NoneType.")
        for dev in ids:
            raise_if_false(dev >= 0, f"device_id must be >= 0, but got {dev}.")
        for dev in ids:
            check_int32("device_id", dev)
        self._device_id = value

    @property
    def sync_kv_timeout(self) -> int | str | None:
        """Timeout of every pull/push in **milliseconds** (int or all-digit str, > 0, int32);
        emits ``llm.SyncKvCacheWaitTime``."""
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, value: int | str) -> None:
        check_isinstance("sync_kv_timeout", value, (int, str), allow_none=False)
        if isinstance(value, str):
            raise_if_false(value.isdigit() and value.isascii(),
                           f"sync_kv_timeout must be digits, but got '{value}'.")
        number = int(value)
        raise_if_false(number > 0, f"sync_kv_timeout must be > 0, but got {value}.")
        if number > INT32_MAX:
            raise ValueError(f"sync_kv_timeout must be in range of int32, but got {value}.")
        self._sync_kv_timeout = value

    @property
    def deploy_res_path(self) -> str | None:
        """``llm.deployResPath`` (emitted when non-empty)."""
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, value: str | None) -> None:
        check_isinstance("deploy_res_path", value, str)
        self._deploy_res_path = value

    @property
    def buf_pool_cfg(self) -> str | None:
        """``llm.BufPoolCfg`` (emitted when non-empty)."""
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, value: str | None) -> None:
        check_isinstance("buf_pool_cfg", value, str)
        self._buf_pool_cfg = value

    @property
    def mem_pool_cfg(self) -> str | None:
        """``llm.MemPoolConfig`` JSON (not parsed here; emitted when non-empty)."""
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, value: str | None) -> None:
        check_isinstance("mem_pool_cfg", value, str)
        self._mem_pool_cfg = value

    @property
    def host_mem_pool_cfg(self) -> str | None:
        """``llm.HostMemPoolConfig`` JSON (emitted when non-empty)."""
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, value: str | None) -> None:
        check_isinstance("host_mem_pool_cfg", value, str)
        self._host_mem_pool_cfg = value

    @property
    def enable_cache_manager(self) -> bool:
        """``llm.EnableCacheManager`` "1"/"0", emitted only once set."""
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, value: bool | None) -> None:
        check_isinstance("enable_cache_manager", value, bool)
        self._enable_cache_manager = value

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """``llm.EnableRemoteCacheAccessible`` "1"/"0", emitted only once set."""
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, value: bool | None) -> None:
        check_isinstance("enable_remote_cache_accessible", value, bool)
        self._enable_remote_cache_accessible = value

    @property
    def listen_ip_info(self) -> str | None:
        """``"ip:port"`` the instance listens on; emitted as ``llm.listenIpInfo`` (lower-case l)
        when non-empty; parsed by ``init`` (PYPKG.md §2.2)."""
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, value: str | None) -> None:
        check_isinstance("listen_ip_info", value, str)
        self._listen_ip_info = value

    @property
    def link_total_time(self) -> int:
        """Rank-table link exchange time in **seconds** (int in [0, 2**32-1], else
        LLM_PARAM_INVALID); reads 0 when unset; ``llm.LinkTotalTime`` once set."""
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, value: int) -> None:
        check_isinstance("link_total_time", value, int, allow_none=False)
        raise_if_false(0 <= value <= UINT32_MAX,
                       f"link_total_time must be in [0, {UINT32_MAX}], but got {value}.")
        self._link_total_time = value

    @property
    def link_retry_count(self) -> int:
        """Rank-table link retries (int in [1, 100], else LLM_PARAM_INVALID); reads 1 when unset;
        ``llm.LinkRetryCount`` once set."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, value: int) -> None:
        check_isinstance("link_retry_count", value, int, allow_none=False)
        raise_if_false(1 <= value <= 100, f"link_retry_count must be in [1, 100], but got {value}.")
        self._link_retry_count = value

    @property
    def rdma_traffic_class(self) -> int | None:
        """``llm.RdmaTrafficClass`` (uint32; emitted when not None)."""
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, value: int) -> None:
        check_uint32("rdma_traffic_class", value)
        self._rdma_traffic_class = value

    @property
    def rdma_service_level(self) -> int | None:
        """``llm.RdmaServiceLevel`` (uint32; emitted when not None)."""
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, value: int) -> None:
        check_uint32("rdma_service_level", value)
        self._rdma_service_level = value

    @property
    def local_comm_res(self) -> str:
        """``llm.LocalCommRes``, emitted whenever set, even to ``""`` (implies cache-manager and
        remote-accessible mode at ``init``, PYPKG.md §2.2)."""
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, value: str | None) -> None:
        check_isinstance("local_comm_res", value, str)
        self._local_comm_res = value

    @property
    def transfer_backend(self) -> str:
        """``llm.TransferBackend`` (``"hixl"``; emitted whenever set)."""
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, value: str | None) -> None:
        check_isinstance("transfer_backend", value, str)
        self._transfer_backend = value

    @property
    def global_resource_config(self) -> str:
        """``llm.GlobalResourceConfig`` (HIXL only; emitted whenever set)."""
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, value: str | None) -> None:
        check_isinstance("global_resource_config", value, str)
        self._global_resource_config = value

    @property
    def enable_switch_role(self) -> bool | None:
        """``llm.EnableSwitchRole`` = "1" emitted only while True."""
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, value: bool | None) -> None:
        check_isinstance("enable_switch_role", value, bool)
        self._enable_switch_role = value

    @property
    def cluster_info(self) -> str:
        """Legacy cluster JSON as set, with each ``listen_ip_info[].ip`` already converted to a
        packed int (the setter parses it: bad JSON raises ``json.JSONDecodeError`` there);
        emitted as ``llm.ClusterInfo``."""
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, value: str) -> None:
        check_isinstance("cluster_info", value, str, allow_none=False)
        self._cluster_info = _convert_cluster_info(value)

    @property
    def output_max_size(self) -> int | None:
        """``llm.OutputMaxSize`` (int; emitted when not None)."""
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, value: int) -> None:
        check_isinstance("output_max_size", value, int)
        self._output_max_size = value

    @property
    def mem_utilization(self) -> float:
        """``llm.MemoryUtilization`` (float in [0, 1], else LLM_PARAM_INVALID; an int is a
        ``TypeError``); always emitted, ``"0.95"`` by default."""
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, value: float) -> None:
        check_isinstance("mem_utilization", value, float, allow_none=False)
        raise_if_false(0.0 <= value <= 1.0, f"mem_utilization must be in [0, 1], but got {value}.")
        self._mem_utilization = value


LLMConfig = LlmConfig


def _convert_cluster_info(text: str) -> str:
    info = json.loads(text)
    if isinstance(info, dict):
        for entry in info.get("listen_ip_info", []) or []:
            if isinstance(entry, dict) and isinstance(entry.get("ip"), str):
                entry["ip"] = ip_to_int(entry["ip"])
    return json.dumps(info)
