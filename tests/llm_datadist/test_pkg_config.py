"""LLMConfig (PYPKG.md §2.1; checklist §7.5 items 1-3) and LLMClusterInfo (§5.4)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvdd.llm_datadist import LLMClusterInfo, LLMConfig, LLMException, LLMRole, LLMStatusCode


def invalid(setter: str, value: Any) -> LLMStatusCode:
    cfg = LLMConfig()
    with pytest.raises(LLMException) as exc:
        setattr(cfg, setter, value)
    return exc.value.status_code


def test_fresh_config_emits_memory_utilization_only() -> None:
    assert LLMConfig().generate_options() == {"llm.MemoryUtilization": "0.95"}


def test_device_id_int_and_list() -> None:
    cfg = LLMConfig()
    cfg.device_id = 0
    assert cfg.generate_options() == {"ge.exec.deviceId": "0", "ge.session_device_id": "0",
                                       "llm.MemoryUtilization": "0.95"}
    cfg = LLMConfig()
    cfg.device_id = [3, 1]
    opts = cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "3;1" and opts["ge.session_device_id"] == "3"
    assert invalid("device_id", -1) is LLMStatusCode.LLM_PARAM_INVALID
    assert invalid("device_id", [0, -1]) is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(ValueError):
        LLMConfig().device_id = 2**31
    LLMConfig().device_id = 2**31 - 1
    with pytest.raises(TypeError):
        LLMConfig().device_id = "0"  # type: ignore[assignment]
    with pytest.raises(TypeError):
        LLMConfig().device_id = [0, "1"]  # type: ignore[list-item]


def test_sync_kv_timeout() -> None:
    assert invalid("sync_kv_timeout", "12a") is LLMStatusCode.LLM_PARAM_INVALID
    assert invalid("sync_kv_timeout", 0) is LLMStatusCode.LLM_PARAM_INVALID
    assert invalid("sync_kv_timeout", "0") is LLMStatusCode.LLM_PARAM_INVALID
    assert invalid("sync_kv_timeout", "-5") is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(ValueError):
        LLMConfig().sync_kv_timeout = 2**31
    with pytest.raises(TypeError):
        LLMConfig().sync_kv_timeout = 1.5  # type: ignore[assignment]
    cfg = LLMConfig()
    cfg.sync_kv_timeout = 2**31 - 1
    assert cfg.generate_options()["llm.SyncKvCacheWaitTime"] == str(2**31 - 1)
    cfg.sync_kv_timeout = "1500"
    assert cfg.generate_options()["llm.SyncKvCacheWaitTime"] == "1500"


def test_link_settings_and_mem_utilization() -> None:
    assert invalid("link_retry_count", 0) is LLMStatusCode.LLM_PARAM_INVALID
    assert invalid("link_retry_count", 101) is LLMStatusCode.LLM_PARAM_INVALID
    assert invalid("link_total_time", -1) is LLMStatusCode.LLM_PARAM_INVALID
    assert invalid("link_total_time", 2**32) is LLMStatusCode.LLM_PARAM_INVALID
    assert invalid("mem_utilization", 1.01) is LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        LLMConfig().mem_utilization = 1
    cfg = LLMConfig()
    assert (cfg.link_total_time, cfg.link_retry_count) == (0, 1)
    assert "llm.LinkTotalTime" not in cfg.generate_options()
    cfg.link_total_time = 0
    cfg.link_retry_count = 100
    cfg.mem_utilization = 1.0
    opts = cfg.generate_options()
    assert (opts["llm.LinkTotalTime"], opts["llm.LinkRetryCount"], opts["llm.MemoryUtilization"]) == (
        "0", "100", "1.0")
    cfg.link_total_time = 2**32 - 1
    cfg.link_retry_count = 1
    assert cfg.generate_options()["llm.LinkTotalTime"] == str(2**32 - 1)


def test_emitted_keys_of_every_attribute() -> None:
    cfg = LLMConfig()
    cfg.deploy_res_path = "/d"
    cfg.buf_pool_cfg = "b"
    cfg.mem_pool_cfg = '{"memory_size": 1024}'
    cfg.host_mem_pool_cfg = '{"memory_size": 2048}'
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = False
    cfg.listen_ip_info = "1.2.3.4:26000"
    cfg.rdma_traffic_class = 132
    cfg.rdma_service_level = 4
    cfg.local_comm_res = ""
    cfg.transfer_backend = "hixl"
    cfg.global_resource_config = ""
    cfg.enable_switch_role = True
    cfg.output_max_size = 10
    cfg.cluster_info = json.dumps({"cluster_id": 1, "listen_ip_info": [{"ip": "1.2.3.4", "port": 26000}]})
    opts = cfg.generate_options()
    assert opts == {
        "llm.deployResPath": "/d", "llm.BufPoolCfg": "b", "llm.MemPoolConfig": '{"memory_size": 1024}',
        "llm.HostMemPoolConfig": '{"memory_size": 2048}', "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "0", "llm.listenIpInfo": "1.2.3.4:26000",
        "llm.RdmaTrafficClass": "132", "llm.RdmaServiceLevel": "4", "llm.LocalCommRes": "",
        "llm.TransferBackend": "hixl", "llm.GlobalResourceConfig": "",
        "llm.ClusterInfo": json.dumps({"cluster_id": 1, "listen_ip_info": [{"ip": 0x04030201, "port": 26000}]}),
        "llm.OutputMaxSize": "10", "llm.EnableSwitchRole": "1", "llm.MemoryUtilization": "0.95"}
    assert cfg.options is opts


def test_unset_and_empty_values_are_not_emitted() -> None:
    cfg = LLMConfig()
    cfg.deploy_res_path = ""
    cfg.listen_ip_info = ""
    cfg.enable_switch_role = False
    assert cfg.generate_options() == {"llm.MemoryUtilization": "0.95"}
    assert (cfg.local_comm_res, cfg.transfer_backend, cfg.enable_cache_manager) == ("", "", False)


def test_same_dict_accumulates_and_ge_options_are_live() -> None:
    cfg = LLMConfig()
    cfg.enable_switch_role = True
    first = cfg.generate_options()
    cfg.enable_switch_role = False
    cfg.ge_options["llm.RdmaServiceLevel"] = "3"  # live dict, not validated
    cfg.ge_options["llm.SyncKvCacheWaitTime"] = "5"
    cfg.sync_kv_timeout = 7  # explicit attributes override ge_options
    second = cfg.gen_options()
    assert second is first
    assert second["llm.EnableSwitchRole"] == "1"  # never removed
    assert second["llm.RdmaServiceLevel"] == "3" and second["llm.SyncKvCacheWaitTime"] == "7"
    with pytest.raises(TypeError):
        cfg.ge_options = {"a": 1}  # type: ignore[dict-item]
    cfg.ge_options = {"x": "y"}
    assert cfg.generate_options()["x"] == "y"


@pytest.mark.parametrize("name", ["deploy_res_path", "buf_pool_cfg", "mem_pool_cfg", "host_mem_pool_cfg",
                                  "listen_ip_info", "local_comm_res", "transfer_backend",
                                  "global_resource_config", "cluster_info"])
def test_string_attributes_reject_other_types(name: str) -> None:
    with pytest.raises(TypeError):
        setattr(LLMConfig(), name, 1)


@pytest.mark.parametrize("name", ["enable_cache_manager", "enable_remote_cache_accessible", "enable_switch_role"])
def test_bool_attributes_reject_ints(name: str) -> None:
    with pytest.raises(TypeError):
        setattr(LLMConfig(), name, 1)


def test_rdma_values_are_uint32() -> None:
    with pytest.raises(ValueError):
        LLMConfig().rdma_traffic_class = -1
    with pytest.raises(ValueError):
        LLMConfig().rdma_service_level = 2**32
    with pytest.raises(TypeError):
        LLMConfig().rdma_service_level = "3"  # type: ignore[assignment]


def test_cluster_info_ips_packing_and_errors() -> None:
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    info.remote_cluster_id = 2**64 - 1
    with pytest.raises(ValueError):
        info.remote_cluster_id = 2**64
    with pytest.raises(TypeError):
        info.remote_cluster_id = "1"  # type: ignore[assignment]
    info.remote_role_type = LLMRole.PROMPT
    info.remote_role_type = 2
    with pytest.raises(TypeError):
        info.remote_role_type = "PROMPT"  # type: ignore[assignment]
    info.append_local_ip_info("1.2.3.4", 0)
    info.append_local_ip_info("127.1", 65535)  # inet_aton shorthand
    info.append_remote_ip_info(0x0A000001, 26000)  # an int is taken as packed
    assert info.local_ip_info_list == [(0x04030201, 0), (0x0100007F, 65535)]
    assert info.remote_ip_info_list == [(0x0A000001, 26000)]
    assert info.local_ip_info_list is info.local_ip_info_list  # no setter, but the list itself
    with pytest.raises(RuntimeError):
        info.append_remote_ip_info("1.2.3.256", 1)
    with pytest.raises(RuntimeError):
        info.append_remote_ip_info("host.example", 1)
    with pytest.raises(ValueError):
        info.append_remote_ip_info("1.2.3.4", 65536)
    with pytest.raises(TypeError):
        info.append_remote_ip_info(1.5, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        info.append_remote_ip_info("1.2.3.4", "1")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        info.local_ip_info_list = []  # type: ignore[misc]
