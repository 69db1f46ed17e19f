"""The process's one engine: ``initialize_v2``, ``finalize_v2``, ``switch_role_v2`` (PYPKG.md §1.4,
§2.3, §3.1-3.2, §3.5) over kvdd's simulator instance (:class:`.instance.PkgInstance`).

Upstream's wrapper keeps a process-wide singleton of the internal engine ``LLMDataDistV2``
(``llm_datadist_v2_wrapper.cc:22-35``): ``initialize_v2`` fails with ``LLM_FAILED`` while one
exists and keeps the new one only on success (a failed one is destroyed: its listen port closes).
The internal engine reads the *derived* options of ``LLMDataDist.init`` (§2.2): ``llm.Role``,
``llm.TransferBackend``, ``llm.EnableRemoteCacheAccessible``, a single ``ge.exec.deviceId``, the
internal ``llm.ListenIp`` / ``llm.ListenPort`` — not the public class's ``llm.DeviceId`` /
``llm.ListenIpInfo``, which are ignored here (§2.3, last paragraph).  The comm / hixl engines and
the cache engine then read the remaining keys exactly as kvdd's simulator does for the C++ class
(SEMANTICS.md §3.2 steps 6-9), so they are handed to :meth:`SimBackend.initialize` unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from ...options import (
    OPTION_DEVICE_ID,
    OPTION_HOST_MEM_POOL_CONFIG,
    OPTION_LINK_TOTAL_TIME,
    OPTION_LISTEN_IP_INFO,
    OPTION_MEM_POOL_CONFIG,
    OPTION_TRANSFER_BACKEND,
    OptionError,
    parse_option,
)
from ...status import FAILED, PARAM_INVALID, S_OK, Status
from .instance import PkgInstance
from .protocols import PkgEngine
from .ranktable import Domains

__all__ = ["Engine", "current", "initialize_v2", "finalize_v2", "switch_role_v2",
           "last_error_detail", "ROLES", "OPTION_ROLE", "OPTION_REMOTE_CACHE_ACCESSIBLE",
           "OPTION_EXEC_DEVICE_ID"]

logger = logging.getLogger(__name__)

OPTION_ROLE = "llm.Role"
OPTION_REMOTE_CACHE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
OPTION_EXEC_DEVICE_ID = "ge.exec.deviceId"
#: ``llm.Role`` / ``switch_role_v2`` role strings -> kvdd role values (PROMPT=1, DECODER=2, MIX=3).
ROLES = {"Prompt": 1, "Decoder": 2, "Mix": 3}
_DEFAULT_LINK_TOTAL_S = 30  # llm.LinkTotalTime 0 (or absent): comm_link_manager.cc:90


class Engine:
    """The process's engine (implements :class:`.protocols.PkgEngine`); made by
    :func:`initialize_v2`, dropped by :func:`finalize_v2`."""

    def __init__(self, instance: PkgInstance, options: Mapping[str, str], link_total_s: int) -> None:
        self.instance = instance
        self.cluster_id = instance.cluster_id
        self.remote_accessible = instance.remote_accessible
        self.sync_wait_ms = instance.sync_wait_ms
        self.transfer_backend = instance.transfer_backend
        self.mem_pool_config = options.get(OPTION_MEM_POOL_CONFIG, "")
        self.host_mem_pool_config = options.get(OPTION_HOST_MEM_POOL_CONFIG, "")
        self.link_total_s = link_total_s
        self.domains = Domains(instance, link_total_s)
        instance.domains = self.domains

    def link_pending(self, remote_cluster_id: int) -> bool:
        return self.domains.pending(remote_cluster_id)


_lock = threading.Lock()
_engine: Engine | None = None
_local = threading.local()


def _fail(status: int, detail: str) -> int:
    _local.detail = detail
    return status


def last_error_detail() -> str | None:
    """Why this thread's last failing lifecycle/link call failed (then forgotten)."""
    detail: str | None = getattr(_local, "detail", None)
    _local.detail = None
    if detail is None:
        engine = _engine
        if engine is not None:
            detail = engine.instance.last_error_detail()
    return detail


def current() -> PkgEngine | None:
    """The process's engine, or None before ``initialize_v2`` / after ``finalize_v2``."""
    return _engine


def current_engine() -> Engine | None:
    """:func:`current` with its concrete type (the links modules of this package)."""
    return _engine


def note(status: int, detail: str) -> int:
    """Record why a call of this package fails with ``status`` on this thread; returns it."""
    return _fail(status, detail)


def _check_options(options: Mapping[str, str]) -> tuple[int, bool, int]:
    """The internal engine's own reads before the transfer engine's (PYPKG.md §2.3): the role,
    remote-accessible mode and device; OptionError (PARAM_INVALID) on a bad value."""
    if OPTION_ROLE not in options:  # llm_datadist_v2.cc:60-61
        raise OptionError(f"option {OPTION_ROLE} is required")
    role = ROLES.get(options[OPTION_ROLE], 3)  # its value is only logged upstream
    hixl = parse_option("factory", OPTION_TRANSFER_BACKEND, options)  # absent, "hixl", else invalid
    ra = options.get(OPTION_REMOTE_CACHE_ACCESSIBLE, "0")
    if ra not in ("0", "1"):  # llm_utils.cc:65-80
        raise OptionError(f"option {OPTION_REMOTE_CACHE_ACCESSIBLE} must be \"0\" or \"1\", "
                          f"not {ra!r}")
    device = parse_option("factory", OPTION_EXEC_DEVICE_ID, options)  # one int32, absent -> 0
    assert device is None or isinstance(device, int)
    if hixl and ra != "1":  # the hixl engine works one-sided only (PYPKG.md §0 item 6)
        raise OptionError(f"the hixl transfer backend needs {OPTION_REMOTE_CACHE_ACCESSIBLE}=1")
    return role, ra == "1", 0 if device is None else device


def initialize_v2(cluster_id: int, options: Mapping[str, str]) -> int:
    """Create the process's engine (``initialize_v2``, PYPKG.md §1.4, §2.3, §3.1 step 6).

    Parameters
    ----------
    cluster_id : int
        This engine's cluster id (uint64; the key peers link and transfer by).
    options : Mapping[str, str]
        The options ``LLMDataDist.init`` derived (§2.2).

    Returns
    -------
    int
        ``LLM_SUCCESS``; ``LLM_FAILED`` while an engine exists, for a negative device or a port
        that cannot be bound; ``LLM_PARAM_INVALID`` for an option the engine rejects (§2.3).
        On failure nothing stays registered or listening and the call may be retried.
    """
    global _engine
    with _lock:
        if _engine is not None:
            return _fail(FAILED, "an engine is already initialized in this process "
                         "(one LLMDataDist per process; finalize it first)")
        try:
            role, remote_accessible, device = _check_options(options)
        except OptionError as exc:
            return _fail(exc.status, str(exc))
        if device < 0:  # aclrtSetDevice fails; its raw code becomes LLM_FAILED in Python
            return _fail(FAILED, f"cannot use device {device} ({OPTION_EXEC_DEVICE_ID})")
        sim_options = {k: v for k, v in options.items()
                       if k not in (OPTION_DEVICE_ID, OPTION_LISTEN_IP_INFO)}  # public-class keys
        sim_options[OPTION_DEVICE_ID] = str(device)
        instance = PkgInstance(cluster_id, role, remote_accessible)
        status = instance.initialize(sim_options)
        if status != S_OK:
            detail = instance.last_error_detail() or "initialization failed"
            _discard(instance)
            return _fail(status, detail)
        try:  # comm: validated by the instance; hixl ignores it
            total = parse_option("comm", OPTION_LINK_TOTAL_TIME, options)
        except OptionError:
            total = None
        link_total_s = total if isinstance(total, int) and total > 0 else _DEFAULT_LINK_TOTAL_S
        _engine = Engine(instance, options, link_total_s)
        return int(S_OK)


def _discard(instance: PkgInstance) -> None:
    """A failed engine is destroyed upstream: nothing of it stays (its listen port closes,
    including the one a failed Initialize keeps until destroyed, SEMANTICS.md §3.2 step 10)."""
    instance.destroy()
    listener = instance.listener
    if listener is not None:
        listener.close()
        instance.listener = None


def finalize_v2() -> None:
    """Tear the engine down: rank-table domains, links (local side), registrations, listeners
    (PYPKG.md §3.2); a no-op without one.  A later ``initialize_v2`` starts afresh (cache and
    comm ids from 1)."""
    global _engine
    with _lock:
        engine, _engine = _engine, None
    if engine is None:
        return
    engine.domains.close()
    engine.instance.finalize()


def switch_role_v2(role: str, options: Mapping[str, str]) -> int:
    """``switch_role_v2`` (PYPKG.md §3.5; SEMANTICS.md §3.4 steps 2-7 natively).

    ``role`` is ``"Prompt"``, ``"Decoder"`` or ``"Mix"``; ``options`` carries ``llm.ListenIp`` /
    ``llm.ListenPort`` when the caller gave ``llm.listenIpInfo``.  Comm: any link entity (from
    ``link_clusters`` or a rank-table ``link``) → ``LLM_EXIST_LINK``; the same port → nothing;
    another → the listener moves; no port → listening stops.  Hixl: another address →
    ``LLM_FEATURE_NOT_ENABLED``.  No engine → ``LLM_PARAM_INVALID`` (§1.4)."""
    engine = _engine
    if engine is None:
        return _fail(PARAM_INVALID, "no engine: initialize first")
    value = ROLES.get(role)
    if value is None:
        return _fail(PARAM_INVALID, f"role {role!r} is not Prompt, Decoder or Mix")
    sim_options = {k: v for k, v in options.items() if k != OPTION_LISTEN_IP_INFO}
    status = engine.instance.set_role(value, sim_options)
    if status != S_OK:
        return _fail(status, engine.instance.last_error_detail() or "switch_role failed")
    return int(Status.LLM_SUCCESS)
