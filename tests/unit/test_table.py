"""The one table renderer (flatpack/table.py) every printed table goes through."""

from __future__ import annotations

import pytest

from flatpack.table import format_table


def test_columns_are_padded_numbers_right_aligned_and_a_rule_under_the_header():
    text = format_table(["layer", "ms"], [("conv", 1.5), ("linear-long", "12.25")], numeric={1})
    assert text.splitlines() == ["layer           ms",
                                 "-----------  -----",
                                 "conv           1.5",
                                 "linear-long  12.25"]


def test_groups_are_centred_over_their_columns_and_indent_applies_to_every_line():
    text = format_table(["stage", "pred", "meas"], [(0, "10.0", "12.5")], numeric={1, 2},
                        groups=[("", 1), ("forward ms", 2)], indent="  ")
    lines = text.splitlines()
    assert lines[0].strip() == "forward ms" and lines[0].index("forward") > lines[1].index("stage")
    assert all(line.startswith("  ") for line in lines)
    assert lines[3].split() == ["0", "10.0", "12.5"]


def test_a_ragged_row_or_wrong_groups_is_refused_naming_it():
    with pytest.raises(ValueError, match="row 1 has 1 cells for 2 columns"):
        format_table(["a", "b"], [("1", "2"), ("3",)])
    with pytest.raises(ValueError, match="span 3 columns of 2"):
        format_table(["a", "b"], [], groups=[("x", 3)])


def test_no_module_pads_its_own_table_columns():
    # every table goes through format_table: no other module computes column widths by hand
    import pathlib
    import re

    import flatpack

    root = pathlib.Path(flatpack.__file__).parent
    hand_written = re.compile(r"\.ljust\(|\.rjust\(|max\(len\(row\[|:<\{width\}")
    offenders = [str(path.relative_to(root)) for path in root.rglob("*.py")
                 if path.name != "table.py" and hand_written.search(path.read_text())]
    assert offenders == []
