"""``flatpack plan --front exact``: every non-dominated plan, the four weight pairs' optima
tagged on it, and the errors for combinations it refuses (before anything is profiled).
Reuses test_plan_cli's MLP, space and profile cache."""

from __future__ import annotations

import itertools
import math

import pytest

from tests.unit.test_plan_cli import json_report, model_spec, plan  # noqa: F401 - fixtures

DP = ["--solver", "dp"]


def points(report: dict) -> list[tuple[float, float]]:
    return [(entry["predictions"]["time_s"], entry["predictions"]["dollars"]) for entry in report["plans"]]


def test_exact_front_holds_the_weight_pairs_front_and_tags_each_pair(plan):
    weights_front = json_report(plan, *DP)
    exact = json_report(plan, *DP, "--front", "exact")
    assert len(exact["plans"]) >= len(weights_front["plans"])
    for time_s, dollars in points(weights_front):
        assert any(math.isclose(time_s, t, rel_tol=1e-9) and math.isclose(dollars, d, rel_tol=1e-9)
                   for t, d in points(exact)), (time_s, dollars)
    found = points(exact)
    assert found == sorted(found)
    assert all(later[1] < earlier[1] for earlier, later in itertools.pairwise(found))   # each point cheaper
    tags = [label for entry in exact["plans"] for label in entry["predictions"]["weights"]]
    assert sorted(tags) == sorted(["(1, 0)", "(1, 2^16)", "(1, 2^19)", "(1, 2^22)"])


@pytest.mark.parametrize("extra,message", [
    (["--front", "exact"], "--front exact needs solver dp"),
    ([*DP, "--front", "exact", "--weights", "1,0"], "--front exact prints the whole front"),
])
def test_front_exact_refuses_what_it_cannot_do(plan, extra, message):
    code, _, err = plan(*extra)
    assert code == 2
    assert message in err
