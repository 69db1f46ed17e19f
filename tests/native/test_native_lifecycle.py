"""NativeBackend beyond marshalling: C++ exceptions, kept-alive memory owners, listen_port,
concurrent finalize, and one transfer through the whole chain (facade -> binding -> library).

Runs against kvdd's CI test double.  Test-double-only hooks used here (never in the real library):
with ``KVDD_TESTDOUBLE_THROW_HOOK=1`` in the environment (set by this module's fixture; the
simulated root ships the hook disarmed), instances constructed with cluster id ``2**64 - 256`` /
``- 255`` / ``- 254`` throw ``std::runtime_error`` / ``std::bad_alloc`` / a
non-``std::exception`` from every method except the constructor, the destructor and
``Finalize``; a Python exception raised by the engine comes back as ``std::runtime_error``.
"""

from __future__ import annotations

import gc
import pickle
import socket
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvdd
from kvdd import (
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    DataType,
    IpInfo,
    KvCacheExtParam,
    LLMError,
    RegisterCfg,
    Status,
    tensor_addrs,
)
from .native_support import skip_unless_test_double

skip_unless_test_double()

from kvdd._native._datadist import NativeBackend  # noqa: E402

THROW_RUNTIME_ERROR = 2**64 - 256
THROW_BAD_ALLOC = 2**64 - 255
THROW_NON_STD = 2**64 - 254
DEVICE = {kvdd.OPTION_DEVICE_ID: "0"}


@pytest.fixture(autouse=True)
def _throw_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arm the simulated root's exception hook (read when an instance is constructed)."""
    monkeypatch.setenv("KVDD_TESTDOUBLE_THROW_HOOK", "1")

DESC = CacheDesc(num_tensors=1, data_type=DataType.DT_UINT8, shape=(4, 8))
IDX = CacheIndex(1, 1, 0)

METHODS: list[tuple[str, Callable[[NativeBackend], object]]] = [
    ("Initialize", lambda nb: nb.initialize(DEVICE)),
    ("SetRole", lambda nb: nb.set_role(1, {})),
    ("LinkLlmClusters", lambda nb: nb.link_llm_clusters([ClusterInfo(1)], 1000)),
    ("UnlinkLlmClusters", lambda nb: nb.unlink_llm_clusters([ClusterInfo(1)], 1000, True)),
    ("RegisterKvCache", lambda nb: nb.register_kv_cache(DESC, [64], RegisterCfg())),
    ("UnregisterKvCache", lambda nb: nb.unregister_kv_cache(1)),
    ("AllocateCache", lambda nb: nb.allocate_cache(DESC)),
    ("DeallocateCache", lambda nb: nb.deallocate_cache(1)),
    ("PullKvCache", lambda nb: nb.pull_kv_cache(IDX, Cache(1), 0, -1, None)),
    ("PullKvBlocks", lambda nb: nb.pull_kv_blocks(IDX, Cache(1), [0], [0], None)),
    ("PushKvCache", lambda nb: nb.push_kv_cache(Cache(1), IDX, 0, -1, None)),
    ("PushKvBlocks", lambda nb: nb.push_kv_blocks(Cache(1), IDX, [0], [0], None)),
    ("CopyKvCache", lambda nb: nb.copy_kv_cache(Cache(1), Cache(2), 0, 0, 0, -1)),
    ("CopyKvBlocks", lambda nb: nb.copy_kv_blocks(Cache(1), Cache(2), [0], [[0]])),
]


# ---- C++ exceptions ---------------------------------------------------------------------------

@pytest.mark.parametrize(("cluster_id", "cxx_message"), [
    (THROW_RUNTIME_ERROR, "kvdd test double: injected C++ exception in {method}"),
    (THROW_BAD_ALLOC, "std::bad_alloc"),
    (THROW_NON_STD, "Unknown exception"),
])
@pytest.mark.parametrize(("method", "call"), METHODS, ids=[m for m, _ in METHODS])
def test_cxx_exception_becomes_llm_failed(cluster_id: int, cxx_message: str, method: str,
                                          call: Callable[[NativeBackend], object]) -> None:
    # The backend returns LLM_FAILED (never raises for a status) and keeps the C++ message as
    # this call's detail; the facade raises (test below).
    nb = NativeBackend(cluster_id, 1)
    result = call(nb)
    status = result[0] if isinstance(result, tuple) else result
    assert status == 0xFFFFFFFF  # LLM_FAILED
    if isinstance(result, tuple):
        # outputs of a failed call: no per-cluster statuses, no cache id, no cache
        assert result[1] == {"LinkLlmClusters": [], "UnlinkLlmClusters": [],
                             "RegisterKvCache": -1, "AllocateCache": None}[method]
    detail = nb.last_error_detail()
    assert detail is not None
    assert f"llm_datadist::LlmDataDist::{method}" in detail
    assert cxx_message.format(method=method) in detail
    assert nb.last_error_detail() is None  # read once
    nb.finalize()  # Finalize does not throw in the double: the instance stays usable


def test_detail_is_per_call_and_per_thread() -> None:
    nb = NativeBackend(THROW_RUNTIME_ERROR, 1)
    assert nb.initialize(DEVICE) == Status.LLM_FAILED
    seen: list[str | None] = []
    worker = threading.Thread(target=lambda: seen.append(nb.last_error_detail()))
    worker.start()
    worker.join()
    assert seen == [None]  # another thread has no explanation of this thread's failure
    ok = NativeBackend(5, 1)
    assert ok.initialize(DEVICE) == Status.LLM_SUCCESS
    assert ok.last_error_detail() is None
    assert nb.last_error_detail() is not None
    nb.finalize()
    ok.finalize()


def test_cxx_exception_through_the_facade() -> None:
    dd = kvdd.LlmDataDist(THROW_RUNTIME_ERROR, kvdd.LlmRole.PROMPT, backend="native")
    with pytest.raises(LLMError) as info:
        dd.initialize(DEVICE)
    err = info.value
    assert type(err) is LLMError
    assert err.status is Status.LLM_FAILED
    assert err.rets is None
    assert "llm_datadist::LlmDataDist::Initialize threw a C++ exception" in str(err)
    assert "injected C++ exception in Initialize" in str(err)
    assert "0xFFFFFFFF" in str(err)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is LLMError and copy.status == err.status and str(copy) == str(err)
    with pytest.raises(LLMError) as info:
        dd.link_llm_clusters([ClusterInfo(1)])
    assert info.value.status is Status.LLM_FAILED and info.value.rets == []
    dd.finalize()


def test_engine_exception_becomes_cxx_exception(recorders: list[Any]) -> None:
    nb = NativeBackend(3, 1)

    def broken(options: object) -> int:
        raise ZeroDivisionError("engine bug")

    recorders[-1].overrides["initialize"] = broken
    assert nb.initialize(DEVICE) == Status.LLM_FAILED
    assert "ZeroDivisionError: engine bug" in (nb.last_error_detail() or "")
    # A status that does not fit ge::Status is a protocol violation, reported the same way.
    recorders[-1].overrides["initialize"] = lambda options: 2**32
    assert nb.initialize(DEVICE) == Status.LLM_FAILED
    assert "wider than 32 bits" in (nb.last_error_detail() or "")


# ---- owners of TensorAddrs ----------------------------------------------------------------------

def _tensor() -> tuple[tuple[int, ...], weakref.ref[np.ndarray[Any, Any]]]:
    """Registered-memory addresses whose only owner is a TensorAddrs (returned) plus a weakref."""
    array = np.arange(32, dtype=np.uint8).reshape(4, 8)
    ref = weakref.ref(array)
    addrs = tensor_addrs([array])
    del array
    return addrs, ref


def _alive(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is not None


def test_owners_live_until_unregister() -> None:
    nb = NativeBackend(1, 1)
    assert nb.initialize(DEVICE) == 0
    addrs, ref = _tensor()
    status, cache_id = nb.register_kv_cache(DESC, addrs, RegisterCfg())
    assert (status, cache_id) == (0, 1)
    del addrs
    assert _alive(ref)
    assert nb.unregister_kv_cache(cache_id) == 0
    assert not _alive(ref)


def test_owners_live_until_finalize() -> None:
    nb = NativeBackend(1, 1)
    assert nb.initialize(DEVICE) == 0
    addrs, ref = _tensor()
    assert nb.register_kv_cache(DESC, addrs, RegisterCfg())[0] == 0
    del addrs
    assert nb.unregister_kv_cache(99) == 0  # another id: nothing released
    assert _alive(ref)
    nb.finalize()
    assert not _alive(ref)


def test_owners_released_with_the_instance() -> None:
    nb = NativeBackend(1, 1)
    assert nb.initialize(DEVICE) == 0
    addrs, ref = _tensor()
    assert nb.register_kv_cache(DESC, addrs, RegisterCfg())[0] == 0
    del addrs
    assert _alive(ref)
    del nb
    assert not _alive(ref)


def test_failed_registration_keeps_nothing() -> None:
    nb = NativeBackend(1, 1)  # not initialized: LLM_FAILED
    addrs, ref = _tensor()
    assert nb.register_kv_cache(DESC, addrs, RegisterCfg()) == (Status.LLM_FAILED, -1)
    del addrs
    assert not _alive(ref)


def test_param_invalid_registration_keeps_owners_until_finalize() -> None:
    # Upstream may keep the entry of a registration that returned PARAM_INVALID (cache table
    # overflow, SEMANTICS.md §3.7 step 10) without telling its id: the binding keeps the memory.
    nb = NativeBackend(1, 1)
    assert nb.initialize(DEVICE) == 0
    addrs, ref = _tensor()
    bad = CacheDesc(num_tensors=2, data_type=DataType.DT_UINT8, shape=(4, 8))
    assert nb.register_kv_cache(bad, addrs, RegisterCfg()) == (Status.LLM_PARAM_INVALID, -1)
    del addrs
    assert _alive(ref)
    nb.finalize()
    assert not _alive(ref)


def test_plain_int_addresses_are_the_callers_job() -> None:
    nb = NativeBackend(1, 1)
    assert nb.initialize(DEVICE) == 0
    array = np.zeros((4, 8), np.uint8)
    assert nb.register_kv_cache(DESC, [array.ctypes.data], RegisterCfg()) == (0, 1)
    ref = weakref.ref(array)
    del array
    assert not _alive(ref)  # nothing kept: plain ints carry no owner
    assert nb.unregister_kv_cache(1) == 0


# ---- listen_port --------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_listen_port_zero_reports_the_bound_port(recorders: list[Any]) -> None:
    nb = NativeBackend(1, 1)
    assert nb.listen_port is None
    assert nb.initialize({**DEVICE, kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"}) == 0
    port = nb.listen_port
    assert port is not None and port > 0
    assert port == recorders[-1].listen_port
    assert _accepts(port)
    nb.finalize()
    assert nb.listen_port is None


def test_listen_port_fixed_and_truncated_to_16_bits() -> None:
    port = _free_port()
    nb = NativeBackend(1, 1)
    assert nb.initialize({**DEVICE, kvdd.OPTION_LISTEN_IP_INFO: f"127.0.0.1:{port}"}) == 0
    assert nb.listen_port == port
    nb.finalize()
    port = _free_port()
    assert nb.initialize({**DEVICE, kvdd.OPTION_LISTEN_IP_INFO: f"127.0.0.1:{65536 + port}"}) == 0
    assert nb.listen_port == port
    assert _accepts(port)
    nb.finalize()


def test_listen_port_follows_set_role_on_the_comm_backend() -> None:
    nb = NativeBackend(1, 1)
    assert nb.initialize(DEVICE) == 0
    assert nb.listen_port is None
    # a second Initialize is a no-op that ignores its options (SEMANTICS.md §3.2 step 1)
    assert nb.initialize({**DEVICE, kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"}) == 0
    assert nb.listen_port is None
    assert nb.set_role(1, {kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"}) == 0
    port = nb.listen_port
    assert port is not None and port > 0 and _accepts(port)
    assert nb.set_role(2, {kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"}) == 0  # same port string
    assert nb.listen_port == port
    assert nb.set_role(7, {}) == Status.LLM_PARAM_INVALID  # failed: unchanged
    assert nb.listen_port == port
    assert nb.set_role(2, {}) == 0  # no listen info: stops listening
    assert nb.listen_port is None


def test_listen_port_is_kept_by_set_role_on_hixl() -> None:
    nb = NativeBackend(1, 1)
    listen = {kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"}
    assert nb.initialize({**DEVICE, **listen, kvdd.OPTION_TRANSFER_BACKEND: "hixl"}) == 0
    port = nb.listen_port
    assert port is not None and port > 0
    assert nb.set_role(2, {}) == 0
    assert nb.listen_port == port
    assert nb.set_role(3, {kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:1"}) == (
        Status.LLM_FEATURE_NOT_ENABLED)
    assert nb.listen_port == port


# ---- concurrency and the whole chain ----------------------------------------------------------

def test_finalize_waits_for_calls_in_flight() -> None:
    nb = NativeBackend(1, 1)
    statuses: set[int] = set()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i in range(300):
                statuses.add(nb.unregister_kv_cache(i))
                statuses.add(nb.deallocate_cache(i))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(30):
        assert nb.initialize(DEVICE) == 0
        nb.finalize()
    for t in threads:
        t.join()
    assert errors == []
    assert statuses <= {0, Status.LLM_FAILED, Status.LLM_FEATURE_NOT_ENABLED}


def test_pull_through_the_whole_chain() -> None:
    """Facade -> NativeBackend -> libllm_datadist.so (double) -> engine, bytes checked."""
    layers = 2
    desc = CacheDesc(num_tensors=2 * layers, data_type=DataType.DT_INT16, shape=(3, 5))
    src = [np.full((3, 5), 100 * k, np.int16) + np.arange(15, dtype=np.int16).reshape(3, 5)
           for k in range(2 * layers)]
    dst = [np.full((3, 5), -1, np.int16) for _ in range(2 * layers)]
    with kvdd.LlmDataDist(11, kvdd.LlmRole.PROMPT, backend="native") as p, \
            kvdd.LlmDataDist(12, kvdd.LlmRole.DECODER, backend="native") as d:
        p.initialize({**DEVICE, kvdd.OPTION_LISTEN_IP_INFO: "127.0.0.1:0"})
        d.initialize(DEVICE)
        src_id = p.register_kv_cache(desc, tensor_addrs(src))
        dst_id = d.register_kv_cache(desc, tensor_addrs(dst))
        port = p.listen_port
        assert port is not None
        rets = d.link_llm_clusters([ClusterInfo(11, 1, (IpInfo("127.0.0.1"),),
                                                (IpInfo("127.0.0.1", port),))])
        assert rets == [Status.LLM_SUCCESS]
        # remote row 2 of layer 1 (tensors 2, 3) into local row 0 of layer 0 (tensors 0, 1)
        d.pull_kv_cache(CacheIndex(11, src_id, 2), Cache(dst_id), 0,
                        ext_param=KvCacheExtParam((1, 1), (0, 0)))
        expected = [np.full((3, 5), -1, np.int16) for _ in range(2 * layers)]
        expected[0][0] = [210, 211, 212, 213, 214]
        expected[1][0] = [310, 311, 312, 313, 314]
        for k in range(2 * layers):
            np.testing.assert_array_equal(dst[k], expected[k])
        d.unlink_llm_clusters([ClusterInfo(11, 1, (IpInfo("127.0.0.1"),),
                                           (IpInfo("127.0.0.1", port),))])
