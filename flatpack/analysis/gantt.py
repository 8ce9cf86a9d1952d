"""A run's timeline as a Gantt chart: one row per worker, its three lanes (compute, upload,
download) as sub-rows, tasks coloured by kind; optionally the model's predicted schedule
(``analysis.report.predicted_schedule``) in a panel above, on the same time axis.

matplotlib is optional and imported only when a chart is drawn; the figure is drawn on the
Agg canvas directly (no pyplot), so no display or global backend state is touched.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from flatpack.errors import InputError
from flatpack.partitioner.plot import require_matplotlib
from flatpack.runtime.timeline import KINDS, OUTSIDE_ITERATION, Event, Mark

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "upload": "tab:green", "download": "tab:olive",
          "sync": "tab:red", "update": "tab:purple", "checkpoint": "tab:gray", "load": "tab:brown",
          "prefetch": "tab:cyan"}
# a worker's row: the compute lane on top, the two transfer lanes below it as thin sub-rows
LANE_BANDS = {"compute": (0.42, 0.40), "upload": (0.18, 0.18), "download": (0.0, 0.16)}
ROW_HEIGHT = 1.0
# a bar gets its micro-batch number when it is at least this share of the axis wide
LABEL_MIN_SHARE = 0.018
# the least height of one panel: with one or two workers, the title, tick labels and axis label fit
MIN_PANEL_INCHES = 2.2


def _workers(*timelines: Sequence[Event]) -> list[tuple[int, int]]:
    return sorted({(e.stage, e.replica) for events in timelines for e in events})


def _draw(axes: Any, events: Sequence[Event], workers: list[tuple[int, int]], origin: float, span: float,
          heading: str) -> set[str]:
    """Draws ``events`` on ``axes``; returns the kinds drawn."""
    rows = {worker: len(workers) - 1 - i for i, worker in enumerate(workers)}   # first worker on top
    bars: dict[tuple[str, str, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        bars[(e.kind, e.lane, rows[(e.stage, e.replica)])].append((e.start - origin, e.seconds))
    for (kind, lane, row), spans in bars.items():
        offset, height = LANE_BANDS[lane]
        axes.broken_barh(spans, (row * ROW_HEIGHT + offset, height), facecolors=COLORS[kind],
                         edgecolor="white", linewidth=0.3)
    for e in events:
        if e.micro_batch is not None and e.seconds >= LABEL_MIN_SHARE * span:
            offset, height = LANE_BANDS[e.lane]
            axes.text(e.start - origin + e.seconds / 2, rows[(e.stage, e.replica)] * ROW_HEIGHT + offset + height / 2,
                      str(e.micro_batch), ha="center", va="center", fontsize=6 if e.lane == "compute" else 5,
                      color="white", clip_on=True)
    # faint lines where each iteration after the first starts
    starts: dict[int, float] = {}
    for e in events:
        if e.kind not in OUTSIDE_ITERATION:
            starts[e.iteration] = min(starts.get(e.iteration, e.start), e.start)
    for iteration in sorted(starts)[1:]:
        axes.axvline(starts[iteration] - origin, color="0.5", alpha=0.35, linewidth=0.8, linestyle="--")
    axes.set_yticks([rows[w] * ROW_HEIGHT + 0.5 for w in workers], [f"s{s}r{r}" for s, r in workers], fontsize=8)
    axes.set_ylim(-0.1, len(workers) * ROW_HEIGHT)
    axes.set_ylabel("worker", fontsize=8)
    iterations = len({e.iteration for e in events if e.kind not in OUTSIDE_ITERATION})
    axes.set_title(f"{heading}: {iterations} iteration{'s' * (iterations != 1)}; each worker's row: compute, then "
                   "upload and download lanes", fontsize=9, loc="left")
    axes.grid(True, axis="x", alpha=0.25)
    return {e.kind for e in events}


def _draw_marks(axes: Any, marks: Sequence[Mark], origin: float) -> None:
    """Each mark as a solid line across every worker's row, its label written up along it
    from the bottom (a label taller than the rows loses its end, never its start)."""
    for mark in marks:
        axes.axvline(mark.at - origin, color="black", linewidth=1.2)
        axes.text(mark.at - origin, 0.0, f" {mark.label}", rotation=90, va="bottom", ha="left", fontsize=6,
                  color="black", clip_on=True)


def plot(events: Sequence[Event], path: str | os.PathLike, *, predicted: Sequence[Event] | None = None,
         title: str = "", marks: Sequence[Mark] = ()) -> Path:
    """Draws ``events`` as a PNG Gantt chart at ``path`` (:func:`figure`) and returns the path."""
    events = list(events)
    if not events:
        raise InputError("no events to draw: the timeline is empty (did the workers record and upload it?)")
    path = Path(path)
    if not path.parent.is_dir():
        raise InputError(f"cannot write {path}: its directory {path.parent} does not exist")
    if not path.suffix:
        path = path.with_suffix(".png")
    elif path.suffix.lower() != ".png":
        raise InputError(f"a timeline is drawn as PNG: end the file name {path.name} with .png")
    figure(events, predicted=predicted, title=title, marks=marks).savefig(path, dpi=110)
    return path


def figure(events: Sequence[Event], *, predicted: Sequence[Event] | None = None, title: str = "",
           marks: Sequence[Mark] = ()) -> Any:
    """The chart as a matplotlib ``Figure``: the predicted panel (when given) above the
    measured one. Each panel has its own time axis, x in seconds from its own first event: the
    prediction is one iteration and the run several, and on a shared axis the prediction was
    squeezed into the left edge. Faint dashed lines mark where each iteration after the first
    begins; ``marks`` (an elastic or re-planning run's decisions) are solid labelled lines on
    the measured panel; micro-batch numbers sit inside bars wide enough. A panel is at least
    ``MIN_PANEL_INCHES`` tall, so a chart of one or two workers keeps its labels apart."""
    require_matplotlib()
    # optional dependency: matplotlib, for plots only (pip install 'flatpack[plot]'; ~0.5 s to load)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels: list[tuple[str, list[Event]]] = []
    if predicted:
        panels.append(("predicted (FuncPipe model)", list(predicted)))
    panels.append(("measured" if predicted else "timeline", list(events)))
    workers = _workers(*(p for _, p in panels))
    panel_inches = max(MIN_PANEL_INCHES, 0.9 + 0.42 * len(workers))
    drawn = Figure(figsize=(11.0, max(3.0, panel_inches * len(panels) + 0.9)), layout="constrained")
    FigureCanvasAgg(drawn)
    grid = drawn.subplots(len(panels), 1, squeeze=False)
    kinds: set[str] = set()
    for axes, (heading, panel) in zip(grid[:, 0], panels):
        origin = min(e.start for e in panel)
        span = (max(e.end for e in panel) - origin) or 1.0
        kinds |= _draw(axes, panel, workers, origin, span, heading)
        if panel is panels[-1][1]:
            _draw_marks(axes, marks, origin)
        axes.set_xlim(0, span * 1.01)
        axes.set_xlabel("seconds from the panel's first event", fontsize=8)
    handles = [Patch(facecolor=COLORS[kind], label=kind) for kind in KINDS if kind in kinds]
    drawn.legend(handles=handles, loc="outside right upper", fontsize=7, title="task", title_fontsize=7)
    if title:
        drawn.suptitle(title, fontsize=10)
    return drawn
