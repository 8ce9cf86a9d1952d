"""PipeDream's version rules (``Schedule.weight_version``), worked by hand: 1F1B-RR (stage
s of S with d_s replicas steps once per round of d_s micro-batches) and 2BW (one step per
iteration, computed on the previous version); the replicas' orders, projections of one 1F1B
order per stage, never wait for a round whose backwards come later; and ``--stage-replicas``,
each fixed stage's degree."""

from __future__ import annotations

import pytest

from flatpack.errors import InputError
from flatpack.job import JobOptions
from flatpack.partitioner.solvers.wrappers import FixedCuts
from flatpack.schedules import Computation, Layout, get, one_forward_one_backward
from tests.unit.test_split_points import problem

RR = get("1f1b-async")
TWO_BW = get("2bw")


def test_1f1b_rr_versions_worked_by_hand_for_degrees_1_2_and_2_1_2():
    # [1, 2], M = 4. Stage 0 (d = 1, warm-up W = 1): its 1F1B order F0 F1 B0 F2 B1 F3 ...; the
    # forward of g follows the backwards of 0..g-2, so it computes on g - 1 steps.
    # Stage 1 (d = 2, W = 0): F0 B0 F1 B1 F2 ...; round k = {2k, 2k+1} is complete before F(2k+2).
    layout = Layout((1, 2), 4)
    assert [RR.weight_version(g, 0, layout) for g in range(8)] == [0, 0, 1, 2, 3, 4, 5, 6]
    assert [RR.weight_version(g, 1, layout) for g in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # [2, 1, 2]: stage 0 (d = 2, W = 2): F0 F1 F2 B0 F3 B1 F4 ...: round 0's last backward (B1)
    # comes before F4, so F4 and F5 compute on one step, F6 and F7 on two
    layout = Layout((2, 1, 2), 4)
    assert [RR.weight_version(g, 0, layout) for g in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [RR.weight_version(g, 1, layout) for g in range(8)] == [0, 0, 1, 2, 3, 4, 5, 6]
    assert [RR.weight_version(g, 2, layout) for g in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [RR.optimizer_steps(4, d) for d in (1, 2, 4)] == [4, 2, 1]


def test_2bw_versions_worked_by_hand():
    # W(t+1) = W(t) - lr * grad(W(t-1)): iteration t computes on t - 1 steps (the first two on
    # the initial weights), the same on every stage; R = M * K micro-batches per step
    layout = Layout((1, 2, 1), 2)
    for stage in range(3):
        assert [TWO_BW.weight_version(g, stage, layout) for g in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    accumulated = Layout((1, 1), 2, accumulate=2)
    assert [TWO_BW.weight_version(g, 0, accumulated) for g in range(12)] == [0] * 8 + [1] * 4
    assert TWO_BW.optimizer_steps(4, 2) == 1 and TWO_BW.weight_versions(5) == 2 and RR.weight_versions(5) == 5
    # the warm-up is capped at a round: deeper, a forward would wait for its own later backward
    assert [TWO_BW.warmup(stage, Layout((1,) * 4, 2)) for stage in range(4)] == [2, 2, 1, 0]


def stage_order(schedule, stage: int, layout: Layout, total: int) -> list[tuple[Computation, int]]:
    return one_forward_one_backward(list(range(total)), schedule.warmup(stage, layout))


@pytest.mark.parametrize("schedule", [RR, TWO_BW])
@pytest.mark.parametrize(("degrees", "micro_batches"), [((1, 2), 4), ((2, 1, 2), 4), ((4, 2, 1, 2), 4), ((2, 2), 2),
                                                        ((1, 1, 1, 1), 2)])
def test_no_forward_waits_for_a_round_whose_backwards_come_after_it(schedule, degrees, micro_batches):
    """Each replica's order is its micro-batches of one 1F1B order of the stage, and the
    version a forward asks for needs only rounds whose backwards come before it there: the
    replicas, each waiting for the others' gradients of a round, never wait in a cycle."""
    layout = Layout(degrees, micro_batches)
    iterations = 3
    total = iterations * micro_batches
    for stage, degree in enumerate(degrees):
        order = stage_order(schedule, stage, layout, total)
        position = {task: index for index, task in enumerate(order)}
        size = schedule.round_size(stage, layout)
        for replica in range(degree):
            owned = [m for m in range(micro_batches) if m % degree == replica]
            chunks = schedule.call_actions(stage, layout, owned, iterations)
            tasks = [(a.kind, a.iteration * micro_batches + a.micro_batch) for chunk in chunks for a in chunk]
            assert tasks == [task for task in order if layout.replica_of(stage, task[1]) == replica]
        for kind, g in order:
            if kind is not Computation.FORWARD:
                continue
            version = schedule.weight_version(g, stage, layout)
            for needed in range(version):       # rounds 0..version-1 stepped before this forward
                last = min((needed + 1) * size, total) - 1
                assert position[(Computation.BACKWARD, last)] < position[(Computation.FORWARD, g)], (stage, g)


def test_stage_replicas_give_each_fixed_stage_its_own_degree():
    chain = problem()
    plan = FixedCuts.of((), 3, (1, 2), stage_replicas=(2, 1, 2))(chain)
    assert [stage.replicas for stage in plan.stages] == [2, 1, 2]
    assert [stage.replicas for stage in FixedCuts.of((), 2, (3,))(chain).stages] == [3, 3]
    with pytest.raises(InputError, match="names 2 degrees, but the cuts make 3 stages"):
        FixedCuts.of((), 3, (1, 2), stage_replicas=(1, 2))(chain)


@pytest.mark.parametrize(("options", "words"), [
    ({"stage_replicas": (1, 2)}, "give --stages 2 .* with it, or let the solver choose from --replicas"),
    ({"stages": 3, "stage_replicas": (1, 2)}, "names 2 degrees for 3 stages"),
    ({"stages": 2, "stage_replicas": (1, 2), "replicas": (2,)}, "give one or the other"),
    ({"stages": 2, "stage_replicas": (1, 8)}, "more replicas than the 4 micro-batches"),
    ({"stages": 2, "stage_replicas": (0, 2)}, "each at least 1"),
])
def test_stage_replicas_are_refused_where_they_cannot_mean_one_plan(options, words):
    with pytest.raises(InputError, match=words):
        JobOptions.of(micro_batches=4, **options).check()


def test_the_command_line_takes_stage_replicas_as_the_plan_s_degrees(capsys):
    from flatpack.cli import main
    from flatpack.cli.run_options import RUN_OPTIONS

    option = next(option for option in RUN_OPTIONS if option.flag == "--stage-replicas")
    assert option.group == "plan" and option.field == "stage_replicas"
    assert option.value is not None and option.value("2,1,2") == (2, 1, 2)
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--stage-replicas D,D[,D...]" in " ".join(capsys.readouterr().out.split())
