"""kvdd's pytest plugin: linked prefill/decode pairs, caches, faults and leak checks for your tests.

Installed with kvdd (entry point ``pytest11``: ``kvdd``) and inert until a test uses one of its
fixtures or markers.  The same test file runs on the simulator (laptop, CI) and on an Atlas node
(``--kvdd-backend native``).  See docs/testing.md.

Options (command line, ``[tool.pytest.ini_options]`` key, environment variable; the first given
wins):

* ``--kvdd-backend`` / ``kvdd_backend`` / ``KVDD_BACKEND``: ``sim``, ``native``, or ``all`` (every
  available backend; the default).  Tests that use ``kvdd_backend`` (directly or through another
  fixture) run once per backend; a named backend that is not available is an error, never a skip.
* ``--kvdd-peer`` / ``kvdd_peer`` / ``KVDD_PEER``: where peers live, ``inprocess`` (default) or
  ``process`` (a child Python process per peer, so transfers cross processes).

Fixtures:

* ``kvdd_backend`` (str): the backend of this run of the test.
* ``kvdd_instance``: a factory ``kvdd_instance(cluster_id, role=..., listen=True, options=None)``
  of initialized ``kvdd.LlmDataDist`` objects of this process (listening on a free loopback port
  unless ``listen=False``), finalized at tear-down.
* ``kvdd_peer``: a factory ``kvdd_peer(cluster_id, role=..., options=None)`` of
  :class:`kvdd.testing.peers.Peer` objects where ``--kvdd-peer`` says, closed at tear-down.
* ``kvdd_pair``: a :class:`PrefillDecodePair`: ``decode`` (an instance of this process: the one
  your code drives) and ``prefill`` (a peer); register the prefill's caches, then ``pair.link()``;
  unlinked and closed at tear-down.
* ``kvdd_cache``: a factory ``kvdd_cache(dd, desc, fill=None)`` registering memory for a cache the
  way the backend needs it (:func:`kvdd.testing.peers.register_cache`); freed at tear-down.
* ``kvdd_faults``: :class:`Faults`, fault injection into this process's calls for one test
  (``kvdd_faults.inject("pull_kv_blocks", status="LLM_TIMEOUT", count=1)``), removed at
  tear-down; skips the test on the native backend (fault injection is the simulator's).

* ``kvdd_llm_datadist``: for one test, ``import llm_datadist`` (and its submodules) resolves to
  kvdd's simulator of CANN's Python package (``kvdd.llm_datadist``), as after ``source
  DEST/set_env.sh`` of a ``kvdd cann-root DEST``; the module is the fixture's value.

Markers: ``kvdd_sim_only(reason)`` skips a test (with the reason) on the native backend.

Leak checks: after the tear-down of a test that used a kvdd fixture, no kvdd thread it started,
no listening socket it opened and no child process it started may be left; a leak fails the test
with what leaked.  ``--kvdd-no-leak-check`` turns them off.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import pytest

import kvdd

from .peers import LocalPeer, Peer, RegisteredCache, RemotePeer, listen_options, register_cache

__all__ = ["PrefillDecodePair", "Faults", "InstanceFactory", "PeerFactory", "CacheFactory",
           "selected_backends", "peer_mode"]

_BACKEND_CHOICES = ("sim", "native", "all")
_PEER_CHOICES = ("inprocess", "process")
_LEAK_GRACE_S = 3.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvdd", "kvdd test kit (LLM-DataDist)")
    group.addoption("--kvdd-backend", choices=_BACKEND_CHOICES, default=None,
                    help="backend of the kvdd fixtures: sim, native or all available "
                         "(default: $KVDD_BACKEND, else all)")
    group.addoption("--kvdd-peer", choices=(*_PEER_CHOICES, "inproc"), default=None,
                    help="where kvdd peers live: inprocess or process (default: $KVDD_PEER, "
                         "else inprocess)")
    group.addoption("--kvdd-no-leak-check", action="store_true", default=False,
                    help="do not check for kvdd threads, listeners and processes left by a test")
    parser.addini("kvdd_backend", "backend of the kvdd fixtures: sim, native or all", default="")
    parser.addini("kvdd_peer", "where kvdd peers live: inprocess or process", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvdd_sim_only(reason): needs a simulator-only feature "
                            "of kvdd; skipped on the native backend")
    if config.getoption("--kvdd-backend") or config.getini("kvdd_backend"):
        selected_backends(config)  # a backend named here and unavailable: one usage line now


def _setting(config: pytest.Config, option: str, ini: str, env: str) -> str:
    value = config.getoption(option) or config.getini(ini) or os.environ.get(env, "")
    return str(value).strip().lower()


def selected_backends(config: pytest.Config) -> tuple[str, ...]:
    """The backends the kvdd fixtures run on (``--kvdd-backend``, ``kvdd_backend``, ``KVDD_BACKEND``).

    Raises
    ------
    pytest.UsageError
        An unknown name, or a named backend that is not available here (with the reason).
    """
    name = _setting(config, "--kvdd-backend", "kvdd_backend", "KVDD_BACKEND") or "all"
    if name == "all":
        return kvdd.available_backends()
    if name not in _BACKEND_CHOICES:
        raise pytest.UsageError(f"kvdd backend {name!r}: choose sim, native or all")
    if name not in kvdd.available_backends():
        from kvdd.backend import backend_problem
        raise pytest.UsageError(f"kvdd backend {name!r} is not available: {backend_problem(name)}")
    return (name,)


def peer_mode(config: pytest.Config) -> str:
    """``"inprocess"`` or ``"process"`` (``--kvdd-peer``, ``kvdd_peer``, ``KVDD_PEER``)."""
    mode = _setting(config, "--kvdd-peer", "kvdd_peer", "KVDD_PEER") or "inprocess"
    mode = "inprocess" if mode == "inproc" else mode
    if mode not in _PEER_CHOICES:
        raise pytest.UsageError(f"kvdd peer mode {mode!r}: choose inprocess or process")
    return mode


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvdd_backend" in metafunc.fixturenames:
        metafunc.parametrize("kvdd_backend", selected_backends(metafunc.config), indirect=True)


@pytest.fixture
def kvdd_backend(request: pytest.FixtureRequest) -> str:
    """The backend of this run of the test (``"sim"`` or ``"native"``)."""
    name: str = getattr(request, "param", None) or selected_backends(request.config)[0]
    marker = request.node.get_closest_marker("kvdd_sim_only")
    if marker is not None and name != "sim":
        reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
        pytest.skip(f"simulator only: {reason}")
    return name


InstanceFactory = Callable[..., kvdd.LlmDataDist]
PeerFactory = Callable[..., Peer]
CacheFactory = Callable[..., RegisteredCache]


@pytest.fixture
def kvdd_instance(kvdd_backend: str, _kvdd_leaks: None) -> Iterator[InstanceFactory]:
    """``kvdd_instance(cluster_id, role=LlmRole.MIX, *, listen=True, options=None)``: an
    initialized ``kvdd.LlmDataDist`` of this process, finalized at tear-down."""
    made: list[kvdd.LlmDataDist] = []

    def make(cluster_id: int, role: int = kvdd.LlmRole.MIX, *, listen: bool = True,
             options: Mapping[str, str] | None = None) -> kvdd.LlmDataDist:
        dd = kvdd.LlmDataDist(cluster_id, role, backend=kvdd_backend)
        made.append(dd)
        dd.initialize({**listen_options(kvdd_backend, listen=listen), **(options or {})})
        return dd

    yield make
    for dd in reversed(made):
        dd.finalize()


@pytest.fixture
def kvdd_peer(request: pytest.FixtureRequest, kvdd_backend: str,
              _kvdd_leaks: None) -> Iterator[PeerFactory]:
    """``kvdd_peer(cluster_id, role=LlmRole.PROMPT, options=None, env=None)``: an initialized,
    listening peer where ``--kvdd-peer`` says (``env``: extra environment of a peer process)."""
    mode = peer_mode(request.config)
    made: list[Peer] = []

    def make(cluster_id: int, role: int = kvdd.LlmRole.PROMPT,
             options: Mapping[str, str] | None = None, *,
             env: Mapping[str, str] | None = None) -> Peer:
        peer: Peer
        if mode == "process":
            peer = RemotePeer(cluster_id, role, kvdd_backend, options, env=env)
        else:
            peer = LocalPeer(cluster_id, role, kvdd_backend, options)
        made.append(peer)
        return peer

    yield make
    for peer in reversed(made):
        peer.close()


@pytest.fixture
def kvdd_cache(kvdd_backend: str) -> Iterator[CacheFactory]:
    """``kvdd_cache(dd, desc, fill=None)``: memory registered as a cache of ``dd``."""
    made: list[RegisteredCache] = []

    def make(dd: kvdd.LlmDataDist, desc: kvdd.CacheDesc, fill: int | None = None) -> RegisteredCache:
        cache = register_cache(dd, desc, backend=kvdd_backend, fill=fill)
        made.append(cache)
        return cache

    yield make
    for cache in reversed(made):
        cache.close()


class PrefillDecodePair:
    """A decode instance of this process and a prefill peer, linked by :meth:`link`.

    Register the prefill's caches first, then link: a link sees the peer's caches as they were
    when it was made (SEMANTICS.md §2.4), as on hardware.

    Attributes
    ----------
    decode : kvdd.LlmDataDist
        Initialized (cluster 2, role DECODER), not listening: the instance your code drives.
    prefill : Peer
        Initialized (cluster 1, role PROMPT), listening; in another process with
        ``--kvdd-peer process``.
    cluster : kvdd.ClusterInfo
        What :meth:`link` passes to ``decode.link_llm_clusters``.
    """

    def __init__(self, decode: kvdd.LlmDataDist, prefill: Peer) -> None:
        self.decode, self.prefill = decode, prefill
        self.cluster = prefill.cluster_info()
        self.linked = False

    def link(self, timeout_ms: int = 5000) -> None:
        """Link decode to prefill (``LinkLlmClusters``); raises ``kvdd.LLMError`` on failure."""
        self.decode.link_llm_clusters([self.cluster], timeout_ms=timeout_ms)
        self.linked = True

    def unlink(self, force: bool = False) -> None:
        """Unlink them (``UnlinkLlmClusters``)."""
        self.linked = False
        self.decode.unlink_llm_clusters([self.cluster], force=force)


@pytest.fixture
def kvdd_pair(kvdd_instance: InstanceFactory, kvdd_peer: PeerFactory) -> Iterator[PrefillDecodePair]:
    """Prefill (cluster 1, a peer) and decode (cluster 2, this process); ``pair.link()`` links
    them, tear-down unlinks and closes both."""
    prefill = kvdd_peer(1, kvdd.LlmRole.PROMPT)
    decode = kvdd_instance(2, kvdd.LlmRole.DECODER, listen=False)
    pair = PrefillDecodePair(decode, prefill)
    yield pair
    if pair.linked:
        try:
            pair.unlink(force=True)
        except kvdd.LLMError:
            pass  # the test finalized or lost the peer itself


class Faults:
    """Fault injection into this process's simulator calls for one test (``kvdd.sim.faults``).

    :meth:`inject` takes the arguments of ``kvdd.sim.faults.inject`` (docs/faults.md) and returns
    the injection (its ``seen``/``fired`` count the matching calls); every injection made here
    is removed at tear-down.
    """

    def __init__(self) -> None:
        self._made: list[Any] = []

    def inject(self, kinds: str | list[str], **kwargs: Any) -> Any:
        from kvdd.sim import faults
        injection = faults.inject(kinds, **kwargs)
        self._made.append(injection)
        return injection

    def remove_all(self) -> None:
        for injection in reversed(self._made):
            injection.remove()
        self._made.clear()


@pytest.fixture
def kvdd_faults(kvdd_backend: str) -> Iterator[Faults]:
    """Inject statuses into named calls for one test (simulator only: skips on native)."""
    if kvdd_backend != "sim":
        pytest.skip("fault injection is the simulator's (kvdd.sim.faults)")
    faults = Faults()
    yield faults
    faults.remove_all()


@pytest.fixture
def kvdd_llm_datadist() -> Iterator[ModuleType]:
    """``import llm_datadist`` resolves to ``kvdd.llm_datadist`` for one test (restored after)."""
    import sys

    from kvdd.llm_datadist import toplevel

    was = toplevel.is_installed()
    saved = {name: mod for name, mod in sys.modules.items()
             if name == "llm_datadist" or name.startswith("llm_datadist.")}
    toplevel.install()
    import llm_datadist  # type: ignore[import-not-found,unused-ignore]

    module: ModuleType = llm_datadist
    try:
        yield module
    finally:
        if not was:
            toplevel.uninstall()
        for name in [n for n in sys.modules if n == "llm_datadist" or n.startswith("llm_datadist.")]:
            del sys.modules[name]
        sys.modules.update(saved)


# ---- leak checks -----------------------------------------------------------------------------------


def _kvdd_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvdd")}


def _listening_inodes() -> set[str]:
    """Inodes of this process's listening TCP sockets."""
    mine: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    listening: set[str] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in mine:  # state LISTEN
                        listening.add(cols[9])
        except OSError:
            continue
    return listening


def _children() -> set[int]:
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return pids


def _leaks(threads: set[threading.Thread], listeners: set[str], children: set[int]) -> list[str]:
    new_threads = sorted(t.name for t in _kvdd_threads() - threads
                         if t.is_alive() and t.name not in _PROCESS_WIDE)
    found = []
    if new_threads:
        found.append(f"kvdd threads still running: {', '.join(new_threads)}")
    new_listeners = _listening_inodes() - listeners
    if new_listeners:
        found.append(f"{len(new_listeners)} listening socket(s) still open (an instance not "
                     "finalized?)")
    new_children = _children() - children
    if new_children:
        found.append(f"child process(es) still running: {sorted(new_children)}")
    return found


#: Threads kvdd starts once per process and keeps (not a leak of one test): the timer of leases
#: and deadlines, the finalizer of dropped instances, the same-host endpoint of the process, the
#: closer and the unmapper of same-host peers' files and mappings (kvdd.sim.fabric.samehost_close),
#: the fabric's pool (kvdd.sim.fabric.reactor: POOL_THREADS threads serving every link).
_PROCESS_WIDE = frozenset({"kvdd-sim-watchdog", "kvdd-sim-reaper", "kvdd-samehost-endpoint",
                           "kvdd-samehost-closer", "kvdd-samehost-unmap",
                           *(f"kvdd-sim-fabric-{i}" for i in range(4))})


@pytest.fixture
def _kvdd_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Runs the leak checks around a test that uses kvdd's instance or peer fixtures (their
    tear-downs run before this one's)."""
    if request.config.getoption("--kvdd-no-leak-check"):
        yield
        return
    threads, listeners, children = _kvdd_threads(), _listening_inodes(), _children()
    yield
    deadline = time.monotonic() + _LEAK_GRACE_S
    while True:
        found = _leaks(threads, listeners, children)
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if found:
        pytest.fail("kvdd leak check: " + "; ".join(found) + " (run with --kvdd-no-leak-check "
                    "to turn the check off)", pytrace=False)
