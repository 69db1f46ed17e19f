"""Cache keys: ``CacheKey``, ``CacheKeyByIdAndIndex``, ``BlocksCacheKey`` (PYPKG.md §5.3).

Re-exported by :mod:`kvdd.llm_datadist.v2.llm_types` (upstream defines them there).
"""

from __future__ import annotations

from typing import Any

from ..status import raise_if_false
from ..utils.utils import UINT64_MAX, check_int64, check_uint32, check_uint64

__all__ = ["CacheKey", "CacheKeyByIdAndIndex", "BlocksCacheKey", "INVALID_ID"]

#: 2**64 - 1: "no id" for req_id / prefix_id, the padding key
INVALID_ID = UINT64_MAX

_ORDINALS = ("first", "second", "third", "fourth")


def _collect(cls_name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
             positional: tuple[str, ...], max_args: int, required: tuple[str, ...] = ()) -> dict[str, Any]:
    # upstream's order: the count, the positional arguments (overwriting keywords of the same
    # name), the cluster id and the other required names, then unknown keywords
    raise_if_false(len(args) + len(kwargs) <= max_args,
                   f"{cls_name} takes at most {max_args} arguments, "
                   f"but got {len(args) + len(kwargs)}.")
    raise_if_false(len(args) <= len(positional),
                   f"{cls_name} takes at most {len(positional)} positional arguments.")
    given = {**kwargs, **dict(zip(positional, args))}
    raise_if_false("cluster_id" in given or "prompt_cluster_id" in given,
                   f"{cls_name}: cluster_id is required (prompt_cluster_id is its alias).")
    for name in required:
        raise_if_false(name in given, f"{cls_name}: {name} is required.")
    allowed = set(positional) | {"prompt_cluster_id"}
    for key in given:
        raise_if_false(key in allowed, f"Unsupported param '{key}' for {cls_name}.")
    return given


def _check_int(cls_name: str, index: int, name: str, value: Any) -> None:
    if not isinstance(value, int):
        raise TypeError(f"The {_ORDINALS[index]} param {name} of {cls_name} only supports int, "
                        f"but got {type(value).__name__}.")


class BlocksCacheKey:
    """Key of a blocks cache: ``(cluster_id, model_id)`` (PYPKG.md §5.3).

    ``BlocksCacheKey(cluster_id, model_id=0)``; ``prompt_cluster_id`` is an alias of
    ``cluster_id`` (``cluster_id`` wins when both are given). At most 2 arguments and a cluster id
    are required (LLM_PARAM_INVALID); values must be ints (``TypeError``), not range-checked.
    At registration the cluster id is ignored and the identity is ``(2**64-1, model_id)``: the
    last cache registered with a model id wins (PYPKG.md §4.1).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = _collect("BlocksCacheKey", args, kwargs, ("cluster_id", "model_id"), 2)
        spelling = "cluster_id" if "cluster_id" in given else "prompt_cluster_id"
        cluster_id = given[spelling]
        model_id = given.get("model_id", 0)
        _check_int("BlocksCacheKey", 0, spelling, cluster_id)
        _check_int("BlocksCacheKey", 1, "model_id", model_id)
        self._spelling = spelling
        self._cluster_id: int = cluster_id
        self._model_id: int = model_id

    @property
    def cluster_id(self) -> int:
        """The peer's cluster id (selects the link)."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as :attr:`cluster_id`."""
        return self._cluster_id

    @property
    def model_id(self) -> int:
        """The model id (the key's identity on the peer)."""
        return self._model_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey({self._spelling}={self._cluster_id}, model_id={self._model_id})"


class CacheKey:
    """Key of a request's cache: ``(cluster_id, req_id, model_id=0, prefix_id=2**64-1)``
    (PYPKG.md §5.3).

    Cluster id (or ``prompt_cluster_id``) and ``req_id`` are required (LLM_PARAM_INVALID); all
    four are uint64 (``TypeError`` / ``ValueError``). Exactly one of ``req_id`` / ``prefix_id``
    must be valid (< 2**64-1) when the key is used for a pull (PYPKG.md §4.5).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = _collect("CacheKey", args, kwargs, ("cluster_id", "req_id", "model_id", "prefix_id"), 4,
                         required=("req_id",))
        spelling = "cluster_id" if "cluster_id" in given else "prompt_cluster_id"
        cluster_id = given[spelling]
        req_id = given["req_id"]
        model_id = given.get("model_id", 0)
        prefix_id = given.get("prefix_id", INVALID_ID)
        check_uint64(spelling, cluster_id)
        check_uint64("req_id", req_id)
        check_uint64("model_id", model_id)
        check_uint64("prefix_id", prefix_id)
        self._spelling = spelling
        self._cluster_id: int = cluster_id
        self._req_id: int = req_id
        self._model_id: int = model_id
        self._prefix_id: int = prefix_id

    @property
    def cluster_id(self) -> int:
        """The peer's cluster id."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as :attr:`cluster_id`."""
        return self._cluster_id

    @property
    def req_id(self) -> int:
        """Request id (2**64-1 = none)."""
        return self._req_id

    @property
    def model_id(self) -> int:
        """Model id."""
        return self._model_id

    @property
    def prefix_id(self) -> int:
        """Prefix id (2**64-1 = none)."""
        return self._prefix_id

    def __repr__(self) -> str:
        return (f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
                f"prefix_id={self._prefix_id}, model_id={self._model_id})")


class CacheKeyByIdAndIndex:
    """A peer's cache by id and batch row: ``(cluster_id uint64, cache_id int64,
    batch_index=0 uint32)`` (PYPKG.md §5.3); ``TypeError`` / ``ValueError`` otherwise."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self._cluster_id = cluster_id
        self._cache_id = cache_id
        self._batch_index = batch_index

    @property
    def cluster_id(self) -> int:
        """The peer's cluster id."""
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        """The peer's cache id."""
        return self._cache_id

    @property
    def batch_index(self) -> int:
        """The remote batch row."""
        return self._batch_index

    def __repr__(self) -> str:
        return (f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
                f"batch_index={self._batch_index})")
