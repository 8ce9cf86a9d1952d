"""docs/extending.md, checked by doing it (issue 38, item 5): a toy backend, solver, compiler
pass and cost model, each added from the tests alone (no edit to ``flatpack/``) the way the
document lists, registered, selected by name and used. The schedule case is
``tests/unit/test_schedules.py::test_a_schedule_added_in_one_file_trains_on_the_local_backend_to_sync_s_weights``.

The registries (``flatpack.registry.Registry``) have no ``unregister``: a registration is
for the life of the process, so each fixture here removes its entry from the registry's
``factories`` afterwards, as ``test_schedules.py``'s does, and no other test sees it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import flatpack
from flatpack.backends import BACKENDS, get_backend
from flatpack.backends.protocol import Backend, Capability, Deployment
from flatpack.ir.graph import LayerGraph
from flatpack.ir.passes import PASSES, register_pass
from flatpack.partitioner.cost.registry import COST_MODEL_REGISTRY, CostModel, Priced
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers import SOLVERS, register_solver
from flatpack.partitioner.workload import Workload
from flatpack.platform.catalog import PLATFORMS, Platform, get_platform, register_platform
from tests.models import MLP
from tests.unit import toy_backend


# -- a solver -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class FirstLayerAlone:
    """Stage 0 is the first layer alone, stage 1 the rest."""

    name: ClassVar[str] = "first-layer-alone"

    def __call__(self, problem: Problem) -> Plan:
        return Plan.from_cuts([0], len(problem.chain), solver=self.name)


@pytest.fixture
def toy_solver():
    # pyright's protocol check refuses a ClassVar ``name`` against ``Solver.name``, which is
    # how every built-in solver names itself (docs/extending.md, "What every registry shares")
    register_solver(FirstLayerAlone.name, FirstLayerAlone)  # pyright: ignore[reportArgumentType]
    yield FirstLayerAlone.name
    SOLVERS.unregister(FirstLayerAlone.name)


def test_a_registered_solver_plans_a_compile_that_names_it(toy_solver):
    model, x = MLP(depth=4), torch.randn(3, 8)
    compiled = flatpack.compile(model, (x,), solver=toy_solver)
    layers = compiled.plan.num_layers
    assert compiled.plan.solver == toy_solver and compiled.plan.ranges == [(0, 0), (1, layers - 1)]
    torch.testing.assert_close(model(x), compiled.as_module()(x))


# -- a compiler pass ----------------------------------------------------------------------------

@dataclass(frozen=True)
class PairLayers:
    """Merges each two consecutive layers into one (``group`` of them, an option)."""

    name: ClassVar[str] = "pair-layers"
    group: int = 2

    def __call__(self, graph: LayerGraph) -> LayerGraph:
        count = len(graph.layers)
        return graph.merged([(start, min(start + self.group, count) - 1) for start in range(0, count, self.group)])


@pytest.fixture
def toy_pass():
    register_pass(PairLayers.name, PairLayers)  # pyright: ignore[reportArgumentType]: as for the solver
    yield PairLayers.name
    PASSES.unregister(PairLayers.name)


def test_a_registered_pass_runs_in_a_compile_s_pipeline_with_its_options(toy_pass):
    model, x = MLP(depth=6), torch.randn(3, 8)
    plain = flatpack.compile(model, (x,), passes="fuse-elementwise", stages=1)
    compiled = flatpack.compile(model, (x,), passes=f"fuse-elementwise,{toy_pass}{{group=3}}", stages=2)
    assert plain.plan.num_layers == 6 and compiled.plan.num_layers == 2
    assert compiled.info.passes == ("fuse-elementwise", "pair-layers{group=3}")
    torch.testing.assert_close(model(x), compiled.as_module()(x))


# -- a cost model -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoreStagesFaster(CostModel):
    """Times a training iteration at 1/stages seconds, a cent each: the most stages win."""

    name: ClassVar[str] = "more-stages-faster"
    label: ClassVar[str] = "MoreStagesFaster"
    modes: ClassVar[tuple[str, ...]] = ("train",)
    platform_kinds: ClassVar[tuple[str, ...]] = ("serverless",)
    asynchronous: ClassVar[bool] = False
    tier_per_stage: ClassVar[bool] = False
    degree_per_stage: ClassVar[bool] = False
    priced: ClassVar[list[Plan]] = []

    def price(self, problem: Problem, plan: Plan) -> Priced:
        MoreStagesFaster.priced.append(plan)
        return Priced(time_s=1.0 / len(plan.stages), dollars=0.01, fits=True, detail=None)


@pytest.fixture
def toy_cost_model():
    COST_MODEL_REGISTRY.register(MoreStagesFaster.name, MoreStagesFaster)
    MoreStagesFaster.priced.clear()
    yield MoreStagesFaster.name
    COST_MODEL_REGISTRY.unregister(MoreStagesFaster.name)


def test_a_registered_cost_model_is_chosen_by_name_and_prices_the_plans(toy_cost_model):
    model, x = MLP(depth=4), torch.randn(4, 8)
    compiled = flatpack.compile(model, (x,), target="aws-lambda", solver="brute",
                                workload=Workload("train", batch=4, micro_batches=1), cost_model=toy_cost_model,
                                weights=(0.0, 1.0), memory_mb=(1024,), replicas=(1,))
    layers = compiled.plan.num_layers
    assert compiled.plan.predictions["cost_model"] == toy_cost_model
    assert len(MoreStagesFaster.priced) == 2 ** (layers - 1), "brute priced every cut of the chain with it"
    assert len(compiled.plan.stages) == layers and compiled.plan.predictions["time_s"] == 1.0 / layers
    torch.testing.assert_close(model(x), compiled.as_module()(x))


# -- a backend ----------------------------------------------------------------------------------

@pytest.fixture
def marked_backend():
    """The toy backend and its platform (the local one under the toy's name), registered for
    this test only."""
    register_platform(Platform.from_json({**get_platform("local").to_json(), "name": toy_backend.NAME}))
    BACKENDS.register(toy_backend.NAME, toy_backend.backend)
    yield get_backend(toy_backend.NAME)
    BACKENDS.unregister(toy_backend.NAME)
    PLATFORMS.unregister(toy_backend.NAME)


@pytest.mark.slow
def test_a_registered_backend_trains_a_compiled_model_to_the_local_backend_s_weights(marked_backend):
    from flatpack.backends import local
    from tests.integration.test_local_training import BATCH, batches, make_model

    assert isinstance(marked_backend, Backend) and marked_backend.NAME == toy_backend.NAME
    assert marked_backend.CAPABILITIES | set(marked_backend.LIMITS) == set(Capability)
    model = make_model()
    base = flatpack.compile(model, (torch.randn(BATCH, 8),), target=toy_backend.NAME, stages=2)
    plan = Plan(tuple(StagePlan(stage.start, stage.end, None, replicas)
                      for stage, replicas in zip(base.plan.stages, (2, 1))), base.plan.num_layers, micro_batches=4)
    compiled = flatpack.compile(model, (torch.randn(BATCH, 8),), target=toy_backend.NAME, plan=plan)
    data, optimizer = batches(2), {"name": "adam", "lr": 0.01}
    with marked_backend.deploy(compiled) as deployment:
        assert isinstance(deployment, Deployment)
        assert isinstance(deployment, toy_backend.MarkedDeployment) and deployment.platform == toy_backend.NAME
        marked = deployment.train(data, iterations=2, optimizer=optimizer)
        launched = list(deployment.launched)
    with local.deploy(compiled) as deployment:
        plain = deployment.train(data, iterations=2, optimizer=optimizer)
    assert sorted((kind, worker) for kind, worker, _ in launched) == [("train", "s0r0"), ("train", "s0r1"),
                                                                      ("train", "s1r0")]
    assert all(marker.startswith("run-") for _, _, marker in launched)
    assert set(marked.parameters) == set(plain.parameters) == set(model.state_dict())
    for name, expected in plain.parameters.items():
        torch.testing.assert_close(marked.parameters[name], expected, msg=name)
    assert marked.losses == pytest.approx(plain.losses, rel=1e-6)
