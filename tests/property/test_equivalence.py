"""Property: a compiled model, run stage by stage, is the original model.

For random small models (see ``strategies``), random pass pipelines and random cut plans:

- every stage tensor equals the original parameter or buffer of the same name, exactly;
- the staged module returns the same nested outputs (same containers, keys and constants,
  tensors equal to float64 tolerance, ``requires_grad`` alike);
- after the same backward, every input and every parameter (each name of a tied one) has
  the same gradient, and tied parameters are one tensor in the staged module;
- buffers that the forward updates (BatchNorm in train mode, the ``stateful`` block) end up
  equal, and are held by the stages;
- where the batch dimension is dynamic, a second call with one more sample agrees too;
- ``compile`` leaves the model's state and the example inputs as they were.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
import torch.utils._pytree as pytree
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

import flatpack
import strategies as S
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.balanced import Balanced
from tests.helpers import layer_graph


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def original_tensor(model: nn.Module, compiled: flatpack.Compiled, name: str) -> torch.Tensor:
    """The model's parameter or buffer called ``name`` (a traced constant: the traced attribute)."""
    for getter in (model.get_parameter, model.get_buffer):
        try:
            return getter(name)
        except AttributeError:
            pass
    # fx turns plain tensor attributes into ``_tensor_constantN`` attributes of the traced module
    graph = layer_graph(compiled)
    value: Any = graph.gm
    for part in name.split("."):
        value = getattr(value, part)
    assert graph.traced.param_kinds.get(name) == "constant", name
    return value


def assert_state_equal(model: nn.Module, compiled: flatpack.Compiled, staged: flatpack.StagedModule,
                       when: str) -> None:
    """Every stage tensor equals the original tensor of its name; tied names share one tensor."""
    for name, tensor in staged.named_original_parameters():
        original = original_tensor(model, compiled, name)
        assert tensor.dtype == original.dtype and tensor.shape == original.shape, (when, name)
        assert torch.equal(tensor.detach(), original.detach()), f"{when}: stage tensor {name} differs"
        assert tensor.requires_grad == original.requires_grad, (when, name)
    # every name of every parameter and buffer the stages hold resolves, to the same tensor for aliases
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    for name, buffer in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(buffer), []).append(name)
    for aliases in by_id.values():
        held = []
        for name in aliases:
            try:
                held.append(staged.tensor(name))
            except KeyError:
                pass
        assert len(held) in (0, len(aliases)), f"only some names of a tied tensor resolve: {aliases}"
        assert all(t is held[0] for t in held), f"tied tensor {aliases} is several tensors in the stages"


def assert_same_outputs(expected: Any, actual: Any, path: str = "output") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} instead of a tensor"
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{path}: {m}")
        assert actual.requires_grad == expected.requires_grad, f"{path}: requires_grad differs"
        return
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} instead of {type(expected).__name__}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} instead of {list(expected)}"
        for key in expected:
            assert_same_outputs(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), f"{path}: {len(actual)} items instead of {len(expected)}"
        for index, (e, a) in enumerate(zip(expected, actual)):
            assert_same_outputs(e, a, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} instead of {expected!r}"


def backward(outputs: Any) -> bool:
    """A fixed random linear functional of every differentiable output; False if there is none."""
    loss = None
    for index, leaf in enumerate(pytree.tree_leaves(outputs)):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point():
            generator = torch.Generator().manual_seed(1000 + index)
            weight = torch.randn(leaf.shape, generator=generator, dtype=leaf.dtype)
            term = (leaf * weight).sum()
            loss = term if loss is None else loss + term
    if loss is None:
        return False
    loss.backward()
    return True


def assert_same_grads(model: nn.Module, staged: flatpack.StagedModule,
                      ref_inputs: dict[str, torch.Tensor], staged_inputs: dict[str, torch.Tensor]) -> None:
    for name, tensor in ref_inputs.items():
        other = staged_inputs[name]
        if tensor.grad is None:
            assert other.grad is None, f"input {name}: a gradient where the original has none"
        else:
            assert other.grad is not None, f"input {name}: no gradient"
            torch.testing.assert_close(other.grad, tensor.grad, msg=lambda m: f"grad of input {name}: {m}")
    for name, param in model.named_parameters(remove_duplicate=False):
        try:
            held = staged.tensor(name)
        except KeyError:
            assert param.grad is None, f"parameter {name} has a gradient but no stage holds it"
            continue
        if param.grad is None:
            assert held.grad is None, f"parameter {name}: a gradient where the original has none"
        else:
            assert held.grad is not None, f"parameter {name}: no gradient in the stages"
            torch.testing.assert_close(held.grad, param.grad, msg=lambda m: f"grad of {name}: {m}")


def assert_updated_buffers_held(model: nn.Module, staged: flatpack.StagedModule,
                                before: dict[str, torch.Tensor]) -> None:
    """Buffers the original forward wrote must be stage tensors too (equal: ``assert_state_equal``)."""
    for name, buffer in model.named_buffers():
        if torch.equal(before[name], buffer):
            continue
        try:
            staged.tensor(name)
        except KeyError:
            raise AssertionError(f"the forward updates buffer {name}, which no stage holds") from None


def batch_is_dynamic(compiled: flatpack.Compiled) -> bool:
    return compiled.frontend == "fx" or compiled.artifacts[0].manifest.dynamic_batch


def check_equivalence(case: S.Case, compiled: flatpack.Compiled, staged: flatpack.StagedModule | None = None) -> None:
    model = case.model
    staged = staged if staged is not None else compiled.as_module()
    staged.train(model.training)
    assert_state_equal(model, compiled, staged, "before the forward")
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}

    ref_args, ref_kwargs, ref_inputs = case.fresh_call()
    expected = model(*ref_args, **ref_kwargs)
    st_args, st_kwargs, st_inputs = case.fresh_call()
    st_args, st_kwargs = case.restyled(st_args, st_kwargs)
    actual = staged(*st_args, **st_kwargs)
    assert_same_outputs(expected, actual)

    if backward(expected):
        assert backward(actual)
        assert_same_grads(model, staged, ref_inputs, st_inputs)
    assert_state_equal(model, compiled, staged, "after the forward and backward")
    assert_updated_buffers_held(model, staged, buffers)

    # another call, with other values and one more sample, where the batch dimension is dynamic
    if batch_is_dynamic(compiled):
        batch = case.spec.batch + 1
        with torch.no_grad():
            ref_args, ref_kwargs, _ = case.fresh_call(batch, seed=1)
            expected = model(*ref_args, **ref_kwargs)
            st_args, st_kwargs, _ = case.fresh_call(batch, seed=1)
            actual = staged(*case.restyled(st_args, st_kwargs)[0], **case.restyled(st_args, st_kwargs)[1])
        assert_same_outputs(expected, actual, f"output at batch size {batch}")
        assert_state_equal(model, compiled, staged, "after a second call")


def compile_case(case: S.Case, passes: Any, **plan: Any) -> flatpack.Compiled:
    """Compiles, and checks that compiling left the model's state and the example inputs alone."""
    state = {name: tensor.clone() for name, tensor in case.model.state_dict().items()}
    leaves = pytree.tree_leaves((case.args, case.kwargs))
    inputs = [leaf.clone() for leaf in leaves if isinstance(leaf, torch.Tensor)]
    compiled = flatpack.compile(case.model, **case.compile_kwargs(), passes=passes, **plan)
    changed = [name for name, tensor in case.model.state_dict().items() if not torch.equal(tensor, state[name])]
    assert not changed, f"compile changed the model's {changed}"
    after = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, inputs)), "compile changed the example inputs"
    return compiled


def compile_with_drawn_plan(case: S.Case, passes: Any, data: st.DataObject) -> flatpack.Compiled:
    """Compiles once, with a solver that draws the plan when it sees how long the chain is."""

    def solver(problem: Problem) -> flatpack.Plan:
        count = len(problem.chain)
        choice = data.draw(S.plans(count), label="plan")
        if choice.mode == "balanced":
            return Balanced()(dataclasses.replace(problem, stages=choice.stages))
        return flatpack.Plan.from_cuts(list(choice.cuts), count)

    compiled = compile_case(case, passes, solver=solver)
    assert compiled.plan.num_layers == len(layer_graph(compiled).layers)
    return compiled


# --------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------

@given(spec=S.model_specs(), pipeline=S.pipelines(), data=st.data())
def test_staged_module_equals_original(spec, pipeline, data):
    """The main property: 200 examples under the ci profile."""
    case = S.build_case(spec)
    passes = pipeline.value
    compiled = compile_with_drawn_plan(case, passes, data)
    graph = layer_graph(compiled)
    graph.validate()
    stages = len(compiled.plan.stages)
    widest = max((len(graph.crossing(cut)) for cut in compiled.plan.cuts), default=0)
    event(f"family={spec.family} frontend={compiled.frontend}")
    event(f"stages={min(stages, 4)}{'+' if stages >= 4 else ''}")
    event(f"values crossing the widest cut={min(widest, 3)}{'+' if widest >= 3 else ''}")
    check_equivalence(case, compiled)


@settings(max_examples=S.scaled(40))
@given(spec=S.cnn_specs(train=True), pipeline=S.pipelines(), data=st.data())
def test_train_mode_batchnorm(spec, pipeline, data):
    """BatchNorm in train mode: batch statistics, running statistics and ``num_batches_tracked``
    updated alike, also by a BatchNorm that normalizes two branches (the CNN ``twin`` block).

    ``compile`` runs the model, but must leave its running statistics as they were
    (``compile_case`` checks).
    """
    case = S.build_case(spec)
    passes = pipeline.value
    compiled = compile_with_drawn_plan(case, passes, data)
    check_equivalence(case, compiled)


@settings(max_examples=S.scaled(30))
@given(spec=S.vector_specs(wrap_dict=True), pipeline=S.pipelines(), data=st.data())
def test_export_frontend(spec, pipeline, data):
    """Tensor inputs nested in a dict: fx cannot trace that, so torch.export does."""
    case = S.build_case(spec)
    passes = pipeline.value
    compiled = compile_with_drawn_plan(case, passes, data)
    assert compiled.frontend == "export"
    check_equivalence(case, compiled)


@settings(max_examples=S.scaled(25))
@given(spec=S.model_specs(), pipeline=S.pipelines(), data=st.data())
def test_saved_and_loaded_equals_original(spec, pipeline, data):
    """The same, after ``save`` and ``flatpack.load`` (no model code, weights from safetensors)."""
    case = S.build_case(spec)
    passes = pipeline.value
    compiled = compile_with_drawn_plan(case, passes, data)
    with tempfile.TemporaryDirectory() as tmp:
        compiled.save(f"{tmp}/out")
        loaded = flatpack.load(f"{tmp}/out")
    assert loaded.plan == compiled.plan
    check_equivalence(case, compiled, loaded.as_module())


@settings(max_examples=S.scaled(25))
@given(spec=S.model_specs(), pipeline=S.pipelines(), data=st.data())
def test_plan_does_not_change_the_chain(spec, pipeline, data):
    """Two different plans over the same passes see the same layers and the same boundaries."""
    case = S.build_case(spec)
    passes = pipeline.value
    first = compile_case(case, passes, stages=1)
    first_graph = layer_graph(first)
    count = len(first_graph.layers)
    choice = data.draw(S.plans(count), label="plan")
    second = compile_case(case, passes, **choice.compile_kwargs(count))
    second_graph = layer_graph(second)
    assert [layer.nodes for layer in first_graph.layers] == [layer.nodes for layer in second_graph.layers]
    moved = [(one, two) for one, two in zip(first.chain["layers"], second.chain["layers"]) if one != two]
    assert first.chain == second.chain, f"the chain moved between plans (BUGS.md, open): {moved}"
    stages = second.plan.stages
    available = set(second.info.input_names)
    for index, artifact in enumerate(second.artifacts):
        manifest = artifact.manifest
        assert manifest.layers == (stages[index].start, stages[index].end)
        inputs = list(manifest.input_names)
        assert set(inputs) <= available, f"stage {index} reads {set(inputs) - available}, which no one made"
        assert inputs == second_graph.crossing(stages[index].start - 1)
        available |= set(manifest.output_names)
    assert set(second.info.output_names) <= set(second.artifacts[-1].manifest.output_names)
