"""The simulator backend: LLM-DataDist V2 semantics (SEMANTICS.md) on host memory.

Use it through ``kvdd.LlmDataDist(..., backend="sim")``; this package also holds the
simulator-only features (fault injection in :mod:`kvdd.sim.faults`).
"""

from __future__ import annotations

from .engine import SimBackend

__all__ = ["SimBackend"]
