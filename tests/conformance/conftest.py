"""Fixtures of the conformance suite (SEMANTICS.md on every available backend).

The suite runs on kvdd's pytest plugin (:mod:`kvdd.testing.pytest_plugin`), as a user's suite does:

* ``backend``: the plugin's ``kvdd_backend``, parametrized over every available backend, or only
  the one ``--kvdd-backend`` / ``$KVDD_BACKEND`` names (CI's native run sets
  ``KVDD_BACKEND=native`` and runs only native; an unavailable backend named there is an error,
  never a silent skip).
* ``kvdd_sim_only(reason)`` marker (the plugin's): skipped, with the reason, on native.
* ``peer_factory``: makes the peers (``Node``); the plugin's ``--kvdd-peer`` / ``$KVDD_PEER``
  selects how:

  - ``inprocess`` (the default): simulator peers in this process;
  - ``process``: peers **of the backend under test** (native peers on native) in other Python
    processes (``tests/sim/peer_proc.py`` on the plugin's process host,
    :class:`kvdd.testing.process.ProcessHost`: the peers' methods become RPCs over a private control
    pipe; links and transfers cross processes through the backend itself).  A peer allocates,
    fills and reads its memory through :mod:`kvdd.testing` (ACL device memory on native).  Peer
    processes are reused by the tests of a module (:class:`PeerPool`).  Native peers have one
    live instance per process, as on hardware: peer process ``i`` uses NPU ``ids[i + 1]`` of
    ``$KVDD_TEST_DEVICE_IDS`` (the node under test uses ``ids[0]``), and a test that needs more
    peers than there are NPUs left is skipped, saying how many it needs.  Simulator peers share
    one process.
* ``world``: the nodes of one test (``world.dut()`` = the node under test, ``world.peer()``).
* ``transfer``: ``"comm"`` (default transfer backend) or ``"hixl"`` (``llm.TransferBackend``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kvdd
import kvdd.testing as kt
from kvdd.testing.pytest_plugin import peer_mode

from .harness import Node, World, port_reported

PeerFactory = Callable[[int, int], Node]


@pytest.fixture
def backend(kvdd_backend: str) -> str:
    """The backend under test (the plugin's ``kvdd_backend``)."""
    return kvdd_backend


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs_bound_port: checks which port llm.ListenIpInfo=...:0 (or the internal "
        "listen keys) bound; skipped where listen_port cannot report it (a real CANN install)")


@pytest.fixture(autouse=True)
def _needs_bound_port(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("needs_bound_port") is None:
        return
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("kvdd_backend") if callspec is not None else None
    if name is not None and not port_reported(name):
        pytest.skip("needs the port that port 0 bound, which the real library cannot report "
                    "(runs on the simulator, and on kvdd's simulated CANN root with its port hook)")


@pytest.fixture(params=["comm", "hixl"])
def transfer(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def _import_sim(name: str) -> ModuleType:
    sim_dir = str(Path(__file__).resolve().parent.parent / "sim")
    if sim_dir not in sys.path:
        sys.path.append(sim_dir)
    return importlib.import_module(name)


class PeerPool:
    """KVDD_PEER=process: the peer processes of one test module, for one backend.

    Native peers get one live instance per process, as on hardware: :meth:`make` puts each new
    peer into a process that hosts no live node of the current test, starting one when all are
    taken.  Simulator peers all share one process (the simulator supports several instances per
    process).  :meth:`end_test` closes the test's peers, which frees their processes for the next
    test; :meth:`close` stops (or kills) the processes.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.one_per_process = backend != "sim"
        self._peer_proc = _import_sim("peer_proc")
        self._peer_node = _import_sim("peer_node")
        self.procs: list[Any] = []
        self._used: list[Any] = []  # (process, node) of the current test

    def make(self, cluster_id: int, role: int) -> Node:
        busy = {id(proc) for proc, _ in self._used} if self.one_per_process else set()
        free = [proc for proc in self.procs if id(proc) not in busy and proc.alive]
        if free:
            proc = free[0]
        else:
            proc = self._spawn()
        node: Node = self._peer_node.ProcessNode(proc, cluster_id, role)
        self._used.append((proc, node))
        return node

    def _spawn(self) -> Any:
        if not self.one_per_process:
            proc = self._peer_proc.PeerProcess(backend=self.backend)
            self.procs.append(proc)
            return proc
        ids = kt.device_ids()
        taken = {proc.device_id for proc in self.procs}
        free = [i for i in ids[1:] if i not in taken]
        if not free:
            k = len(self.procs) + 1
            pytest.skip(f"needs {k + 1} NPUs in ${kt.ENV_DEVICE_IDS} (the node under test and "
                        f"{k} peer processes), has {len(ids)}: {ids}")
        proc = self._peer_proc.PeerProcess(backend=self.backend, device_id=free[0])
        self.procs.append(proc)
        return proc

    def end_test(self) -> None:
        used, self._used = self._used, []
        for _, node in reversed(used):
            node.close()
        for proc in [proc for proc in self.procs if not proc.alive]:
            proc.close()  # reap a peer process a test killed; the next test starts a new one
            self.procs.remove(proc)

    def close(self) -> None:
        for proc in self.procs:
            proc.close()
        self.procs = []


@pytest.fixture(scope="module")
def _peer_pools() -> Iterator[dict[str, PeerPool]]:
    """KVDD_PEER=process: the module's peer processes, per backend (stopped at the end)."""
    pools: dict[str, PeerPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def peer_factory(request: pytest.FixtureRequest, backend: str) -> Iterator[PeerFactory]:
    mode = peer_mode(request.config)
    if mode == "process":
        pools: dict[str, PeerPool] = request.getfixturevalue("_peer_pools")
        pool = pools.get(backend)
        if pool is None:
            pool = pools[backend] = PeerPool(backend)
        try:
            yield pool.make
        finally:
            pool.end_test()
        return
    made: list[Node] = []

    def make(cluster_id: int, role: int) -> Node:
        node = Node(cluster_id, role, backend="sim")
        made.append(node)
        return node

    yield make
    for node in reversed(made):
        node.close()


@pytest.fixture
def inproc_peers(request: pytest.FixtureRequest) -> None:
    """Requested by tests that need the peers in this process (shared memory between nodes)."""
    if peer_mode(request.config) != "inprocess":
        pytest.skip("needs peers in this process (shares memory between nodes)")


@pytest.fixture
def world(backend: str, peer_factory: PeerFactory) -> Iterator[World]:
    w = World(backend, peer_factory)
    yield w
    for node in reversed(w.nodes):
        node.close()
