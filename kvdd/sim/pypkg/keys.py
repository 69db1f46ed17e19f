"""Cache keys of CANN's Python package: identities, the owner's key maps, remote lookups.

docs/spec/PYPKG.md §4.1 (indexing at registration), §4.2 (unregistration), §4.4 (how a key
resolves to a remote cache in the one-sided, remote-cache-accessible mode).

A key's *identity* is ``(prefix_id, model_id)`` when ``prefix_id != 2**64-1``, else
``(req_id, model_id)``; the ``cluster_id`` inside a key is ignored at registration.  The owner
keeps two maps (identity -> ``(cache id, batch position)``): the req map (published with the cache
table, so peers can resolve it) and the prefix map (never published).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...llm_datadist._seam import CacheKeyTuple
    from ..caches import CacheTable
    from ..entries import CacheEntry
    from ..fabric import RemoteCache

__all__ = ["NO_ID", "identity", "index_keys", "drop_keys", "find_remote"]

#: 2**64 - 1: "no id" for req_id / prefix_id (a padding key has it as req_id).
NO_ID = (1 << 64) - 1

Identity = tuple[int, int]


def identity(key: CacheKeyTuple) -> tuple[Identity, bool]:
    """``(identity, is_prefix)`` of a CacheKeyTuple ``(cluster, cache_id, batch, req, prefix,
    model, is_blocks_key)`` (PYPKG.md §4.1)."""
    req, prefix, model = int(key[3]), int(key[4]), int(key[5])
    if prefix != NO_ID:
        return (prefix, model), True
    return (req, model), False


def index_keys(table: CacheTable, entry: CacheEntry, keys: Sequence[CacheKeyTuple],
               blocks: bool) -> None:
    """Index ``keys`` for ``entry`` (the caller holds the table's lock), PYPKG.md §4.1:

    * a blocks entry stores every key in the req map with overwrite: the last registration with
      an identity wins (the entry it pointed at loses it);
    * a non-blocks entry skips keys whose identity starts with 2**64-1 (padding; they still take a
      batch position) and inserts the others without overwrite (the first registration wins)
      into the req or the prefix map, with the key's batch position (its list index).
    """
    for position, key in enumerate(keys):
        ident, is_prefix = identity(key)
        if blocks:
            old = table.req_keys.get(ident)
            if old is not None:
                _forget(table, old[0], ident)
            table.req_keys[ident] = (entry.cache_id, position)
            entry.keys.append((ident[0], ident[1], position))
            continue
        if ident[0] == NO_ID:
            continue
        target = table.prefix_keys if is_prefix else table.req_keys
        if ident in target:
            continue
        target[ident] = (entry.cache_id, position)
        if not is_prefix:
            entry.keys.append((ident[0], ident[1], position))


def _forget(table: CacheTable, cache_id: int, ident: Identity) -> None:
    """``ident`` no longer points at ``cache_id`` (overwritten by a later blocks registration)."""
    entry = table.caches.get(cache_id)
    if entry is not None:
        entry.keys[:] = [k for k in entry.keys if (k[0], k[1]) != ident]


def drop_keys(table: CacheTable, cache_id: int) -> None:
    """Remove every key still pointing at ``cache_id`` from both maps (PYPKG.md §4.2; a key a
    later registration overwrote points elsewhere and stays).  The caller holds the lock."""
    for keymap in (table.req_keys, table.prefix_keys):
        for ident in [i for i, (cid, _pos) in keymap.items() if cid == cache_id]:
            del keymap[ident]


# the req map of a snapshot, built once per snapshot dict (snapshots never change)
_indexes: dict[int, tuple[Mapping[int, RemoteCache], dict[Identity, int]]] = {}


def _index(snapshot: Mapping[int, RemoteCache]) -> dict[Identity, int]:
    got = _indexes.get(id(snapshot))
    if got is not None and got[0] is snapshot:
        return got[1]
    index: dict[Identity, int] = {}
    for cid, rc in snapshot.items():
        for req, model, _pos in rc.keys:
            index[(req, model)] = cid
    if len(_indexes) > 256:
        _indexes.clear()
    _indexes[id(snapshot)] = (snapshot, index)
    return index


def find_remote(snapshot: Mapping[int, RemoteCache], key: CacheKeyTuple) -> RemoteCache | None:
    """PYPKG.md §4.4, one-sided: ``cache_id > 0`` selects the entry by id; anything else the
    identity ``(req_id, model_id)`` in the peer's published req map.  Upstream's quirks follow
    (a ``CacheKeyByIdAndIndex`` with id <= 0 resolves ``(2**64-1, 0)``, i.e. a
    ``BlocksCacheKey(model_id=0)`` cache; a prefix-only ``CacheKey`` resolves ``(2**64-1,
    model)``): both name a registered cache, so every later bound check still applies."""
    cache_id = int(key[1])
    if cache_id > 0:
        return snapshot.get(cache_id)
    cid = _index(snapshot).get((int(key[3]), int(key[5])))
    return None if cid is None else snapshot.get(cid)
