"""LLMConfig and LLMClusterInfo setters given None, and the order of the device_id checks
(PYPKG.md §2.1: ``check_isinstance`` lets None through, so a plain type-checked attribute set to
None becomes unset; attributes whose setter then compares or converts the value raise TypeError
there).  Also the cluster_info conversion happening in the setter."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pkg_fake import raised

from kvdd.llm_datadist import LLMClusterInfo, LLMConfig, LLMStatusCode

PI = LLMStatusCode.LLM_PARAM_INVALID


def outcome(call: Any) -> Any:
    return raised(call, IndexError)


@pytest.mark.parametrize("name,value,key", [
    ("listen_ip_info", "1.2.3.4:5", "llm.listenIpInfo"),
    ("deploy_res_path", "/x", "llm.deployResPath"),
    ("buf_pool_cfg", "{}", "llm.BufPoolCfg"),
    ("mem_pool_cfg", "{}", "llm.MemPoolConfig"),
    ("host_mem_pool_cfg", "{}", "llm.HostMemPoolConfig"),
    ("local_comm_res", "", "llm.LocalCommRes"),
    ("transfer_backend", "hixl", "llm.TransferBackend"),
    ("global_resource_config", "{}", "llm.GlobalResourceConfig"),
    ("enable_cache_manager", True, "llm.EnableCacheManager"),
    ("enable_remote_cache_accessible", False, "llm.EnableRemoteCacheAccessible"),
    ("enable_switch_role", True, "llm.EnableSwitchRole"),
])
def test_none_unsets_a_type_checked_attribute(name: str, value: Any, key: str) -> None:
    cfg = LLMConfig()
    setattr(cfg, name, value)
    setattr(cfg, name, None)
    assert key not in cfg.generate_options()


def test_none_reads_back_as_upstream_getters_give_it() -> None:
    cfg = LLMConfig()
    for name in ("local_comm_res", "transfer_backend", "global_resource_config"):
        setattr(cfg, name, None)
        assert getattr(cfg, name) == ""
    for name in ("enable_cache_manager", "enable_remote_cache_accessible"):
        setattr(cfg, name, None)
        assert getattr(cfg, name) is False
    cfg.listen_ip_info = None
    assert cfg.listen_ip_info is None


@pytest.mark.parametrize("name", ["device_id", "sync_kv_timeout", "link_total_time", "link_retry_count",
                                  "mem_utilization", "cluster_info", "rdma_traffic_class"])
def test_none_is_a_type_error_where_the_setter_uses_the_value(name: str) -> None:
    assert outcome(lambda: setattr(LLMConfig(), name, None)) is TypeError


def test_device_id_list_checks_each_kind_over_all_items_first() -> None:
    # all item types, then all signs (PARAM_INVALID), then all int32 ranges (ValueError)
    assert outcome(lambda: setattr(LLMConfig(), "device_id", [-1, "a"])) is TypeError
    assert outcome(lambda: setattr(LLMConfig(), "device_id", [2**31, -1])) == PI
    assert outcome(lambda: setattr(LLMConfig(), "device_id", [2**31, 0])) is ValueError
    assert outcome(lambda: setattr(LLMConfig(), "device_id", -1)) == PI
    assert outcome(lambda: setattr(LLMConfig(), "device_id", 2**31)) is ValueError


def test_empty_device_id_list_is_accepted_and_fails_at_generation() -> None:
    cfg = LLMConfig()
    cfg.device_id = []
    assert cfg.device_id == []
    assert outcome(cfg.generate_options) is IndexError


def test_cluster_info_is_converted_when_set() -> None:
    cfg = LLMConfig()
    cfg.cluster_info = '{"cluster_id": 1, "listen_ip_info": [{"ip": "1.2.3.4", "port": 26000}]}'
    converted = json.loads(cfg.cluster_info)
    assert converted["listen_ip_info"][0]["ip"] == 0x04030201
    assert cfg.generate_options()["llm.ClusterInfo"] == cfg.cluster_info
    with pytest.raises(ValueError):  # bad JSON fails at once, not at generate_options()
        cfg.cluster_info = "{"


def test_cluster_info_remote_role_type_none() -> None:
    info = LLMClusterInfo()
    info.remote_role_type = 1
    info.remote_role_type = None
    assert info.remote_role_type is None
