"""An instance that becomes unreachable without finalize() is torn down as Finalize does:
SEMANTICS.md §3.1 (upstream's destructor).

Its listen port closes (a fresh connection to it is refused, and another instance can listen
there), its links are dropped (a peer linked to it finds its caches gone), and nothing of the
simulator (listener and connection threads, peer handles, registries) keeps it alive: a weak
reference to it dies once its teardown ran.
"""

from __future__ import annotations

import gc
import socket
import time
import weakref
from collections.abc import Callable

import numpy as np
import pytest

import kvdd
import kvdd.testing as kt
from kvdd import OPTION_LISTEN_IP_INFO, CachePlacement, LlmRole, Status

from .harness import (
    DEFAULT_DTYPE,
    DEFAULT_N,
    DEFAULT_SHAPE,
    KV_CACHE_NOT_EXIST,
    LOCALHOST,
    World,
    cluster,
    free_port,
    raises,
)
from .init_helpers import DEV
from . import reference as ref

DESC = kvdd.CacheDesc(num_tensors=DEFAULT_N, data_type=DEFAULT_DTYPE, shape=DEFAULT_SHAPE)
T = ref.tensor_nbytes(DEFAULT_DTYPE, DEFAULT_SHAPE)


def refused(port: int) -> bool:
    """A fresh TCP connection to ``port`` is refused (nothing listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        return s.connect_ex((LOCALHOST, port)) != 0


def eventually(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _linked_instance(backend: str, world: World, port: int, cycle: bool
                     ) -> tuple[kvdd.LlmDataDist, kt.Buffer, int]:
    """An instance listening on ``port``, with one registered cache, linked to a peer that
    pulled from it once: (instance, its memory, cache id)."""
    buf = kt.allocate(DEFAULT_N * T, backend=backend, placement=CachePlacement.DEVICE,
                      device_id=kt.device_ids()[0])
    buf.write(np.arange(DEFAULT_N * T, dtype=np.uint32).astype(np.uint8))
    dd = kvdd.LlmDataDist(2, LlmRole.DECODER, backend=backend)
    dd.initialize({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}"})
    cache_id = dd.register_kv_cache(DESC, buf.addrs([k * T for k in range(DEFAULT_N)], T))
    p = world.peer(1, LlmRole.PROMPT)
    p.initialize(listen=True)
    dd.link_llm_clusters([cluster(p.listen_port or 0, 1)])
    if cycle:  # the user's own reference cycle through the instance
        holder: dict[str, object] = {"dd": dd}
        holder["self"] = holder
    return dd, buf, cache_id


@pytest.mark.parametrize("cycle", [False, True], ids=["plain", "cycle"])
def test_dropped_instance_is_torn_down(backend: str, world: World, cycle: bool) -> None:
    port = free_port()
    dd, buf, cache_id = _linked_instance(backend, world, port, cycle)
    p = world.nodes[-1]
    ph = p.register()
    src = kvdd.CacheIndex(2, cache_id, 0)
    p.pull_kv_cache(src, ph.cache())  # linked both ways (comm)
    assert not refused(port)
    gone = weakref.ref(dd)
    del dd
    gc.collect()
    assert gone() is None
    assert refused(port)  # the listener closed at once
    try:
        # the links were dropped: the peer keeps a stale entity, over which our caches are gone
        def peer_sees_it_gone() -> bool:
            try:
                p.pull_kv_cache(src, ph.cache())
            except kvdd.LLMKvCacheNotExistError:
                return True
            return False

        assert eventually(peer_sees_it_gone)
        with raises(KV_CACHE_NOT_EXIST):
            p.pull_kv_cache(src, ph.cache())
        # and another instance can listen on its port
        q = world.peer(3, LlmRole.MIX)
        q.initialize_raw({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}"})
        assert q.listen_port == port
    finally:
        buf.free()


@pytest.mark.kvdd_sim_only(reason="SimBackend itself, without the facade")
def test_dropped_sim_backend_is_collected(world: World) -> None:
    from kvdd.sim import SimBackend

    port = free_port()
    p = world.peer(1, LlmRole.PROMPT)
    p.initialize(listen=True)
    b = SimBackend(2, LlmRole.DECODER)
    assert b.initialize({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:{port}"}) == Status.LLM_SUCCESS
    status, rets = b.link_llm_clusters([cluster(p.listen_port or 0, 1)], 1000)
    assert (status, rets) == (Status.LLM_SUCCESS, [Status.LLM_SUCCESS])
    gone = weakref.ref(b)
    del b
    gc.collect()
    assert refused(port)
    # nothing of the simulator keeps it: it goes once the teardown ran
    assert eventually(lambda: (gc.collect(), gone() is None)[1])


@pytest.mark.kvdd_sim_only(reason="several instances of the backend under test")
def test_dropped_peer_in_this_process_is_collected(world: World) -> None:
    # a link in both directions between two instances of this process: neither keeps the other
    from kvdd.sim import SimBackend

    a, b = SimBackend(11, LlmRole.PROMPT), SimBackend(12, LlmRole.DECODER)
    for x in (a, b):
        assert x.initialize({**DEV, OPTION_LISTEN_IP_INFO: f"{LOCALHOST}:0"}) == Status.LLM_SUCCESS
    port_a = a.listen_port
    assert port_a
    assert b.link_llm_clusters([cluster(port_a, 11)], 1000)[0] == Status.LLM_SUCCESS
    gone = weakref.ref(a)
    del a
    gc.collect()
    assert refused(port_a)
    assert eventually(lambda: (gc.collect(), gone() is None)[1])
    # b's link to it is stale: relinking to the closed port fails to connect
    status, rets = b.link_llm_clusters([cluster(port_a, 11)], 1000)
    assert (status, rets) == (Status.LLM_LINK_FAILED, [Status.LLM_LINK_FAILED])
    b.finalize()
