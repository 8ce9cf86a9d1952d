"""The Backend protocol: every backend offers or declares each operation, its deployment has
exactly the methods it offers, and a workload its target cannot run is refused when the plan is
made, naming the backend, the operation and the targets that can."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import flatpack
from flatpack.backends import BACKENDS, check_supported, get_backend
from flatpack.backends.protocol import Backend, Capability, Deployment
from flatpack.errors import InputError
from flatpack.partitioner.workload import MODES, Workload

DEPLOYMENTS = {"local": "LocalDeployment", "aws-lambda": "LambdaDeployment", "alibaba-fc": "FcDeployment",
               "gpu-container": "GpuContainerDeployment", "ray": "RayDeployment"}
METHODS = {Capability.TRAIN: "train", Capability.INFER: "infer", Capability.RESUME: "resume",
           Capability.TEARDOWN: "teardown"}


@pytest.mark.parametrize("name", BACKENDS.names())
def test_every_backend_offers_or_declares_each_operation(name):
    backend = get_backend(name)
    assert isinstance(backend, Backend)
    assert name == backend.NAME
    assert not backend.CAPABILITIES & set(backend.LIMITS), "an operation is offered or limited, not both"
    assert backend.CAPABILITIES | set(backend.LIMITS) == set(Capability), "every operation is offered or declared"
    assert all(reason.strip() for reason in backend.LIMITS.values())


@pytest.mark.parametrize("name", BACKENDS.names())
def test_a_deployment_has_exactly_the_methods_its_backend_offers(name):
    backend = get_backend(name)
    deployment = getattr(backend, DEPLOYMENTS[name])
    # the Deployment protocol's methods: what every backend's deployment offers
    assert {"train", "infer", "teardown"} <= {member for member in dir(Deployment) if not member.startswith("_")}
    for capability, method in METHODS.items():
        offered = capability in backend.CAPABILITIES
        assert callable(getattr(deployment, method, None)) == offered, f"{name}: {method} offered={offered}"


def test_every_workload_mode_is_a_capability():
    assert {Capability(mode) for mode in MODES} == {Capability.TRAIN, Capability.INFER}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Untraceable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("traced: the workload should have been refused first")


def test_compile_refuses_a_workload_the_backend_cannot_run_before_tracing(monkeypatch):
    from flatpack.backends import gpu_container

    # gpu-container ranks recompute (training.stage_backward); a backend that declared it could
    # not would have the plan refused before the model is traced
    assert Capability.RECOMPUTE in gpu_container.CAPABILITIES
    monkeypatch.setattr(gpu_container, "CAPABILITIES", gpu_container.CAPABILITIES - {Capability.RECOMPUTE})
    monkeypatch.setattr(gpu_container, "LIMITS", {**gpu_container.LIMITS,
                                                  Capability.RECOMPUTE: "its ranks keep every activation"})
    with pytest.raises(InputError) as caught:
        flatpack.compile(Untraceable(), torch.randn(4, 4), target="gpu-container",
                         workload=Workload("train", batch=4, recompute="auto"))
    message = str(caught.value)
    assert "the gpu-container backend cannot recompute: its ranks keep every activation" in message
    assert "targets that can: alibaba-fc, aws-lambda, local" in message


def test_compile_plans_inference_and_plain_training_for_gpu_container():
    for mode in MODES:
        compiled = flatpack.compile(Tiny(), torch.randn(4, 4), target="gpu-container", stages=2,
                                    workload=Workload(mode, batch=4))
        assert len(compiled.plan.stages) == 2


def test_a_backend_without_an_operation_is_refused_with_the_alternatives(monkeypatch):
    limited = types.SimpleNamespace(NAME="toy", CAPABILITIES=frozenset({Capability.DEPLOY, Capability.TRAIN}),
                                    LIMITS={Capability.INFER: "toy functions cannot serve requests"})
    monkeypatch.setitem(BACKENDS.factories, "toy", lambda: limited)
    check_supported("toy", Capability.TRAIN)
    with pytest.raises(InputError, match=r"the toy backend cannot infer: toy functions cannot serve requests; "
                                         r"targets that can: alibaba-fc, aws-lambda, gpu-container, local"):
        check_supported("toy", Capability.INFER)


def test_a_planning_only_platform_is_not_held_to_a_backend():
    check_supported("no-such-backend", Capability.INFER)   # nothing deploys there, nothing to refuse
