"""The simulator's engine for CANN's ``llm_datadist`` Python package (docs/spec/PYPKG.md).

Implements :class:`kvdd.llm_datadist._seam.Wrapper` over kvdd's simulator:
:func:`process_wrapper` is the process-wide engine object (the engine inside exists between
``initialize_v2`` and ``finalize_v2``).
"""

from __future__ import annotations

from .wrapper import SimWrapper, process_wrapper

__all__ = ["SimWrapper", "process_wrapper"]
