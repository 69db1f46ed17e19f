"""The engine's lifecycle in one process: ``initialize_v2`` (PYPKG.md §2.3, §3.1, §7.5 items 5-8),
``finalize_v2`` (§3.2), ``switch_role_v2`` (§3.5), the no-engine statuses (§1.4), and the rank-table
checks that need no peer (§3.3, §7.5 item 10)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvdd.sim.pypkg import lifecycle, links
from links_support import (FAILED, FAILED_STATE, FEATURE_NOT_ENABLED, LINK_FAILED, NOT_YET_LINK,
                           PARAM_INVALID, PREPARING, S_OK, cluster, engine, free_port, listening,
                           options, rank_table)


@pytest.fixture(autouse=True)
def _no_engine_left() -> Iterator[None]:
    lifecycle.finalize_v2()
    yield
    lifecycle.finalize_v2()


def _init(opts: dict[str, str], cluster_id: int = 1) -> int:
    return lifecycle.initialize_v2(cluster_id, opts)


# -- initialize_v2 ---------------------------------------------------------------------------------
def test_local_comm_res_only_is_a_remote_accessible_cache_manager_engine() -> None:
    # §7.5 item 5 as the engine receives it: LocalCommRes "" implied both switches
    opts = {"llm.Role": "Prompt", "llm.LocalCommRes": "", "llm.EnableCacheManager": "1",
            "llm.EnableRemoteCacheAccessible": "1", "llm.MemoryUtilization": "0.95"}
    assert _init(opts) == S_OK
    engine = lifecycle.current()
    assert engine is not None and engine.remote_accessible and engine.transfer_backend == "comm"
    assert engine.cluster_id == 1 and engine.sync_wait_ms == 1000


@pytest.mark.parametrize("value, expected", [("hixl", S_OK), ("foo", PARAM_INVALID),
                                             ("", PARAM_INVALID), ("HIXL", PARAM_INVALID)])
def test_transfer_backend(value: str, expected: int) -> None:
    # §7.5 item 6: "foo" with a listen address -> native PARAM_INVALID
    assert _init(options(port=free_port(), llm_TransferBackend=value)) == expected
    engine = lifecycle.current()
    assert (engine is not None) == (expected == S_OK)
    if engine is not None:
        assert engine.transfer_backend == "hixl"


@pytest.mark.parametrize("ra", ["0", None])
def test_hixl_needs_remote_accessible(ra: str | None) -> None:
    assert _init(options(port=free_port(), ra=ra, llm_TransferBackend="hixl")) == PARAM_INVALID
    assert lifecycle.current() is None


def test_hixl_needs_the_internal_listen_keys() -> None:
    opts = options(llm_TransferBackend="hixl")
    opts["llm.listenIpInfo"] = "127.0.0.1:26000"  # the raw key is read by nobody natively
    assert _init(opts) == PARAM_INVALID
    assert lifecycle.current() is None


@pytest.mark.parametrize("value, expected", [("0;1", PARAM_INVALID), ("x", PARAM_INVALID),
                                             ("", PARAM_INVALID), ("1 ", PARAM_INVALID),
                                             ("2147483648", PARAM_INVALID), ("-1", FAILED),
                                             ("3", S_OK), ("2147483647", S_OK)])
def test_exec_device_id_is_one_int32(value: str, expected: int) -> None:
    # §7.5 item 7: device_id=[0, 1] emits ge.exec.deviceId "0;1" -> native PARAM_INVALID
    assert _init(options(ge_exec_deviceId=value)) == expected


def test_device_id_absent_is_device_0_and_public_keys_are_ignored() -> None:
    port = free_port()
    opts = options()
    del opts["ge.exec.deviceId"]
    # the public class's keys: silently ignored here (device 0, no listener)
    opts.update({"llm.DeviceId": "x", "llm.ListenIpInfo": f"127.0.0.1:{port}"})
    assert _init(opts) == S_OK
    engine = lifecycle.current()
    assert engine is not None and engine.instance.listen_port is None
    assert not listening(port)


def test_role_is_required_and_only_logged() -> None:
    opts = options()
    del opts["llm.Role"]
    assert _init(opts) == PARAM_INVALID
    assert _init(options(role="Whatever")) == S_OK


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (None, False)])
def test_remote_accessible_mode(value: str | None, expected: bool) -> None:
    assert _init(options(ra=value)) == S_OK
    engine = lifecycle.current()
    assert engine is not None and engine.remote_accessible is expected


@pytest.mark.parametrize("value", ["2", "", "true", " 1", "01"])
def test_remote_accessible_must_be_0_or_1(value: str) -> None:
    assert _init(options(ra=value)) == PARAM_INVALID


@pytest.mark.parametrize("key, value, expected", [
    ("llm.SyncKvCacheWaitTime", "12a", PARAM_INVALID), ("llm.SyncKvCacheWaitTime", "", PARAM_INVALID),
    ("llm.SyncKvCacheWaitTime", "-1", PARAM_INVALID), ("llm.SyncKvCacheWaitTime", "+5", PARAM_INVALID),
    ("llm.SyncKvCacheWaitTime", "0", S_OK), ("llm.SyncKvCacheWaitTime", "2500", S_OK),
    ("llm.RdmaTrafficClass", "4294967295", S_OK), ("llm.RdmaTrafficClass", "4294967296", PARAM_INVALID),
    ("llm.RdmaServiceLevel", "x", PARAM_INVALID), ("llm.LinkTotalTime", "2147483648", PARAM_INVALID),
    ("llm.LinkTotalTime", "5 ", PARAM_INVALID), ("llm.LinkTotalTime", "0", S_OK),
    ("llm.LinkRetryCount", "0", PARAM_INVALID), ("llm.LinkRetryCount", "101", PARAM_INVALID),
    ("llm.LinkRetryCount", "1", S_OK), ("llm.LinkRetryCount", "100", S_OK),
    ("llm.MemPoolConfig", "{", PARAM_INVALID),
])
def test_engine_option_rules(key: str, value: str, expected: int) -> None:
    opts = options()
    opts[key] = value
    assert _init(opts) == expected
    if expected == S_OK and key == "llm.SyncKvCacheWaitTime":
        engine = lifecycle.current()
        assert engine is not None and engine.sync_wait_ms == int(value)


def test_listen_port_without_ip_is_invalid() -> None:
    opts = options()
    opts["llm.ListenPort"] = str(free_port())
    assert _init(opts) == PARAM_INVALID


def test_a_port_in_use_fails_and_leaves_no_engine() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert _init(options(port=busy.getsockname()[1])) == FAILED
    assert lifecycle.current() is None
    assert "listen" in (lifecycle.last_error_detail() or "")


def test_a_failed_initialize_leaves_nothing_listening_and_may_be_retried() -> None:
    port = free_port()
    opts = options(port=port, llm_SyncKvCacheWaitTime="12a")  # fails after listening
    assert _init(opts) == PARAM_INVALID
    assert lifecycle.current() is None
    assert not listening(port)  # the failed engine is destroyed: its port closed
    assert _init(options(port=port)) == S_OK
    assert listening(port)


def test_one_engine_per_process() -> None:
    # §7.5 item 8 natively; finalize, then a fresh engine (twice is harmless)
    assert _init(options()) == S_OK
    assert _init(options(), cluster_id=2) == FAILED
    engine = lifecycle.current()
    assert engine is not None and engine.cluster_id == 1
    lifecycle.finalize_v2()
    lifecycle.finalize_v2()
    assert lifecycle.current() is None
    assert _init(options(), cluster_id=2) == S_OK


def test_finalize_closes_the_listener() -> None:
    port = free_port()
    assert _init(options(port=port)) == S_OK
    assert listening(port)
    lifecycle.finalize_v2()
    assert not listening(port)


def test_no_engine_statuses() -> None:
    # PYPKG.md §1.4: LLM_FAILED for the link family, PARAM_INVALID for switch_role
    assert links.link("c", [(1, 0), (2, 1)], rank_table()) == (FAILED, 0)
    assert links.unlink(1) == FAILED
    assert links.query_register_mem_status(1) == (FAILED, 0)
    assert links.link_clusters_v2([cluster(2, 1)], 1000) == (FAILED, [])
    assert links.unlink_clusters_v2([cluster(2, 1)], 1000, True) == (FAILED, [])
    assert lifecycle.switch_role_v2("Prompt", {}) == PARAM_INVALID


# -- switch_role_v2 ----------------------------------------------------------------------------------
def test_switch_role_moves_stops_and_restarts_the_listener() -> None:
    p1, p2 = free_port(), free_port()
    listen2 = {"llm.ListenIp": "127.0.0.1", "llm.ListenPort": str(p2)}
    with engine(1, options(port=p1)):
        assert lifecycle.switch_role_v2("Prompt", {"llm.ListenIp": "127.0.0.1",
                                                   "llm.ListenPort": str(p1)}) == S_OK
        assert listening(p1)  # same port: nothing changes
        assert lifecycle.switch_role_v2("Prompt", listen2) == S_OK
        assert listening(p2) and not listening(p1)
        assert lifecycle.switch_role_v2("Decoder", {}) == S_OK  # no port: stop listening
        assert not listening(p2)
        assert lifecycle.switch_role_v2("Mix", listen2) == S_OK  # not listening: start
        assert listening(p2)
        assert lifecycle.switch_role_v2("Prompter", {}) == PARAM_INVALID
        assert listening(p2)
        engine_ = lifecycle.current()
        assert engine_ is not None and engine_.instance.role == 3


def test_switch_role_on_hixl_cannot_change_the_address() -> None:
    p1, p2 = free_port(), free_port()
    with engine(1, options(port=p1, llm_TransferBackend="hixl")):
        assert lifecycle.switch_role_v2("Decoder", {}) == S_OK  # never stops listening
        assert listening(p1)
        assert lifecycle.switch_role_v2("Decoder", {"llm.ListenIp": "127.0.0.1",
                                                    "llm.ListenPort": str(p2)}) == FEATURE_NOT_ENABLED
        assert lifecycle.switch_role_v2("Decoder", {"llm.ListenIp": "127.0.0.1",
                                                    "llm.ListenPort": str(p1)}) == S_OK


# -- rank-table link: the checks that need no peer ---------------------------------------------------
@pytest.fixture
def rendezvous_dir(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> str:
    import os
    import pathlib
    assert isinstance(tmp_path, pathlib.Path)
    path = tmp_path / "rv"
    os.mkdir(path, 0o700)
    monkeypatch.setenv("KVDD_SIM_RENDEZVOUS_DIR", str(path))
    return str(path)


def test_rank_link_checks_and_comm_ids(rendezvous_dir: str) -> None:
    # §7.5 item 10 (native part): own id absent -> PARAM_INVALID; ids 1 then 2; unknown id ->
    # NOT_YET_LINK for query and unlink
    with engine(1, options()):
        assert links.link("c", [(2, 0), (3, 1)], rank_table()) == (PARAM_INVALID, 0)
        # the native name checks (the Python layer checks first; the engine checks again)
        assert links.link("", [(1, 0), (2, 1)], rank_table()) == (PARAM_INVALID, 0)
        assert links.link("n" * 128, [(1, 0), (2, 1)], rank_table()) == (PARAM_INVALID, 0)
        assert links.link("\u00e9" * 64, [(1, 0), (2, 1)], rank_table()) == (PARAM_INVALID, 0)
        assert links.link("c", [(1, 0), (2, 1)], "not json") == (LINK_FAILED, 0)
        assert links.link("c", [(1, 0), (2, 1)], "[]") == (LINK_FAILED, 0)
        assert links.link("c", [(1, 0), (2, 2)], rank_table()) == (LINK_FAILED, 0)  # no rank 2
        assert links.link("c" * 127, [(1, 0), (2, 1)], rank_table()) == (S_OK, 1)
        assert links.link("d", [(1, 0), (3, 1)], rank_table()) == (S_OK, 2)
        assert links.query_register_mem_status(1) == (S_OK, PREPARING)
        assert links.query_register_mem_status(3) == (NOT_YET_LINK, 0)
        assert links.unlink(3) == NOT_YET_LINK
        assert links.unlink(1) == S_OK
        assert links.query_register_mem_status(1) == (NOT_YET_LINK, 0)
        assert links.unlink(1) == NOT_YET_LINK
        assert links.query_register_mem_status(2) == (S_OK, PREPARING)
    with engine(1, options()):  # a fresh engine numbers from 1 again
        assert links.link("c", [(1, 0), (2, 1)], rank_table()) == (S_OK, 1)


def test_preparing_ends_failed_after_the_link_total_time(rendezvous_dir: str) -> None:
    with engine(1, options(llm_LinkTotalTime="1")):
        t0 = time.monotonic()
        assert links.link("alone", [(1, 0), (2, 1)], rank_table()) == (S_OK, 1)
        engine_ = lifecycle.current()
        assert engine_ is not None and engine_.link_pending(2) and not engine_.link_pending(3)
        while links.query_register_mem_status(1) == (S_OK, PREPARING):
            assert time.monotonic() - t0 < 15.0
            time.sleep(0.02)
        assert 0.9 < time.monotonic() - t0 < 10.0
        assert links.query_register_mem_status(1) == (S_OK, FAILED_STATE)  # sticky
        assert not engine_.link_pending(2)


def test_rank_link_on_hixl_is_not_enabled(rendezvous_dir: str) -> None:
    with engine(1, options(port=free_port(), llm_TransferBackend="hixl")):
        assert links.link("c", [(1, 0), (2, 1)], rank_table()) == (FEATURE_NOT_ENABLED, 0)
        assert links.query_register_mem_status(1) == (FEATURE_NOT_ENABLED, 0)
        assert links.unlink(1) == FEATURE_NOT_ENABLED


# -- fault injection reaches the link calls (kvdd.sim.faults) -----------------------------------------
def test_injected_faults_reach_rank_table_calls(rendezvous_dir: str) -> None:
    from kvdd.sim import faults
    link_busy, timeout, unlink_failed = 0x5010B01B, 0x5010B01A, 0x5010B00A
    with engine(1, options()):
        with faults.inject("link", status=link_busy, count=1):
            assert links.link("c", [(1, 0), (2, 1)], rank_table()) == (link_busy, 0)
            assert "LINK_BUSY" in (lifecycle.last_error_detail() or "")
            assert links.link("c", [(1, 0), (2, 1)], rank_table()) == (S_OK, 1)  # id not consumed
        with faults.inject("query_register_mem_status", status=timeout, count=1, peer=2):
            assert links.query_register_mem_status(1) == (timeout, 0)
            assert links.query_register_mem_status(1) == (S_OK, PREPARING)
        with faults.inject("unlink", status=unlink_failed, count=1):
            assert links.unlink(1) == unlink_failed
            assert links.query_register_mem_status(1) == (S_OK, PREPARING)  # kept: retry works
            assert links.unlink(1) == S_OK
        with faults.inject("link", status=link_busy, peer=3):  # another peer: not this domain
            assert links.link("c", [(1, 0), (2, 1)], rank_table()) == (S_OK, 2)


def test_injected_faults_reach_link_clusters() -> None:
    from kvdd.sim import faults
    processing, not_yet = 0x5010B00D, NOT_YET_LINK
    with engine(2, options("Decoder")):
        with faults.inject("link", status=processing, count=1, peer=1):
            assert links.link_clusters_v2([cluster(1, free_port())], 1000) == (processing, [processing])
        with faults.inject("unlink", status=not_yet, count=1):
            assert links.unlink_clusters_v2([(1, 0, [], [])], 1000, True) == (not_yet, [not_yet])
        engine_ = lifecycle.current()
        assert engine_ is not None and not engine_.instance.entities


@pytest.mark.parametrize("value, seconds", [(None, 30), ("0", 30), ("1", 1), ("1080", 1080)])
def test_link_total_time_in_seconds_30_when_0(value: str | None, seconds: int) -> None:
    opts = options() if value is None else options(llm_LinkTotalTime=value)
    assert _init(opts) == S_OK
    engine_ = lifecycle.current_engine()
    assert engine_ is not None and engine_.link_total_s == seconds


def test_a_member_without_listen_address_is_reachable_until_finalize(rendezvous_dir: str) -> None:
    # the rank-table link starts a fabric listener on demand and publishes it (0600, ours);
    # finalize stops it and withdraws the entry
    import json
    import os
    import stat
    with engine(1, options()):
        engine_ = lifecycle.current()
        assert engine_ is not None and engine_.instance.listen_port is None
        assert links.link("c", [(1, 0), (2, 1)], rank_table()) == (S_OK, 1)
        (name,) = os.listdir(rendezvous_dir)
        path = os.path.join(rendezvous_dir, name)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with open(path) as f:
            entry = json.load(f)
        assert entry["cluster_id"] == 1 and entry["comm_name"] == "c" and entry["ip"] == "127.0.0.1"
        assert listening(entry["port"])
    assert not listening(entry["port"])
    assert os.listdir(rendezvous_dir) == []
