"""The process-wide Wrapper (kvdd.sim.pypkg.process_wrapper): codes without an engine, a fresh
engine after finalize, and fault injection into the façade's calls by name (docs/spec/PYPKG.md
§1.4, §3.2, §9.7; checklist §7.5 item 24, engine part)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_support import (FAILED, LINK_BUSY, NOT_EXIST, PARAM_INVALID, S_OK, TIMEOUT, Mem,
                            blocks_key, free_port, link_to, process_options, pull_param)
from kvdd.sim import faults
from kvdd.sim.pypkg import process_wrapper
from kvdd.sim.pypkg.wrapper import SimWrapper
from peer import Peer

NO = (1 << 64) - 1


@pytest.fixture
def w() -> Iterator[SimWrapper]:
    wrapper = process_wrapper()
    wrapper.finalize_v2()
    yield wrapper
    faults.clear()
    wrapper.finalize_v2()


def no_engine_codes(w: SimWrapper) -> dict[str, object]:
    desc = (1, 4, -1, [4, 16], 1, True)
    key = blocks_key(5)
    return {
        "link": w.link("c", [(1, 0), (2, 1)], "{}"),
        "unlink": w.unlink(1),
        "query_register_mem_status": w.query_register_mem_status(1)[0],
        "register_cache": w.register_cache(desc, [4096], [], True),
        "unregister_cache": w.unregister_cache(1),
        "allocate_cache_v2": w.allocate_cache_v2(desc, [])[0],
        "link_clusters_v2": w.link_clusters_v2([(2, 0, [], [])], 100),
        "unlink_clusters_v2": w.unlink_clusters_v2([(2, 0, [], [])], 100, True),
        "deallocate_cache_v2": w.deallocate_cache_v2(1),
        "pull_cache_v2": w.pull_cache_v2(1, key, pull_param([0], [0])),
        "copy_cache_v2": w.copy_cache_v2((1, 2, 0, 0, 0, -1, NO)),
        "remove_cache_key_v2": w.remove_cache_key_v2(key),
        "remap_registered_memory": w.remap_registered_memory([(0, 4096, 1)]),
        "swap_blocks_v2": w.swap_blocks_v2((-1, [[4096]]), (-1, [[8192]]), 1, 0, [(0, 0)]),
        "check_capacity_v2": w.check_capacity_v2(1),
        "transfer_cache_v2": w.transfer_cache_v2(0, (1, 0, 0, [], 2, 0, 0, 1, 0, 2), (0, [0], [0])),
        "switch_role_v2": w.switch_role_v2("Prompt", {}),
    }


EXPECTED = {
    "link": (FAILED, 0), "unlink": FAILED, "query_register_mem_status": FAILED,
    "register_cache": (FAILED, (-1, [])), "unregister_cache": FAILED,
    "allocate_cache_v2": FAILED, "link_clusters_v2": (FAILED, []),
    "unlink_clusters_v2": (FAILED, []), "deallocate_cache_v2": PARAM_INVALID,
    "pull_cache_v2": PARAM_INVALID, "copy_cache_v2": PARAM_INVALID,
    "remove_cache_key_v2": PARAM_INVALID, "remap_registered_memory": PARAM_INVALID,
    "swap_blocks_v2": PARAM_INVALID, "check_capacity_v2": PARAM_INVALID,
    "transfer_cache_v2": PARAM_INVALID, "switch_role_v2": PARAM_INVALID,
}


def test_codes_without_an_engine_and_after_finalize(w: SimWrapper) -> None:
    got = no_engine_codes(w)
    got["link"] = (w.link("c", [(1, 0), (2, 1)], "{}")[0], 0)
    assert got == EXPECTED
    assert w.initialize_v2(1, process_options(None)) == S_OK
    mem = Mem(1, 4, 16)
    st, (cid, addrs) = w.register_cache(mem.desc(True), mem.addrs, [], True)
    assert (st, cid, addrs) == (S_OK, 1, [mem.addrs])
    w.finalize_v2()
    got = no_engine_codes(w)
    got["link"] = (w.link("c", [(1, 0), (2, 1)], "{}")[0], 0)
    assert got == EXPECTED
    assert w.last_error_detail() is not None
    # a fresh engine: cache ids restart at 1
    assert w.initialize_v2(1, process_options(None)) == S_OK
    assert w.register_cache(mem.desc(True), mem.addrs, [], True)[1][0] == 1


def test_stateless_calls(w: SimWrapper) -> None:
    assert w.calc_tensor_size([4, 16], 4) == 64 and w.calc_tensor_size([0], 4) == -1
    assert w.dict_to_vector({3: 1, 1: 2}) == [(3, 1), (1, 2)]


def test_faults_reach_pull_blocks_and_registration(w: SimWrapper) -> None:
    """LINK_BUSY / TIMEOUT injected into pull_blocks by name (count semantics), a registration
    failure that burns its id; checks still come first."""
    port = free_port()
    assert w.initialize_v2(2, process_options(port)) == S_OK
    mem = Mem(2, 4, 16)
    with faults.inject("register_blocks_cache", status="LLM_DEVICE_OUT_OF_MEMORY", count=1):
        st, (cid, _) = w.register_cache(mem.desc(True), mem.addrs, [], True)
        assert st == 0x5010B00E and cid == -1
        assert "injected" in (w.last_error_detail() or "")
        assert w.register_cache(mem.desc(False), mem.addrs, [], True)[1][0] == 2  # id 1 burnt
    st, (did, _) = w.register_cache(mem.desc(True), mem.addrs, [], True)
    assert (st, did) == (S_OK, 3)
    with faults.inject("pull_blocks", status="LLM_LINK_BUSY", count=2, after=1) as inj:
        # no link: NOT_YET_LINK comes first and consumes nothing
        assert w.pull_cache_v2(did, blocks_key(1), pull_param([0], [0])) == 0x5010B007
        assert inj.fired == 0
    with faults.inject("pull_cache", status="LLM_TIMEOUT"):
        assert w.pull_cache_v2(did, blocks_key(1), pull_param([0], [0])) == 0x5010B007


def test_injected_pull_faults_in_order(w: SimWrapper) -> None:
    """Over a link (to an engine in a peer process): after=1, count=2 → success, LINK_BUSY twice,
    success; TIMEOUT then breaks the link until it is relinked."""
    port = free_port()
    with Peer() as p:
        ids = p.call("engine_support.serve", 1, port,
                     [{"n": 2, "rows": 4, "row_bytes": 16, "seed": 3, "keys": [blocks_key(0, 0)]}])
        assert ids == [1]
        assert w.initialize_v2(2, process_options(None)) == S_OK
        mem = Mem(2, 4, 16)
        did = w.register_cache(mem.desc(True), mem.addrs, [], True)[1][0]
        assert link_to(1, port) == S_OK
        with faults.inject("pull_blocks", status="LLM_LINK_BUSY", count=2, after=1):
            got = [w.pull_cache_v2(did, blocks_key(1), pull_param([0], [0])) for _ in range(4)]
        assert got == [S_OK, LINK_BUSY, LINK_BUSY, S_OK]
        with faults.inject("package", status="LLM_TIMEOUT", count=1):
            assert w.pull_cache_v2(did, blocks_key(1), pull_param([1], [1])) == TIMEOUT
        assert w.pull_cache_v2(did, blocks_key(1), pull_param([1], [1])) == TIMEOUT  # broken
        src = p.call("engine_support.tensors", 0)
        assert mem.tensors[0][:16].tobytes() == src[0][:16]
        assert (mem.tensors[0][16:] == 0).all()
        assert w.unlink_clusters_v2([(1, 0, [], [])], 1000, True)[0] == S_OK
        assert link_to(1, port) == S_OK
        assert w.pull_cache_v2(did, blocks_key(1), pull_param([1], [1])) == S_OK
        assert mem.tensors[1][16:32].tobytes() == src[1][16:32]
        assert w.pull_cache_v2(did, blocks_key(1, 4), pull_param([1], [1])) == NOT_EXIST
        p.call("engine_support.finalize")
