"""The package's logger ``LLM_DATADIST`` (PYPKG.md §1.1).

Upstream logs to stdout with the level taken from ``ASCEND_GLOBAL_LOG_LEVEL`` ("0".."3" mean
DEBUG, INFO, WARNING, ERROR; anything else ERROR).  kvdd sets that level and attaches one stdout
handler that prints a record only while the root logger has no handlers: once an application (or
pytest's log capture) configures logging, records propagate there instead, so nothing is printed
twice and ``caplog`` sees every record.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

__all__ = ["logger", "LOGGER_NAME", "level_from_env"]

LOGGER_NAME = "LLM_DATADIST"

_LEVELS = {"0": logging.DEBUG, "1": logging.INFO, "2": logging.WARNING, "3": logging.ERROR}


def level_from_env(value: str | None) -> int:
    """The logging level for an ``ASCEND_GLOBAL_LOG_LEVEL`` value: "0".."3" -> DEBUG..ERROR,
    anything else (or unset) -> ERROR (PYPKG.md §1.1)."""
    return _LEVELS.get((value or "").strip(), logging.ERROR)


class _StdoutUnlessConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """stdout, but only while logging is unconfigured (the root logger has no handlers)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.stream = sys.stdout  # follow redirections (capsys, contextlib.redirect_stdout)
        super().emit(record)


def _make_logger() -> logging.Logger:
    log = logging.getLogger(LOGGER_NAME)
    log.setLevel(level_from_env(os.environ.get("ASCEND_GLOBAL_LOG_LEVEL")))
    if not any(isinstance(h, _StdoutUnlessConfigured) for h in log.handlers):
        handler = _StdoutUnlessConfigured()
        handler.setFormatter(logging.Formatter("[%(levelname)s] %(name)s %(asctime)s %(message)s"))
        log.addHandler(handler)
    return log


_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)


def _find_caller() -> tuple[str, int, str]:
    """``(file, line, function)`` of the nearest frame outside this package (the user's call that
    led to a log record); ``("(unknown file)", 0, "(unknown function)")`` when there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not str(Path(filename).resolve()).startswith(_PACKAGE_DIR):
            return filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back  # type: ignore[assignment]
    return "(unknown file)", 0, "(unknown function)"


logger = _make_logger()
