"""The ``flatpack`` logger: diagnostics and progress on stderr, apart from the reports
(tables, results) that the commands print on stdout, so ``flatpack plan ... > plan.txt`` or
``--json`` output piped into ``jq`` holds the report alone.

Modules log to ``logging.getLogger("flatpack.<part>")`` (:func:`get`); the library adds no
handler of its own (an application configures logging as it likes). The command line calls
:func:`configure` with its ``-v``/``-q`` count: INFO by default (what the run is doing),
DEBUG with ``-v``, WARNING with ``-q`` (warnings and errors only; no progress display).
"""

from __future__ import annotations

import logging
import sys

ROOT = "flatpack"
VERBOSITY_LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}


def get(part: str) -> logging.Logger:
    """The logger of one part of flatpack (``get("job")`` is ``flatpack.job``)."""
    return logging.getLogger(f"{ROOT}.{part}")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (a test's captured
    stream, a redirected one), not the stream of the moment it was configured."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _Format(logging.Formatter):
    """INFO lines as they are (they read as the command's own output); DEBUG lines with the
    logger's name; warnings and errors prefixed ``flatpack: warning:`` / ``flatpack: error:``."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.levelno >= logging.ERROR:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.ERROR:
            return f"flatpack: error: {message}"
        if record.levelno >= logging.WARNING:
            return f"flatpack: warning: {message}"
        if record.levelno <= logging.DEBUG:
            return f"[{record.name}] {message}"
        return message


def level_for(verbosity: int) -> int:
    """``-q`` is -1, nothing 0, ``-v`` 1 (more ``-v`` stay at DEBUG)."""
    return VERBOSITY_LEVELS[max(-1, min(1, verbosity))]


def configure(verbosity: int = 0) -> logging.Logger:
    """Sends the ``flatpack`` logger's records at ``level_for(verbosity)`` and above to stderr,
    replacing the handler an earlier call installed (``main`` may run more than once in a
    process: the tests call it)."""
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Format())
    logger.addHandler(handler)
    logger.setLevel(level_for(verbosity))
    return logger


def progress_enabled() -> bool:
    """Whether progress displays are wanted: the ``flatpack`` logger takes INFO (not ``-q``)."""
    return logging.getLogger(ROOT).isEnabledFor(logging.INFO)
