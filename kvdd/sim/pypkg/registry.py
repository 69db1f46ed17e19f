"""Registration of CANN's Python package: CACHE and BLOCKS entries, keys, unregistration.

docs/spec/PYPKG.md §4.1 (``register_cache`` / ``register_blocks_cache``, native order), §4.2
(``unregister_cache``), §5.1 (``calc_tensor_size``).  The entries live in the simulator instance's
own :class:`kvdd.sim.caches.CacheTable` (the table peers snapshot when they link), next to the C++
face's MIX entries; checks raise :class:`kvdd.sim.checks.Rejected`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...dtypes import tensor_nbytes
from ...status import FAILED, PARAM_INVALID, S_OK
from .. import faults
from ..checks import CACHE_TABLE_LIMIT, reject
from ..entries import CacheEntry
from ..fabric import KIND_BLOCKS, KIND_CACHE
from ..memory import first_inaccessible
from .keys import drop_keys, index_keys

if TYPE_CHECKING:
    from ...llm_datadist._seam import CacheDescTuple, CacheKeyTuple
    from .protocols import PkgEngine

__all__ = ["calc_tensor_size", "register", "unregister", "MAX_DIMS"]

#: A shape has 1..31 dims (PYPKG.md §4.1 step 1).
MAX_DIMS = 32


def calc_tensor_size(shape: Sequence[int], data_type: int) -> int:
    """Bytes of one tensor of ``shape`` and ``data_type`` (a ``ge::DataType`` value), or -1 where
    upstream's ``CalcTensorMemSize`` fails: a dim <= 0, int64 overflow, an unsupported data type
    (PYPKG.md §1.4; DT_STRING counts 16 bytes an element)."""
    try:
        return tensor_nbytes([int(d) for d in shape], int(data_type))
    except (ValueError, TypeError, OverflowError):
        return -1


def register(engine: PkgEngine, cache_desc: CacheDescTuple, addrs: Sequence[int],
             cache_keys: Sequence[CacheKeyTuple], remote_accessible: bool) -> int:
    """``LLMDataDistV2::RegisterCache`` in its order (PYPKG.md §4.1): the new cache id.

    Raises
    ------
    kvdd.sim.checks.Rejected
        PARAM_INVALID (shape with 0 or >= 32 dims; ``num_tensors != len(addrs)``; the tensor size
        cannot be computed: the id is consumed; a null address; a cache table over 1 MiB in
        remote-cache-accessible mode: the cache stays registered); FAILED (a tensor is not
        readable and writable memory of this process, kvdd's rule: upstream registers what it is
        given); an injected fault (kinds ``register_cache`` / ``register_blocks_cache``).
    """
    num_tensors, data_type, _seq_len_dim, shape, placement, is_blocks = cache_desc
    instance = engine.instance
    table = instance.cache_table
    with table.lock:
        if not instance.initialized:  # finalized meanwhile
            reject(FAILED, "the engine is finalized")
        if len(shape) == 0 or len(shape) >= MAX_DIMS:  # 1
            reject(PARAM_INVALID, f"shape must have 1..{MAX_DIMS - 1} dims, has {len(shape)}")
        if num_tensors != len(addrs):  # 2
            reject(PARAM_INVALID, f"{len(addrs)} addrs but num_tensors={num_tensors}")
        cache_id = table.take_id()  # 3: consumed from here on
        T = calc_tensor_size(shape, data_type)  # 4
        if T < 0:
            reject(PARAM_INVALID, f"cannot size a tensor of shape {list(shape)} and data type "
                   f"{data_type} (a dim <= 0, overflow or an unsupported data type)")
        # 5: a remote-accessible cache's memory is registered with the transport, which refuses
        # a null address; kvdd refuses one (and memory this process cannot read and write) for
        # every cache, since copies and pulls write into it (SEMANTICS.md §10 rule 4)
        for i, a in enumerate(addrs):
            if a == 0:
                reject(PARAM_INVALID, f"addrs[{i}] is 0")
        bad = first_inaccessible(addrs, T)
        if bad >= 0:
            reject(FAILED, f"tensor {bad} at 0x{addrs[bad]:x} ({T} bytes) is not readable and "
                   "writable memory of this process")
        kind_name = "register_blocks_cache" if is_blocks else "register_cache"
        status = faults.on_call(instance, kind_name)
        if status != S_OK:
            reject(status, instance.last_error_detail() or "the transport refused the registration")
        owners = tuple(getattr(addrs, "owners", ()))
        rows = int(shape[0])
        if is_blocks:  # 6
            entry = CacheEntry(cache_id, len(addrs), T, 1, int(placement), addrs, owners,
                               KIND_BLOCKS, rows, bool(remote_accessible))
        else:
            entry = CacheEntry(cache_id, len(addrs), T, rows & 0xFFFFFFFF, int(placement), addrs,
                               owners, KIND_CACHE, 0, bool(remote_accessible))
        index_keys(table, entry, cache_keys, bool(is_blocks))  # 7
        size = table.insert(entry)
        if engine.remote_accessible and size > CACHE_TABLE_LIMIT:
            reject(PARAM_INVALID, f"cache table would be {size} bytes (> 1 MiB); the cache stays "
                   "registered as upstream, but peers keep reading the last table that fit")
        return cache_id


def unregister(engine: PkgEngine, cache_id: int) -> None:
    """``UnregisterCache`` (PYPKG.md §4.2): remove the entry and every key still pointing at it;
    unknown, negative or repeated ids succeed.  Returns once no transfer holds the cache (a peer
    that snapshotted it keeps a stale view: its transfers get KV_CACHE_NOT_EXIST)."""
    table = engine.instance.cache_table
    with table.lock:
        if cache_id in table.caches:
            drop_keys(table, cache_id)
        entry = table.take(cache_id)
    if entry is not None:
        table.retire(cache_id, entry)
