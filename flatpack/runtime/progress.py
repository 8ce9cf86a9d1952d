"""A live progress line for a training run:
``iter 3/10  loss 0.4213  52.1 samples/s  $0.000123 so far``.

On a terminal the line is rewritten in place (``\\r``); on anything else (a log file, a CI
log, a pipe) each update is its own line, so logs stay readable. Dollars accrue as
``dollars_per_second × elapsed``; the caller prices the deployed functions (every
worker's memory tier at the platform's rate) and passes the sum per second.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


class ProgressLine:
    """``update(iteration, loss, elapsed_s)`` after each iteration: ``iteration`` counts the
    iterations finished so far (1 after the first; pass index + 1 for a 0-based index),
    ``elapsed_s`` the seconds since the run (or this ProgressLine's share of it) began.
    Throughput is (iteration − start_iteration) × samples_per_iteration / elapsed_s, so a
    resumed run passes the iteration it resumed from as ``start_iteration``.

    A line can span several ``train()`` calls (``flatpack run --eval-every``: one call per
    evaluation): the caller makes it and passes it as ``progress``; each call then counts
    iterations from the line's ``origin`` (the run iteration it began at, set by the first
    call) and time from its creation, and ``note`` (the last evaluation) ends every update."""

    def __init__(self, total_iterations: int, samples_per_iteration: int, dollars_per_second: float,
                 stream: TextIO | None = None, *, start_iteration: int = 0) -> None:
        self.total_iterations = total_iterations
        self.samples_per_iteration = samples_per_iteration
        self.dollars_per_second = dollars_per_second
        self.stream = sys.stderr if stream is None else stream
        self.start_iteration = start_iteration
        self.tty = _is_tty(self.stream)
        self.dollars = 0.0
        self._width = 0      # length of the line now on screen (TTY), to blank a longer one
        self._open = False   # a TTY line without its newline yet
        self.origin: int | None = None
        self.started = time.time()
        self.note = ""

    def format(self, iteration: int, loss: float | None, elapsed_s: float) -> str:
        done = iteration - self.start_iteration
        rate = done * self.samples_per_iteration / elapsed_s if elapsed_s > 0 else 0.0
        loss_text = "-" if loss is None else f"{loss:.4f}"
        note = f"  {self.note}" if self.note else ""
        return (f"iter {iteration}/{self.total_iterations}  loss {loss_text}  {rate:.1f} samples/s  "
                f"${self.dollars_per_second * max(elapsed_s, 0.0):.6f} so far{note}")

    def update(self, iteration: int, loss: float | None, elapsed_s: float) -> None:
        text = self.format(iteration, loss, elapsed_s)
        self.dollars = self.dollars_per_second * max(elapsed_s, 0.0)
        if self.tty:
            self.stream.write("\r" + text + " " * max(0, self._width - len(text)))
            self._width = len(text)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the line (on a terminal; other streams already end every update)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
            self._width = 0

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
