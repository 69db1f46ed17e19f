"""LLMDataDist's Python layer over a recording engine (PYPKG.md §2.2, §3; checklist §7.5 items
4-6, 8, 9, 10 and 12 (Python checks)): what is derived and sent, and that every Python-level
error happens before any engine call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pkg_fake import CM_OPTIONS, PARAM_INVALID, RecordingWrapper, fake, started

from kvdd.llm_datadist import (
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    RegisterMemStatus,
)
from kvdd.llm_datadist.v2 import llm_datadist as dd_module

__all__ = ["fake"]

PI = LLMStatusCode.LLM_PARAM_INVALID


def init_error(fake: RecordingWrapper, options: dict[str, str], exc_type: type[BaseException] = LLMException,
               role: LLMRole = LLMRole.DECODER) -> BaseException:
    dd = LLMDataDist(role, 2)
    with pytest.raises(exc_type) as exc:
        dd.init(options)
    assert "initialize_v2" not in fake.names()
    assert LLMDataDist.llm_engine_instance is None
    return exc.value


def sent_options(fake: RecordingWrapper) -> dict[str, str]:
    options: dict[str, str] = fake.last("initialize_v2")[1]
    return options


def test_constructor_checks() -> None:
    with pytest.raises(TypeError):
        LLMDataDist(1, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, -1)
    with pytest.raises(ValueError):
        LLMDataDist(LLMRole.PROMPT, 2**64)
    with pytest.raises(TypeError):
        LLMDataDist(LLMRole.PROMPT, "1")  # type: ignore[arg-type]
    assert LLMDataDist(LLMRole.PROMPT, 2**64 - 1).cluster_id == 2**64 - 1


def test_role_none_fails_in_init_with_key_error(fake: RecordingWrapper) -> None:
    init_error(fake, dict(CM_OPTIONS), KeyError, role=None)  # type: ignore[arg-type]


def test_init_derives_role_and_listen_address(fake: RecordingWrapper) -> None:
    options = {**CM_OPTIONS, "llm.Role": "Mix", "llm.listenIpInfo": "1.2.3.4:026000"}
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    dd.init(options)
    assert fake.last("initialize_v2")[0] == 7
    assert sent_options(fake) == {**options, "llm.Role": "Prompt", "llm.ListenIp": "1.2.3.4",
                                  "llm.ListenPort": "26000"}
    assert options == {**CM_OPTIONS, "llm.Role": "Mix", "llm.listenIpInfo": "1.2.3.4:026000"}  # caller's untouched
    assert LLMDataDist.llm_engine_instance is dd


@pytest.mark.parametrize("role, name", [(LLMRole.PROMPT, "Prompt"), (LLMRole.DECODER, "Decoder"),
                                        (LLMRole.MIX, "Mix")])
def test_role_names(fake: RecordingWrapper, role: LLMRole, name: str) -> None:
    started(role=role)
    assert sent_options(fake)["llm.Role"] == name


def test_listen_ip_info_errors(fake: RecordingWrapper) -> None:
    exc = init_error(fake, {**CM_OPTIONS, "llm.listenIpInfo": "1.2.3.4"})
    assert isinstance(exc, LLMException) and exc.status_code is PI
    exc = init_error(fake, {**CM_OPTIONS, "llm.listenIpInfo": "::1:26000"})
    assert isinstance(exc, LLMException) and exc.status_code is PI  # IPv6 literals cannot pass
    init_error(fake, {**CM_OPTIONS, "llm.listenIpInfo": "1.2.3.4:x"}, ValueError)


def test_local_comm_res_implies_cache_manager_and_remote_accessible(fake: RecordingWrapper) -> None:
    started({"llm.LocalCommRes": ""})
    opts = sent_options(fake)
    assert opts["llm.EnableCacheManager"] == "1" and opts["llm.EnableRemoteCacheAccessible"] == "1"


def test_local_comm_res_keeps_callers_values(fake: RecordingWrapper) -> None:
    exc = init_error(fake, {"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"})
    assert isinstance(exc, LLMException) and exc.status_code is PI
    started({"llm.LocalCommRes": "", "llm.EnableRemoteCacheAccessible": "0"})
    assert sent_options(fake)["llm.EnableRemoteCacheAccessible"] == "0"


def test_transfer_backend_rules(fake: RecordingWrapper) -> None:
    for options in ({**CM_OPTIONS, "llm.TransferBackend": "hixl"},
                    {**CM_OPTIONS, "llm.TransferBackend": "hixl", "llm.EnableRemoteCacheAccessible": "0",
                     "llm.listenIpInfo": "1.2.3.4:1"},
                    {"llm.EnableCacheManager": "0", "llm.TransferBackend": "hixl", "llm.listenIpInfo": "1.2.3.4:1"}):
        exc = init_error(fake, options)
        assert isinstance(exc, LLMException) and exc.status_code is PI
    started({"llm.EnableCacheManager": "1", "llm.TransferBackend": "foo", "llm.listenIpInfo": "1.2.3.4:1"})
    opts = sent_options(fake)
    assert opts["llm.EnableRemoteCacheAccessible"] == "1" and opts["llm.TransferBackend"] == "foo"


def test_flow_graph_mem_max_size(fake: RecordingWrapper) -> None:
    init_error(fake, {**CM_OPTIONS, "ge.flowGraphMemMaxSize": 5}, TypeError)  # type: ignore[dict-item]
    for bad in ("1,2", "12a", ""):
        exc = init_error(fake, {**CM_OPTIONS, "ge.flowGraphMemMaxSize": bad})
        assert isinstance(exc, LLMException) and exc.status_code is PI
    started({**CM_OPTIONS, "ge.flowGraphMemMaxSize": "1024"})


def test_options_must_be_a_dict(fake: RecordingWrapper) -> None:
    init_error(fake, [("llm.EnableCacheManager", "1")], TypeError)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [{}, {"llm.EnableCacheManager": "0"}, {"llm.EnableCacheManager": "true"}])
def test_legacy_mode_names_the_legacy_package(fake: RecordingWrapper, options: dict[str, str]) -> None:
    exc = init_error(fake, options, ModuleNotFoundError)
    assert isinstance(exc, ModuleNotFoundError) and exc.name == "llm_datadist_v1"


def test_engine_failure_raises_its_code_with_the_original_options(fake: RecordingWrapper) -> None:
    fake.status["initialize_v2"] = PARAM_INVALID
    fake.detail = "ge.exec.deviceId must be one int32"
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as exc:
        dd.init({**CM_OPTIONS, "ge.exec.deviceId": "0;1"})
    assert exc.value.status_code is PI
    assert "'ge.exec.deviceId': '0;1'" in str(exc.value) and "must be one int32" in str(exc.value)
    assert "llm.Role" not in str(exc.value)
    assert LLMDataDist.llm_engine_instance is None
    fake.status["initialize_v2"] = 123  # unknown raw code
    with pytest.raises(LLMException) as exc:
        dd.init(dict(CM_OPTIONS))
    assert exc.value.status_code is LLMStatusCode.LLM_FAILED
    del fake.status["initialize_v2"]
    dd.init(dict(CM_OPTIONS))  # init may be retried after a failure
    assert LLMDataDist.llm_engine_instance is dd


def test_one_engine_per_process(fake: RecordingWrapper) -> None:
    first = started()
    first.init({"anything": "ignored"})  # same object: silent no-op
    assert fake.names().count("initialize_v2") == 1
    second = LLMDataDist(LLMRole.PROMPT, 9)
    with pytest.raises(LLMException) as exc:
        second.init(dict(CM_OPTIONS))
    assert exc.value.status_code is LLMStatusCode.LLM_FAILED
    assert fake.names().count("initialize_v2") == 1
    first.finalize()
    assert fake.names()[-1] == "finalize_v2" and LLMDataDist.llm_engine_instance is None
    first.finalize()  # no-op
    assert fake.names().count("finalize_v2") == 1
    second.init(dict(CM_OPTIONS))
    assert LLMDataDist.llm_engine_instance is second


def test_finalize_marks_the_cache_manager_and_reinit_makes_a_new_one(fake: RecordingWrapper) -> None:
    dd = started()
    cm = dd.cache_manager
    assert dd.cache_manager is cm
    dd.finalize()
    assert cm._initialized is False
    with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
        dd.cache_manager
    dd.init(dict(CM_OPTIONS))
    assert dd.cache_manager is not cm


def calls_before_init(dd: LLMDataDist) -> list[Any]:
    info = LLMClusterInfo()
    return [lambda: dd.link("c", {1: 0, 2: 1}, "{}"), lambda: dd.unlink(1),
            lambda: dd.query_register_mem_status(1), lambda: dd.link_clusters([info]),
            lambda: dd.unlink_clusters([info]), lambda: dd.switch_role(LLMRole.PROMPT),
            lambda: dd.cache_manager, lambda: dd.kv_cache_manager, lambda: dd.check_link_status(1)]


def test_every_method_before_init_is_runtime_error(fake: RecordingWrapper) -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    for call in calls_before_init(dd):
        with pytest.raises(RuntimeError) as exc:
            call()
        assert not isinstance(exc.value, LLMException)
        assert str(exc.value) == "llm datadist is not initialized"
    assert dd.cluster_id == 1
    assert fake.calls == []


def test_legacy_only_members_in_cache_manager_mode(fake: RecordingWrapper) -> None:
    dd = started()
    for call in (lambda: dd.kv_cache_manager, lambda: dd.check_link_status(1)):
        with pytest.raises(LLMException) as exc:
            call()
        assert exc.value.status_code is PI


def link_error(dd: LLMDataDist, fake: RecordingWrapper, *args: Any) -> BaseException:
    before = len(fake.calls)
    with pytest.raises((TypeError, ValueError, LLMException)) as exc:
        dd.link(*args)
    assert len(fake.calls) == before
    return exc.value


def test_link_python_checks_in_order(fake: RecordingWrapper) -> None:
    dd = started()
    ok = {1: 0, 2: 1}
    for args, expected in [
        ((None, ok, "rt"), TypeError), (("", ok, "rt"), PI), (("x" * 128, ok, "rt"), PI),
        (("c", [(1, 0)], "rt"), TypeError), (("c", {1: "0"}, "rt"), TypeError),
        (("c", {i: i for i in range(5)}, "rt"), PI), (("c", {-1: 0, 2: 1}, "rt"), ValueError),
        (("c", {1: 0, 2: 2**32}, "rt"), ValueError), (("c", ok, None), TypeError),
        (("c", {1: 0}, "rt"), PI), (("c", {1: 1, 2: 0}, "rt"), PI),
        # order: the name is checked before the dict, the size before the ranges; a None
        # rank_table passes the type check and fails after the count and order rules
        (("", {1: "x"}, None), PI), (("c", {i: -i for i in range(5)}, "rt"), PI),
        (("c", {1: 0}, None), PI),
    ]:
        exc = link_error(dd, fake, *args)
        if isinstance(expected, LLMStatusCode):
            assert isinstance(exc, LLMException) and exc.status_code is expected, args
        else:
            assert type(exc) is expected, args


def test_link_sends_pairs_in_order_and_marks_the_cache_manager(fake: RecordingWrapper) -> None:
    dd = started()
    assert dd.link("x" * 127, {5: 0, 2: 1, 9: 3, 4: 7}, "{rt}") == 1
    assert fake.last("link") == ("x" * 127, [(5, 0), (2, 1), (9, 3), (4, 7)], "{rt}")
    assert dd.cache_manager._is_call_linked
    assert dd.link("d", {1: 0, 2: 1}, "{}") == 2


def test_link_failure_raises_and_does_not_mark(fake: RecordingWrapper) -> None:
    dd = started()
    fake.status["link"] = 0x5010B009
    with pytest.raises(LLMException) as exc:
        dd.link("c", {1: 0, 2: 1}, "{}")
    assert exc.value.status_code is LLMStatusCode.LLM_LINK_FAILED
    assert not dd.cache_manager._is_call_linked


def test_unlink_and_query(fake: RecordingWrapper) -> None:
    dd = started()
    for call in (dd.unlink, dd.query_register_mem_status):
        with pytest.raises(TypeError):
            call("1")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            call(-1)
    assert fake.names() == ["initialize_v2"]
    for raw, expected in ((0, RegisterMemStatus.OK), (1, RegisterMemStatus.PREPARING),
                          (2, RegisterMemStatus.FAILED), (3, RegisterMemStatus.FAILED)):
        fake.mem_status = raw
        assert dd.query_register_mem_status(comm_id=4) is expected
    assert fake.last("query_register_mem_status") == (4,)
    fake.status["query_register_mem_status"] = fake.status["unlink"] = 0x5010B007
    for call in (dd.unlink, dd.query_register_mem_status):
        with pytest.raises(LLMException) as exc:
            call(9)
        assert exc.value.status_code is LLMStatusCode.LLM_NOT_YET_LINK


def cluster(remote: int | None = 1, local: bool = True, remote_ip: bool = True) -> LLMClusterInfo:
    info = LLMClusterInfo()
    if remote is not None:
        info.remote_cluster_id = remote
    info.remote_role_type = LLMRole.PROMPT
    if local:
        info.append_local_ip_info("10.0.0.2", 0)
    if remote_ip:
        info.append_remote_ip_info("10.0.0.1", 26000)
    return info


def test_link_clusters_python_checks(fake: RecordingWrapper) -> None:
    dd = started()
    for args, expected in [(([cluster()], 0), PI), (([cluster()], -5), PI), (([cluster()], 2**31), ValueError),
                           (([cluster()], "1"), TypeError), ((cluster(), 100), TypeError),
                           (([cluster(), "x"], 100), TypeError), (([cluster(local=False)], 100), PI),
                           (([cluster(remote=None)], 100), TypeError), (("x", 0), PI)]:
        with pytest.raises((TypeError, ValueError, LLMException)) as exc:
            dd.link_clusters(*args)  # type: ignore[arg-type]
        if isinstance(expected, LLMStatusCode):
            assert isinstance(exc.value, LLMException) and exc.value.status_code is expected, args
        else:
            assert type(exc.value) is expected, args
    with pytest.raises(TypeError):
        dd.unlink_clusters([cluster()], 100, force=1)  # type: ignore[arg-type]
    assert fake.names() == ["initialize_v2"]


def test_link_clusters_sends_tuples_and_returns_statuses(fake: RecordingWrapper) -> None:
    dd = started()
    fake.status["link_clusters_v2"] = 0x5010B009
    fake.rets = [0, 0x5010B009, 77]
    ret = dd.link_clusters((cluster(1), cluster(2), cluster(3)), timeout=2**31 - 1)
    assert ret == (LLMStatusCode.LLM_LINK_FAILED,
                   [LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_FAILED])
    local, remote = [(0x0200000A, 0)], [(0x0100000A, 26000)]
    assert fake.last("link_clusters_v2") == ([(1, 0, local, remote), (2, 0, local, remote), (3, 0, local, remote)],
                                             2**31 - 1)
    assert not dd.cache_manager._is_call_linked  # only link() sets it
    fake.status["link_clusters_v2"], fake.rets = PARAM_INVALID, []
    assert dd.link_clusters([]) == (PI, [])


def test_link_clusters_local_ip_needed_only_without_non_empty_local_comm_res(fake: RecordingWrapper) -> None:
    dd = started({"llm.LocalCommRes": ""})
    with pytest.raises(LLMException):
        dd.link_clusters([cluster(local=False)])
    dd.finalize()
    dd = started({"llm.LocalCommRes": '{"rank_table": 1}'})
    dd.link_clusters([cluster(local=False)])
    assert fake.last("link_clusters_v2")[0] == [(1, 0, [], [(0x0100000A, 26000)])]


def test_unlink_clusters_sends_an_empty_local_list(fake: RecordingWrapper) -> None:
    dd = started()
    fake.rets = [0]
    assert dd.unlink_clusters([cluster(4, local=True)], 500, force=True) == (LLMStatusCode.LLM_SUCCESS,
                                                                             [LLMStatusCode.LLM_SUCCESS])
    assert fake.last("unlink_clusters_v2") == ([(4, 0, [], [(0x0100000A, 26000)])], 500, True)
    dd.unlink_clusters([cluster(5, local=False, remote_ip=False)])
    assert fake.last("unlink_clusters_v2") == ([(5, 0, [], [])], 3000, False)
    with pytest.raises(TypeError):
        dd.unlink_clusters([cluster(remote=None)])


def test_switch_role(fake: RecordingWrapper) -> None:
    dd = started(role=LLMRole.DECODER)
    with pytest.raises(TypeError):
        dd.switch_role(2)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dd.switch_role(LLMRole.PROMPT, [("a", "b")])  # type: ignore[arg-type]
    with pytest.raises(LLMException) as exc:
        dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "1.2.3.4"})
    assert exc.value.status_code is PI
    with pytest.raises(ValueError):
        dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "1.2.3.4:p"})
    assert fake.names() == ["initialize_v2"]
    dd.switch_role(LLMRole.DECODER)  # no same-role check
    assert fake.last("switch_role_v2") == ("Decoder", {})
    opts = {"llm.listenIpInfo": "1.2.3.4:26001"}
    dd.switch_role(LLMRole.PROMPT, opts)
    assert fake.last("switch_role_v2") == ("Prompt", {**opts, "llm.ListenIp": "1.2.3.4", "llm.ListenPort": "26001"})
    assert opts == {"llm.listenIpInfo": "1.2.3.4:26001"}
    assert dd._role is LLMRole.PROMPT
    fake.status["switch_role_v2"] = 0x5010B018
    with pytest.raises(LLMException) as exc:
        dd.switch_role(LLMRole.MIX)
    assert exc.value.status_code is LLMStatusCode.LLM_EXIST_LINK
    assert dd._role is LLMRole.PROMPT


def test_atexit_hook_finalizes_and_swallows_llm_exception(fake: RecordingWrapper,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    dd = started()
    dd_module._shutdown_handler()
    assert fake.names()[-1] == "finalize_v2" and LLMDataDist.llm_engine_instance is None
    dd.init(dict(CM_OPTIONS))

    def failing() -> None:
        raise LLMException("boom", status_code=LLMStatusCode.LLM_FAILED)

    monkeypatch.setattr(dd, "finalize", failing)
    dd_module._shutdown_handler()  # swallowed
    monkeypatch.undo()



def test_cache_manager_only_members_refuse_an_instance_in_legacy_mode(fake: RecordingWrapper) -> None:
    """kvdd cannot initialize legacy mode (no llm_datadist_v1); an instance flagged as legacy shows
    the mode guards of PYPKG.md §3.6-§3.7: the cache-manager members raise LLM_PARAM_INVALID
    before any engine call."""
    dd = started()
    dd._enable_cache_mgr = False
    calls: list[Callable[[], object]] = [lambda: dd.cache_manager, lambda: dd.link("c", {2: 0, 3: 1}, "{}"),
                                         lambda: dd.unlink(1), lambda: dd.query_register_mem_status(1)]
    for call in calls:
        with pytest.raises(LLMException) as exc:
            call()
        assert exc.value.status_code is PI
    with pytest.raises(ModuleNotFoundError, match="llm_datadist_v1"):
        dd.kv_cache_manager
    assert fake.names() == ["initialize_v2"]
    dd._enable_cache_mgr = True


def test_packed_int_ips_must_fit_the_engines_uint32(fake: RecordingWrapper) -> None:
    dd = started()
    for bad in (-1, 2**32):
        info = cluster()
        info.append_remote_ip_info(bad, 1)
        with pytest.raises(TypeError):
            dd.link_clusters([info])
        with pytest.raises(TypeError):
            dd.unlink_clusters([info])
    info = cluster(local=False)
    info.append_local_ip_info(2**32 - 1, 1)
    dd.link_clusters([info])
    assert fake.last("link_clusters_v2")[0][0][2] == [(2**32 - 1, 1)]
    assert fake.names() == ["initialize_v2", "link_clusters_v2"]


def test_role_names_and_shutdown_handler_without_an_instance() -> None:
    assert [LLMDataDist._role_to_str(r) for r in LLMRole] == ["Prompt", "Decoder", "Mix"]
    assert LLMDataDist.llm_engine_instance is None
    dd_module._shutdown_handler()  # nothing to do


def test_shutdown_handler_swallows_llm_exception_of_any_instance() -> None:
    from unittest import mock

    instance = mock.Mock()
    instance.finalize.side_effect = LLMException("boom", status_code=LLMStatusCode.LLM_FAILED)
    with mock.patch.object(LLMDataDist, "llm_engine_instance", instance):
        dd_module._shutdown_handler()
    instance.finalize.assert_called_once_with()


def test_option_errors_name_the_keys(fake: RecordingWrapper) -> None:
    for options, key in (({"llm.TransferBackend": "hixl", "llm.listenIpInfo": "1.2.3.4:1"}, "EnableCacheManager"),
                         ({"llm.EnableCacheManager": "1", "llm.TransferBackend": "hixl"}, "listenIpInfo"),
                         ({"llm.EnableCacheManager": "1", "llm.TransferBackend": "hixl",
                           "llm.EnableRemoteCacheAccessible": "0", "llm.listenIpInfo": "1.2.3.4:1"},
                          "EnableRemoteCacheAccessible")):
        assert key in str(init_error(fake, options))


def test_state_set_by_hand_reaches_the_python_checks_without_an_engine() -> None:
    """Upstream-style tests build an instance's state by hand (PYPKG.md §3.0 names it)."""
    dd = LLMDataDist(LLMRole.MIX, 100)
    dd._is_initialized = True
    dd._enable_cache_mgr = True
    dd._enable_local_comm_res = False
    dd._engine_options = {}
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    with pytest.raises(LLMException, match="local_ip_info_list is empty") as exc:
        dd.link_clusters([info], 5000)
    assert exc.value.status_code is PI


def test_legacy_mode_python_rules_then_the_missing_package(fake: RecordingWrapper) -> None:
    dd = started(role=LLMRole.MIX)
    dd._enable_cache_mgr = False
    with pytest.raises(LLMException) as exc:
        dd.switch_role(LLMRole.MIX)  # must change
    assert exc.value.status_code is PI
    with pytest.raises(LLMException) as exc:
        dd.switch_role(LLMRole.PROMPT, {})  # PROMPT needs a listen address
    assert exc.value.status_code is PI
    for call in (lambda: dd.switch_role(LLMRole.DECODER), lambda: dd.link_clusters([cluster()]),
                 lambda: dd.unlink_clusters([cluster()]), lambda: dd.check_link_status(1),
                 lambda: dd.kv_cache_manager):
        with pytest.raises(ModuleNotFoundError, match="llm_datadist_v1"):
            call()
    dd._kv_cache_manager = manager = object()
    assert dd.kv_cache_manager is manager
    assert fake.names() == ["initialize_v2"]
    dd._enable_cache_mgr = True


def test_the_engine_name_can_be_replaced_by_a_double(monkeypatch: pytest.MonkeyPatch) -> None:
    """As upstream's tests patch llm_datadist.v2.llm_datadist.llm_datadist_wrapper."""
    from unittest import mock

    backend = mock.Mock()
    backend.initialize_v2.return_value = 0
    backend.register_cache.return_value = (PARAM_INVALID, (-1, []))
    monkeypatch.setattr(dd_module, "llm_datadist_wrapper", backend)
    monkeypatch.setattr(LLMDataDist, "llm_engine_instance", None)
    dd = LLMDataDist(LLMRole.PROMPT, 0)
    dd.init({"llm.EnableCacheManager": "1"})
    assert backend.initialize_v2.call_args.args == (0, {"llm.EnableCacheManager": "1", "llm.Role": "Prompt"})
    from kvdd.llm_datadist import CacheDesc, DataType

    with pytest.raises(LLMException) as exc:  # a double without a usable last_error_detail
        dd.cache_manager.register_cache(CacheDesc(1, [2], DataType.DT_INT8), [4096])
    assert exc.value.status_code is PI
    assert str(exc.value) == ("register_cache failed, error code is LLMStatusCode.LLM_PARAM_INVALID, "
                              f"cache_desc={CacheDesc(1, [2], DataType.DT_INT8)!r}.")
    dd.finalize()
    backend.finalize_v2.assert_called_once_with()
