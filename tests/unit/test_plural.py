"""User-facing counts read right in the singular (issue 41): "deployed 1 function", "1 stage"."""

from __future__ import annotations

from flatpack.table import plural


def test_plural_reads_right_for_one_and_many():
    assert plural(1, "stage") == "1 stage" and plural(2, "stage") == "2 stages" and plural(0, "file") == "0 files"
    assert plural(1, "batch", "batches") == "1 batch" and plural(4, "batch", "batches") == "4 batches"
