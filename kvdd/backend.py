"""The Backend protocol and backend selection (API.md "Backends").

A backend implements the LLM-DataDist V2 calls on some substrate (``sim``: kvdd's simulator on
host memory; ``native``: the real ``libllm_datadist.so`` through the Cython binding) and returns raw
integer statuses; it never raises for an LLM status.  :class:`kvdd.LlmDataDist` wraps one.
"""

from __future__ import annotations

import glob
import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from .status import BackendUnavailableError
from .types import Cache, CacheDesc, CacheIndex, ClusterInfo, KvCacheExtParam, RegisterCfg

__all__ = [
    "Backend",
    "FastTransfers",
    "fast_transfers",
    "BACKEND_NAMES",
    "available_backends",
    "backend_problem",
    "create_backend",
    "resolve_backend_name",
    "looks_like_ascend_node",
]

BACKEND_NAMES: tuple[str, ...] = ("sim", "native")
ENV_VAR = "KVDD_BACKEND"


@runtime_checkable
class Backend(Protocol):
    """What every backend implements: the C++ ``LlmDataDist`` methods, statuses as ints.

    Argument names and order are those of :class:`kvdd.LlmDataDist`; outputs come back with the
    status (``(status, rets)`` for link/unlink, ``(status, cache_id)`` for registration,
    ``(status, cache | None)`` for allocate_cache).  A backend never raises for an LLM status: it
    returns it and explains it through :meth:`last_error_detail`, and the facade turns both into
    an exception in one place (:func:`kvdd.status.raise_for_status`).
    """

    @property
    def listen_port(self) -> int | None: ...

    def last_error_detail(self) -> str | None:
        """The backend's explanation of the calling thread's last non-success status.

        Returns
        -------
        str or None
            None when it has none (and after it was read once).  The simulator says which check
            of SEMANTICS.md failed; the native backend gives the message of a C++ exception the
            library threw (the call then returned ``LLM_FAILED``).
        """
        ...

    def initialize(self, options: Mapping[str, str]) -> int: ...

    def finalize(self) -> None: ...

    def set_role(self, role: int, options: Mapping[str, str]) -> int: ...

    def link_llm_clusters(
        self, clusters: Sequence[ClusterInfo], timeout_ms: int
    ) -> tuple[int, list[int]]: ...

    def unlink_llm_clusters(
        self, clusters: Sequence[ClusterInfo], timeout_ms: int, force: bool
    ) -> tuple[int, list[int]]: ...

    def register_kv_cache(
        self, cache_desc: CacheDesc, addrs: Sequence[int], cfg: RegisterCfg
    ) -> tuple[int, int]: ...

    def unregister_kv_cache(self, cache_id: int) -> int: ...

    def allocate_cache(self, cache_desc: CacheDesc) -> tuple[int, Cache | None]: ...

    def deallocate_cache(self, cache_id: int) -> int: ...

    def pull_kv_cache(
        self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int, size: int,
        ext_param: KvCacheExtParam,
    ) -> int: ...

    def pull_kv_blocks(
        self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: Sequence[int],
        dst_blocks: Sequence[int], ext_param: KvCacheExtParam,
    ) -> int: ...

    def push_kv_cache(
        self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int, size: int,
        ext_param: KvCacheExtParam,
    ) -> int: ...

    def push_kv_blocks(
        self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
        dst_blocks: Sequence[int], ext_param: KvCacheExtParam,
    ) -> int: ...

    def copy_kv_cache(
        self, src_cache: Cache, dst_cache: Cache, src_batch_index: int, dst_batch_index: int,
        offset: int, size: int,
    ) -> int: ...

    def copy_kv_blocks(
        self, src_cache: Cache, dst_cache: Cache, src_blocks: Sequence[int],
        dst_blocks_list: Sequence[Sequence[int]],
    ) -> int: ...


class FastTransfers(Protocol):
    """A backend's optional compiled path for its common transfers (the simulator's:
    :class:`kvdd.sim._fastpath.FastTransfers`).

    Each method takes the facade's arguments unchecked and returns True when it performed the call
    (it succeeded), False when it declined having done nothing; the facade then runs its checked
    path, which alone produces statuses and exceptions.  A backend that has one sets
    ``fast_transfers``.
    """

    def pull_kv_cache(self, src_cache_index: object, dst_cache: object, batch_index: object,
                      size: object, ext_param: object) -> bool: ...

    def pull_kv_blocks(self, src_cache_index: object, dst_cache: object, src_blocks: object,
                       dst_blocks: object, ext_param: object) -> bool: ...

    def push_kv_cache(self, src_cache: object, dst_cache_index: object, src_batch_index: object,
                      size: object, ext_param: object) -> bool: ...

    def push_kv_blocks(self, src_cache: object, dst_cache_index: object, src_blocks: object,
                       dst_blocks: object, ext_param: object) -> bool: ...


def fast_transfers(backend: Backend) -> FastTransfers | None:
    """``backend.fast_transfers`` when the backend has a compiled transfer path, else None."""
    fast: FastTransfers | None = getattr(backend, "fast_transfers", None)
    return fast


def _build_config() -> tuple[bool, bool, str]:
    try:
        # generated by meson at build time, so imported by name (mypy cannot see it in a source tree)
        cfg = importlib.import_module("kvdd._build_config")
    except ImportError:  # running from a source tree without a build
        return False, False, "kvdd was not built with meson (no _build_config)"
    return bool(cfg.NATIVE_BUILT), bool(cfg.NATIVE_TEST_DOUBLE), str(cfg.NATIVE_REASON)


def backend_problem(name: str) -> str | None:
    """Why backend ``name`` cannot be used here, or None when it can."""
    if name == "sim":
        return None
    if name != "native":
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(BACKEND_NAMES)}")
    built, _, reason = _build_config()
    if not built:
        return (
            f"the native backend was not built ({reason}). On an Atlas node with CANN, rebuild "
            "with: pip install '.[test]' -Csetup-args=-Dnative=enabled "
            "-Csetup-args=-Dascend-home=$ASCEND_HOME_PATH"
        )
    try:
        importlib.import_module("kvdd._native._datadist")
    except ImportError as exc:
        return (
            f"the native backend is built but does not load ({exc}); source CANN's set_env.sh "
            "so that LD_LIBRARY_PATH finds libllm_datadist.so"
        )
    return None


def link_data_path(backend: Backend, remote_cluster_id: int) -> str | None:
    """How ``backend``'s link to ``remote_cluster_id`` moves bytes (introspection, e.g. for benchmarks).

    Parameters
    ----------
    backend : Backend
        :attr:`kvdd.LlmDataDist.backend`.
    remote_cluster_id : int
        The linked peer's cluster id.

    Returns
    -------
    str or None
        The simulator's ``"in_process"`` (a peer in this process: the copy kernels),
        ``"process_vm"`` (another process on this host: one-sided copies from the peer's
        ``/proc/<pid>/mem``, or through a mapping of its ``kvdd.empty`` memory) or ``"tcp"``
        (docs/backends.md); None when there is no such link or the backend does not say (native).
    """
    getter = getattr(backend, "link_data_path", None)
    path = getter(remote_cluster_id) if callable(getter) else None
    return path if isinstance(path, str) else None


def available_backends() -> tuple[str, ...]:
    """Names of the backends usable in this installation, e.g. ``('sim',)`` or ``('sim', 'native')``."""
    return tuple(name for name in BACKEND_NAMES if backend_problem(name) is None)


def looks_like_ascend_node() -> bool:
    """True when ``ASCEND_HOME_PATH`` is set or ``/dev/davinci*`` devices exist.

    An ``ASCEND_HOME_PATH`` that points at kvdd's simulated CANN root (``kvdd cann-root``) does not
    count: sourcing its ``set_env.sh`` leaves backend selection as it was.
    """
    from .cann import is_simulated_root

    home = os.environ.get("ASCEND_HOME_PATH")
    return (bool(home) and not is_simulated_root(str(home))) or bool(glob.glob("/dev/davinci*"))


def resolve_backend_name(backend: str | None) -> str:
    """Apply API.md's selection rule: argument, then ``$KVDD_BACKEND``, then auto."""
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str or None, not {type(backend).__name__}")
        if backend not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {backend!r}; valid names: {', '.join(BACKEND_NAMES)}")
        return backend
    env = os.environ.get(ENV_VAR)
    if env:
        if env not in BACKEND_NAMES:
            raise ValueError(
                f"{ENV_VAR}={env!r} is not a backend; valid names: {', '.join(BACKEND_NAMES)}"
            )
        return env
    _, test_double, _ = _build_config()
    problem = backend_problem("native")
    if problem is None and not test_double:
        return "native"
    if looks_like_ascend_node():
        why = problem or ("the native backend was built against kvdd's simulated CANN root (a "
                          "test double, not a real CANN install)")
        raise BackendUnavailableError(
            "this machine looks like an Ascend node (ASCEND_HOME_PATH or /dev/davinci*) but "
            f"{why}. Build the native backend, or choose the simulator explicitly with "
            f"backend='sim' or {ENV_VAR}=sim."
        )
    return "sim"


def create_backend(name: str, cluster_id: int, role: int) -> Backend:
    """Instantiate backend ``name`` (already resolved) for one LlmDataDist instance."""
    if name == "sim":
        from .sim.engine import SimBackend

        return SimBackend(cluster_id, role)
    problem = backend_problem(name)
    if problem is not None:
        raise BackendUnavailableError(problem)
    module = importlib.import_module("kvdd._native._datadist")
    backend: Backend = module.NativeBackend(cluster_id, role)
    return backend
