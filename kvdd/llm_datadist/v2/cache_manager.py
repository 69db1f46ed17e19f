"""``CacheManager``: registration, pulls, pushes and local copies (PYPKG.md §4).

Each method checks its arguments as upstream's Python layer does, in the same order, before any
engine call (``TypeError`` / ``ValueError`` for types and C ranges, ``LLMException(LLM_PARAM_INVALID)``
for the rest), then calls the :class:`~kvdd.llm_datadist._seam.Wrapper` and raises
``LLMException(code_2_status(status))`` on failure.  No method checks whether the instance was
finalized: the engine answers with the statuses of PYPKG.md §1.4.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._engine import with_detail
from .._seam import TransferCfgTuple, Wrapper
from ..status import LLMException, handle_llm_status, raise_if_false
from ..utils.utils import (
    check_int64,
    check_isinstance,
    check_list_of,
    check_uint32,
)
from . import transfer
from .cache_copies import LocalCopies
from .doc_limits import RegistrationLimits
from .llm_keys import BlocksCacheKey, CacheKey, CacheKeyByIdAndIndex
from .llm_types import (
    Cache,
    CacheDesc,
    CacheTask,
    LayerSynchronizer,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_layer_range,
)
from .llm_utils import (
    check_cache_key_ids,
    layer_range_to_tensor_indices,
    pack_cache_desc,
    pack_cache_key,
    pack_uint64_list,
)

__all__ = ["CacheManager"]



def _pull_kwargs(kwargs: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    # unknown keywords are ignored, as upstream
    return (kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"),
            kwargs.get("tensor_num_per_layer", 2))


def _check_tensor_num_per_layer(t: Any) -> None:
    check_uint32("tensor_num_per_layer", t)
    raise_if_false(t > 0, f"tensor_num_per_layer must be > 0, but got {t}.")


class CacheManager(LocalCopies):
    """The cache side of an initialized :class:`~kvdd.llm_datadist.LLMDataDist` in
    cache-manager mode (CANN ``CacheManager``, PYPKG.md §4); obtained from
    ``LLMDataDist.cache_manager``."""

    def __init__(self, wrapper: Wrapper, engine_options: Mapping[str, str]) -> None:
        self._llm_datadist = wrapper
        self._enabled_mem_pool = bool(engine_options.get("llm.MemPoolConfig"))
        self._enable_host_mem_pool = bool(engine_options.get("llm.HostMemPoolConfig"))
        self._enable_remote_cache_accessible = engine_options.get("llm.EnableRemoteCacheAccessible") == "1"
        self._enable_local_comm_res = "llm.LocalCommRes" in engine_options
        self._is_call_linked = False
        self._initialized = True
        self._limits = RegistrationLimits()

    def _note_registered(self, cache_id: int, cache_desc: CacheDesc, addrs: list[int]) -> None:
        try:
            nbytes: int | None = cache_desc.size * cache_desc.num_tensors
        except LLMException:
            nbytes = None
        self._limits.registered(cache_id, addrs, cache_desc.placement == Placement.DEVICE, nbytes)

    def _check(self, status: int, func: str, info: object) -> None:
        # ``info`` may be a zero-argument callable, so hot paths format nothing on success
        if status != 0:
            text = info() if callable(info) else info
            handle_llm_status(status, func, with_detail(self._llm_datadist, str(text)))

    # -- registration (§4.1, §4.2) -------------------------------------------------------------

    def set_is_call_linked(self) -> None:
        """Record that a rank-table ``link()`` succeeded: later registrations default to
        not remote-accessible and refuse ``remote_accessible=True`` (PYPKG.md §4.1)."""
        self._is_call_linked = True

    def _get_remote_accessible(self, cache_desc: CacheDesc, remote_accessible: bool | None) -> bool:
        if remote_accessible is not None:
            return remote_accessible
        if self._is_call_linked:
            return False
        return cache_desc.placement == Placement.DEVICE

    def _check_register_args(self, cache_desc: Any, addrs: Any, remote_accessible: Any) -> None:
        check_isinstance("remote_accessible", remote_accessible, bool)
        raise_if_false(not (remote_accessible is True and self._is_call_linked),
                       "remote_accessible=True is not allowed after link().")
        raise_if_false(len(addrs) > 0, "addrs must not be empty.")

    def register_cache(self, cache_desc: CacheDesc, addrs: list[int],
                       cache_keys: list[CacheKey] | tuple[CacheKey, ...] = (),
                       remote_accessible: bool | None = None) -> Cache:
        """Register caller memory as a cache (CANN ``CacheManager.register_cache``, PYPKG.md §4.1).

        Parameters
        ----------
        cache_desc
            Shape of each of the ``num_tensors`` tensors.
        addrs
            A **list** (a tuple is a ``TypeError``) of ``num_tensors`` non-zero addresses.
        cache_keys
            ``CacheKey``s bound to batch rows 0, 1, ... (padding keys skip a row).
        remote_accessible
            Whether peers may read/write it; default True for DEVICE, False for HOST and after
            a rank-table ``link()``.

        Returns
        -------
        Cache
            With the engine's id (1, 2, ... per engine).

        Raises
        ------
        TypeError
            Argument types.
        LLMException
            LLM_PARAM_INVALID: ``remote_accessible=True`` after ``link()``, empty ``addrs``,
            ``len(addrs) != num_tensors``, an address 0; engine statuses otherwise.
        """
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_list_of("addrs", addrs, int, list)
        check_list_of("cache_keys", cache_keys, CacheKey)
        self._check_register_args(cache_desc, addrs, remote_accessible)
        raise_if_false(len(addrs) == cache_desc.num_tensors,
                       f"len(addrs)={len(addrs)} != num_tensors={cache_desc.num_tensors}.")
        raise_if_false(all(a != 0 for a in addrs), "addrs must not contain 0.")
        ra = self._get_remote_accessible(cache_desc, remote_accessible)
        status, (cache_id, tensor_addrs) = self._llm_datadist.register_cache(
            pack_cache_desc(cache_desc), pack_uint64_list("addrs", addrs),
            [pack_cache_key(k) for k in cache_keys], ra)
        self._check(status, "register_cache", f"cache_desc={cache_desc!r}")
        self._note_registered(cache_id, cache_desc, addrs)
        return Cache(cache_id, cache_desc, list(tensor_addrs[0]) if tensor_addrs else list(addrs),
                     self, True, False)

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs: list[int],
                              blocks_cache_key: BlocksCacheKey | None = None,
                              remote_accessible: bool | None = None) -> Cache:
        """Register caller memory as a blocks cache (``shape[0]`` = number of blocks; CANN
        ``CacheManager.register_blocks_cache``, PYPKG.md §4.1).

        Sets ``cache_desc._is_blocks`` on the caller's descriptor. The key's identity is
        ``model_id`` only: the last registration with a model id wins. There is no Python count or
        zero-address check (the engine checks the count).

        Raises
        ------
        TypeError
            Argument types (``addrs`` must be a list).
        LLMException
            LLM_PARAM_INVALID: ``remote_accessible=True`` after ``link()``, empty ``addrs``;
            engine statuses otherwise.
        """
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_list_of("addrs", addrs, int, list)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        self._check_register_args(cache_desc, addrs, remote_accessible)
        cache_desc._is_blocks = True
        ra = self._get_remote_accessible(cache_desc, remote_accessible)
        keys = [] if blocks_cache_key is None else [pack_cache_key(blocks_cache_key)]
        status, (cache_id, tensor_addrs) = self._llm_datadist.register_cache(
            pack_cache_desc(cache_desc), pack_uint64_list("addrs", addrs), keys, ra)
        self._check(status, "register_blocks_cache", f"cache_desc={cache_desc!r}")
        self._note_registered(cache_id, cache_desc, addrs)
        return Cache(cache_id, cache_desc, list(tensor_addrs[0]) if tensor_addrs else list(addrs),
                     self, True, True)

    def unregister_cache(self, cache_id: int) -> None:
        """Forget a registered cache and the keys still pointing to it (unknown ids succeed;
        CANN ``unregister_cache``, PYPKG.md §4.2). ``TypeError`` / ``ValueError`` (int64)."""
        check_int64("cache_id", cache_id)
        self._check(self._llm_datadist.unregister_cache(cache_id), "unregister_cache", f"cache_id={cache_id}")
        self._limits.unregistered(cache_id)

    # -- pool-backed allocation (§4.3) ---------------------------------------------------------

    def _check_allocate(self, cache_desc: CacheDesc) -> None:
        raise_if_false(cache_desc.num_tensors > 0, "num_tensors must be > 0.")
        # upstream's Python refuses before the engine when no pool matches the placement, so
        # the engine's FEATURE_NOT_ENABLED (no pool at all) is not reached through the package
        pool = (self._enabled_mem_pool if cache_desc.placement == Placement.DEVICE
                else self._enable_host_mem_pool)
        raise_if_false(pool, f"no memory pool is configured for placement {cache_desc.placement!r} "
                             "(llm.MemPoolConfig for DEVICE, llm.HostMemPoolConfig for HOST).")

    def allocate_cache(self, cache_desc: CacheDesc,
                       cache_keys: list[CacheKey] | tuple[CacheKey, ...] = ()) -> Cache:
        """Allocate a cache from the memory pool (needs ``llm.MemPoolConfig`` /
        ``llm.HostMemPoolConfig`` matching the placement; else LLM_PARAM_INVALID) (PYPKG.md §4.3)."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_list_of("cache_keys", cache_keys, CacheKey)
        self._check_allocate(cache_desc)
        status, (cache_id, addrs) = self._llm_datadist.allocate_cache_v2(
            pack_cache_desc(cache_desc), [pack_cache_key(k) for k in cache_keys])
        self._check(status, "allocate_cache", f"cache_desc={cache_desc!r}")
        return Cache(cache_id, cache_desc, list(addrs[0]) if addrs else [], self, False, False)

    def allocate_blocks_cache(self, cache_desc: CacheDesc,
                              blocks_cache_key: BlocksCacheKey | None = None) -> Cache:
        """Allocate a blocks cache from the pool (PYPKG.md §4.3); marks ``cache_desc`` blocks."""
        check_isinstance("cache_desc", cache_desc, CacheDesc, allow_none=False)
        check_isinstance("blocks_cache_key", blocks_cache_key, BlocksCacheKey)
        self._check_allocate(cache_desc)
        cache_desc._is_blocks = True
        keys = [] if blocks_cache_key is None else [pack_cache_key(blocks_cache_key)]
        status, (cache_id, addrs) = self._llm_datadist.allocate_cache_v2(pack_cache_desc(cache_desc), keys)
        self._check(status, "allocate_blocks_cache", f"cache_desc={cache_desc!r}")
        return Cache(cache_id, cache_desc, list(addrs[0]) if addrs else [], self, False, True)

    def _deallocate(self, cache: Cache, func: str) -> None:
        self._check(self._llm_datadist.deallocate_cache_v2(cache.cache_id), func, f"cache_id={cache.cache_id}")
        cache._tensor_addrs = []
        cache._valid = False

    def deallocate_cache(self, cache: Cache) -> None:
        """Release an allocated (not blocks) cache; a registered one is left alone (§4.3)."""
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(not cache.is_blocks_cache, "use deallocate_blocks_cache for a blocks cache.")
        self._deallocate(cache, "deallocate_cache")

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        """Release an allocated blocks cache (§4.3)."""
        check_isinstance("cache", cache, Cache, allow_none=False)
        raise_if_false(cache.is_blocks_cache, "use deallocate_cache for a non-blocks cache.")
        self._deallocate(cache, "deallocate_blocks_cache")

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """Drop a key of an allocated cache (unknown keys succeed; §4.3)."""
        check_isinstance("cache_key", cache_key, CacheKey, allow_none=False)
        self._check(self._llm_datadist.remove_cache_key_v2(pack_cache_key(cache_key)),
                    "remove_cache_key", f"cache_key={cache_key!r}")

    @staticmethod
    def check_cache_key(cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey) -> None:
        """LLM_PARAM_INVALID unless a ``CacheKey`` has exactly one of req_id/prefix_id valid."""
        check_cache_key_ids(cache_key)

    # -- pulls (§4.5-§4.7) ---------------------------------------------------------------------

    def pull_cache(self, cache_key: CacheKeyByIdAndIndex | CacheKey, cache: Cache,
                   batch_index: int = 0, size: int = -1, **kwargs: Any) -> None:
        """Pull a peer's cache rows into batch row ``batch_index`` of ``cache`` (CANN
        ``pull_cache``, PYPKG.md §4.5).

        ``size`` is bytes per tensor (-1 = the local stride). Keyword arguments
        ``src_layer_range`` / ``dst_layer_range`` (half-open ``range``s of layers) and
        ``tensor_num_per_layer`` (default 2); other keywords are ignored.

        Raises
        ------
        TypeError
            A ``CacheKey`` in remote-accessible mode; other types.
        ValueError
            ``batch_index`` not uint32, ``size`` not int64, range bounds beyond uint32.
        LLMException
            LLM_PARAM_INVALID for a blocks destination, ``size`` not -1/> 0,
            ``tensor_num_per_layer`` 0, an invalid ``CacheKey``, a range with step != 1 or a
            negative start; engine statuses (NOT_YET_LINK, KV_CACHE_NOT_EXIST, TIMEOUT, ...).
        """
        src_range, dst_range, t = _pull_kwargs(kwargs)
        if self._enable_remote_cache_accessible:
            if not isinstance(cache_key, CacheKeyByIdAndIndex):
                raise TypeError("in remote-accessible mode pull_cache takes a CacheKeyByIdAndIndex, "
                                f"but got {type(cache_key).__name__}.")
        else:
            check_isinstance("cache_key", cache_key, (CacheKey, CacheKeyByIdAndIndex), allow_none=False)
        check_isinstance("cache", cache, Cache, allow_none=False)
        check_uint32("batch_index", batch_index)
        check_int64("size", size)
        raise_if_false(not cache.is_blocks_cache, "pull_cache cannot pull into a blocks cache.")
        raise_if_false(size == -1 or size > 0, f"size must be -1 or > 0, but got {size}.")
        _check_tensor_num_per_layer(t)
        check_cache_key_ids(cache_key)
        src_idx, dst_idx = layer_range_to_tensor_indices(src_range, dst_range, t)
        status = self._llm_datadist.pull_cache_v2(
            cache.cache_id, pack_cache_key(cache_key), (size, batch_index, [], [], src_idx, dst_idx, -1, -1, t))
        self._check(status, "pull_cache", lambda: f"cache_key={cache_key!r}, cache_id={cache.cache_id}")

    def pull_blocks(self, src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
                    dst_cache: Cache, src_blocks: list[int] | tuple[int, ...] = (),
                    dst_blocks: list[int] | tuple[int, ...] = (), **kwargs: Any) -> None:
        """Pull a peer's blocks into blocks ``dst_blocks`` of ``dst_cache`` (CANN
        ``pull_blocks``, PYPKG.md §4.6).

        With a ``BlocksCacheKey`` block ``src_blocks[i]`` goes to ``dst_blocks[i]`` (block size =
        the local stride); with a ``CacheKey`` / ``CacheKeyByIdAndIndex`` ``src_blocks`` must be
        empty and the peer's contiguous cache fills ``dst_blocks``. Keywords as :meth:`pull_cache`.
        Unequal list lengths are the engine's LLM_PARAM_INVALID (after its link checks).

        Raises
        ------
        TypeError
            Argument types.
        LLMException
            LLM_PARAM_INVALID: destination not a blocks cache, empty ``dst_blocks``,
            ``tensor_num_per_layer`` 0, empty ``src_blocks`` with a ``BlocksCacheKey``,
            non-empty ``src_blocks`` with another key, an invalid ``CacheKey``, a bad range;
            engine statuses otherwise.
        """
        src_range, dst_range, t = _pull_kwargs(kwargs)
        check_isinstance("src_cache_key", src_cache_key, (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey),
                         allow_none=False)
        check_isinstance("dst_cache", dst_cache, Cache, allow_none=False)
        check_list_of("src_blocks", src_blocks, int)
        check_list_of("dst_blocks", dst_blocks, int)
        raise_if_false(dst_cache.is_blocks_cache, "pull_blocks needs a blocks cache as destination.")
        raise_if_false(len(dst_blocks) > 0, "dst_blocks must not be empty.")
        _check_tensor_num_per_layer(t)
        if isinstance(src_cache_key, BlocksCacheKey):
            raise_if_false(len(src_blocks) > 0, "src_blocks must not be empty for a BlocksCacheKey.")
        else:
            check_cache_key_ids(src_cache_key)
            raise_if_false(len(src_blocks) == 0,
                           f"src_blocks must be empty for a {type(src_cache_key).__name__}.")
        src_idx, dst_idx = layer_range_to_tensor_indices(src_range, dst_range, t)
        param = (-1, 0, pack_uint64_list("src_blocks", src_blocks),
                 pack_uint64_list("dst_blocks", dst_blocks), src_idx, dst_idx, -1, -1, t)
        status = self._llm_datadist.pull_cache_v2(dst_cache.cache_id, pack_cache_key(src_cache_key), param)
        self._check(status, "pull_blocks", lambda: f"cache_key={src_cache_key!r}, cache_id={dst_cache.cache_id}")

    # -- pushes (§4.8) -------------------------------------------------------------------------

    def _push_layers(self, src_cache: Cache, src_layer_range: Any, dst_layer_range: Any,
                     t: int) -> list[tuple[int, int]]:
        check_layer_range("src_layer_range", src_layer_range)
        check_layer_range("dst_layer_range", dst_layer_range)
        default = range(0, src_cache.cache_desc.num_tensors // t)
        src = default if src_layer_range is None else src_layer_range
        dst = default if dst_layer_range is None else dst_layer_range
        raise_if_false(len(src) == len(dst),
                       f"src_layer_range {src!r} and dst_layer_range {dst!r} differ in length.")
        return list(zip(src, dst))

    def _push(self, func: str, layers: list[tuple[int, int]], cfg: TransferCfgTuple,
              block_cfg: tuple[int, list[int], list[int]]) -> None:
        task_id = transfer.next_task_id()
        for ls, ld in layers:
            layer_cfg: TransferCfgTuple = (cfg[0], cfg[1], ls, cfg[3], cfg[4], cfg[5], cfg[6], cfg[7], ld, cfg[9])
            status = self._llm_datadist.transfer_cache_v2(task_id, layer_cfg, block_cfg)
            self._check(status, func, f"src layer {ls} -> dst layer {ld}")

    def push_cache(self, dst_cache_key: CacheKeyByIdAndIndex, src_cache: Cache, src_batch_index: int = 0,
                   src_layer_range: range | None = None, dst_layer_range: range | None = None,
                   size: int = -1, tensor_num_per_layer: int = 2) -> None:
        """Write batch row ``src_batch_index`` of ``src_cache`` into a peer's cache, one engine
        call per layer (CANN ``push_cache``, PYPKG.md §4.8; remote-accessible mode only).

        Missing ranges mean ``range(num_tensors // tensor_num_per_layer)`` (empty -> nothing is
        moved, success). The first failing layer raises; earlier layers stay written.

        Raises
        ------
        TypeError, ValueError
            Argument types and ranges.
        LLMException
            LLM_PARAM_INVALID: not remote-accessible mode, a blocks source, ``size != -1``,
            ``tensor_num_per_layer`` 0, a bad range, unequal range lengths; engine statuses.
        """
        raise_if_false(self._enable_remote_cache_accessible, "push_cache needs remote-accessible mode.")
        check_isinstance("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex, allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_uint32("src_batch_index", src_batch_index)
        raise_if_false(not src_cache.is_blocks_cache, "push_cache cannot push from a blocks cache.")
        _check_tensor_num_per_layer(tensor_num_per_layer)
        layers = self._push_layers(src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer)
        check_int64("size", size)  # after the layer arguments, as upstream
        raise_if_false(size == -1, f"push_cache supports only size=-1, but got {size}.")
        cfg: TransferCfgTuple = (src_cache.cache_id, src_batch_index, 0, [], dst_cache_key.cluster_id,
                                 dst_cache_key.cache_id, dst_cache_key.batch_index, 2, 0, tensor_num_per_layer)
        self._push("push_cache", layers, cfg, (0, [], []))

    def push_blocks(self, dst_cache_key: BlocksCacheKey, src_cache: Cache,
                    src_blocks: list[int] | tuple[int, ...] | None = (),
                    dst_blocks: list[int] | tuple[int, ...] = (),
                    src_layer_range: range | None = None, dst_layer_range: range | None = None,
                    tensor_num_per_layer: int = 2) -> None:
        """Write blocks of ``src_cache`` into a peer's blocks cache named by ``model_id``, one
        engine call per layer (CANN ``push_blocks``, PYPKG.md §4.8; remote-accessible mode only).

        Raises
        ------
        TypeError, ValueError
            Argument types and ranges.
        LLMException
            LLM_PARAM_INVALID: not remote-accessible mode, a non-blocks source, empty
            ``dst_blocks``, ``tensor_num_per_layer`` 0, bad ranges; engine statuses (an empty
            ``src_blocks`` is the engine's LLM_PARAM_INVALID).
        """
        raise_if_false(self._enable_remote_cache_accessible, "push_blocks needs remote-accessible mode.")
        check_isinstance("dst_cache_key", dst_cache_key, BlocksCacheKey, allow_none=False)
        check_isinstance("src_cache", src_cache, Cache, allow_none=False)
        check_list_of("src_blocks", src_blocks, int, allow_none=True)  # None is sent as []
        check_list_of("dst_blocks", dst_blocks, int)
        raise_if_false(src_cache.is_blocks_cache, "push_blocks needs a blocks cache as source.")
        raise_if_false(len(dst_blocks) > 0, "dst_blocks must not be empty.")
        _check_tensor_num_per_layer(tensor_num_per_layer)
        layers = self._push_layers(src_cache, src_layer_range, dst_layer_range, tensor_num_per_layer)
        key = pack_cache_key(dst_cache_key)
        cfg: TransferCfgTuple = (src_cache.cache_id, 0, 0, [], key[0], key[5], 0, 1, 0, tensor_num_per_layer)
        block_cfg = (0, pack_uint64_list("src_blocks", src_blocks or []),
                     pack_uint64_list("dst_blocks", dst_blocks))
        self._push("push_blocks", layers, cfg, block_cfg)

    def transfer_cache_async(self, src_cache: Cache, layer_synchronizer: LayerSynchronizer,
                             transfer_configs: list[TransferConfig] | list[TransferWithCacheKeyConfig]
                             | tuple[TransferConfig | TransferWithCacheKeyConfig, ...],
                             src_block_indices: list[int] | tuple[int, ...] | None = None,
                             dst_block_indices: list[int] | tuple[int, ...] | None = None,
                             dst_block_memory_size: int | None = None) -> CacheTask:
        """Send layers of ``src_cache`` as ``layer_synchronizer`` reports them ready, on a worker
        thread (CANN ``transfer_cache_async``, PYPKG.md §4.10); see :mod:`.transfer`.

        Returns
        -------
        CacheTask
            ``synchronize()`` / ``get_results()``.
        """
        return transfer.transfer_cache_async(self._llm_datadist, self._enable_remote_cache_accessible,
                                             src_cache, layer_synchronizer, transfer_configs,
                                             src_block_indices, dst_block_indices, dst_block_memory_size)
