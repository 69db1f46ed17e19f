"""The demo's exceptions and its JSON document type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigError", "DemoError", "Json", "VerificationError"]

#: A JSON object (control messages, ``--json`` output).
Json = dict[str, Any]


class ConfigError(ValueError):
    """A model config (or a geometry argument) the demo cannot use."""


class DemoError(Exception):
    """The demo failed: ``transfer`` names the step, ``location`` (verification) where."""

    def __init__(self, message: str, *, transfer: str | None = None,
                 location: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.transfer = transfer
        self.location = dict(location) if location is not None else None

    def to_json(self) -> Json:
        return {"message": self.message, "transfer": self.transfer, "location": self.location}


class VerificationError(DemoError):
    """Bytes in a cache differ from what the verifier recomputed."""
