"""The one renderer of the plain-text tables flatpack prints: the layer chain, the profile,
the plan front and its breakdowns, predicted vs measured, a calibration, the platform tiers,
the files of a deployment. Plain text (no box drawing, no colour) so that a table reads the
same in a terminal, a log file and a test's captured output.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

GAP = "  "


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, numeric: Collection[int] = (),
                 groups: Sequence[tuple[str, int]] = (), rule: bool = True, indent: str = "") -> str:
    """Columns padded to their widest cell, the ``numeric`` columns (indices) right-aligned,
    a rule of dashes under the header (``rule=False``: none; a column with an empty title gets
    no dashes). ``groups``: ``(title, span)`` pairs over consecutive columns, printed centred
    above the header (``"forward ms"`` over its ``pred`` and ``meas`` columns); their spans
    must add up to the columns. Cells are ``str()``-ed; every line starts with ``indent``."""
    header = [str(title) for title in header]
    body = [[str(cell) for cell in row] for row in rows]
    for index, row in enumerate(body):
        if len(row) != len(header):
            raise ValueError(f"table row {index} has {len(row)} cells for {len(header)} columns")
    if groups and sum(span for _, span in groups) != len(header):
        raise ValueError(f"the column groups span {sum(span for _, span in groups)} columns of {len(header)}")
    widths = [max(len(row[column]) for row in [header, *body]) for column in range(len(header))]
    widths = _widen_for_groups(widths, groups)

    def line(cells: Sequence[str]) -> str:
        padded = [cell.rjust(width) if column in numeric else cell.ljust(width)
                  for column, (cell, width) in enumerate(zip(cells, widths))]
        return (indent + GAP.join(padded)).rstrip()

    lines = []
    if groups:
        spans, start = [], 0
        for title, span in groups:
            width = sum(widths[start:start + span]) + len(GAP) * (span - 1)
            spans.append(title.center(width) if title else " " * width)
            start += span
        lines.append((indent + GAP.join(spans)).rstrip())
    lines.append(line(header))
    if rule:
        lines.append((indent + GAP.join(("-" if title else " ") * width
                                         for title, width in zip(header, widths))).rstrip())
    lines.extend(line(row) for row in body)
    return "\n".join(lines)


def _widen_for_groups(widths: list[int], groups: Sequence[tuple[str, int]]) -> list[int]:
    """A group title wider than its columns widens its last column."""
    widths, start = list(widths), 0
    for title, span in groups:
        have = sum(widths[start:start + span]) + len(GAP) * (span - 1)
        if len(title) > have:
            widths[start + span - 1] += len(title) - have
        start += span
    return widths


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """A count for people to read: ``plural(1, "stage")`` is "1 stage", ``plural(3, "stage")``
    "3 stages"; ``nouns`` where adding "s" is wrong (``plural(2, "batch", "batches")``)."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"
