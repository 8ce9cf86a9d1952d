"""HuggingFace transformers 5 models (fx cannot trace them; torch.export can) cut into ≥3 stages."""

from __future__ import annotations

import pytest
import torch

import flatpack
from flatpack.examples import bert, gpt2, hf_resnet, llama, vit
from tests.helpers import assert_equivalent

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("factory", [bert, gpt2, vit, hf_resnet, llama], ids=["bert", "gpt2", "vit", "resnet", "llama"])
def test_hf_model_three_stages_equivalent(factory):
    model, inputs = factory()
    compiled = flatpack.compile(model, inputs, stages=3)
    assert compiled.frontend == "export"
    assert len(compiled.plan.stages) == 3
    assert_equivalent(model, inputs, compiled=compiled)


def test_bert_mask_crosses_boundaries_without_collapsing_the_encoder():
    import transformers

    model, inputs = bert()
    assert isinstance(model.config, transformers.BertConfig)
    compiled = flatpack.compile(model, inputs, stages=1)
    layers = compiled.chain["layers"]
    # embeddings + (attention, feed-forward) per encoder layer + head: the mask did not merge them
    assert len(layers) >= 2 * model.config.num_hidden_layers
    # boundaries after each encoder layer's attention and feed-forward up to the last attention
    # (found by name: the embeddings are 2 or 3 layers, as the sequence dimension is static or not)
    encoder_boundaries = [layer["boundary"] for layer in layers if ".encoder.layer." in layer["name"]][:-2]
    for boundary in encoder_boundaries:
        dependent = [v for v in boundary["values"] if v["param_dependent"]]
        assert len(dependent) == 1, boundary
        assert any(v["kind"] == "tensor" and v["dtype"] == "bool" for v in boundary["values"]), \
            "the attention mask should ride along as an extra boundary tensor"


def test_bert_other_batch_size_runs_through_the_stages():
    import transformers

    model, inputs = bert()
    assert isinstance(model.config, transformers.BertConfig)
    staged = flatpack.compile(model, inputs, stages=3).as_module()
    ids = torch.randint(0, model.config.vocab_size, (5, 16))
    mask = torch.ones_like(ids)
    mask[:, -3:] = 0
    torch.testing.assert_close(staged(input_ids=ids, attention_mask=mask).logits,
                               model(input_ids=ids, attention_mask=mask).logits)


def test_gpt2_tied_lm_head_is_shared_and_its_gradient_sums(tmp_path):
    model, inputs = gpt2()
    compiled = flatpack.compile(model, inputs, stages=3, out_dir=tmp_path / "out")
    holders = [a.index for a in compiled.artifacts
               if any(set(p.aliases) >= {"transformer.wte.weight", "lm_head.weight"}
                      for p in a.manifest.parameters)]
    assert holders == [0, 2], "the tied embedding is replicated into the first and last stage"
    first = next(p for p in compiled.artifacts[0].manifest.parameters if "lm_head.weight" in p.aliases)
    assert first.shared_with == (2,)
    assert_equivalent(model, inputs, staged=flatpack.load(tmp_path / "out").as_module())


@pytest.mark.parametrize("factory", [bert, gpt2], ids=["bert", "gpt2"])
def test_hf_models_profile_with_their_masks_and_exact_activation_bytes(factory, tmp_path):
    """Export-traced graphs with keyword inputs (ids, mask) are resized per batch size, and
    the per-layer saved bytes add up to what autograd keeps for the whole model."""
    from flatpack.ir.profile import stage_saved_bytes
    from flatpack.measure import saved_tensors
    from flatpack.profiler import ProfileOptions

    model, inputs = factory()
    model.train()
    compiled = flatpack.compile(model, inputs, stages=1, profile=ProfileOptions(
        batch_sizes=(1, 2), repeats=1, warmup=0, cache_dir=str(tmp_path), progress=False))
    batch = next(iter(inputs.values())).shape[0]
    with saved_tensors(exclude=[*model.parameters(), *model.buffers()]) as saved:
        torch.manual_seed(0)
        model(**inputs)
    whole = sum(saved.values())
    assert compiled.profile is not None  # compiled with profile=...
    estimated = stage_saved_bytes(compiled.profile.layers, batch)
    # BERT's position ids are sliced from a buffer to the (dynamic) sequence length in one layer
    # and read by the next: in the model they are a view of the buffer, which is not an
    # activation; in the stages they are a tensor of their own that the embedding keeps
    position_ids = inputs["input_ids"].shape[1] * 8 if factory is bert else 0
    # dropout masks differ run to run only in values, not in size: the two must agree exactly
    assert estimated == pytest.approx(whole + position_ids, rel=1e-6)
    assert compiled.profile.input_bytes.at(batch) == pytest.approx(
        sum(t.numel() * t.element_size() for t in inputs.values()))


def test_encoder_decoder_keeps_its_decoder_layers_with_max_crossing_two():
    """The encoder output is read by every decoder layer's cross-attention, so two branch
    values cross each decoder boundary. The default counts the encoder output as a long-lived
    value at block boundaries and keeps a cut between every two blocks (without that rule,
    ``long-lived=0``, BART folds into 3 layers); merge-branches{max-crossing=2} keeps the cuts
    inside the blocks too and ships both tensors."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False)
    model = transformers.BartForConditionalGeneration(config).eval()
    ids = torch.randint(0, 100, (2, 8))
    inputs = {"input_ids": ids, "decoder_input_ids": ids}
    default = flatpack.compile(model, inputs, stages=4)
    folded = flatpack.compile(model, inputs, stages=1, passes="fuse-elementwise,merge-branches{long-lived=0}")
    wide = flatpack.compile(model, inputs, stages=4, passes="fuse-elementwise,merge-branches{max-crossing=2}")
    assert folded.plan.num_layers == 3
    assert config.encoder_layers is not None and config.decoder_layers is not None
    assert default.plan.num_layers >= config.encoder_layers + config.decoder_layers + 1
    assert wide.plan.num_layers > default.plan.num_layers
    assert_equivalent(model, inputs, compiled=default)
    assert_equivalent(model, inputs, compiled=wide)
