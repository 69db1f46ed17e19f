"""Shared set-up of the cross-process fabric tests (test_fabric*.py): the peer-process fixtures
(one shared peer per module, or one per test for tests that kill or stop it), a world of nodes
on both sides, and the pair of nodes most tests start from."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdd import LlmRole, Status
from kvdd.sim import fabric

import peer_node
from conformance.harness import CacheHandle, Node, Spec, World, register
from peer_node import ProcessNode
from peer_proc import PeerProcess

S = Status.LLM_SUCCESS
WAIT = "llm.SyncKvCacheWaitTime"
XPROC_ENV = {"tcp": "tcp"}


def peer_env(xproc: str) -> dict[str, str]:
    return {fabric.ENV_XPROC: XPROC_ENV[xproc]}


@pytest.fixture(scope="module", params=["tcp"])
def xproc(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def proc(xproc: str) -> Iterator[PeerProcess]:
    """One peer process per data path, shared by the module's tests that do not kill it."""
    with PeerProcess(env=peer_env(xproc)) as p:
        yield p


def world_of(p: PeerProcess, monkeypatch: pytest.MonkeyPatch, xproc: str) -> Iterator[World]:
    monkeypatch.setenv(fabric.ENV_XPROC, XPROC_ENV[xproc])
    with peer_node.process_world(p) as w:
        yield w


@pytest.fixture
def world(proc: PeerProcess, xproc: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield from world_of(proc, monkeypatch, xproc)


@pytest.fixture
def own_proc(xproc: str) -> Iterator[PeerProcess]:
    """A peer process for one test (killed or stopped by it); always cleaned up."""
    with PeerProcess(env=peer_env(xproc)) as p:
        yield p


@pytest.fixture
def own_world(own_proc: PeerProcess, xproc: str,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    yield from world_of(own_proc, monkeypatch, xproc)


def setup_pair(world: World, transfer: str = "comm", *, d_listen: bool = False,
           d_extra: dict[str, str] | None = None, p_extra: dict[str, str] | None = None,
           spec: Spec = Spec()) -> tuple[Node, ProcessNode, CacheHandle, CacheHandle]:
    """P (other process, listening) and D (here), each with one registered cache, not linked."""
    p = world.peer(1, LlmRole.PROMPT)
    assert isinstance(p, ProcessNode)
    p.initialize(listen=True, transfer=transfer, extra=p_extra)
    d = world.dut(2, LlmRole.DECODER)
    d.initialize(listen=d_listen, transfer=transfer, extra=d_extra)
    return d, p, register(d, spec), register(p, spec)


def d_path(d: Node, peer_cluster_id: int) -> str:
    entity = d.dd.backend.entities[peer_cluster_id]  # type: ignore[attr-defined]
    return str(getattr(entity.peer, "data_path", "in_process"))


def expected_paths(xproc: str, p: PeerProcess) -> tuple[str, str]:
    """(D→P, P→D) data paths: TCP (a same-host path exists only with a kernel-attested identity
    proof, registered as a handshake extension; none is registered in these tests)."""
    return "tcp", "tcp"
