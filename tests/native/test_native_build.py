"""The native build identifies itself correctly (build config, doctor data, backend selection)."""

from __future__ import annotations

import os

import pytest

import kvdd
import kvdd.backend
from .native_support import NATIVE_TEST_DOUBLE, build_config, skip_unless_native

skip_unless_native()

from kvdd._native import _datadist  # noqa: E402  (after the module-level skip)


def test_build_config_records_the_native_build() -> None:
    cfg = build_config()
    assert cfg is not None
    assert cfg.NATIVE_BUILT is True
    assert cfg.ASCEND_HOME != ""
    assert cfg.ASCEND_HOME in cfg.NATIVE_REASON
    assert ("test double" in cfg.NATIVE_REASON) == cfg.NATIVE_TEST_DOUBLE
    assert cfg.CXX11_ABI in ("0", "1")


def test_available_backends_include_native() -> None:
    assert "native" in kvdd.available_backends()
    assert kvdd.backend.backend_problem("native") is None


def test_native_backend_implements_the_protocol() -> None:
    nb = _datadist.NativeBackend(1, kvdd.LlmRole.PROMPT)
    assert isinstance(nb, kvdd.backend.Backend)
    assert nb.listen_port is None


def test_header_constants_match_kvdd() -> None:
    constants = _datadist.header_constants()
    for name in ("OPTION_LISTEN_IP_INFO", "OPTION_DEVICE_ID", "OPTION_SYNC_CACHE_WAIT_TIME",
                 "OPTION_BUF_POOL_CFG", "OPTION_ENABLE_SET_ROLE", "OPTION_LOCAL_COMM_RES",
                 "OPTION_TRANSFER_BACKEND", "OPTION_GLOBAL_RESOURCE_CONFIG"):
        assert constants[name] == getattr(kvdd, name), name
    # Values from API.md, not from kvdd.Status (the enum under comparison).
    assert constants["LLM_SUCCESS"] == 0 == int(kvdd.Status.LLM_SUCCESS)
    assert constants["LLM_FAILED"] == 0xFFFFFFFF == int(kvdd.Status.LLM_FAILED)


def test_build_info_matches_the_build_config() -> None:
    cfg = build_config()
    assert cfg is not None
    info = _datadist.build_info()
    assert info["cxx11_abi"] == int(cfg.CXX11_ABI)
    assert info["test_double"] is cfg.NATIVE_TEST_DOUBLE
    library = info["library"]
    assert isinstance(library, str) and library.endswith("libllm_datadist.so")
    if cfg.NATIVE_TEST_DOUBLE:
        # The double was compiled with the same _GLIBCXX_USE_CXX11_ABI as the binding, and the
        # library loaded is the one of the fake root the build used.
        assert info["test_double_cxx11_abi"] == int(cfg.CXX11_ABI)
        assert os.path.realpath(library).startswith(os.path.realpath(cfg.ASCEND_HOME))
    else:
        assert info["test_double_cxx11_abi"] is None


@pytest.mark.skipif(not NATIVE_TEST_DOUBLE, reason="only a test-double build")
def test_backend_none_never_picks_the_test_double(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVDD_BACKEND", raising=False)
    monkeypatch.setattr(kvdd.backend, "looks_like_ascend_node", lambda: False)
    assert kvdd.backend.resolve_backend_name(None) == "sim"
    # On something that looks like an Ascend node the test double is not a usable native backend.
    monkeypatch.setattr(kvdd.backend, "looks_like_ascend_node", lambda: True)
    with pytest.raises(kvdd.BackendUnavailableError, match="test double"):
        kvdd.backend.resolve_backend_name(None)
    # Asked for by name it is used.
    assert kvdd.backend.resolve_backend_name("native") == "native"
    with kvdd.LlmDataDist(5, kvdd.LlmRole.MIX, backend="native") as dd:
        assert dd.backend_name == "native"
