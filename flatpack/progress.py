"""Progress displays: a training run's ``iter 3/10  loss 0.4213  52.1 samples/s  $0.000123 so
far`` (:class:`ProgressLine`) and the profiler's steps, both through :class:`Progress`.

On a terminal, :class:`Progress` is a ``tqdm`` bar rewritten in place. tqdm, not rich: it
draws one line on the stream it is given and leaves the rest of the output alone, where
rich's live display takes over the console (and would redirect the ``flatpack`` logger's
lines and the workers' output through itself). On anything else (a log file, a CI log, a
pipe) it writes plain lines instead, never a ``\\r`` frame: one at the first update, then at
most one every ``interval_s`` seconds (the profiler's many short steps: 10 s; a training
iteration: each), and the last one when it closes, so logs stay short and readable.
Dollars accrue as ``dollars_per_second × elapsed``; the caller prices the deployed functions
(every worker's memory tier at the platform's rate) and passes the sum per second.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from tqdm import tqdm

PLAIN_INTERVAL_S = 10.0   # off a terminal: at most one line per this many seconds (and the last)


def is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


class Progress:
    """Progress over ``total`` steps on ``stream`` (default stderr): ``update(done, text)``
    with the steps done so far and what to show (the bar's postfix on a terminal; elsewhere
    the line, after ``desc``, which ends with its own separator: ``"profiling "``);
    ``close()`` ends it. ``tty`` overrides the terminal test; ``clock`` is
    what the plain lines are spaced by (a test passes its own)."""

    def __init__(self, total: int, desc: str, stream: TextIO | None = None, *, initial: int = 0,
                 interval_s: float = PLAIN_INTERVAL_S, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.tty = is_terminal(self.stream) if tty is None else tty
        self.interval_s = interval_s
        self.clock = clock
        self.desc = desc
        self._bar = (tqdm(total=total, initial=initial, desc=desc, file=self.stream, leave=True,
                          bar_format="{desc}{bar:20} {postfix}", dynamic_ncols=True) if self.tty else None)
        self._pending: str | None = None      # a plain line not written yet (the interval had not passed)
        self._last_written: float | None = None
        self._closed = False

    def update(self, done: int, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(done - self._bar.n)
            return
        now = self.clock()
        if self._last_written is not None and now - self._last_written < self.interval_s:
            self._pending = text
            return
        self._write(text, now)

    def _write(self, text: str, now: float) -> None:
        self.stream.write(self.desc + text + "\n")
        self.stream.flush()
        self._pending, self._last_written = None, now

    def close(self) -> None:
        """Ends the bar, or writes the last plain line if the interval held it back."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._pending is not None:
            self._write(self._pending, self.clock())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class ProgressLine:
    """``update(iteration, loss)`` after each iteration: ``iteration`` counts the iterations
    finished so far (1 after the first; pass index + 1 for a 0-based index). Time is the
    line's own, from its creation on ``clock``, so the dollars so far never decrease, whatever
    segments or calls the iterations come in (a checkpoint segment restarting the caller's
    clock made them drop). Throughput is (iteration − start_iteration) ×
    samples_per_iteration / elapsed, so a resumed run passes the iteration it resumed from as
    ``start_iteration``. Off a terminal,
    every iteration gets its line by default (``interval_s`` 0): an iteration is coarse, and a
    log is read for where a run stopped (tests/integration/test_recovery.py waits on one).

    A line can span several ``train()`` calls (``flatpack run --eval-every``: one call per
    evaluation): the caller makes it and passes it as ``progress``; each call then counts
    iterations from the line's ``origin`` (the run iteration it began at, set by the first
    call) and time from its creation, and ``note`` (the last evaluation) ends every update."""

    def __init__(self, total_iterations: int, samples_per_iteration: int, dollars_per_second: float,
                 stream: TextIO | None = None, *, start_iteration: int = 0, interval_s: float = 0.0,
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_iterations = total_iterations
        self.samples_per_iteration = samples_per_iteration
        self.dollars_per_second = dollars_per_second
        self.start_iteration = start_iteration
        self.dollars = 0.0
        self.progress = Progress(total_iterations, "", stream, initial=start_iteration, interval_s=interval_s,
                                 tty=tty, clock=clock)
        self.tty = self.progress.tty
        self.origin: int | None = None
        self.clock = clock
        self.started = clock()
        self.note = ""

    def format(self, iteration: int, loss: float | None, elapsed_s: float) -> str:
        done = iteration - self.start_iteration
        rate = done * self.samples_per_iteration / elapsed_s if elapsed_s > 0 else 0.0
        loss_text = "-" if loss is None else f"{loss:.4f}"
        note = f"  {self.note}" if self.note else ""
        return (f"iter {iteration}/{self.total_iterations}  loss {loss_text}  {rate:.1f} samples/s  "
                f"${self.dollars_per_second * max(elapsed_s, 0.0):.6f} so far{note}")

    def update(self, iteration: int, loss: float | None) -> None:
        elapsed_s = self.clock() - self.started
        self.dollars = self.dollars_per_second * max(elapsed_s, 0.0)
        self.progress.update(iteration, self.format(iteration, loss, elapsed_s))

    def close(self) -> None:
        self.progress.close()

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
