"""What every :class:`kvdd.LlmDataDist` call does around its backend call.

Before: the Python-level argument checks (``TypeError``/``ValueError`` for values the C++ types
cannot hold; integer widths are :func:`kvdd.widths.check_int`).  After: the one conversion of a
non-success status into the :class:`kvdd.LLMError` subclass of that status (docs/spec/API.md
"Status and errors"), with the backend's explanation of it when it has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from .backend import Backend
from .status import raise_for_status
from .types import CacheDesc, ClusterInfo, KvCacheExtParam

__all__ = ["DEFAULT_EXT", "check_type", "check_clusters", "check_tensor_sizes", "ext_or_default",
           "raise_status"]

#: The ``ext_param`` of a call that gives none (immutable, so one instance serves every call).
DEFAULT_EXT = KvCacheExtParam()


def check_type(name: str, value: object, klass: type) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is a ``klass``."""
    if not isinstance(value, klass):
        raise TypeError(f"{name} must be {klass.__name__}, not {type(value).__name__}")


def check_clusters(clusters: object) -> tuple[ClusterInfo, ...]:
    """``clusters`` as a tuple; ``TypeError`` unless it is a sequence of :class:`ClusterInfo`."""
    if isinstance(clusters, (str, bytes)) or not isinstance(clusters, Sequence):
        raise TypeError(f"clusters must be a sequence of ClusterInfo, not {type(clusters).__name__}")
    for i, c in enumerate(clusters):
        check_type(f"clusters[{i}]", c, ClusterInfo)
    return tuple(clusters)


def check_tensor_sizes(cache_desc: CacheDesc, nbytes: Sequence[int]) -> None:
    """``ValueError`` when a tensor holds fewer bytes than ``cache_desc`` needs per tensor.

    The C++ API only sees addresses, so upstream cannot notice a tensor smaller than the
    descriptor says; :class:`kvdd.TensorAddrs` knows each owner's size, so kvdd refuses that
    classic bug (identically on every backend) instead of letting transfers write past the tensor
    (docs/spec/SEMANTICS.md §10).  An invalid shape or dtype is left to the backend's LLM status.
    """
    try:
        need = cache_desc.tensor_nbytes
    except ValueError:
        return
    for i, have in enumerate(nbytes):
        if have < need:
            raise ValueError(
                f"tensor {i} holds {have} bytes but cache_desc needs {need} bytes per tensor "
                f"(shape {cache_desc.shape}, data_type {cache_desc.data_type!r}); transfers would "
                "read and write past it. Register tensors of the described shape."
            )


def ext_or_default(ext_param: KvCacheExtParam | None) -> KvCacheExtParam:
    """``ext_param``, or :data:`DEFAULT_EXT` for None; ``TypeError`` for anything else."""
    if ext_param is None:
        return DEFAULT_EXT
    check_type("ext_param", ext_param, KvCacheExtParam)
    return ext_param


def raise_status(backend: Backend, status: int, what: str, rets: list[int] | None = None) -> NoReturn:
    """Raise the :class:`kvdd.LLMError` subclass of the failure ``status`` of the C++ call ``what``.

    ``rets`` are the per-cluster statuses of a link/unlink call; the message includes the
    backend's explanation of its last failing call in this thread when it has one (optional,
    backend-neutral ``last_error_detail()``).
    """
    getter = getattr(backend, "last_error_detail", None)
    raise_for_status(status, what, rets, getter() if callable(getter) else None)
    raise AssertionError(f"raise_for_status returned for status {status}")  # pragma: no cover
