"""Tracing frontends: fx first, export as the fallback, a TraceError that says what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flatpack
from flatpack.errors import TraceError
from flatpack.ir.trace import trace
from tests.helpers import assert_equivalent
from tests.models import MLP, Outer
from tests.unit.narrowing import graph_of


def test_plain_model_uses_fx_and_inlines_every_module():
    traced = trace(MLP(), (torch.randn(2, 8),))
    assert traced.frontend == "fx"
    assert not [n for n in traced.gm.graph.nodes if n.op == "call_module"]
    assert {n.target for n in traced.gm.graph.nodes if n.op == "get_attr"} == {
        f"layers.{i}.{kind}" for i in range(4) for kind in ("weight", "bias")}


class TupleInput(nn.Module):
    """A nested input fx cannot take as a placeholder: export handles it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, pair, scale: float = 1.0):
        left, right = pair
        return {"sum": self.a(left) * scale + self.b(right), "left": left}


def test_nested_inputs_and_outputs_go_through_export():
    model = TupleInput()
    inputs = ((torch.randn(2, 4), torch.randn(2, 4)), 3.0)
    compiled = flatpack.compile(model, inputs, stages=2, passes="fuse-elementwise")
    assert compiled.frontend == "export"
    assert any("fx skipped" in note for note in compiled.info.trace_notes)
    assert_equivalent(model, inputs, compiled=compiled)


def test_batchnorm_traces_with_fx_in_both_modes():
    for training in (False, True):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train(training)
        assert trace(model, (torch.randn(2, 3, 6, 6),)).frontend == "fx"


def test_untraceable_model_raises_trace_error_naming_module_and_fix():
    with pytest.raises(TraceError) as info:
        flatpack.compile(Outer(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "router" in message and "DataDependent" in message
    assert "data-dependent control flow" in message
    assert "torch.cond" in message


def test_inplace_ops_keep_their_semantics_across_cuts():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)

        def forward(self, x):
            h = self.a(x)
            skip = h * 1.0
            h.mul_(2).add_(skip)
            h = torch.relu_(self.b(h))
            return h + skip

    model = InPlace()
    for stages in (1, 2, 3):
        assert_equivalent(model, torch.randn(3, 6), stages=stages, passes="")


def test_tracing_leaves_the_model_as_it_was():
    """fx stores tensor constants on the traced module; a second trace then renamed them
    (`_tensor_constant1`), and the chain differed between two compiles (BUGS.md)."""
    class WithConstant(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * torch.tensor([1.0, 2.0])

    model = WithConstant()
    attributes = set(vars(model))
    first = flatpack.compile(model, (torch.randn(1, 2),), stages=1)
    assert set(vars(model)) == attributes
    second = flatpack.compile(model, (torch.randn(1, 2),), stages=1)
    assert first.chain == second.chain
    x = torch.randn(3, 2)
    torch.testing.assert_close(second.as_module()(x), model(x))


# --- shapes: dynamic sequence length, batch 1, the input check -----------------------------------


def test_an_hf_encoder_compiled_at_one_sequence_length_runs_at_others():
    """torch.export marks the token inputs' dim 1 dynamic: BERT compiled at 16 tokens runs at 8 and 32."""
    pytest.importorskip("transformers")
    from transformers import PretrainedConfig

    from flatpack.examples import bert

    model, inputs = bert()
    config = model.config
    assert isinstance(config, PretrainedConfig)
    vocab_size = config.vocab_size
    assert inputs["input_ids"].shape[1] == 16
    compiled = flatpack.compile(model, inputs, stages=3)
    assert compiled.frontend == "export"
    assert compiled.info.input_specs is not None
    assert all(spec.free_dims == (0, 1) for spec in compiled.info.input_specs)
    staged = compiled.as_module()
    for length in (8, 16, 32):
        ids = torch.randint(0, vocab_size, (3, length))
        mask = torch.ones_like(ids)
        mask[:, -2:] = 0
        torch.testing.assert_close(staged(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits)


class PositionTable(nn.Module):
    """Adds a learned table of 16 positions: the sequence length is fixed by the model itself.
    The dict input sends it through torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.positions = nn.Parameter(torch.randn(16, 8))
        self.out = nn.Linear(8, 4)

    def forward(self, batch):
        return self.out(self.embed(batch["ids"]) + self.positions)


def test_a_fixed_dimension_is_an_input_error_naming_the_input_shape_and_fix():
    from flatpack.errors import InputError

    model = PositionTable()
    compiled = flatpack.compile(model, ({"ids": torch.randint(0, 50, (2, 16))},), stages=2)
    assert compiled.frontend == "export" and compiled.info.input_specs is not None
    assert compiled.info.input_specs[0].free_dims == (0,)
    staged = compiled.as_module()
    ids = torch.randint(0, 50, (5, 16))
    torch.testing.assert_close(staged({"ids": ids}), model({"ids": ids}))
    with pytest.raises(InputError, match=r"input 'batch_ids' has shape \(5, 8\).*compiled for \(2, 16\).*"
                                         r"dim 1 must be 16, got 8.*recompile"):
        staged({"ids": torch.randint(0, 50, (5, 8))})
    with pytest.raises(InputError, match=r"input 'batch_ids' has dtype int32.*compiled for int64"):
        staged({"ids": ids.int()})


def test_an_example_of_batch_one_keeps_the_batch_dynamic():
    model = PositionTable()
    compiled = flatpack.compile(model, ({"ids": torch.randint(0, 50, (1, 16))},), stages=2)
    assert graph_of(compiled).traced.dynamic_batch
    assert any("repeated to batch 2" in note for note in compiled.info.trace_notes)
    ids = torch.randint(0, 50, (4, 16))
    torch.testing.assert_close(compiled.as_module()({"ids": ids}), model({"ids": ids}))


def _default_bart():
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                     vocab_size=50, max_position_embeddings=32)
    assert config.use_cache     # the default config, which returns a Cache object
    return transformers.BartModel(config).eval()


def test_a_model_whose_config_turns_the_cache_on_compiles_with_the_cache_off():
    model = _default_bart()
    ids = torch.randint(0, 50, (2, 8))
    compiled = flatpack.compile(model, {"input_ids": ids}, stages=2)
    assert len(compiled.plan.stages) == 2
    assert any("traced with use_cache=False" in note for note in compiled.info.trace_notes)
    staged = compiled.as_module()(input_ids=ids)       # called as the example was, without use_cache
    expected = model(input_ids=ids, use_cache=False)
    assert set(staged.keys()) == set(expected.keys())
    torch.testing.assert_close(staged.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(staged.last_hidden_state, model(input_ids=ids).last_hidden_state)
    torch.testing.assert_close(staged.encoder_last_hidden_state, expected.encoder_last_hidden_state)


def test_a_model_asked_for_its_cache_is_told_to_turn_it_off():
    model = _default_bart()
    ids = torch.randint(0, 50, (2, 8))
    with pytest.raises(TraceError, match="Cache object.*use_cache=False"):
        trace(model, (), {"input_ids": ids, "use_cache": True})
    assert trace(model, (), {"input_ids": ids, "use_cache": False}).frontend == "export"


class _CountingExport:
    """Wraps torch.export.export, recording each call's dynamic_shapes; ``refuse_sequence``
    makes an attempt that marks a sequence dimension fail, as a model that cannot take one would."""

    def __init__(self, refuse_sequence: bool = False) -> None:
        self.calls: list[object] = []
        self.refuse_sequence = refuse_sequence
        self.export = torch.export.export

    def __call__(self, *args, **kwargs):
        shapes = kwargs.get("dynamic_shapes")
        self.calls.append(shapes)
        if self.refuse_sequence and shapes is not None and "1:" in str(shapes).replace(" ", ""):
            raise RuntimeError("the sequence dimension cannot be dynamic here")
        return self.export(*args, **kwargs)


def test_a_batch_one_example_is_exported_once_per_mode(monkeypatch):
    """Issue 42: a batch-1 example is exported repeated to batch 2 first, not at batch 1 and then
    again at batch 2; the trace in the other mode takes the same route: two exports in all."""
    counting = _CountingExport()
    monkeypatch.setattr(torch.export, "export", counting)
    traced = trace(PositionTable(), ({"ids": torch.randint(0, 50, (1, 16))},))
    assert len(counting.calls) == 2
    assert traced.dynamic_batch and traced.export_route is not None and traced.export_route.doubled


def test_the_other_mode_starts_at_the_export_attempt_that_succeeded(monkeypatch):
    """A model that refuses a dynamic sequence: the first mode tries batch-and-sequence, then the
    batch alone; the second mode starts at the batch alone (3 exports, not 4), and the compiled
    model still equals the original."""
    counting = _CountingExport(refuse_sequence=True)
    monkeypatch.setattr(torch.export, "export", counting)
    model = PositionTable()
    example = ({"ids": torch.randint(0, 50, (2, 16))},)
    traced = trace(model, example)
    assert len(counting.calls) == 3, counting.calls
    assert traced.export_route is not None and traced.export_route.attempt == 1
    assert any("dynamic batch and sequence dimensions refused" in note for note in traced.notes)
    compiled = flatpack.compile(model, example, stages=2)
    ids = torch.randint(0, 50, (3, 16))
    torch.testing.assert_close(compiled.as_module()({"ids": ids}), model({"ids": ids}))
