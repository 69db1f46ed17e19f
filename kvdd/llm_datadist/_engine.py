"""Where the Python layer gets its :class:`~kvdd.llm_datadist._seam.Wrapper` from.

By default the simulator's process-wide engine (``kvdd.sim.pypkg.process_wrapper()``, imported on
first use).  :func:`use_wrapper` substitutes another implementation of the seam (tests use a
recording fake); it does not touch an already initialized ``LLMDataDist``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

from ._seam import Wrapper

__all__ = ["wrapper", "use_wrapper"]

_override: Wrapper | None = None


def wrapper() -> Wrapper:
    """The engine the next ``LLMDataDist.init`` (and ``CacheDesc.size``) uses."""
    if _override is not None:
        return _override
    module = importlib.import_module("kvdd.sim.pypkg")
    return cast(Wrapper, module.process_wrapper())


@contextmanager
def use_wrapper(engine: Wrapper) -> Iterator[Wrapper]:
    """Use ``engine`` instead of the simulator's within the ``with`` block."""
    global _override
    previous = _override
    _override = engine
    try:
        yield engine
    finally:
        _override = previous


def with_detail(engine: object, info: str) -> str:
    """``info`` plus the engine's explanation of its last failure on this thread, if it gives one
    (an upstream-shaped module or a test double may have no ``last_error_detail``)."""
    getter = getattr(engine, "last_error_detail", None)
    detail = getter() if callable(getter) else None
    return f"{info}; {detail}" if isinstance(detail, str) and detail else info
