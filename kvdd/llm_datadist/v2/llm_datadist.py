"""``LLMDataDist``: one LLM-DataDist engine per process (PYPKG.md §3).

Only cache-manager mode exists in kvdd (``llm.EnableCacheManager == "1"``, implied by
``llm.LocalCommRes``); legacy mode needs CANN's ``llm_datadist_v1`` package, which kvdd does not
provide, so ``init`` in legacy mode raises ``ModuleNotFoundError`` naming it (PYPKG.md §9.10).
"""

from __future__ import annotations

import atexit
from typing import Any, ClassVar

from .. import _engine
from .. import llm_datadist_wrapper as _native_module
from .._seam import ClusterTuple, Wrapper
from ..configs import LLMClusterInfo, LLMRole
from ..status import LLMException, LLMStatusCode, code_2_status, handle_llm_status, raise_if_false
from ..utils.log import logger
from ..utils.utils import (
    UINT32_MAX,
    check_dict,
    check_int32,
    check_isinstance,
    check_list_of,
    check_uint32,
    check_uint64,
)
from .cache_manager import CacheManager
from .llm_types import RegisterMemStatus, int_to_mem_status_dict
from .llm_utils import parse_listen_ip_info

__all__ = ["LLMDataDist", "LEGACY_PACKAGE"]

#: the legacy ("v1") package upstream imports for legacy mode
LEGACY_PACKAGE = "llm_datadist_v1"

#: The engine ``init`` starts, under upstream's name for its native module: kvdd's stand-in module,
#: which forwards every call to :func:`kvdd.llm_datadist._engine.wrapper`.  Replaceable by a test
#: double (as upstream's tests patch it).
llm_datadist_wrapper: Wrapper = _native_module

_ROLE_NAMES = {LLMRole.PROMPT: "Prompt", LLMRole.DECODER: "Decoder", LLMRole.MIX: "Mix"}
_MAX_COMM_NAME = 128
_MAX_RANK_INFO = 4


def _legacy_missing(what: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"{what} needs CANN's legacy package '{LEGACY_PACKAGE}' (KvCacheManager), which kvdd's "
        f"simulator does not provide; use cache-manager mode (LLMConfig.enable_cache_manager = True).",
        name=LEGACY_PACKAGE)


def _native_ips(ips: list[tuple[int, int]]) -> list[tuple[int, int]]:
    # an int IP is taken as packed; one the engine's uint32 cannot hold is a TypeError, as the
    # native binding raises
    for ip, _port in ips:
        if not 0 <= ip <= UINT32_MAX:
            raise TypeError(f"ip {ip} cannot be passed to the engine as a packed IPv4 (uint32).")
    return ips


class LLMDataDist:
    """An LLM-DataDist instance (CANN ``llm_datadist.LLMDataDist``, PYPKG.md §3).

    Parameters
    ----------
    role
        :class:`LLMRole` (``TypeError`` otherwise; None passes here and fails in :meth:`init`).
    cluster_id
        This instance's cluster id (uint64; ``TypeError`` / ``ValueError``).

    Notes
    -----
    One engine per process: a second instance's :meth:`init` raises LLM_FAILED until the first
    is finalized. Every method except :meth:`init` / :meth:`finalize` raises ``RuntimeError``
    ("llm datadist is not initialized") before :meth:`init`.
    """

    llm_engine_instance: ClassVar[LLMDataDist | None] = None

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole)
        check_uint64("cluster_id", cluster_id)
        self._role = role
        self._cluster_id = cluster_id
        self._is_initialized = False
        self._enable_cache_mgr = False
        self._enable_local_comm_res = False
        self._engine_options: dict[str, str] = {}
        self._cache_manager: CacheManager | None = None
        self._kv_cache_manager: Any = None  # legacy mode only; never set by kvdd
        self._llm_datadist: Wrapper | None = None

    # -- lifecycle (§3.1, §3.2) ----------------------------------------------------------------

    def init(self, options: dict[str, str]) -> None:
        """Start the process's engine with ``options`` (``LLMConfig.generate_options()`` plus any
        raw keys; CANN ``LLMDataDist.init``, PYPKG.md §3.1, §2.2).

        Raises
        ------
        TypeError
            ``options`` not a dict; ``ge.flowGraphMemMaxSize`` not a str.
        ValueError
            A non-numeric ``llm.listenIpInfo`` port.
        ModuleNotFoundError
            Legacy mode (no ``llm.EnableCacheManager="1"`` and no ``llm.LocalCommRes``).
        LLMException
            LLM_FAILED: another instance is initialized; LLM_PARAM_INVALID: the option rules of
            PYPKG.md §2.2; the engine's status (PYPKG.md §2.3) otherwise.
        """
        if self._is_initialized:
            return
        if LLMDataDist.llm_engine_instance is not None:
            raise LLMException("Cannot init multiple LLMDataDists in one process.",
                               status_code=LLMStatusCode.LLM_FAILED)
        check_isinstance("options", options, dict, allow_none=False)
        self._check_flow_graph_mem_max_size(options)
        derived = self._derive_options(options)
        if not self._enable_cache_mgr:
            raise _legacy_missing("LLMDataDist.init in legacy mode")
        wrapper = llm_datadist_wrapper
        status = wrapper.initialize_v2(self._cluster_id, derived)
        if status != 0:
            handle_llm_status(status, "init", _engine.with_detail(wrapper, f"options={options}"))
        self._llm_datadist = wrapper
        self._engine_options = derived
        self._cache_manager = CacheManager(wrapper, derived)
        self._is_initialized = True
        LLMDataDist.llm_engine_instance = self

    @staticmethod
    def _check_flow_graph_mem_max_size(options: dict[str, str]) -> None:
        if "ge.flowGraphMemMaxSize" not in options:
            return
        value: Any = options["ge.flowGraphMemMaxSize"]
        if not isinstance(value, str):
            raise TypeError(f"ge.flowGraphMemMaxSize must be str, but got {type(value).__name__}.")
        raise_if_false("," not in value, "ge.flowGraphMemMaxSize must be a single value.")
        raise_if_false(value.isdigit(), f"ge.flowGraphMemMaxSize must be digits, but got '{value}'.")

    def _derive_options(self, options: dict[str, str]) -> dict[str, str]:
        derived = options.copy()
        derived["llm.Role"] = self._role_to_str(self._role)  # KeyError for role=None, as upstream
        if "llm.LocalCommRes" in derived:
            derived.setdefault("llm.EnableCacheManager", "1")
            derived.setdefault("llm.EnableRemoteCacheAccessible", "1")
        self._enable_cache_mgr = derived.get("llm.EnableCacheManager") == "1"
        self._enable_local_comm_res = "llm.LocalCommRes" in derived
        raise_if_false(not self._enable_local_comm_res or self._enable_cache_mgr,
                       "llm.LocalCommRes needs cache-manager mode (llm.EnableCacheManager=1).")
        if "llm.TransferBackend" in derived:
            raise_if_false(self._enable_cache_mgr,
                           "llm.TransferBackend needs cache-manager mode (llm.EnableCacheManager=1).")
            if "llm.EnableRemoteCacheAccessible" not in options:
                derived["llm.EnableRemoteCacheAccessible"] = "1"
            raise_if_false(derived["llm.EnableRemoteCacheAccessible"] == "1",
                           "llm.TransferBackend needs llm.EnableRemoteCacheAccessible=1.")
            raise_if_false("llm.listenIpInfo" in derived, "llm.TransferBackend needs llm.listenIpInfo.")
        if self._enable_cache_mgr and "llm.listenIpInfo" in derived:
            ip, port = parse_listen_ip_info(derived["llm.listenIpInfo"])
            derived["llm.ListenIp"], derived["llm.ListenPort"] = ip, str(port)
        return derived

    def finalize(self) -> None:
        """Tear the engine down (links, registrations, caches); a no-op when not initialized.
        A later :meth:`init` starts a fresh engine (ids restart at 1) (PYPKG.md §3.2)."""
        if not self._is_initialized:
            return
        if self._llm_datadist is not None:
            self._llm_datadist.finalize_v2()
        if self._cache_manager is not None:
            self._cache_manager._initialized = False
        self._is_initialized = False
        if LLMDataDist.llm_engine_instance is self:
            LLMDataDist.llm_engine_instance = None

    # -- helpers -------------------------------------------------------------------------------

    def _check_initialized(self) -> Wrapper:
        if not self._is_initialized:
            raise RuntimeError("llm datadist is not initialized")
        return self._llm_datadist if self._llm_datadist is not None else llm_datadist_wrapper

    @staticmethod
    def _role_to_str(role: LLMRole) -> str:
        """The engine's role name: "Prompt", "Decoder" or "Mix"."""
        return _ROLE_NAMES[role]

    def _check_is_cache_mgr_mode(self, name: str) -> None:
        raise_if_false(self._enable_cache_mgr, f"{name} is only supported in cache-manager mode.")

    def _check_is_not_cache_mgr_mode(self, name: str) -> None:
        raise_if_false(not self._enable_cache_mgr, f"{name} is not supported in cache-manager mode.")

    def _raise(self, wrapper: Wrapper, status: int, func: str, info: str) -> None:
        if status != 0:
            handle_llm_status(status, func, _engine.with_detail(wrapper, info))

    def _check_comm_id(self, name: str, comm_id: Any) -> Wrapper:
        wrapper = self._check_initialized()
        self._check_is_cache_mgr_mode(name)
        check_uint64("comm_id", comm_id)
        return wrapper

    # -- rank-table links (§3.3) ---------------------------------------------------------------

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Build a rank-table communication domain (CANN ``LLMDataDist.link``, PYPKG.md §3.3).

        Returns the comm id (1, 2, ... per engine) in state PREPARING; poll
        :meth:`query_register_mem_status` until OK. After it, new registrations default to not
        remote-accessible.

        Raises
        ------
        RuntimeError
            Not initialized.
        TypeError, ValueError
            Types; a key not uint64 or a rank not uint32.
        LLMException
            LLM_PARAM_INVALID: empty or >= 128-character name, fewer than 2 or more than 4
            members, ranks out of order (equal ranks pass); engine statuses (own cluster id absent, LINK_FAILED...).
        """
        wrapper = self._check_initialized()
        self._check_is_cache_mgr_mode("link")
        check_isinstance("comm_name", comm_name, str, allow_none=False)
        raise_if_false(len(comm_name) > 0, "comm_name must not be empty.")
        raise_if_false(len(comm_name) < _MAX_COMM_NAME,
                       f"comm_name must be shorter than {_MAX_COMM_NAME} characters.")
        check_dict("cluster_rank_info", cluster_rank_info, int, int, allow_none=False)
        raise_if_false(len(cluster_rank_info) <= _MAX_RANK_INFO,
                       f"cluster_rank_info has more than {_MAX_RANK_INFO} entries.")
        for cluster_id, rank in cluster_rank_info.items():
            check_uint64("cluster_rank_info key", cluster_id)
            check_uint32("cluster_rank_info value", rank)
        check_isinstance("rank_table", rank_table, str)  # None passes here, as upstream
        raise_if_false(len(cluster_rank_info) >= 2, "cluster_rank_info needs at least 2 entries.")
        ranks = list(cluster_rank_info.values())
        raise_if_false(ranks == sorted(ranks),
                       f"cluster_rank_info ranks must be in ascending order, but got {ranks}.")
        if rank_table is None:  # what the native binding does with None for a std::string
            raise TypeError("rank_table only supports str, but got NoneType.")
        status, comm_id = wrapper.link(comm_name, list(cluster_rank_info.items()), rank_table)
        self._raise(wrapper, status, "link", f"comm_name={comm_name}")
        assert self._cache_manager is not None
        self._cache_manager.set_is_call_linked()
        return comm_id

    def unlink(self, comm_id: int) -> None:
        """Destroy a rank-table domain on this side (CANN ``unlink``, PYPKG.md §3.3); an unknown
        id raises LLM_NOT_YET_LINK."""
        wrapper = self._check_comm_id("unlink", comm_id)
        self._raise(wrapper, wrapper.unlink(comm_id), "unlink", f"comm_id={comm_id}")

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """PREPARING, then OK or FAILED (sticky) for a comm id from :meth:`link` (CANN
        ``query_register_mem_status``, PYPKG.md §3.3); unknown id -> LLM_NOT_YET_LINK raised."""
        wrapper = self._check_comm_id("query_register_mem_status", comm_id)
        status, value = wrapper.query_register_mem_status(comm_id)
        self._raise(wrapper, status, "query_register_mem_status", f"comm_id={comm_id}")
        return int_to_mem_status_dict.get(value, RegisterMemStatus.FAILED)

    # -- cluster links (§3.4) ------------------------------------------------------------------

    def _check_clusters(self, clusters: Any, timeout: Any) -> Wrapper:
        wrapper = self._check_initialized()
        check_int32("timeout", timeout)
        raise_if_false(timeout > 0, f"timeout must be > 0, but got {timeout}.")
        check_list_of("clusters", clusters, LLMClusterInfo, allow_none=False)
        return wrapper

    def link_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                      timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to listening peers (CANN ``link_clusters``, PYPKG.md §3.4).

        ``timeout`` in **milliseconds**. Engine failures are **returned**:
        ``(overall, [per cluster])``; an empty list returns ``(LLM_PARAM_INVALID, [])``.

        Raises
        ------
        RuntimeError
            Not initialized.
        TypeError, ValueError
            Types; ``remote_cluster_id`` unset.
        LLMException
            LLM_PARAM_INVALID: ``timeout <= 0``; a cluster without a local IP while
            ``llm.LocalCommRes`` is absent or empty.
        """
        wrapper = self._check_clusters(clusters, timeout)
        if not self._enable_cache_mgr:
            raise _legacy_missing("link_clusters in legacy mode")
        need_local_ip = not self._engine_options.get("llm.LocalCommRes")
        tuples: list[ClusterTuple] = []
        for cluster in clusters:
            raise_if_false(not (need_local_ip and not cluster.local_ip_info_list),
                           "local_ip_info_list is empty; it is required without a non-empty llm.LocalCommRes.")
            check_uint64("remote_cluster_id", cluster.remote_cluster_id)
            assert cluster.remote_cluster_id is not None
            tuples.append((cluster.remote_cluster_id, 0, _native_ips(cluster.local_ip_info_list),
                           _native_ips(cluster.remote_ip_info_list)))
        status, rets = wrapper.link_clusters_v2(tuples, timeout)
        return code_2_status(status), [code_2_status(r) for r in rets]

    def unlink_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                        timeout: int = 3000, force: bool | None = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink peers on this side (CANN ``unlink_clusters``, PYPKG.md §3.4); ``force`` cleans
        up without the peer. Returns ``(overall, [per cluster])`` like :meth:`link_clusters`."""
        wrapper = self._check_clusters(clusters, timeout)
        check_isinstance("force", force, bool)  # None passes, and the engine takes it as False
        if not self._enable_cache_mgr:
            raise _legacy_missing("unlink_clusters in legacy mode")
        tuples: list[ClusterTuple] = []
        for cluster in clusters:
            check_uint64("remote_cluster_id", cluster.remote_cluster_id)
            assert cluster.remote_cluster_id is not None
            tuples.append((cluster.remote_cluster_id, 0, [], _native_ips(cluster.remote_ip_info_list)))
        status, rets = wrapper.unlink_clusters_v2(tuples, timeout, bool(force))
        return code_2_status(status), [code_2_status(r) for r in rets]

    # -- role (§3.5) ---------------------------------------------------------------------------

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """Change the role; ``llm.listenIpInfo`` in ``switch_options`` (re)starts the listener,
        no listen address stops it (CANN ``switch_role``, PYPKG.md §3.5).

        Raises ``RuntimeError`` (not initialized), ``TypeError``, ``KeyError`` (role None, as upstream),
        ``ValueError`` (port), and the
        engine's status (LLM_EXIST_LINK while links exist)."""
        wrapper = self._check_initialized()
        check_isinstance("role", role, LLMRole)  # None passes, as upstream ...
        if not self._enable_cache_mgr:  # legacy mode's Python rules (PYPKG.md §3.5)
            raise_if_false(role != self._role, f"the role is already {role}.")
        role_name = self._role_to_str(role)  # ... and fails here with KeyError
        check_isinstance("switch_options", switch_options, dict)
        options = dict(switch_options or {})
        if not self._enable_cache_mgr:
            raise_if_false(role != LLMRole.PROMPT or "llm.listenIpInfo" in options,
                           "switching to PROMPT needs llm.listenIpInfo.")
            raise _legacy_missing("switch_role in legacy mode")
        if "llm.listenIpInfo" in options:
            ip, port = parse_listen_ip_info(options["llm.listenIpInfo"])
            options["llm.ListenIp"], options["llm.ListenPort"] = ip, str(port)
        self._raise(wrapper, wrapper.switch_role_v2(role_name, options), "switch_role",
                    f"role={role}")
        self._role = role

    # -- properties (§3.6) ---------------------------------------------------------------------

    @property
    def cache_manager(self) -> CacheManager:
        """The :class:`CacheManager` (the same object until the next :meth:`init`)."""
        self._check_initialized()
        self._check_is_cache_mgr_mode("cache_manager")
        assert self._cache_manager is not None
        return self._cache_manager

    @property
    def kv_cache_manager(self) -> Any:
        """Legacy mode only: LLM_PARAM_INVALID in cache-manager mode (kvdd has no legacy mode)."""
        self._check_initialized()
        self._check_is_not_cache_mgr_mode("kv_cache_manager")
        if self._kv_cache_manager is None:
            raise _legacy_missing("kv_cache_manager")
        return self._kv_cache_manager

    @property
    def cluster_id(self) -> int:
        """The constructor's cluster id (no ``init`` needed)."""
        return self._cluster_id

    def check_link_status(self, remote_cluster_id: int) -> None:
        """Legacy mode only: LLM_PARAM_INVALID in cache-manager mode."""
        self._check_initialized()
        self._check_is_not_cache_mgr_mode("check_link_status")
        raise _legacy_missing("check_link_status")


def _shutdown_handler() -> None:
    """At interpreter exit: finalize the live instance; an LLMException is logged, not raised."""
    instance = LLMDataDist.llm_engine_instance
    if instance is not None:
        try:
            instance.finalize()
        except LLMException as exc:
            logger.warning("finalize at exit failed: %s", exc)


atexit.register(_shutdown_handler)
