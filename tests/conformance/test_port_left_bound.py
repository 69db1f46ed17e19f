"""An Initialize that fails after its listener started keeps the port: SEMANTICS.md §3.2 step 10.

The transfer engine starts listening (step 8) before the DataCacheEngine parses
``llm.SyncKvCacheWaitTime`` (step 9); the failure cleanup skips the transfer engine, so the port
stays bound by the failed instance until it is initialized again (step 6 replaces the engine) or
destroyed; Finalize of an uninitialized instance does nothing.  Another instance's Initialize on
that port gets LLM_FAILED (its bind fails)."""

from __future__ import annotations

import gc

import kvdd
from kvdd import OPTION_LISTEN_IP_INFO, OPTION_SYNC_CACHE_WAIT_TIME, OPTION_TRANSFER_BACKEND

from .harness import FAILED, LOCALHOST, PARAM_INVALID, World, free_port, raises
from .init_helpers import DEV, assert_initialized, assert_uninitialized, is_listening

BAD_WAIT = {OPTION_SYNC_CACHE_WAIT_TIME: "abc"}  # step 9: PARAM_INVALID


def _opts(port: int, transfer: str, **extra: str) -> dict[str, str]:
    opts = {**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}", **extra}
    if transfer == "hixl":
        opts[OPTION_TRANSFER_BACKEND] = "hixl"
    return opts


def test_failed_initialize_keeps_its_port_until_initialized_again(world: World,
                                                                  transfer: str) -> None:
    port = free_port()
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw(_opts(port, transfer, **BAD_WAIT))
    assert_uninitialized(d)
    assert d.listen_port is None
    assert is_listening(port)  # still bound by the failed instance
    other = world.peer()
    with raises(FAILED):  # its bind fails
        other.initialize_raw(_opts(port, transfer))
    d.finalize()  # Finalize of an uninitialized instance does nothing (§3.3)
    assert is_listening(port)
    with raises(FAILED):
        other.initialize_raw(_opts(port, transfer))
    # Initialized again, on the same port: the old engine is replaced before the new one binds.
    d.initialize_raw(_opts(port, transfer))
    assert_initialized(d)
    d.finalize()
    assert not is_listening(port)
    other.initialize_raw(_opts(port, transfer))  # free now
    assert other.listen_port == port


def test_a_retry_that_fails_before_the_engine_keeps_the_port(world: World) -> None:
    # Steps 3-4 (llm.DeviceId, llm.ListenIpInfo) fail before DoInitialize replaces the engine:
    # the port stays bound; a retry that reaches step 6 frees it, whatever fails later.
    port, other_port = free_port(), free_port()
    d = world.dut()
    with raises(PARAM_INVALID):
        d.initialize_raw(_opts(port, "comm", **BAD_WAIT))
    with raises(PARAM_INVALID):
        d.initialize_raw({kvdd.OPTION_DEVICE_ID: "x", OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{other_port}"})
    with raises(PARAM_INVALID):
        d.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}"})
    assert is_listening(port)
    with raises(PARAM_INVALID):  # step 6: an invalid transfer backend, after the engine went
        d.initialize_raw({**DEV, OPTION_TRANSFER_BACKEND: "rdma"})
    assert not is_listening(port)
    assert_uninitialized(d)


def test_a_failure_before_listening_binds_nothing(world: World) -> None:
    port = free_port()
    d = world.dut()
    with raises(PARAM_INVALID):  # step 8 comm option: parsed before the daemon starts
        d.initialize_raw(_opts(port, "comm", **{"llm.LinkRetryCount": "0"}))
    assert not is_listening(port)


def test_destroying_the_failed_instance_frees_its_port(backend: str, world: World) -> None:
    port = free_port()
    dd = kvdd.LlmDataDist(7, kvdd.LlmRole.DECODER, backend=backend)
    try:
        dd.initialize(_opts(port, "comm", **BAD_WAIT))
    except kvdd.LLMParamInvalidError:
        pass
    else:
        raise AssertionError("Initialize with an invalid llm.SyncKvCacheWaitTime succeeded")
    assert is_listening(port)
    dd.finalize()
    assert is_listening(port)
    del dd
    gc.collect()  # the destructor (§3.1): the port closes at once
    assert not is_listening(port)
    other = world.peer()
    other.initialize_raw(_opts(port, "comm"))
    assert other.listen_port == port
