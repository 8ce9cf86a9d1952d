"""``flatpack plan --time-limit SECONDS``: the exact solvers' anytime option (dp's and miqp's
``time_limit_s``) from the command line, each plan's proof or gap printed, and the errors for
what it cannot apply to (raised before anything is profiled). Reuses test_plan_cli's MLP,
space and profile cache."""

from __future__ import annotations

import math

import pytest

from tests.unit.test_plan_cli import json_report, model_spec, plan  # noqa: F401 - fixtures

DP = ["--solver", "dp"]


def objectives(report: dict) -> list[float]:
    return [entry["predictions"]["objective"] for entry in report["plans"]]


def test_a_generous_limit_proves_every_plan_and_changes_no_objective(plan):
    unlimited = json_report(plan, *DP)
    limited = json_report(plan, *DP, "--time-limit", "60")
    assert objectives(limited) == pytest.approx(objectives(unlimited), rel=1e-12)
    assert {entry["predictions"]["status"] for entry in limited["plans"]} == {"optimal"}
    code, out, err = plan(*DP, "--time-limit", "60")
    assert code == 0, err
    assert "proofs within the time limit of 60 s per solve:" in out
    assert out.count("proven optimal") == len(limited["plans"])


def test_a_limit_that_ends_the_search_returns_plans_with_a_proven_bound_and_prints_the_gap(plan):
    """A limit far below one search: dp returns its beam plan, status feasible, and a lower
    bound from the unsearched configurations that is never above the exact optimum."""
    exact = json_report(plan, *DP, "--weights", "1,0")["plans"][0]["predictions"]
    cut = json_report(plan, *DP, "--weights", "1,0", "--time-limit", "1e-9")["plans"][0]["predictions"]
    assert cut["status"] == "feasible"
    assert cut["lower_bound"] <= exact["objective"] * (1 + 1e-9)
    assert cut["objective"] >= exact["objective"] * (1 - 1e-9)
    assert cut["gap"] == pytest.approx((cut["objective"] - cut["lower_bound"]) / cut["objective"])
    code, out, err = plan(*DP, "--weights", "1,0", "--time-limit", "1e-9")
    assert code == 0, err
    assert f"plan 0: feasible, gap {100 * cut['gap']:.2f} % to the proven lower bound" in out


def test_miqp_takes_the_limit_and_proves_dp_s_optimum(plan):
    dp = json_report(plan, *DP, "--weights", "1,2^16")["plans"][0]["predictions"]
    miqp = json_report(plan, "--solver", "miqp", "--weights", "1,2^16", "--time-limit", "30")["plans"][0]
    assert miqp["predictions"]["status"] == "optimal"
    assert math.isclose(miqp["predictions"]["objective"], dp["objective"], rel_tol=1e-6)


@pytest.mark.parametrize("extra,message", [
    (["--time-limit", "5"], "--time-limit applies to the exact solvers with an anytime search (dp, miqp); "
                            "solver 'brute' has no time limit"),
    ([*DP, "--time-limit", "0"], "--time-limit must be a positive number of seconds, got 0"),
    ([*DP, "--time-limit", "-3"], "--time-limit must be a positive number of seconds, got -3"),
    ([*DP, "--time-limit", "nan"], "--time-limit must be a positive number of seconds, got nan"),
    ([*DP, "--front", "exact", "--time-limit", "5"], "--front exact runs dp to its proof"),
    ([*DP, "--stages", "2", "--time-limit", "5"], "fix the cuts, so no solver runs: drop --time-limit"),
])
def test_time_limit_refuses_what_it_cannot_apply_to_before_profiling(plan, monkeypatch, extra, message):
    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled before refusing the option")

    monkeypatch.setattr("flatpack.compiler.build_problem", no_profiling)
    code, _, err = plan(*extra)
    assert code == 2
    assert message in err
