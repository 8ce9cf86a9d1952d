"""``train(replan=...)``: a run that switches plans between epochs (``backends.replan``) ends
with the weights and losses of a run that keeps one plan, a crash in the middle of a switch
resumes from one plan's consistent checkpoint, and the default policy re-fits the cost model
to the epoch's timeline (``analysis.refit.replan``)."""

from __future__ import annotations

import pytest
import torch

import flatpack
from flatpack.analysis.refit import Replan
from flatpack.backends import local
from flatpack.backends import replan as replan_module
from flatpack.backends.replan import ReplanPolicy
from flatpack.errors import InputError
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.workload import Workload
from flatpack.runtime.optim import OptimizerSpec, ScheduleSpec
from tests.integration.test_local_training import BATCH, batches, compiled_with, make_model

pytestmark = pytest.mark.slow

ITERATIONS, EPOCH, MICRO_BATCHES = 6, 3, 4
# every piece of state a switch moves: AdamW moments and steps, two parameter groups (no decay
# for biases) whose split differs per stage, a stepped learning rate, a gradient accumulated
# across the boundary (2 iterations per step, the boundary after iteration 2), global clipping
OPTIMIZER = OptimizerSpec("adamw", 0.01, {"weight_decay": 0.1}, no_decay_bias_norm=True,
                          schedule=ScheduleSpec("step", {"step_size": 1, "gamma": 0.5}), clip_grad_norm=1.0,
                          accumulate=2)


class Killed(BaseException):
    """The invoker dying in the middle of a call (as SIGKILL would: nothing of flatpack catches it)."""


def _plan(ranges_percent: list[tuple[int, int]], replicas: list[int]) -> Plan:
    return compiled_with(make_model(), ranges_percent, replicas, MICRO_BATCHES).plan


def forced(*plans: Plan):
    """A chooser switching to ``plans[k]`` at the k-th epoch boundary (a test's way to pick)."""
    boundaries = iter(plans)

    def choose(compiled: flatpack.Compiled, events: list) -> Replan:
        return Replan(compiled.plan, next(boundaries), 1.0, 0.5, 1.0, None)  # type: ignore[arg-type]

    return choose


def first_plan() -> flatpack.Compiled:
    return compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], MICRO_BATCHES)


@pytest.fixture(scope="module")
def baseline(s3_server):
    """The run on the first plan alone, which every switching run must end like."""
    return _train(s3_server, first_plan())[0]


def _train(s3_server, compiled, **options):
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(batches(ITERATIONS), iterations=ITERATIONS, optimizer=OPTIMIZER,
                                  micro_batches=MICRO_BATCHES, **options)
        return result, deployment.compiled


def assert_same_run(result, baseline) -> None:
    assert result.parameters.keys() == baseline.parameters.keys()
    for name, expected in baseline.parameters.items():
        torch.testing.assert_close(result.parameters[name], expected, rtol=1e-4, atol=1e-5, msg=name)
    assert result.losses == pytest.approx(baseline.losses, rel=1e-4, abs=1e-5)


def test_switching_plans_mid_run_ends_where_one_plan_ends(s3_server, baseline):
    three = _plan([(0, 34), (34, 67), (67, 100)], [1, 2, 1])
    result, final = _train(s3_server, first_plan(), epoch_iterations=EPOCH, replan=ReplanPolicy(choose=forced(three)))
    assert_same_run(result, baseline)
    assert [(s.iteration, s.new.ranges) for s in result.switches] == [(EPOCH - 1, three.ranges)]
    assert result.switches[0].run.endswith("-plan1") and result.switches[0].measured_after_s is not None
    assert "50.0% saving" in result.switches[0].describe()
    assert final.plan.ranges == three.ranges and result.degrees[-1] == (1, 2, 1)
    # the result's timeline holds every plan's iterations
    assert sorted({event.iteration for event in result.events if event.kind == "forward"}) == list(range(ITERATIONS))


def test_a_crash_mid_switch_resumes_on_the_old_plan_and_after_it_on_the_new(s3_server, baseline):
    compiled = first_plan()
    epoch = 2   # two boundaries: the second crashes after the switch at the first
    three = _plan([(0, 34), (34, 67), (67, 100)], [1, 1, 1])

    def crash(switch, new_compiled):
        raise Killed("while the new plan's checkpoints were written")

    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(Killed):
            deployment.train(batches(ITERATIONS), iterations=ITERATIONS, optimizer=OPTIMIZER,
                             micro_batches=MICRO_BATCHES, epoch_iterations=epoch,
                             replan=ReplanPolicy(choose=forced(three), on_switch=crash))
        # the run never moved: the old plan's prefix and checkpoints are whole
        assert deployment.compiled is compiled and deployment.consistent_checkpoint() == epoch - 1
        resumed = deployment.resume(batches(ITERATIONS))
        assert resumed is not None and not resumed.switches
        assert_same_run(resumed, _tail(baseline, epoch))

    def stop_at_second_boundary(compiled, events):
        if compiled.plan.ranges == three.ranges:
            raise Killed("at the next boundary")
        return Replan(compiled.plan, three, 1.0, 0.5, 1.0, None)  # type: ignore[arg-type]

    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(Killed):
            deployment.train(batches(ITERATIONS), iterations=ITERATIONS, optimizer=OPTIMIZER,
                             micro_batches=MICRO_BATCHES, epoch_iterations=epoch,
                             replan=ReplanPolicy(choose=stop_at_second_boundary))
        # switched after iteration 1, then trained the new plan's epoch: it resumes there
        assert deployment.compiled.plan.ranges == three.ranges
        assert deployment.consistent_checkpoint() == 2 * epoch - 1
        resumed = deployment.resume(batches(ITERATIONS))
        assert resumed is not None
        assert_same_run(resumed, _tail(baseline, 2 * epoch))


def _tail(result, done: int):
    """``result`` as the part of it after its first ``done`` iterations (parameters: the end's)."""
    return type(result)(parameters=result.parameters, losses=result.losses[done:], events=[], restarts=[],
                        degrees=[], wall_s=0.0, samples=0, dollars=0.0)


def test_the_default_policy_refits_the_cost_model_to_the_epoch(s3_server, monkeypatch):
    model = make_model()
    example = (torch.randn(BATCH, 8),)
    plan = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], MICRO_BATCHES, memory_mb=1024).plan
    compiled = flatpack.compile(model, example, plan=plan, profile=True,
                                workload=Workload(batch=BATCH, micro_batches=MICRO_BATCHES, optimizer="adam"))
    asked = []

    def recording(problem, old_plan, events, **keywords):
        proposal = real(problem, old_plan, events, **keywords)
        asked.append((old_plan, sorted({event.iteration for event in events}), keywords, proposal))
        return proposal

    real = replan_module.replan
    monkeypatch.setattr(replan_module, "replan", recording)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(batches(4), iterations=4, optimizer="adam", micro_batches=MICRO_BATCHES,
                                  epoch_iterations=3, replan=ReplanPolicy(threshold=0.0))
    assert len(asked) == 1
    old_plan, iterations, keywords, proposal = asked[0]
    assert old_plan == compiled.plan and iterations == [0, 1, 2]
    assert keywords["skip_first"] == replan_module.SKIP_FIRST
    assert "re-fitted" in proposal.calibration.provenance["measured"]
    assert len(result.switches) == (proposal.new != proposal.old)


@pytest.mark.parametrize(("options", "cause"), [
    ({"epoch_iterations": 2, "schedule": "1f1b-async"}, "1f1b-async"),
    ({"epoch_iterations": 2, "elastic": lambda epoch, degrees: None}, "give one of them"),
    ({}, "epoch boundaries"),
    ({"epoch_iterations": 2, "replan": True}, "at least 3"),
    ({"epoch_iterations": 3, "replan": True}, "memory tier"),
])
def test_replan_refusals_name_cause_and_fix(s3_server, options, cause):
    compiled = first_plan()
    options = {"replan": ReplanPolicy(choose=forced()), **options}
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(InputError, match=cause):
            deployment.train(batches(4), iterations=4, micro_batches=MICRO_BATCHES, **options)
        assert deployment.calls() == []    # refused before launch


def test_replan_refuses_an_artifact_read_back(s3_server, tmp_path):
    compiled = first_plan()
    loaded = flatpack.load(compiled.save(tmp_path / "compiled"))
    with local.deploy(loaded, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(InputError, match="flatpack.load"):
            deployment.train(batches(4), iterations=4, micro_batches=MICRO_BATCHES, epoch_iterations=2,
                             replan=ReplanPolicy(choose=forced()))


def test_each_switch_gets_the_next_run_prefix():
    assert replan_module.next_run("run-abc") == "run-abc-plan1"
    assert replan_module.next_run("run-abc-plan1") == "run-abc-plan2"
