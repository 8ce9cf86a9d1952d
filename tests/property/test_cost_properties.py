"""Properties of the cost models on random profiled chains and random plans: what must hold
whatever the numbers, so a solver comparing plans through them compares like with like."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatpack.partitioner.cost import funcpipe, pipedream
from flatpack.partitioner.plan import Plan, StagePlan
from tests.unit.test_cost_models import layer, platform, problem

TIERS = (512, 1024, 2048)


@st.composite
def chains_and_plans(draw, same_replicas: bool = True):
    """A chain of 1..6 layers with random times and sizes, and a plan over it: random cuts,
    a random tier per stage, one replica degree (FuncPipe) or one per stage (PipeDream)."""
    count = draw(st.integers(1, 6))
    specs = [(f"l{index}", draw(st.floats(0.0, 2.0)), draw(st.floats(0.0, 4.0)), draw(st.integers(0, 50)),
              draw(st.floats(0.0, 4.0)), draw(st.floats(0.0, 8.0))) for index in range(count)]
    cuts = sorted(draw(st.sets(st.integers(0, count - 2), max_size=count - 1))) if count > 1 else []
    starts, ends = [0, *(cut + 1 for cut in cuts)], [*cuts, count - 1]
    replicas = draw(st.sampled_from([1, 2, 4]))
    stages = tuple(StagePlan(start, end, draw(st.sampled_from(TIERS)),
                             replicas if same_replicas else draw(st.sampled_from([1, 2, 4])))
                   for start, end in zip(starts, ends))
    return specs, Plan(stages, count)


def priced(specs, bandwidth_scale: float = 1.0):
    tiers = tuple((memory, 50 * bandwidth_scale) for memory in TIERS)
    return problem(layers=specs, target=platform(tiers=tiers))


@given(chains_and_plans())
def test_funcpipe_cost_is_time_times_the_workers_price(case):
    specs, plan = case
    costed = funcpipe.iteration(priced(specs), plan)
    tiers = [priced(specs).platform.tier(stage.memory_mb) for stage in plan.stages]
    price = costed.replicas * sum(tier.price_per_s for tier in tiers)
    assert costed.dollars_per_iteration == pytest.approx(costed.iteration_s * price)
    assert costed.memory_mb_total == costed.replicas * sum(stage.memory_mb for stage in plan.stages)


@given(chains_and_plans())
def test_funcpipe_iteration_is_at_least_the_busiest_stage_over_every_micro_batch(case):
    specs, plan = case
    costed = funcpipe.iteration(priced(specs), plan)
    busiest_forward = max(stage.forward_s for stage in costed.stages)
    assert costed.forward_s >= costed.micro_batches_per_replica * busiest_forward - 1e-9
    assert costed.iteration_s >= costed.forward_s + max(stage.backward_s for stage in costed.stages) - 1e-9
    if costed.replicas == 1:
        assert all(stage.sync_s == 0 for stage in costed.stages)


@given(chains_and_plans())
def test_funcpipe_more_bandwidth_never_slows_an_iteration(case):
    specs, plan = case
    slow = funcpipe.iteration(priced(specs), plan)
    fast = funcpipe.iteration(priced(specs, bandwidth_scale=4.0), plan)
    assert fast.iteration_s <= slow.iteration_s + 1e-9


@given(chains_and_plans(same_replicas=False))
def test_pipedream_iteration_is_every_micro_batch_through_the_bottleneck(case):
    specs, plan = case
    costed = pipedream.iteration(priced(specs), plan)
    slowest = max([stage.time_s for stage in costed.stages] + [cut.time_s for cut in costed.cuts])
    assert costed.slowest_s == slowest
    assert costed.iteration_s == pytest.approx(costed.micro_batches * slowest)
    for stage in costed.stages:
        assert stage.time_s >= stage.compute_s / stage.replicas - 1e-12
        assert stage.in_flight >= 1 and (stage.replicas > 1 or stage.sync_s == 0)
    # doubling every stage's replicas halves each replica's share of the compute and never speeds up the sync
    doubled = Plan(tuple(dataclasses.replace(stage, replicas=stage.replicas * 2) for stage in plan.stages),
                   plan.num_layers)
    wider = pipedream.iteration(priced(specs), doubled)
    for before, after in zip(costed.stages, wider.stages):
        assert after.compute_s / after.replicas == pytest.approx(before.compute_s / before.replicas / 2)
        assert after.sync_s >= before.sync_s - 1e-12  # a larger ring never synchronizes faster


@given(st.lists(st.tuples(st.floats(0, 4), st.floats(0, 8)), min_size=1, max_size=6), st.floats(1, 16))
def test_stage_saved_bytes_never_exceed_the_naive_sum_nor_undercut_the_largest_layer(layers, batch):
    from flatpack.ir.profile import Linear, stage_saved_bytes

    profiles = []
    for index, (shared, own) in enumerate(layers):
        base = layer(f"l{index}", 0, 0, 0, own + shared, 0)
        # each layer keeps the tensor it receives from its predecessor and the one it hands on
        boundary = {f"v{index}": Linear(shared * 2**20), f"v{index + 1}": Linear(shared * 2**20)}
        profiles.append(dataclasses.replace(base, saved_boundary_bytes=boundary,
                                            saved_bytes=Linear((own + 2 * shared) * 2**20)))
    total = stage_saved_bytes(profiles, batch)
    naive = sum(profile.saved_bytes.at(batch) for profile in profiles)
    assert total <= naive + 1e-6
    assert total >= max(profile.saved_bytes.at(batch) for profile in profiles) - 1e-6


# a layer keeps some of the boundary values v0..v5 (the same value may be kept by several
# layers, each measuring its own line of it) on top of what it keeps alone
_KEPT = st.dictionaries(st.sampled_from([f"v{index}" for index in range(6)]),
                        st.tuples(st.floats(0, 4), st.floats(0, 2)), max_size=3)


@given(st.lists(st.tuples(st.floats(0, 8), _KEPT), min_size=1, max_size=8))
def test_every_stage_of_the_running_sums_equals_the_stage_counted_from_scratch(layers):
    """``stage_tensor_rows`` (what dp's table of every stage reads) against the definition
    counted afresh for each stage: the layers' saved bytes, less, for each boundary value
    several of its layers keep, every line of it but the largest (one storage)."""
    from flatpack.ir.profile import Linear
    from flatpack.partitioner.cost.common import stage_tensor_rows, stage_tensors
    from flatpack.partitioner.problem import ChainLayer

    profiles = []
    for index, (own, kept) in enumerate(layers):
        boundary = {value: Linear(per_sample * 2**20, fixed * 2**20) for value, (per_sample, fixed) in kept.items()}
        saved = Linear(own * 2**20 + sum(line.per_sample for line in boundary.values()),
                       sum(line.fixed for line in boundary.values()))
        profiles.append(dataclasses.replace(layer(f"l{index}", 0.1, 0.2, index + 1, 0, 1),
                                            saved_boundary_bytes=boundary, saved_bytes=saved))
    chain_problem = dataclasses.replace(problem(), chain=tuple(ChainLayer(p.name, p.param_bytes, 0, 0, p)
                                                               for p in profiles))
    for start in range(len(profiles)):
        for end, running in enumerate(stage_tensor_rows(chain_problem, start), start):
            stage = profiles[start:end + 1]
            lines: dict[str, list[Linear]] = {}
            for profile in stage:
                for value, line in profile.saved_boundary_bytes.items():
                    lines.setdefault(value, []).append(line)
            per_sample = sum(p.saved_bytes.per_sample for p in stage)
            fixed = sum(p.saved_bytes.fixed for p in stage)
            for kept in lines.values():
                largest = max(kept, key=lambda line: (line.per_sample, line.fixed))
                per_sample -= sum(line.per_sample for line in kept) - largest.per_sample
                fixed -= sum(line.fixed for line in kept) - largest.fixed
            assert running.saved.per_sample == pytest.approx(per_sample, rel=1e-9, abs=1e-3)
            assert running.saved.fixed == pytest.approx(fixed, rel=1e-9, abs=1e-3)
            assert running.weights == sum(p.param_bytes + p.buffer_bytes for p in stage)
            assert running.gradients == sum(p.grad_bytes for p in stage)
            assert running == stage_tensors(chain_problem, start, end)
