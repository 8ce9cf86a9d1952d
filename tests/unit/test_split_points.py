"""``--stages N`` and ``--split-points MODULE,...`` on ``flatpack run`` and ``flatpack plan``:
fixed cuts instead of the solver's, at module names as torch.distributed.pipelining users
write them, refused with the close matches when no layer begins there."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from flatpack.cli import main
from flatpack.compiler import build_problem
from flatpack.errors import InputError
from flatpack.job import JobOptions
from flatpack.partitioner.solvers.wrappers import FixedCuts, check_split_points
from flatpack.partitioner.problem import Problem


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def problem() -> Problem:
    return build_problem(Blocks(), (torch.randn(4, 8),), passes="fuse-elementwise", profile=False)


def test_split_points_begin_a_stage_at_each_named_module():
    chain = problem()
    plan = FixedCuts(("blocks.2", "head"))(chain)
    names = [layer.name.split(":")[0] for layer in chain.chain]
    starts = [start for start, _ in plan.ranges]
    assert len(plan.stages) == 3 and starts[0] == 0
    assert names[starts[1]].startswith("blocks.2") and names[starts[2]] == "head"
    assert len(FixedCuts(stages=3)(chain).stages) == 3


def test_split_points_that_start_no_layer_or_run_backwards_are_refused():
    chain = problem()
    with pytest.raises(InputError, match="in the order the model runs them"):
        FixedCuts(("head", "blocks.1"))(chain)
    with pytest.raises(InputError, match="no layer begins at module 'blocks.7'.*flatpack inspect"):
        FixedCuts(("blocks.7",))(chain)
    with pytest.raises(InputError, match="has no module 'blocks.9'; did you mean"):
        check_split_points(Blocks(), ["blocks.9"])


def test_run_options_for_fixed_cuts_are_checked_first():
    with pytest.raises(InputError, match="--stages and --split-points both fix the cuts"):
        JobOptions.of(stages=2, split_points=("head",)).check()
    with pytest.raises(InputError, match="--stages must be a positive"):
        JobOptions.of(stages=0).check()
    with pytest.raises(InputError, match="with --stages or --split-points the cuts are fixed"):
        JobOptions.of(stages=2, pick="fastest").check()


def test_plan_prices_the_cuts_asked_for(capsys):
    assert main(["plan", "mlp", "--target", "aws-lambda", "--stages", "2", "--repeats", "1", "--batch-sizes",
                 "1,2"]) == 0
    printed = capsys.readouterr().out
    assert "fixed cuts" in printed and "the cuts asked for (2 stages)" in printed
    assert main(["plan", "mlp", "--stages", "2", "--slo", "1"]) == 2
    assert "--slo and --weights choose them" in capsys.readouterr().err


def test_plan_prices_each_stage_at_the_degree_stage_replicas_gives(capsys):
    """``flatpack plan --stages 2 --stage-replicas 1,2`` prices the plan ``flatpack run`` would
    run with the same flags: stage 0 alone, stage 1 on two replicas; refused without fixed
    cuts, beside --replicas, or with a degree per stage missing."""
    common = ["plan", "mlp", "--target", "aws-lambda", "--repeats", "1", "--batch-sizes", "1,2", "--json", "-"]
    assert main([*common, "--stages", "2", "--stage-replicas", "1,2"]) == 0
    report = json.loads(capsys.readouterr().out)
    chosen = report["plans"][report["chosen"]]
    assert [stage["replicas"] for stage in chosen["stages"]] == [1, 2]
    for extra, message in ((["--stage-replicas", "1,2"], "give --stages (or --split-points) with it"),
                           (["--stages", "2", "--stage-replicas", "1,2", "--replicas", "2"], "give one or the other"),
                           (["--stages", "2", "--stage-replicas", "1,0"], "must be positive integers"),
                           (["--stages", "2", "--stage-replicas", "2"], "give one degree per stage")):
        assert main([*common, *extra]) == 2
        assert message in capsys.readouterr().err, extra
