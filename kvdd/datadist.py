"""The ``LlmDataDist`` facade: one instance of the C++ ``llm_datadist::LlmDataDist`` on a backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType

from .backend import Backend, create_backend, resolve_backend_name
from .memory import TensorAddrs
from .options import check_options
from .status import Status, raise_for_status
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

__all__ = ["LlmDataDist"]


def _check_type(name: str, value: object, klass: type) -> None:
    if not isinstance(value, klass):
        raise TypeError(f"{name} must be {klass.__name__}, not {type(value).__name__}")


def _check_clusters(clusters: object) -> tuple[ClusterInfo, ...]:
    if isinstance(clusters, (str, bytes)) or not isinstance(clusters, Sequence):
        raise TypeError(f"clusters must be a sequence of ClusterInfo, not {type(clusters).__name__}")
    for i, c in enumerate(clusters):
        _check_type(f"clusters[{i}]", c, ClusterInfo)
    return tuple(clusters)


def _check_tensor_sizes(cache_desc: CacheDesc, nbytes: Sequence[int]) -> None:
    # The C++ API only sees addresses, so upstream cannot notice a tensor smaller than the
    # descriptor says; TensorAddrs knows each owner's size, so kvdd refuses that classic bug here
    # (identically on every backend) instead of letting transfers write past the tensor.
    try:
        need = cache_desc.tensor_nbytes
    except ValueError:
        return  # the backend reports the invalid shape/dtype with its LLM status
    for i, have in enumerate(nbytes):
        if have < need:
            raise ValueError(
                f"tensor {i} holds {have} bytes but cache_desc needs {need} bytes per tensor "
                f"(shape {cache_desc.shape}, data_type {cache_desc.data_type!r}); transfers would "
                "read and write past it. Register tensors of the described shape."
            )


_DEFAULT_EXT = KvCacheExtParam()  # immutable, so one instance serves every call


def _ext(ext_param: KvCacheExtParam | None) -> KvCacheExtParam:
    if ext_param is None:
        return _DEFAULT_EXT
    _check_type("ext_param", ext_param, KvCacheExtParam)
    return ext_param


def _detail(backend: Backend) -> str | None:
    # Optional, backend-neutral: a backend may explain its last failing status in this thread.
    getter = getattr(backend, "last_error_detail", None)
    return getter() if callable(getter) else None


class LlmDataDist:
    """One LLM-DataDist instance (a *cluster*): C++ ``llm_datadist::LlmDataDist``.

    Parameters
    ----------
    cluster_id : int
        This instance's cluster id (uint64); peers address it in ``CacheIndex.cluster_id``.
    role : int
        An :class:`LlmRole` (any int32 is accepted here; Initialize rejects values outside 1..3 with
        LLM_PARAM_INVALID).
    backend : {"sim", "native"} or None
        ``None`` picks ``$KVDD_BACKEND``, else a real native build, else the simulator (API.md).

    Every method raises the :class:`LLMError` subclass of the status the C++ call returns
    (SEMANTICS.md §3), ``TypeError``/``ValueError`` for arguments that do not fit the C++ types.
    Use as a context manager: leaving the block calls :meth:`finalize`.
    """

    def __init__(self, cluster_id: int, role: int, *, backend: str | None = None) -> None:
        self._cluster_id = check_int("cluster_id", cluster_id, UINT64)
        self._role = check_int("role", role, INT32)
        self._backend_name = resolve_backend_name(backend)
        self._backend: Backend = create_backend(self._backend_name, self._cluster_id, self._role)

    def _check(self, status: int, what: str, rets: list[int] | None = None) -> None:
        # The one place a backend status becomes an exception (via kvdd.status.raise_for_status).
        if status != Status.LLM_SUCCESS:
            raise_for_status(status, what, rets, _detail(self._backend))

    # -- properties -------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        """``"sim"`` or ``"native"``."""
        return self._backend_name

    @property
    def backend(self) -> Backend:
        """The backend object (statuses as ints, no exceptions)."""
        return self._backend

    @property
    def cluster_id(self) -> int:
        """The cluster id given to the constructor."""
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
        """Initialize with string options (``kvdd.OPTION_*``) [Initialize, SEMANTICS.md §3.2].

        Raises LLMParamInvalidError for invalid options or role, LLMError(LLM_FAILED) when the
        listen address cannot be bound.  A second call on an initialized instance succeeds and
        ignores its options.
        """
        opts = check_options(options)
        self._check(self._backend.initialize(opts), "Initialize")

    def finalize(self) -> None:
        """Tear down links, forget caches, stop listening [Finalize, §3.3].  Safe to call twice."""
        self._backend.finalize()

    def set_role(self, role: int, options: Mapping[str, str] | None = None) -> None:
        """Change the role and listen address [SetRole, §3.4].

        Raises LLMExistLinkError while links exist (default backend), LLMParamInvalidError for a
        role outside 1..3 or a malformed listen address, LLMFeatureNotEnabledError for a listen
        change on the hixl backend, LLMError(LLM_FAILED) when not initialized.
        """
        role = check_int("role", role, INT32)
        opts = check_options(options)
        self._check(self._backend.set_role(role, opts), "SetRole")

    # -- links ------------------------------------------------------------------------------
    def link_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int = 1000) -> list[Status]:
        """Link to peers [LinkLlmClusters, §3.5].

        Returns one status per cluster (all LLM_SUCCESS).  On failure raises the error of the
        overall status (the last failing cluster's) with ``.rets`` holding every cluster's status
        (``[]`` when the call failed before the per-cluster phase).  ``timeout_ms`` (int32) bounds
        connecting to each peer.
        """
        cl = _check_clusters(clusters)
        timeout_ms = check_int("timeout_ms", timeout_ms, INT32)
        status, rets = self._backend.link_llm_clusters(cl, timeout_ms)
        self._check(status, "LinkLlmClusters", rets=list(rets))
        return [Status(r) for r in rets]

    def unlink_llm_clusters(self, clusters: Sequence[ClusterInfo], timeout_ms: int = 1000,
                            force: bool = False) -> list[Status]:
        """Unlink peers [UnlinkLlmClusters, §3.6]; ``force`` is the C++ ``force_flag`` (local only).

        Returns and raises like :meth:`link_llm_clusters` (LLMUnlinkFailedError when the peer cannot
        be reached for a non-force unlink).
        """
        cl = _check_clusters(clusters)
        timeout_ms = check_int("timeout_ms", timeout_ms, INT32)
        if not isinstance(force, bool):
            raise TypeError(f"force must be bool, not {type(force).__name__}")
        status, rets = self._backend.unlink_llm_clusters(cl, timeout_ms, force)
        self._check(status, "UnlinkLlmClusters", rets=list(rets))
        return [Status(r) for r in rets]

    # -- registration -----------------------------------------------------------------------
    def register_kv_cache(self, cache_desc: CacheDesc, addrs: Sequence[int],
                          cfg: RegisterCfg | None = None) -> int:
        """Register ``cache_desc.num_tensors`` tensors at ``addrs`` [RegisterKvCache, §3.7].

        ``addrs``: one address (uint64) per tensor, each the start of ``cache_desc.tensor_nbytes``
        bytes; a :class:`TensorAddrs` from :func:`kvdd.tensor_addrs` keeps its tensors alive while
        registered; a ``TensorAddrs`` tensor smaller than ``cache_desc.tensor_nbytes`` is a
        ``ValueError`` (upstream cannot see sizes and would let transfers overrun it).
        Returns the cache id (1, 2, ... per instance).  Raises LLMParamInvalidError
        (empty/mismatched/zero addrs, bad shape or dtype), LLMError(LLM_FAILED) when not
        initialized or (simulator) the memory is not readable and writable.
        """
        _check_type("cache_desc", cache_desc, CacheDesc)
        checked = check_int_seq("addrs", addrs, UINT64)
        if cfg is None:
            cfg = RegisterCfg()
        _check_type("cfg", cfg, RegisterCfg)
        passed: Sequence[int] = addrs if isinstance(addrs, TensorAddrs) else checked
        if isinstance(addrs, TensorAddrs) and len(addrs.nbytes) == len(checked):
            _check_tensor_sizes(cache_desc, addrs.nbytes)
        status, cache_id = self._backend.register_kv_cache(cache_desc, passed, cfg)
        self._check(status, "RegisterKvCache")
        return cache_id

    def unregister_kv_cache(self, cache_id: int) -> None:
        """Unregister a cache [UnregisterKvCache, §3.8]; unknown ids succeed."""
        cache_id = check_int("cache_id", cache_id, INT64)
        self._check(self._backend.unregister_kv_cache(cache_id), "UnregisterKvCache")

    def allocate_cache(self, cache_desc: CacheDesc) -> Cache:
        """[AllocateCache, §3.9] Not supported by LLM-DataDist V2: raises LLMFeatureNotEnabledError."""
        _check_type("cache_desc", cache_desc, CacheDesc)
        status, cache = self._backend.allocate_cache(cache_desc)
        self._check(status, "AllocateCache")
        assert cache is not None
        return cache

    def deallocate_cache(self, cache_id: int) -> None:
        """[DeallocateCache, §3.9] Not supported: raises LLMFeatureNotEnabledError."""
        cache_id = check_int("cache_id", cache_id, INT64)
        self._check(self._backend.deallocate_cache(cache_id), "DeallocateCache")

    # -- transfers --------------------------------------------------------------------------
    def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: Cache, batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None) -> None:
        """Read a batch row of a peer's cache into ``dst_cache`` [PullKvCache, §3.10].

        For each tensor k (or the layer range of ``ext_param``): ``size`` bytes (``-1``: the local
        stride S) from row ``src_cache_index.batch_index`` of the remote tensor into row
        ``batch_index`` (uint32) of the local tensor; offsets use the local stride.  Only
        ``dst_cache.cache_id`` is read.  Raises LLMParamInvalidError, LLMKvCacheNotExistError,
        LLMNotYetLinkError, LLMTimeoutError (``llm.SyncKvCacheWaitTime``), LLMError(LLM_FAILED).
        """
        _check_type("src_cache_index", src_cache_index, CacheIndex)
        _check_type("dst_cache", dst_cache, Cache)
        batch_index = check_int("batch_index", batch_index, UINT32)
        size = check_int("size", size, INT64)
        status = self._backend.pull_kv_cache(src_cache_index, dst_cache, batch_index, size, _ext(ext_param))
        self._check(status, "PullKvCache")

    def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> None:
        """Read blocks of a peer's cache into local blocks [PullKvBlocks, §3.11].

        ``src_blocks[i]`` -> ``dst_blocks[i]`` (uint64 block indices; block size = the local stride
        S bytes).  Raises like :meth:`pull_kv_cache`.
        """
        _check_type("src_cache_index", src_cache_index, CacheIndex)
        _check_type("dst_cache", dst_cache, Cache)
        src = check_int_seq("src_blocks", src_blocks, UINT64)
        dst = check_int_seq("dst_blocks", dst_blocks, UINT64)
        status = self._backend.pull_kv_blocks(src_cache_index, dst_cache, src, dst, _ext(ext_param))
        self._check(status, "PullKvBlocks")

    def push_kv_cache(self, src_cache: Cache, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None) -> None:
        """Write a local batch row into a peer's cache [PushKvCache, §3.12].

        Writes the local stride S bytes of row ``src_batch_index`` of each tensor of the planned
        layers into row ``dst_cache_index.batch_index`` of the remote tensors.  ``size`` must be -1.
        Reads ``src_cache.cache_id``, ``.cache_desc.placement`` (must be DEVICE) and
        ``.cache_desc.num_tensors``.  Layers are written one by one: on failure earlier layers stay
        written (upstream behaviour).  Raises like :meth:`pull_kv_cache`.
        """
        _check_type("src_cache", src_cache, Cache)
        _check_type("dst_cache_index", dst_cache_index, CacheIndex)
        src_batch_index = check_int("src_batch_index", src_batch_index, UINT32)
        size = check_int("size", size, INT64)
        status = self._backend.push_kv_cache(src_cache, dst_cache_index, src_batch_index, size, _ext(ext_param))
        self._check(status, "PushKvCache")

    def push_kv_blocks(self, src_cache: Cache, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None) -> None:
        """Write local blocks into a peer's cache [PushKvBlocks, §3.13] (block size = local S).

        Raises like :meth:`push_kv_cache`.
        """
        _check_type("src_cache", src_cache, Cache)
        _check_type("dst_cache_index", dst_cache_index, CacheIndex)
        src = check_int_seq("src_blocks", src_blocks, UINT64)
        dst = check_int_seq("dst_blocks", dst_blocks, UINT64)
        status = self._backend.push_kv_blocks(src_cache, dst_cache_index, src, dst, _ext(ext_param))
        self._check(status, "PushKvBlocks")

    def copy_kv_cache(self, src_cache: Cache, dst_cache: Cache, src_batch_index: int = 0,
                      dst_batch_index: int = 0, offset: int = 0, size: int = -1) -> None:
        """[CopyKvCache, §3.9] Not supported by LLM-DataDist V2: raises LLMFeatureNotEnabledError."""
        _check_type("src_cache", src_cache, Cache)
        _check_type("dst_cache", dst_cache, Cache)
        src_batch_index = check_int("src_batch_index", src_batch_index, UINT32)
        dst_batch_index = check_int("dst_batch_index", dst_batch_index, UINT32)
        offset = check_int("offset", offset, UINT64)
        size = check_int("size", size, INT64)
        status = self._backend.copy_kv_cache(src_cache, dst_cache, src_batch_index, dst_batch_index, offset, size)
        self._check(status, "CopyKvCache")

    def copy_kv_blocks(self, src_cache: Cache, dst_cache: Cache, src_blocks: Sequence[int],
                       dst_blocks_list: Sequence[Sequence[int]]) -> None:
        """[CopyKvBlocks, §3.9] Not supported by LLM-DataDist V2: raises LLMFeatureNotEnabledError."""
        _check_type("src_cache", src_cache, Cache)
        _check_type("dst_cache", dst_cache, Cache)
        src = check_int_seq("src_blocks", src_blocks, UINT64)
        if isinstance(dst_blocks_list, (str, bytes)) or not isinstance(dst_blocks_list, Sequence):
            raise TypeError("dst_blocks_list must be a sequence of sequences of block indices")
        dst = tuple(check_int_seq(f"dst_blocks_list[{i}]", d, UINT64) for i, d in enumerate(dst_blocks_list))
        status = self._backend.copy_kv_blocks(src_cache, dst_cache, src, dst)
        self._check(status, "CopyKvBlocks")

