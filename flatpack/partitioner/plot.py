"""The front as a picture: time against cost, one point per plan, the chosen plan
highlighted and labelled.

matplotlib is optional and imported only here, when a plot is asked for; the figure is drawn
on the Agg canvas directly (no pyplot), so no display or global backend state is touched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from flatpack.errors import InputError
from flatpack.partitioner.pareto import dollars_of, time_of
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.report import MARK, Selection

FORMATS = (".png", ".svg", ".pdf")
INSTALL_HINT = "pip install matplotlib (or the plot extra: pip install 'flatpack[plot]')"
# a cost axis spanning more than this ratio is drawn on a log scale, or the cheap plans merge
LOG_SCALE_RATIO = 50.0


def require_matplotlib() -> Any:
    """The matplotlib module, or an error that says how to install it."""
    try:   # optional dependency: matplotlib, for plots only (pip install 'flatpack[plot]'; ~0.5 s to load)
        import matplotlib
    except ImportError:
        raise InputError(f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    return matplotlib


def check_destination(path: str | os.PathLike) -> Path:
    """Refuses, before any work is done, a plot path flatpack could not write."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise InputError(f"cannot tell the image format of {path}: end the file name with one of {', '.join(FORMATS)}")
    if not path.parent.is_dir():
        raise InputError(f"cannot write {path}: its directory {path.parent} does not exist")
    return path


def _plan_label(plan: Plan) -> str:
    tiers = sorted({stage.memory_mb for stage in plan.stages if stage.memory_mb is not None})
    degrees = sorted(set(plan.replicas))
    tier_text = "/".join(map(str, tiers)) + " MB" if tiers else "no tier"
    replica_text = "×" + "/".join(map(str, degrees))
    return f"{len(plan.stages)} stage(s), {tier_text} {replica_text}"


def _left_half(x: float, xs: Sequence[float]) -> bool:
    return x <= (min(xs) + max(xs)) / 2


def _toward_centre(x: float, y: float, xs: Sequence[float], ys: Sequence[float]) -> tuple[int, int]:
    """An offset for the chosen plan's label that points into the plot, away from the edge
    the point sits near, so the label stays inside the axes."""
    dx = 20 if _left_half(x, xs) else -20
    dy = -40 if y >= (min(ys) + max(ys)) / 2 else 30
    return dx, dy


def plot_selection(selection: Selection, path: str | os.PathLike, *, title: str, inference: bool = False,
                   context: Sequence[Plan] = ()) -> Path:
    """Draws ``selection`` to ``path`` (.png, .svg or .pdf) and returns the path.

    Every plan is a point numbered as in the table; the chosen one is a large star with its
    reason and shape. ``context``: other plans drawn faintly behind (the front, when the
    selection is one SLO or weighted pick). An SLO is a dashed vertical line.
    """
    require_matplotlib()
    # optional dependency: matplotlib, for plots only (pip install 'flatpack[plot]'; ~0.5 s to load)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = check_destination(path)
    unit = "request" if inference else "iteration"
    figure = Figure(figsize=(7.5, 5.0), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()

    if context:
        ordered = sorted(context, key=time_of)
        axes.plot([time_of(p) for p in ordered], [dollars_of(p) for p in ordered], "o--", color="0.75",
                  markersize=5, label="front (the solver's weight pairs)", zorder=1)

    times = [time_of(plan) for plan in selection.plans]
    dollars = [dollars_of(plan) for plan in selection.plans]
    # the plans are discrete points; the faint line only guides the eye along the front
    axes.plot(times, dollars, "o--", color="tab:blue", markersize=6, linewidth=0.8, alpha=0.9,
              label="plans" if len(times) > 1 else None, zorder=2)
    for index, (x, y) in enumerate(zip(times, dollars)):
        if index != selection.chosen:
            axes.annotate(f"#{index}", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8,
                          color="tab:blue")

    chosen = selection.chosen_plan
    x, y = time_of(chosen), dollars_of(chosen)
    axes.plot([x], [y], marker="*", linestyle="none", color="tab:orange", markersize=18, markeredgecolor="black",
              label=f"{MARK} {selection.reason}", zorder=3)
    axes.margins(0.15)
    every_time = times + [time_of(p) for p in context]
    every_cost = dollars + [dollars_of(p) for p in context]
    axes.annotate(f"#{selection.chosen} {MARK} {selection.reason}\n{_plan_label(chosen)}", (x, y),
                  textcoords="offset points", xytext=_toward_centre(x, y, every_time, every_cost), fontsize=9,
                  ha="left" if _left_half(x, every_time) else "right",
                  bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "tab:orange"},
                  arrowprops={"arrowstyle": "->", "color": "tab:orange"}, zorder=4)

    if selection.slo_s is not None:
        axes.axvline(selection.slo_s, linestyle="--", color="tab:red", label=f"SLO {selection.slo_s:g} s")

    if min(every_cost) > 0 and max(every_cost) / min(every_cost) > LOG_SCALE_RATIO:
        axes.set_yscale("log")
    else:
        axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    axes.set_xlabel(f"{unit} time (s)")
    axes.set_ylabel(f"cost per {unit} ($)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    try:
        figure.savefig(path)
    except (OSError, ValueError) as err:
        raise InputError(f"could not write the plot to {path}: {err}") from None
    return path
