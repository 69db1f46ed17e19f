"""Fixtures of the conformance suite (SEMANTICS.md on every available backend).

* ``backend``: parametrized over :func:`kvdd.available_backends`, or only ``$KVDD_BACKEND`` when
  that is set (CI's native run sets ``KVDD_BACKEND=native`` and runs only native; an unavailable
  backend named there is an error, never a silent skip).
* ``sim_only(reason)`` marker: skipped, with the reason, unless the backend under test is ``sim``.
* ``peer_factory``: makes simulator peers (``Node``); ``KVDD_PEER`` selects how: ``inproc`` (the
  default) in this process, ``process`` in a separate Python process shared by the tests of a
  module (``tests/sim/peer_proc.py``: the peers' methods become RPCs, links and transfers cross
  processes through the simulator's fabric).
* ``world``: the nodes of one test (``world.dut()`` = the node under test, ``world.peer()`` = sim).
* ``transfer``: ``"comm"`` (default transfer backend) or ``"hixl"`` (``llm.TransferBackend``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvdd

from .harness import Node, World

PeerFactory = Callable[[int, int], Node]


def selected_backends() -> tuple[str, ...]:
    env = os.environ.get("KVDD_BACKEND")
    if env:
        return (env,)
    return kvdd.available_backends()


@pytest.fixture(params=selected_backends())
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(autouse=True)
def _sim_only(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("sim_only")
    if marker is None:
        return
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("backend") if callspec is not None else None
    if name is None:
        if "sim" in selected_backends():
            return
    elif name == "sim":
        return
    reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
    pytest.skip(f"simulator only: {reason}")


@pytest.fixture(params=["comm", "hixl"])
def transfer(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def _peer_process() -> Iterator[object]:
    """KVDD_PEER=process: one peer process per test module (stopped, or killed, at the end)."""
    sim_dir = str(Path(__file__).resolve().parent.parent / "sim")
    if sim_dir not in sys.path:
        sys.path.append(sim_dir)
    import peer_proc

    with peer_proc.PeerProcess() as proc:
        yield proc


@pytest.fixture
def peer_factory(request: pytest.FixtureRequest) -> Iterator[PeerFactory]:
    mode = os.environ.get("KVDD_PEER", "inproc")
    if mode == "process":
        proc = request.getfixturevalue("_peer_process")  # puts tests/sim on sys.path
        import peer_proc

        assert isinstance(proc, peer_proc.PeerProcess) and proc.alive, "the peer process died"
        make_remote, cleanup = peer_proc.process_peer_factory(proc)
        yield make_remote
        cleanup()
        return
    if mode != "inproc":
        pytest.skip(f"KVDD_PEER={mode!r}: unknown mode (inproc or process)")
    made: list[Node] = []

    def make(cluster_id: int, role: int) -> Node:
        node = Node(cluster_id, role, backend="sim")
        made.append(node)
        return node

    yield make
    for node in reversed(made):
        node.close()


@pytest.fixture
def inproc_peers() -> None:
    """Requested by tests that need the peers in this process (shared memory between nodes)."""
    if os.environ.get("KVDD_PEER", "inproc") != "inproc":
        pytest.skip("needs peers in this process (shares memory between nodes)")


@pytest.fixture
def world(backend: str, peer_factory: PeerFactory) -> Iterator[World]:
    w = World(backend, peer_factory)
    yield w
    for node in reversed(w.nodes):
        node.close()
