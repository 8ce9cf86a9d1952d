"""Recomputation as a plan choice and bf16 boundaries in the cost model and the exact dp
(issue 22, items 3 and 4): what a recomputing stage needs and costs, that the solver picks
it only where it must, and that a tier too small to keep the activations becomes feasible."""

from __future__ import annotations

import dataclasses

import pytest

from flatpack.errors import InputError, PlanError
from flatpack.ir.profile import Linear
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.cost.common import stage_boundaries, stage_memory
from flatpack.partitioner.objective import Weights, evaluate
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.workload import Workload
from tests.property.solver_strategies import BASE, MIB, make_platform, make_problem
from tests.unit.narrowing import cost_solver, solved

SMALL_TIER = [(256, 1, 50.0, 0.25e-5)]    # 256 MiB, 64 of them the runtime: 192 MiB for tensors
# forward s/sample, backward s/sample, params MiB, saved MiB/sample, output MiB/sample.
# A micro-batch of 2 samples saves 32 MiB per layer; with µ = 8 in flight that is 256 MiB, so
# neither layer fits the small tier keeping its activations, even alone
HEAVY = [(0.01, 0.02, 10.0, 16.0, 0.25), (0.01, 0.02, 10.0, 16.0, 0.25)]


def heavy_problem(recompute: str, precision: str = "fp32"):
    workload = Workload("train", batch=16, micro_batches=8, optimizer="sgd", recompute=recompute,
                        precision=precision)
    return make_problem(HEAVY, make_platform(SMALL_TIER), workload, replicas=(1,))


def test_a_recomputing_stage_keeps_inputs_and_outputs_and_one_micro_batch():
    problem = heavy_problem("auto")
    tier = problem.platform.tier(256)
    kept = stage_memory(problem, 0, 0, tier, micro_batches_in_flight=8)
    recomputed = stage_memory(problem, 0, 0, tier, micro_batches_in_flight=8, recompute=True)
    assert kept.activations == 8 * 32 * MIB
    # the model's input (1 MiB/sample) and the boundary after layer 0 (0.25 MiB/sample) for 8
    # micro-batches of 2 samples, plus the 32 MiB one micro-batch saves while it is recomputed
    assert recomputed.activations == pytest.approx(8 * 2 * (1 + 0.25) * MIB + 32 * MIB)
    assert not kept.fits and recomputed.fits
    assert recomputed.total - recomputed.activations == kept.total - kept.activations
    assert recomputed.base == BASE


def test_a_recomputing_stage_runs_its_forward_again_in_the_backward():
    problem = heavy_problem("auto")
    plain = funcpipe.iteration(problem, Plan((StagePlan(0, 0, 256), StagePlan(1, 1, 256)), 2))
    again = funcpipe.iteration(problem, Plan((StagePlan(0, 0, 256, recompute=True), StagePlan(1, 1, 256)), 2))
    assert again.stages[0].recompute and not again.stages[1].recompute
    assert again.stages[0].backward_s == pytest.approx(plain.stages[0].backward_s + plain.stages[0].forward_s)
    assert again.stages[1].backward_s == pytest.approx(plain.stages[1].backward_s)
    assert again.iteration_s > plain.iteration_s
    assert again.stages[0].memory.activations < plain.stages[0].memory.activations
    assert again.fits is False and again.unfit_stage == 1    # layer 1 keeps its activations


def test_a_tier_too_small_without_recompute_becomes_feasible_with_it():
    dp = cost_solver("dp")
    with pytest.raises(PlanError):
        dp.solve(heavy_problem("never"), Goal(Weights(1, 0)))
    plan = dp.solve(heavy_problem("auto"), Goal(Weights(1, 0)))
    assert plan is not None and all(stage.memory_mb == 256 for stage in plan.stages)
    assert all(stage.recompute for stage in plan.stages)
    assert evaluate(heavy_problem("auto"), plan).fits
    # the plan says which stages recompute, in its JSON too
    assert all(stage["recompute"] for stage in Plan.loads(plan.dumps()).to_json()["stages"])


def test_recompute_is_chosen_only_where_keeping_the_activations_does_not_fit():
    roomy = make_platform([(256, 1, 50.0, 0.25e-5), (1024, 1, 50.0, 1e-5)])
    workload = Workload("train", batch=16, micro_batches=8, optimizer="sgd")
    fast = Goal(Weights(0, 1))
    never = solved(cost_solver("dp").solve(make_problem(HEAVY, roomy, workload, replicas=(1,)), fast))
    auto = solved(cost_solver("dp").solve(
        make_problem(HEAVY, roomy, dataclasses.replace(workload, recompute="auto"), replicas=(1,)), fast))
    # fastest: recomputation only adds time, so with a tier that holds the activations, none
    assert not any(stage.recompute for stage in auto.stages)
    assert auto.predictions["time_s"] == pytest.approx(never.predictions["time_s"])
    cheap = solved(cost_solver("dp").solve(
        make_problem(HEAVY, roomy, dataclasses.replace(workload, recompute="auto"), replicas=(1,)),
        Goal(Weights(1, 0))))
    # cheapest: the small tier with recomputation costs less than the large one without
    assert any(stage.recompute and stage.memory_mb == 256 for stage in cheap.stages)


def test_balanced_cuts_get_a_tier_that_fits_with_recompute():
    problem = heavy_problem("auto")
    plan = funcpipe.with_tiers(problem, Plan.from_ranges([(0, 0), (1, 1)], 2))
    assert [(stage.memory_mb, stage.recompute) for stage in plan.stages] == [(256, True), (256, True)]
    assert funcpipe.iteration(problem, plan).fits


def test_bf16_halves_the_boundary_bytes_the_cost_model_moves():
    fp32, bf16 = heavy_problem("never"), heavy_problem("never", precision="bf16")
    assert bf16.boundary_bytes(0, 2) == fp32.boundary_bytes(0, 2) / 2
    assert bf16.boundary_bytes(-1, 2) == fp32.boundary_bytes(-1, 2)   # the data is not cast
    plan = Plan((StagePlan(0, 0, 256, recompute=True), StagePlan(1, 1, 256, recompute=True)), 2)
    slow, fast = funcpipe.iteration(fp32, plan), funcpipe.iteration(bf16, plan)
    assert fast.boundaries[0].bytes == slow.boundaries[0].bytes / 2
    assert fast.boundaries[0].forward_upload_s < slow.boundaries[0].forward_upload_s
    assert fast.iteration_s < slow.iteration_s


def test_older_plans_without_recompute_load_as_keeping_activations():
    data = Plan((StagePlan(0, 1, 256),), 2).to_json()
    for stage in data["stages"]:
        del stage["recompute"]
    assert Plan.from_json(data).stages[0].recompute is False


@pytest.mark.parametrize(("options", "named"), [
    ({"recompute": "sometimes"}, "recompute 'sometimes' is not one of never, auto"),
    ({"precision": "fp8"}, "precision 'fp8' is not one of fp32, bf16, fp16"),
])
def test_bad_workload_options_are_refused_with_the_choices(options, named):
    with pytest.raises(InputError, match=named):
        Workload("train", batch=16, micro_batches=8, **options)


def test_a_stage_keeps_its_boundaries_in_the_wire_precision():
    problem = heavy_problem("never", precision="bf16")
    # the model's input as profiled (1 MiB/sample) plus the bf16 boundary after layer 1 (half of 0.25)
    assert stage_boundaries(problem, 0, 1) == Linear(1.125 * MIB, 0.0)


# --- bad options: refused before anything is compiled or started ----------------------------

@pytest.mark.parametrize(("args", "words"), [
    (["--precision", "fp8"], "invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')"),
    (["--recompute", "always"], "invalid choice: 'always' (choose from 'never', 'auto')"),
])
def test_bad_run_options_exit_2_before_the_model_is_built(args, words, capsys, monkeypatch, tmp_path):
    from flatpack import cli

    monkeypatch.setattr(cli, "load_factory", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", "mlp", "--out", str(tmp_path / "out"), *args])
    assert exited.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("options", "words"), [
    ({"precision": "fp8"}, "--precision 'fp8' is not one of fp32, bf16, fp16; .*fp16 \\(the same with a loss "
                           "scaler\\)"),
    ({"recompute": "yes"}, "--recompute 'yes' is not one of never, auto; use never"),
])
def test_job_options_refuse_a_bad_precision_or_recompute(options, words, tmp_path):
    from flatpack.job import JobOptions

    with pytest.raises(InputError, match=words):
        JobOptions.of(out=tmp_path / "out", **options).check()


def test_the_runtime_and_the_reference_refuse_an_unknown_precision():
    import torch

    from flatpack.runtime.optim import OptimizerSpec
    from flatpack.analysis.reference import train_single_process
    from flatpack.runtime.spec import RunSpec

    with pytest.raises(InputError, match="precision 'fp8' is not one of fp32, bf16, fp16; use fp32"):
        RunSpec(run="r", stages=(), micro_batches=1, batch=1, optimizer=OptimizerSpec.of("sgd"), loss="mse",
                loss_output="out", precision="fp8")
    with pytest.raises(InputError, match="precision 'half' is not one of fp32, bf16, fp16"):
        train_single_process(torch.nn.Linear(2, 2), [(torch.randn(4, 2), torch.randn(4, 2))], 1, loss="mse",
                             precision="half")


def test_boundary_tensors_travel_in_bfloat16_and_other_values_as_they_are():
    import torch

    from flatpack.runtime.precision import for_wire
    from flatpack.stage.wire import pack_values, unpack_values

    values = {"hidden": torch.randn(3, 4, requires_grad=True) * 2, "mask": torch.ones(3, dtype=torch.long), "size": 3}
    received = unpack_values(pack_values(for_wire(values, "bf16")))
    assert received["hidden"].dtype == torch.bfloat16 and received["mask"].dtype == torch.long
    assert received["size"] == 3
    torch.testing.assert_close(received["hidden"].float(), values["hidden"].detach(), rtol=2 ** -8, atol=0)
    assert len(pack_values(for_wire(values, "bf16"))) < len(pack_values(values))
    assert for_wire(values, "fp32") is values


def test_a_layer_too_big_for_every_tier_names_recomputation_as_a_fix():
    from flatpack.partitioner.cost.funcpipe import check_layers_fit

    with pytest.raises(PlanError, match=r"recomputing activations in the backward \(Workload\(recompute=\"auto\"\)"):
        check_layers_fit(heavy_problem("never"))


def test_the_stage_breakdown_and_the_front_mark_recomputing_stages():
    from flatpack.partitioner.report import stage_breakdown

    problem = heavy_problem("auto")
    plan = solved(cost_solver("dp").solve(problem, Goal(Weights(1, 0))))
    text = stage_breakdown(problem, plan)
    assert f"{plan.stages[0].start}-{plan.stages[0].end} R" in text or f"{plan.stages[0].start} R" in text
    assert "R: the stage recomputes its activations in the backward" in text
    kept = stage_breakdown(problem, Plan((StagePlan(0, 0, 256), StagePlan(1, 1, 256)), 2))
    assert "recomputes" not in kept


def test_recompute_auto_never_makes_dp_worse():
    """"auto" only adds options per stage: dp's optimum can only improve or stay."""
    from tests.unit.test_exact_solvers import LAYERS, TIERS

    for weights in (Weights(1, 0), Weights(0, 1), Weights(1, 2 ** 16)):
        scores = []
        for recompute in ("never", "auto"):
            workload = Workload("train", batch=16, micro_batches=4, recompute=recompute)
            problem = make_problem(LAYERS, make_platform(TIERS), workload, replicas=(1, 2, 4))
            scores.append(solved(cost_solver("dp").solve(problem, Goal(weights))).predictions["objective"])
        assert scores[1] <= scores[0] * (1 + 1e-9)
