"""The ``LlmDataDist`` facade: one instance of the C++ ``llm_datadist::LlmDataDist`` on a backend.

Every method checks its Python arguments (``TypeError``/``ValueError`` for values the C++ types cannot
hold), calls the backend and turns a non-success status into the :class:`kvdd.LLMError` subclass of
that status (docs/spec/API.md "Status and errors"); the behaviour of each call is
docs/spec/SEMANTICS.md §3.

Terms used below (docs/spec/SEMANTICS.md §2.1): a cache is ``num_tensors`` tensors of one shape
``[B, ...]``; T is the bytes of one tensor; a *row* (batch row) and a *block* are the same unit, one
index of the first dimension (``B = shape[0]`` of them); the *stride* S = T // B is the bytes of one
row or block of one tensor.  Sizes and offsets of transfers are in bytes of the **local** (caller's)
stride.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType

from .backend import Backend, FastTransfers, create_backend, fast_transfers, resolve_backend_name
from .calllog import DEBUG, cache_bytes, is_enabled, peer_of, peers_of, traced, tracing, transfer_bytes
from .calls import DEFAULT_EXT, check_clusters, check_tensor_sizes, check_type, ext_or_default, raise_status
from .memory import TensorAddrs
from .options import check_options
from .status import Status
from .types import (
    INT32,
    INT64,
    UINT32,
    UINT64,
    Cache,
    CacheDesc,
    CacheIndex,
    ClusterInfo,
    KvCacheExtParam,
    RegisterCfg,
    check_int,
    check_int_seq,
)
from .unsupported import UnsupportedCalls

__all__ = ["LlmDataDist"]


class LlmDataDist(UnsupportedCalls):
    """One LLM-DataDist instance (a *cluster*): C++ ``llm_datadist::LlmDataDist``.

    Parameters
    ----------
    cluster_id : int
        This instance's cluster id (uint64); peers address it in ``CacheIndex.cluster_id``.
    role : int
        An :class:`LlmRole` (any int32 is accepted here; Initialize rejects values outside 1..3 with
        LLM_PARAM_INVALID, docs/spec/SEMANTICS.md §3.2).
    backend : {"sim", "native"} or None
        ``None`` picks ``$KVDD_BACKEND``, else a real native build, else the simulator
        (docs/spec/API.md "Backends").

    Raises
    ------
    TypeError, ValueError
        ``cluster_id`` or ``role`` does not fit its C++ type; an unknown backend name.
    BackendUnavailableError
        The backend is not built or cannot load here.

    Notes
    -----
    Every method raises the :class:`LLMError` subclass of the status the C++ call returns
    (docs/spec/SEMANTICS.md §3), ``TypeError``/``ValueError`` for arguments that do not fit the C++
    types.  Use as a context manager: leaving the block calls :meth:`finalize`.  An instance that
    becomes unreachable without :meth:`finalize` is torn down as Finalize does, as upstream's
    destructor does (docs/spec/SEMANTICS.md §3.1): its listen port closes at once (for a reference
    cycle, when it is collected), its links and registrations are dropped soon after.
    """

    def __init__(self, cluster_id: int, role: int, *, backend: str | None = None) -> None:
        self._cluster_id = check_int("cluster_id", cluster_id, UINT64)
        self._role = check_int("role", role, INT32)
        self._backend_name = resolve_backend_name(backend)
        self._backend: Backend = create_backend(self._backend_name, self._cluster_id, self._role)
        # the backend's compiled path for common transfers, tried before the checked path
        self._fast: FastTransfers | None = fast_transfers(self._backend)
        # registered here: cache id -> (stride, num_tensors), for the bytes of DEBUG call records
        self._geometry: dict[int, tuple[int, int]] = {}

    # -- properties -------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        """``"sim"`` or ``"native"``: the backend this instance runs on."""
        return self._backend_name

    @property
    def backend(self) -> Backend:
        """The :class:`kvdd.Backend` object (statuses as ints, no exceptions; docs/spec/API.md)."""
        return self._backend

    @property
    def cluster_id(self) -> int:
        """The cluster id given to the constructor (uint64)."""
        return self._cluster_id

    @property
    def listen_port(self) -> int | None:
        """The TCP port of ``llm.ListenIpInfo``, or None when not listening.

        Returns
        -------
        int or None
            The port bound (the real one when port 0 was asked; the native backend reports 0
            there, as the C++ library has no call that tells), None before Initialize, after
            Finalize and on an instance without ``llm.ListenIpInfo``.  :attr:`listening_port`
            is the same as a plain ``int`` for typed code.
        """
        return self._backend.listen_port

    @property
    def listening_port(self) -> int:
        """The TCP port this instance listens on, as an ``int`` (docs/spec/API.md).

        For typed code that passes the port on (``IpInfo(ip, dd.listening_port)``) without a
        ``None`` check.

        Returns
        -------
        int
            The port bound for ``llm.ListenIpInfo`` (1..65535).

        Raises
        ------
        RuntimeError
            When the instance does not listen (not initialized, finalized, or initialized
            without ``kvdd.OPTION_LISTEN_IP_INFO``), or when the backend cannot tell which port
            ``":0"`` bound (native: the C++ library has no call for it).
        """
        port = self._backend.listen_port
        if port is None:
            raise RuntimeError(
                f"{self!r} is not listening: initialize it with "
                "{kvdd.OPTION_LISTEN_IP_INFO: 'IP:PORT'} (port 0 picks a free one) first; "
                "listen_port is None"
            )
        if port == 0:
            raise RuntimeError(
                f"{self!r} listens on port 0 as asked, and the {self._backend_name} backend cannot "
                "tell which port that bound; ask for a fixed port in llm.ListenIpInfo"
            )
        return port

    def __enter__(self) -> LlmDataDist:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.finalize()

    def __repr__(self) -> str:
        return f"LlmDataDist(cluster_id={self._cluster_id}, role={self._role}, backend={self._backend_name!r})"

    # -- lifecycle --------------------------------------------------------------------------
    def initialize(self, options: Mapping[str, str]) -> None:
        """Initialize with string options [Initialize, docs/spec/SEMANTICS.md §3.2].

        Parameters
        ----------
        options : Mapping[str, str]
            ``kvdd.OPTION_*`` keys (C++ names such as ``"llm.ListenIpInfo"``) to string values;
            ``llm.SyncKvCacheWaitTime`` is in milliseconds.

        Raises
        ------
        TypeError
            ``options`` is not a mapping of str to str.
        LLMParamInvalidError
            An invalid option value or role (§3.2, in upstream's check order).
        LLMError
            LLM_FAILED when the listen address cannot be bound.

        Notes
        -----
        A second call on an initialized instance succeeds and ignores its options.
        """
        if is_enabled(DEBUG) and not tracing():
            return traced("Initialize", self._cluster_id, None, None, self.initialize, options)
        opts = check_options(options)
        status = self._backend.initialize(opts)
        if status:
            raise_status(self._backend, status, "Initialize")

    def finalize(self) -> None:
        """Tear down links, forget caches, stop listening [Finalize, docs/spec/SEMANTICS.md §3.3].

        Safe to call twice; never raises for a status (upstream's Finalize returns none).
        """
        if is_enabled(DEBUG) and not tracing():
            return traced("Finalize", self._cluster_id, None, None, self.finalize)
        self._backend.finalize()
        self._geometry.clear()

    def set_role(self, role: int, options: Mapping[str, str] | None = None) -> None:
        """Change the role and listen address [SetRole, docs/spec/SEMANTICS.md §3.4].

        Parameters
        ----------
        role : int
            An :class:`LlmRole` (int32).
        options : Mapping[str, str] or None
            ``llm.ListenIpInfo`` to change the listen address; None means none.

        Raises
        ------
        LLMExistLinkError
            Links exist (default transfer backend).
        LLMParamInvalidError
            A role outside 1..3 or a malformed listen address.
        LLMFeatureNotEnabledError
            A listen change on the hixl transfer backend.
        LLMError
            LLM_FAILED when not initialized.
        """
        if is_enabled(DEBUG) and not tracing():
            return traced("SetRole", self._cluster_id, None, None, self.set_role, role, options)
        role = check_int("role", role, INT32)
        opts = check_options(options)
        status = self._backend.set_role(role, opts)
        if status:
            raise_status(self._backend, status, "SetRole")

    # -- links ------------------------------------------------------------------------------
    def link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int = 1000) -> list[Status]:
        """Link to peers [LinkLlmClusters, docs/spec/SEMANTICS.md §3.5].

        Parameters
        ----------
        clusters : Sequence[ClusterInfo]
            The peers (IPv4 addresses; ``remote_ip_infos[0]`` is the peer's listen address).
        timeout_ms : int
            Milliseconds (int32) to connect to each peer (C++ ``timeout_in_millis``).

        Returns
        -------
        list[Status]
            One status per cluster, all LLM_SUCCESS.

        Raises
        ------
        LLMError
            The subclass of the overall status (the last failing cluster's), with ``.rets`` holding
            every cluster's status (``[]`` when the call failed before the per-cluster phase):
            LLMLinkFailedError, LLMAlreadyLinkError, LLMParamInvalidError, ...
        """
        if is_enabled(DEBUG) and not tracing():
            return traced("LinkLlmClusters", self._cluster_id, peers_of(clusters), None,
                          self.link_llm_clusters, clusters, timeout_ms)
        cl = check_clusters(clusters)
        timeout_ms = check_int("timeout_ms", timeout_ms, INT32)
        status, rets = self._backend.link_llm_clusters(cl, timeout_ms)
        if status:
            raise_status(self._backend, status, "LinkLlmClusters", list(rets))
        return [Status(r) for r in rets]

    def unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int = 1000,
                            force: bool = False) -> list[Status]:
        """Unlink peers [UnlinkLlmClusters, docs/spec/SEMANTICS.md §3.6].

        Parameters
        ----------
        clusters : Sequence[ClusterInfo]
            The peers to unlink.
        timeout_ms : int
            Milliseconds (int32) to reach each peer.
        force : bool
            The C++ ``force_flag``: unlink locally without telling the peer.

        Returns
        -------
        list[Status]
            One status per cluster, all LLM_SUCCESS.

        Raises
        ------
        LLMError
            Like :meth:`link_llm_clusters`: LLMUnlinkFailedError (or LLMTimeoutError) when the peer
            cannot be reached for a non-force unlink, LLMParamInvalidError for a non-positive timeout
            or an empty list.  Unlinking a cluster that was never linked succeeds.
        """
        if is_enabled(DEBUG) and not tracing():
            return traced("UnlinkLlmClusters", self._cluster_id, peers_of(clusters), None,
                          self.unlink_llm_clusters, clusters, timeout_ms, force)
        cl = check_clusters(clusters)
        timeout_ms = check_int("timeout_ms", timeout_ms, INT32)
        if not isinstance(force, bool):
            raise TypeError(f"force must be bool, not {type(force).__name__}")
        status, rets = self._backend.unlink_llm_clusters(cl, timeout_ms, force)
        if status:
            raise_status(self._backend, status, "UnlinkLlmClusters", list(rets))
        return [Status(r) for r in rets]

    # -- registration -----------------------------------------------------------------------
    def register_kv_cache(self, cache_desc: CacheDesc, addrs: Sequence[int],
                          cfg: RegisterCfg | None = None) -> int:
        """Register ``cache_desc.num_tensors`` tensors at ``addrs`` [RegisterKvCache, docs/spec/SEMANTICS.md §3.7].

        Parameters
        ----------
        cache_desc : CacheDesc
            Number, dtype and shape of the tensors; each tensor is ``cache_desc.tensor_nbytes`` (T)
            bytes, ``B = shape[0]`` rows/blocks of S = T // B bytes.
        addrs : Sequence[int]
            One address (uint64) per tensor, each the start of T bytes.  A :class:`TensorAddrs` from
            :func:`kvdd.tensor_addrs` keeps its tensors alive while registered.
        cfg : RegisterCfg or None
            Reserved (no fields).

        Returns
        -------
        int
            The cache id (1, 2, ... per instance).

        Raises
        ------
        ValueError
            A ``TensorAddrs`` tensor smaller than T (upstream cannot see sizes and would let transfers
            overrun it; docs/spec/SEMANTICS.md §10).
        LLMParamInvalidError
            Empty or mismatched ``addrs``, a zero address, a bad shape or dtype (§3.7, §5).
        LLMError
            LLM_FAILED when not initialized or (simulator) the memory is not readable and writable.

        Notes
        -----
        Register before linking: a cache registered after a link is invisible over it (§2.4).
        """
        if is_enabled(DEBUG) and not tracing():
            return traced("RegisterKvCache", self._cluster_id, None, cache_bytes(cache_desc),
                          self.register_kv_cache, cache_desc, addrs, cfg)
        check_type("cache_desc", cache_desc, CacheDesc)
        checked = check_int_seq("addrs", addrs, UINT64)
        if cfg is None:
            cfg = RegisterCfg()
        check_type("cfg", cfg, RegisterCfg)
        passed: Sequence[int] = addrs if isinstance(addrs, TensorAddrs) else checked
        if isinstance(addrs, TensorAddrs) and len(addrs.nbytes) == len(checked):
            check_tensor_sizes(cache_desc, addrs.nbytes)
        status, cache_id = self._backend.register_kv_cache(cache_desc, passed, cfg)
        if status:
            raise_status(self._backend, status, "RegisterKvCache")
        try:
            self._geometry[cache_id] = (cache_desc.tensor_nbytes // cache_desc.shape[0], cache_desc.num_tensors)
        except (ValueError, ZeroDivisionError, IndexError):  # a shape the backend accepted as it is
            pass
        return cache_id

    def unregister_kv_cache(self, cache_id: int) -> None:
        """Unregister a cache [UnregisterKvCache, docs/spec/SEMANTICS.md §3.8].

        Parameters
        ----------
        cache_id : int
            An id :meth:`register_kv_cache` returned (int64); unknown ids succeed.

        Raises
        ------
        LLMError
            LLM_FAILED when not initialized.
        """
        if is_enabled(DEBUG) and not tracing():
            return traced("UnregisterKvCache", self._cluster_id, None, None,
                          self.unregister_kv_cache, cache_id)
        cache_id = check_int("cache_id", cache_id, INT64)
        status = self._backend.unregister_kv_cache(cache_id)
        if status:
            raise_status(self._backend, status, "UnregisterKvCache")
        self._geometry.pop(cache_id, None)

    # -- transfers --------------------------------------------------------------------------
    def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None) -> None:
        """Read a batch row of a peer's cache into a local row [PullKvCache, docs/spec/SEMANTICS.md §3.10].

        For each tensor k (or the tensors of the layer range of ``ext_param``, §2.5): ``size`` bytes
        from row ``src_cache_index.batch_index`` of the remote tensor into row ``batch_index`` of the
        local tensor.  Offsets are ``row x S`` with S the **local** stride.

        Parameters
        ----------
        src_cache_index : CacheIndex
            The peer's cluster id, its cache id and the remote row.
        dst_cache : Cache
            The local cache; only ``cache_id`` is read.
        batch_index : int
            The local row (uint32).
        size : int
            Bytes per tensor (int64) from the start of the row; ``-1`` means S.
        ext_param : KvCacheExtParam or None
            Layer ranges and tensors per layer; None means all layers, 2 tensors per layer.

        Raises
        ------
        LLMParamInvalidError
            Out-of-range rows or sizes, bad layer ranges (§3.10 in upstream's order).
        LLMKvCacheNotExistError
            The remote or local cache is unknown (or was registered after the link).
        LLMNotYetLinkError
            No link to ``src_cache_index.cluster_id``.
        LLMTimeoutError
            The transfer exceeded ``llm.SyncKvCacheWaitTime`` (ms) or the peer is gone.
        LLMError
            LLM_FAILED when not initialized.
        """
        fast = self._fast
        if fast is not None and fast.pull_kv_cache(src_cache_index, dst_cache, batch_index, size, ext_param):
            return
        if is_enabled(DEBUG) and not tracing():  # (the compiled path declines while DEBUG is on)
            return traced("PullKvCache", self._cluster_id, peer_of(src_cache_index),
                          transfer_bytes(self._geometry, dst_cache, None, size, ext_param, 1),
                          self.pull_kv_cache, src_cache_index, dst_cache, batch_index, size, ext_param)
        check_type("src_cache_index", src_cache_index, CacheIndex)
        check_type("dst_cache", dst_cache, Cache)
        batch_index = check_int("batch_index", batch_index, UINT32)
        size = check_int("size", size, INT64)
        ext = DEFAULT_EXT if ext_param is None else ext_or_default(ext_param)
        status = self._backend.pull_kv_cache(src_cache_index, dst_cache, batch_index, size, ext)
        if status:
            raise_status(self._backend, status, "PullKvCache")

    def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> None:
        """Read blocks of a peer's cache into local blocks [PullKvBlocks, docs/spec/SEMANTICS.md §3.11].

        Parameters
        ----------
        src_cache_index : CacheIndex
            The peer's cluster id and cache id (``batch_index`` must be 0).
        dst_cache : Cache
            The local cache; only ``cache_id`` is read.
        src_blocks, dst_blocks : Sequence[int]
            Block indices (uint64): remote block ``src_blocks[i]`` -> local block ``dst_blocks[i]``.  A
            block is one index of the first dimension, S bytes (the local stride) per tensor.
        ext_param : KvCacheExtParam or None
            Layer ranges and tensors per layer (§2.5).

        Raises
        ------
        LLMParamInvalidError, LLMKvCacheNotExistError, LLMNotYetLinkError, LLMTimeoutError, LLMError
            As :meth:`pull_kv_cache` (§3.11 gives the order of the checks).
        """
        fast = self._fast
        if fast is not None and fast.pull_kv_blocks(src_cache_index, dst_cache, src_blocks, dst_blocks,
                                                    ext_param):
            return
        if is_enabled(DEBUG) and not tracing():  # (the compiled path declines while DEBUG is on)
            return traced("PullKvBlocks", self._cluster_id, peer_of(src_cache_index),
                          transfer_bytes(self._geometry, dst_cache, dst_blocks, None, ext_param, 1),
                          self.pull_kv_blocks, src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        check_type("src_cache_index", src_cache_index, CacheIndex)
        check_type("dst_cache", dst_cache, Cache)
        src = check_int_seq("src_blocks", src_blocks, UINT64)
        dst = check_int_seq("dst_blocks", dst_blocks, UINT64)
        ext = DEFAULT_EXT if ext_param is None else ext_or_default(ext_param)
        status = self._backend.pull_kv_blocks(src_cache_index, dst_cache, src, dst, ext)
        if status:
            raise_status(self._backend, status, "PullKvBlocks")

    def push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None) -> None:
        """Write a local batch row into a peer's cache [PushKvCache, docs/spec/SEMANTICS.md §3.12].

        Writes S (the local stride) bytes of row ``src_batch_index`` of each tensor of the planned
        layers into row ``dst_cache_index.batch_index`` of the remote tensors.  Layers are written one
        by one: on failure earlier layers stay written (upstream behaviour).

        Parameters
        ----------
        src_cache : Cache
            The local cache: ``cache_id``, ``cache_desc.placement`` (must be DEVICE) and
            ``cache_desc.num_tensors`` are read (upstream reads them from this struct).
        dst_cache_index : CacheIndex
            The peer's cluster id, cache id and destination row.
        src_batch_index : int
            The local row (uint32).
        size : int
            Must be -1 (int64).
        ext_param : KvCacheExtParam or None
            Layer ranges and tensors per layer (§2.5).

        Raises
        ------
        LLMParamInvalidError, LLMKvCacheNotExistError, LLMNotYetLinkError, LLMTimeoutError, LLMError
            As :meth:`pull_kv_cache` (§3.12 gives the order of the checks).
        """
        fast = self._fast
        if fast is not None and fast.push_kv_cache(src_cache, dst_cache_index, src_batch_index, size, ext_param):
            return
        if is_enabled(DEBUG) and not tracing():  # (the compiled path declines while DEBUG is on)
            return traced("PushKvCache", self._cluster_id, peer_of(dst_cache_index),
                          transfer_bytes(self._geometry, src_cache, None, size, ext_param, 0),
                          self.push_kv_cache, src_cache, dst_cache_index, src_batch_index, size, ext_param)
        check_type("src_cache", src_cache, Cache)
        check_type("dst_cache_index", dst_cache_index, CacheIndex)
        src_batch_index = check_int("src_batch_index", src_batch_index, UINT32)
        size = check_int("size", size, INT64)
        ext = DEFAULT_EXT if ext_param is None else ext_or_default(ext_param)
        status = self._backend.push_kv_cache(src_cache, dst_cache_index, src_batch_index, size, ext)
        if status:
            raise_status(self._backend, status, "PushKvCache")

    def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> None:
        """Write local blocks into a peer's cache [PushKvBlocks, docs/spec/SEMANTICS.md §3.13].

        Parameters
        ----------
        src_cache : Cache
            The local cache (read as in :meth:`push_kv_cache`).
        dst_cache_index : CacheIndex
            The peer's cluster id and cache id.
        src_blocks, dst_blocks : Sequence[int]
            Block indices (uint64): local ``src_blocks[i]`` -> remote ``dst_blocks[i]``; a block is S
            bytes (the local stride) per tensor.
        ext_param : KvCacheExtParam or None
            Layer ranges and tensors per layer (§2.5).

        Raises
        ------
        LLMParamInvalidError, LLMKvCacheNotExistError, LLMNotYetLinkError, LLMTimeoutError, LLMError
            As :meth:`push_kv_cache` (§3.13).
        """
        fast = self._fast
        if fast is not None and fast.push_kv_blocks(src_cache, dst_cache_index, src_blocks, dst_blocks,
                                                    ext_param):
            return
        if is_enabled(DEBUG) and not tracing():  # (the compiled path declines while DEBUG is on)
            return traced("PushKvBlocks", self._cluster_id, peer_of(dst_cache_index),
                          transfer_bytes(self._geometry, src_cache, src_blocks, None, ext_param, 0),
                          self.push_kv_blocks, src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param)
        check_type("src_cache", src_cache, Cache)
        check_type("dst_cache_index", dst_cache_index, CacheIndex)
        src = check_int_seq("src_blocks", src_blocks, UINT64)
        dst = check_int_seq("dst_blocks", dst_blocks, UINT64)
        ext = DEFAULT_EXT if ext_param is None else ext_or_default(ext_param)
        status = self._backend.push_kv_blocks(src_cache, dst_cache_index, src, dst, ext)
        if status:
            raise_status(self._backend, status, "PushKvBlocks")

