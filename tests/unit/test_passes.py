"""Each pass: a structural test (what the chain looks like after it) and a numerical one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest
import torch
from torch import nn

import flatpack
from flatpack.errors import PassError
from flatpack.ir import meta
from flatpack.ir.graph import LayerGraph
from flatpack.ir.passes import (DEFAULT_PIPELINE, PASSES, Pass, available_passes, make_pass, parse_pipeline, pass_spec,
                                register_pass, run_pipeline)
from flatpack.ir.passes.coarsen import Coarsen
from flatpack.ir.trace import trace
from tests.helpers import assert_equivalent
from tests.models import MLP, Inception, MaskedEncoder, ResidualStack


def chain(model, *inputs, passes: str | Sequence[Pass | str] = "") -> LayerGraph:
    return run_pipeline(LayerGraph.from_traced(trace(model, inputs)), passes)


def ops_of(graph, index):
    return [graph.analysis.nodes[name] for name in graph.layers[index].nodes]


# registry and pipeline strings ------------------------------------------------------------

def test_every_registered_key_equals_its_pass_name():
    for name in PASSES.names():
        assert make_pass(name).name == name


def test_registering_a_taken_name_is_refused():
    with pytest.raises(PassError, match="already registered"):
        register_pass("coarsen", lambda: make_pass("coarsen"))


def test_pipeline_string_parses_options_and_round_trips():
    passes = parse_pipeline("fuse-elementwise, merge-branches,coarsen{max-layers=5,by=params}")
    assert [p.name for p in passes] == ["fuse-elementwise", "merge-branches", "coarsen"]
    assert passes[2] == Coarsen(max_layers=5, by="params")
    assert parse_pipeline(",".join(pass_spec(p) for p in passes)) == passes


@pytest.mark.parametrize("text, message", [
    ("fuse-elementwise,nope", "unknown pass 'nope'"),
    ("coarsen{max-layers=0}", "positive integer"),
    ("coarsen{by=cost}", "by must be one of"),
    ("coarsen{layers=3}", "has no option layers"),
    ("coarsen{max-layers=3", "unbalanced"),
    ("coarsen{max-layers}", "key=value"),
])
def test_bad_pipelines_name_the_problem(text, message):
    with pytest.raises(PassError, match=message):
        parse_pipeline(text)


def test_user_pass_objects_mix_with_names():
    seen = []

    def spy(graph):
        seen.append(len(graph.layers))
        return graph

    # spy is a plain function, not a Pass (it has no name): the pipeline takes any
    # LayerGraph -> LayerGraph callable, which is what this test checks
    graph = chain(MLP(), torch.randn(2, 8), passes=["fuse-elementwise", spy])  # pyright: ignore[reportArgumentType]
    assert seen == [len(graph.layers)] and "fuse-elementwise" in available_passes()


def test_default_pipeline_is_fuse_then_merge():
    assert DEFAULT_PIPELINE == "fuse-elementwise,merge-branches"


# fuse-elementwise ----------------------------------------------------------------------------

def test_fuse_elementwise_puts_each_activation_with_its_linear():
    raw = chain(MLP(depth=4), torch.randn(2, 8))
    fused = run_pipeline(raw, "fuse-elementwise")
    assert len(raw.layers) == 8 and len(fused.layers) == 4
    for index in range(4):
        assert [n.meta[meta.FREE] for n in ops_of(fused, index)] == [False, False]
        assert [flatpack.ir.ops.op_name(n) for n in ops_of(fused, index)] == ["linear", "relu"]


def test_fuse_elementwise_sinks_input_preprocessing_into_its_first_reader():
    graph = chain(MaskedEncoder(), torch.randn(2, 5, 8), torch.ones(2, 5), passes="fuse-elementwise")
    first = [flatpack.ir.ops.op_name(n) for n in ops_of(graph, 0)]
    assert "gt" in first and "unsqueeze" in first, "the mask is computed where it is first used"


def batch_norm_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)).train()


def test_fuse_elementwise_puts_buffer_counters_with_the_layer_before():
    graph = chain(batch_norm_net(), torch.randn(2, 3, 8, 8), passes="fuse-elementwise")
    names = [[flatpack.ir.ops.op_name(node) for node in ops_of(graph, index)] for index in range(len(graph.layers))]
    assert len(graph.layers) == 3, names  # conv+bn(+counter)+relu twice, then the classifier
    assert [layer[0] for layer in names] == ["conv2d", "conv2d", "linear"]
    assert [layer.count("add_") for layer in names] == [1, 1, 0]
    assert_equivalent(batch_norm_net(), torch.randn(2, 3, 8, 8), stages=3)


def test_fuse_elementwise_is_numerically_neutral():
    assert_equivalent(MLP(), torch.randn(3, 8), passes="fuse-elementwise", stages=3)


class LeakyWhereStack(nn.Module):
    """Residual blocks whose activation is ``torch.where(x > 0, x, 0.1 * x)``: three ops on one
    tensor, each reading it, after the residual add and inside the branch."""

    def __init__(self, blocks: int = 4, width: int = 8, pre_norm: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(width), "first": nn.Linear(width, width),
                                                   "second": nn.Linear(width, width)}) for _ in range(blocks))
        self.pre_norm = pre_norm
        self.head = nn.Linear(width, 2)

    @staticmethod
    def act(x):
        return torch.where(x > 0, x, 0.1 * x)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            block = cast(nn.ModuleDict, block)  # a ModuleList iterates as plain Modules
            if self.pre_norm:
                x = x + self.act(block["first"](block["norm"](x)))
            else:
                x = self.act(x + block["second"](self.act(block["first"](x))))
        return self.head(x)


@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-act", "pre-norm"])
def test_fuse_elementwise_keeps_a_multi_op_activation_with_its_producer(pre_norm):
    model = LeakyWhereStack(pre_norm=pre_norm)
    fused = chain(model, torch.randn(2, 8), passes="fuse-elementwise")
    for index in range(len(fused.layers)):
        names = [flatpack.ir.ops.op_name(node) for node in ops_of(fused, index)]
        # gt, mul and where of one activation sit in the same layer as the op they read
        assert names.count("gt") == names.count("where") == names.count("mul"), names
    merged = chain(model, torch.randn(2, 8), passes=DEFAULT_PIPELINE)
    assert len(merged.layers) == 6  # stem, one layer per block, head
    assert all(len(boundary.values) == 1 for boundary in merged.boundaries())
    assert_equivalent(model, torch.randn(3, 8), stages=4)


# merge-branches -----------------------------------------------------------------------------

def test_merge_branches_makes_each_residual_block_one_layer():
    graph = chain(ResidualStack(blocks=3), torch.randn(2, 8), passes=DEFAULT_PIPELINE)
    assert len(graph.layers) == 5  # stem, 3 blocks, head
    for boundary in graph.boundaries():
        assert [v.name for v in boundary.values if v.param_dependent] == [boundary.values[-1].name]
        assert len(boundary.values) == 1


def test_merge_branches_keeps_an_inception_module_in_one_layer():
    graph = chain(Inception(), torch.randn(1, 4, 6, 6), passes=DEFAULT_PIPELINE)
    assert len(graph.layers) == 2  # the four branch convolutions and the concat; then the 1x1 conv after the join
    names = [flatpack.ir.ops.op_name(n) for n in ops_of(graph, 0)]
    assert names.count("conv2d") == 4 and names[-1] == "cat"
    assert [v.name for v in graph.boundary(0).values] == ["cat"]


def test_merge_branches_lets_the_mask_cross_instead_of_merging():
    graph = chain(MaskedEncoder(depth=3), torch.randn(2, 5, 8), torch.ones(2, 5), passes=DEFAULT_PIPELINE)
    assert len(graph.layers) == 3
    for boundary in graph.boundaries():
        names = [v.name for v in boundary.values]
        assert len(names) == 2 and sum(v.param_dependent for v in boundary.values) == 1


class ZeroStateStack(nn.Module):
    """Every layer starts from one zero state sized by the batch, as stacked RNNs do."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))

    def forward(self, x):
        state = torch.zeros(x.size(0), 8)
        for layer in self.layers:
            layer = cast(nn.Linear, layer)  # a ModuleList iterates as plain Modules
            x = torch.tanh(torch.addmm(state, x, layer.weight.t()))  # parameters applied to the state directly
        return x


def test_merge_branches_lets_size_only_values_cross_instead_of_merging():
    graph = chain(ZeroStateStack(), torch.randn(2, 8), passes=DEFAULT_PIPELINE)
    assert len(graph.layers) == 3
    assert_equivalent(ZeroStateStack(), torch.randn(2, 8), stages=3)


class TwoInputCells(nn.Module):
    """Each cell reads the outputs of the two cells before it, as AmoebaNet's cells do."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.cells = nn.ModuleList(nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)}) for _ in range(depth))

    def forward(self, x):
        previous, current = x, torch.tanh(x)
        for cell in self.cells:
            cell = cast(nn.ModuleDict, cell)  # a ModuleList iterates as plain Modules
            previous, current = current, torch.tanh(cell["a"](previous)) + torch.tanh(cell["b"](current))
        return current


def test_merge_branches_max_crossing_keeps_cuts_that_carry_two_tensors():
    graph = chain(TwoInputCells(), torch.randn(2, 8), passes=DEFAULT_PIPELINE)
    # two branch values cross every boundary between cells: the default sees one fork-join region
    # (only the cut right after the raw input survives)
    assert len(graph.layers) == 2
    wide = chain(TwoInputCells(), torch.randn(2, 8), passes="fuse-elementwise,merge-branches{max-crossing=2}")
    assert len(wide.layers) == 8  # each cell's two linears are cut apart too: exactly two values cross
    assert all(len(boundary.values) == 2 for boundary in wide.boundaries())
    assert_equivalent(TwoInputCells(), torch.randn(2, 8), stages=4,
                      passes="fuse-elementwise,merge-branches{max-crossing=2}")


def test_merge_branches_refuses_a_bad_max_crossing():
    with pytest.raises(PassError, match="max-crossing"):
        parse_pipeline("merge-branches{max-crossing=0}")


def test_merge_branches_is_numerically_neutral():
    assert_equivalent(ResidualStack(), torch.randn(3, 8), stages=3)
    assert_equivalent(MaskedEncoder(), (torch.randn(2, 5, 8), torch.ones(2, 5)), stages=3)


# coarsen ------------------------------------------------------------------------------------

@pytest.mark.parametrize("by", ["time", "params", "activation"])
def test_coarsen_respects_max_layers(by):
    graph = chain(MLP(depth=6), torch.randn(2, 8), passes=f"fuse-elementwise,coarsen{{max-layers=3,by={by}}}")
    assert len(graph.layers) == 3
    assert sum(layer.meta[meta.PARAM_BYTES] for layer in graph.layers) == graph.total_param_bytes()


def test_coarsen_by_params_balances_equal_layers():
    graph = chain(MLP(depth=8), torch.randn(2, 8), passes="fuse-elementwise,coarsen{max-layers=4,by=params}")
    assert {layer.meta[meta.PARAM_BYTES] for layer in graph.layers} == {2 * (8 * 8 + 8) * 4}


def test_coarsen_is_a_no_op_below_the_limit():
    graph = chain(MLP(depth=2), torch.randn(2, 8), passes="fuse-elementwise")
    assert run_pipeline(graph, "coarsen{max-layers=10}").layers == graph.layers


def test_coarsen_is_numerically_neutral():
    assert_equivalent(MLP(depth=6), torch.randn(3, 8), passes="fuse-elementwise,coarsen{max-layers=3}", stages=2)


def test_merge_branches_cuts_an_encoder_decoder_between_blocks():
    """BART: every decoder block reads the encoder output and the decoder's input ids wait
    across the encoder; these long-lived values cross block boundaries beside the hidden state
    and no longer fold the model into 3 layers, so the default plans 4 stages."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     vocab_size=100, max_position_embeddings=64, use_cache=False)
    model = transformers.BartModel(config).eval()
    ids = torch.randint(0, 100, (2, 8))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    compiled = flatpack.compile(model, inputs, stages=4)
    names = [layer["name"] for layer in compiled.chain["layers"]]
    for block in ("encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1"):
        assert any(block in name for name in names), (block, names)
    assert len(names) >= 5 and len(compiled.plan.stages) == 4
    old = flatpack.compile(model, inputs, stages=1, passes="fuse-elementwise,merge-branches{long-lived=0}")
    assert len(old.chain["layers"]) < len(names)
    assert_equivalent(model, inputs, compiled=compiled)


def test_merge_branches_long_lived_values_do_not_split_parallel_towers():
    graph = chain(Inception(), torch.randn(1, 4, 6, 6), passes="fuse-elementwise,merge-branches{long-lived=3}")
    assert len(graph.layers) == 2


def test_merge_branches_refuses_a_bad_long_lived():
    with pytest.raises(PassError, match="long-lived"):
        parse_pipeline("merge-branches{long-lived=-1}")
