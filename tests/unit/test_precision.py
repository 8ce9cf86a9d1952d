"""fp16's loss scaler and the global step checks (runtime.precision, runtime.clipping): a
stage's scaler is torch.amp.GradScaler's arithmetic bit for bit; the overflow check and the
clipping norm travel in one reduction, and a stage that overflowed makes every stage skip."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from flatpack.errors import InputError
from flatpack.partitioner.workload import Workload
from flatpack.runtime import clipping
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.precision import LossScaler, LossScaling, for_wire, loss_scaler
from flatpack.runtime.spec import RunSpec
from flatpack.runtime.store import FileStore


def test_a_stage_scaler_follows_grad_scaler_through_overflows_and_growth():
    """The same overflow pattern through GradScaler (one process) and a stage's LossScaler:
    equal gradients after unscaling, equal found-inf, equal scale and clean-step count."""
    settings = LossScaling(init_scale=2.0 ** 10, growth_interval=2)
    mine = LossScaler(settings)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    theirs = settings.grad_scaler()
    for overflow in (False, True, False, False, False, True):
        grads = [torch.randn(2, 3), torch.randn(2)]
        if overflow:
            grads[1][0] = float("inf")
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad.clone()
        theirs.scale(torch.ones(()))      # GradScaler makes its scale on the first scale()
        theirs.unscale_(optimizer)
        found = sum(float(value) for value in theirs._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
                    .values())
        copies = [grad.clone() for grad in grads]
        assert mine.unscale(copies) == bool(found) == overflow
        for param, copy in zip(model.parameters(), copies):
            torch.testing.assert_close(copy, param.grad, rtol=0, atol=0, equal_nan=True)
        theirs.step(optimizer)
        theirs.update()
        mine.update(overflow)
        assert mine.state() == {"scale": theirs.get_scale(), "growth_tracker": theirs.state_dict()["_growth_tracker"]}
    assert mine.state()["scale"] == 2.0 ** 9     # backed off twice, grew once (two clean steps in a row)
    restored = LossScaler(settings)
    restored.load(mine.state())
    assert restored.state() == mine.state()
    assert loss_scaler("bf16", settings) is None and loss_scaler("fp16", settings) is not None


def checked_steps(tmp_path, stages: Sequence[Sequence[torch.Tensor]], max_norm: float | None,
                  scalers: list[LossScaler | None]) -> list[bool | None]:
    """Every stage's ``clipping.checked_step`` through one store, each in its own thread
    (None where a stage's thread did not return in time)."""
    store, keys = FileStore(tmp_path), RunKeys("run")
    steps: list[bool | None] = [None] * len(stages)

    def run(index: int) -> None:
        def reduce(own: list[float]) -> list[float]:
            return clipping.global_sums(store, keys, 3, index, len(stages), 0, own, timeout_s=10)

        steps[index] = clipping.checked_step(stages[index], [p.grad for p in stages[index]], max_norm,
                                             scalers[index], reduce)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(stages))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return steps


def parameters_with(*grads: torch.Tensor) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    return params


def test_an_overflow_on_one_stage_makes_every_stage_skip(tmp_path):
    settings = LossScaling(init_scale=4.0)
    finite = parameters_with(torch.tensor([4.0, 8.0]))
    overflowed = parameters_with(torch.tensor([float("inf"), 4.0]))
    steps = checked_steps(tmp_path, [finite, overflowed], None, [LossScaler(settings), LossScaler(settings)])
    assert steps == [False, False]
    # the finite stage still unscaled its gradients (GradScaler's unscale_ does, step or not)
    assert finite[0].grad is not None and finite[0].grad.tolist() == [1.0, 2.0]


def test_unscaling_then_clipping_is_grad_scaler_with_clip_grad_norm(tmp_path):
    """Two stages, scale 8, clipping to 1: the gradients are those of unscale_ followed by
    clip_grad_norm_ over all of them, and both stages step."""
    grads = [torch.tensor([3.0, 0.0]) * 8, torch.tensor([0.0, 4.0]) * 8]
    stages = [parameters_with(grads[0]), parameters_with(grads[1])]
    scale = LossScaling(init_scale=8.0)
    assert checked_steps(tmp_path, stages, 1.0, [LossScaler(scale), LossScaler(scale)]) == [True, True]
    whole = parameters_with(grads[0] / 8, grads[1] / 8)
    torch.nn.utils.clip_grad_norm_(whole, 1.0)
    for stage, expected in zip(stages, whole):
        torch.testing.assert_close(stage[0].grad, expected.grad, rtol=1e-6, atol=0)
    # neither a limit nor a scaler: nothing is reduced, nothing touched
    untouched = parameters_with(torch.tensor([5.0]))
    assert clipping.checked_step(untouched, [untouched[0].grad], None, None, lambda own: pytest.fail("reduced")) \
        is True
    assert untouched[0].grad is not None and untouched[0].grad.tolist() == [5.0]


@pytest.mark.parametrize(("settings", "named"), [
    ({"init_scale": 0}, "init_scale must be a positive, finite number, got 0; GradScaler's default is 65536"),
    ({"init_scale": float("inf")}, "init_scale must be a positive, finite number, got inf"),
    ({"growth_factor": 1.0}, "growth_factor must be a finite number above 1, got 1.0"),
    ({"backoff_factor": 1.5}, "backoff_factor must be between 0 and 1, got 1.5"),
    ({"growth_interval": 0}, "growth_interval must be a positive integer .* got 0"),
    ({"growth_interval": 2.5}, "growth_interval must be a positive integer .* got 2.5"),
    ({"scale": 2.0}, "loss_scaling has no setting scale; the settings are init_scale, growth_factor"),
])
def test_bad_loss_scaling_is_refused_naming_the_setting_and_the_default(settings, named):
    with pytest.raises(InputError, match=named):
        LossScaling.of(settings)


def test_fp16_halves_the_boundary_bytes_and_travels_in_the_run_spec():
    assert Workload("train", batch=8, micro_batches=2, precision="fp16").boundary_scale == 0.5
    assert for_wire({"h": torch.ones(2)}, "fp16")["h"].dtype == torch.float16
    spec = RunSpec(run="r", stages=(), micro_batches=1, batch=1, optimizer=OptimizerSpec.of("sgd"), loss="mse",
                   loss_output="out", precision="fp16", loss_scaling=LossScaling(init_scale=256.0, growth_interval=5))
    assert RunSpec.loads(spec.dumps()).loss_scaling == spec.loss_scaling
    with pytest.raises(InputError, match="--precision fp16 skips a step .* 1f1b-async .* use --precision bf16"):
        RunSpec(run="r", stages=(), micro_batches=1, batch=1, optimizer=OptimizerSpec.of("sgd"), loss="mse",
                loss_output="out", precision="fp16", schedule="1f1b-async")
