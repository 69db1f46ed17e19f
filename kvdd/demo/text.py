"""Human-readable output shared by both sides: progress lines and sizes."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

__all__ = ["Progress", "fmt_seconds", "mib", "plural"]

_log = logging.getLogger(__name__)


class Progress:
    """Step lines on stderr (``kvdd demo [decode] ...``) when enabled."""

    def __init__(self, enabled: bool, role: str, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.role = role
        self.stream = stream

    def __call__(self, message: str) -> None:
        _log.info("[%s] %s", self.role, message)
        if self.enabled:
            out = self.stream or sys.stderr
            print(f"kvdd demo [{self.role}] {message}", file=out, flush=True)

    def warn(self, message: str) -> None:
        """A line on stderr whether or not progress lines are enabled (and a logged warning):
        what the operator must see, e.g. a refused connection."""
        _log.warning("[%s] %s", self.role, message)
        print(f"kvdd demo [{self.role}] warning: {message}", file=self.stream or sys.stderr, flush=True)

    @contextmanager
    def step(self, message: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self(f"{message} ...")
        yield
        self(f"{message}: done in {time.perf_counter() - t0:.2f} s")


def plural(n: int, word: str) -> str:
    """``"1 block"``, ``"2 blocks"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def mib(n: float) -> str:
    """A byte count as KiB, MiB or GiB."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def fmt_seconds(s: float) -> str:
    """Milliseconds below 10 s, else seconds."""
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"
