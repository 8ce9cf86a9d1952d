"""Structural properties of the LayerGraph passes, the balanced solver and plans.

The passes run one at a time on the chain of a random model (see ``strategies``), and after
each one:

- ``graph.validate()`` holds, and the input graph is unchanged (passes never mutate);
- ``fuse-elementwise`` never adds a layer;
- ``merge-branches`` and ``coarsen`` only merge runs of adjacent layers;
- after ``merge-branches`` every boundary carries at most one parameter-dependent value that
  a later layer reads (values only the output reads do not count), and this survives later
  ``coarsen`` passes; merge-branches is idempotent;
- ``coarsen{max-layers=N}`` leaves at most N layers, and leaves a chain of at most N alone;
- the string, name-list and object forms of a pipeline give the same chain, and
  ``pass_spec`` round-trips through ``parse_pipeline``.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flatpack
import strategies as S
from flatpack.ir.graph import LayerGraph
from flatpack.ir.passes import parse_pipeline, pass_spec, run_pipeline
from flatpack.ir.passes.merge_branches import MergeBranches
from flatpack.ir.trace import trace
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.balanced import Balanced


def layer_graph(case: S.Case) -> LayerGraph:
    return LayerGraph.from_traced(trace(case.model, case.args, case.kwargs))


def snapshot(graph: LayerGraph) -> list[list[str]]:
    return [list(layer.nodes) for layer in graph.layers]


def flat(graph: LayerGraph) -> list[str]:
    return [name for layer in graph.layers for name in layer.nodes]


def assert_merges_adjacent(graph: LayerGraph, result: LayerGraph, name: str) -> None:
    """Each layer of ``result`` is the union of a run of consecutive layers of ``graph``."""
    index = 0
    for position, layer in enumerate(result.layers):
        nodes: set[str] = set()
        while index < len(graph.layers) and len(nodes) < len(layer.nodes):
            nodes |= set(graph.layers[index].nodes)
            index += 1
        assert nodes == set(layer.nodes), f"{name}: layer {position} is not a run of adjacent layers"
    assert index == len(graph.layers)


def joined_values(graph: LayerGraph, boundary: int) -> list[str]:
    """Parameter-dependent values crossing ``boundary`` that a layer after it reads."""
    analysis = graph.analysis
    joined = []
    for name in graph.crossing(boundary):
        if name not in analysis.param_dependent:
            continue
        users = analysis.nodes[name].users
        if any(user.op != "output" and graph.layer_of[user.name] > boundary for user in users):
            joined.append(name)
    return joined


def assert_branches_merged(graph: LayerGraph, when: str) -> None:
    """At most one joined value crosses a boundary; a module boundary may carry one more when
    that one only feeds parameterized ops ahead (a long-lived value, such as an encoder output)."""
    modules = MergeBranches._module_boundaries(graph)
    for boundary in range(len(graph.layers) - 1):
        joined = joined_values(graph, boundary)
        inputs_ahead = [name for name in joined if MergeBranches._feeds_parameters(graph, name, boundary)]
        allowed = 2 if boundary in modules and inputs_ahead else 1
        assert len(joined) <= allowed, f"{when}: boundary {boundary} carries {joined} to later layers"


@settings(max_examples=S.scaled(100))
@given(spec=S.model_specs(), pipeline=S.pipelines(max_size=5))
def test_pass_properties(spec, pipeline):
    case = S.build_case(spec)
    graph = layer_graph(case)
    graph.validate()
    start = graph
    merged_since = False  # merge-branches ran, and only merging passes after it
    for step in pipeline.steps:
        graph_pass = step.as_object()
        before = snapshot(graph)
        result = graph_pass(graph)
        assert snapshot(graph) == before, f"{step.text()} changed its input graph"
        assert isinstance(result, LayerGraph)
        result.validate()
        assert set(flat(result)) == set(flat(graph))
        if step.name == "fuse-elementwise":
            assert len(result.layers) <= len(graph.layers)
            merged_since = False
        else:
            assert_merges_adjacent(graph, result, step.text())
        if step.name == "merge-branches":
            merged_since = True
            assert snapshot(MergeBranches()(result)) == snapshot(result), "merge-branches is not idempotent"
        if step.name == "coarsen":
            limit = graph_pass.max_layers
            assert len(result.layers) <= limit
            if len(graph.layers) <= limit:
                assert snapshot(result) == snapshot(graph)
        if merged_since:
            assert_branches_merged(result, f"after {step.text()}")
        graph = result

    # the pipeline forms agree with applying the passes one by one
    for form in ("string", "names", "objects"):
        value = S.Pipeline(pipeline.steps, form).value
        assert snapshot(run_pipeline(start, value)) == snapshot(graph), form
    objects = [step.as_object() for step in pipeline.steps]
    assert parse_pipeline(",".join(pass_spec(p) for p in objects)) == objects


@settings(max_examples=S.scaled(40))
@given(spec=S.model_specs(), pipeline=S.pipelines(), data=st.data())
def test_balanced_solver(spec, pipeline, data):
    """K stages tile the chain, and no K-stage split has a lighter heaviest stage (brute force)."""
    case = S.build_case(spec)
    graph = run_pipeline(layer_graph(case), pipeline.value)
    count = len(graph.layers)
    stages = data.draw(st.integers(1, count), label="stages")
    problem = Problem.from_graph(graph, stages=stages)
    plan = Balanced()(problem)
    plan.check_against(count)
    assert len(plan.stages) == stages
    weights = [layer.param_bytes for layer in problem.chain]

    def heaviest(cuts: tuple[int, ...]) -> int:
        edges = [0, *(cut + 1 for cut in cuts), count]
        return max(sum(weights[a:b]) for a, b in itertools.pairwise(edges))

    assert plan.predictions["max_stage_param_bytes"] == heaviest(tuple(plan.cuts))
    if math.comb(count - 1, stages - 1) <= 3000:
        best = min(heaviest(cuts) for cuts in itertools.combinations(range(count - 1), stages - 1))
        assert heaviest(tuple(plan.cuts)) == best


@given(count=st.integers(1, 40), data=st.data())
def test_plan_round_trip(count, data):
    cuts = data.draw(st.lists(st.integers(0, count - 2), unique=True) if count > 1 else st.just([]))
    plan = flatpack.Plan.from_cuts(cuts, count)
    assert plan.cuts == sorted(cuts)
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == count - 1
    assert sum(stage.num_layers for stage in plan.stages) == count
    assert flatpack.Plan.loads(plan.dumps()) == plan
    assert flatpack.Plan.from_ranges(plan.ranges, count) == plan
    with pytest.raises(flatpack.PlanError):
        plan.check_against(count + 1)
