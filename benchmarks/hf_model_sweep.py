"""Which HuggingFace architectures compile and stay exact: a sweep over small random configs.

For each model: the frontend, the layer count after the default passes, a 3-stage compile
(or fewer when the chain is shorter), its wall time, and flatpack.verify.check_equivalence
on outputs and every input and parameter gradient. Run: python benchmarks/hf_model_sweep.py [NAME ...]
"""
import os
import sys
import time
from typing import Any, TypeVar

os.environ["HF_HUB_OFFLINE"] = "1"
import torch
import transformers as tf

import flatpack
from flatpack.verify import check_equivalence

tf.logging.set_verbosity_error()
torch.manual_seed(0)
ids = torch.randint(0, 100, (2, 12))
mask = torch.ones_like(ids)
img = torch.randn(2, 3, 32, 32)
TEXT = {"input_ids": ids, "attention_mask": mask}
SMALL: dict[str, Any] = {"vocab_size": 100, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 64,
                         "max_position_embeddings": 64}
DECODER: dict[str, Any] = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "use_cache": False}
ConfigT = TypeVar("ConfigT", bound=tf.PretrainedConfig)


def with_labels(config: ConfigT, labels: int = 5) -> ConfigT:
    """``config`` for ``labels`` classes. The vision configs take ``num_labels=`` at runtime
    without declaring it, so it is set as the attribute it becomes (the same config)."""
    config.num_labels = labels
    return config


cases = {
 "distilbert": lambda: (tf.DistilBertForMaskedLM(tf.DistilBertConfig(
     vocab_size=100, dim=32, n_layers=3, n_heads=2, hidden_dim=64, max_position_embeddings=64)), TEXT),
 "roberta": lambda: (tf.RobertaForMaskedLM(tf.RobertaConfig(hidden_size=32, **SMALL)), TEXT),
 "albert(shared layers)": lambda: (tf.AlbertForMaskedLM(tf.AlbertConfig(embedding_size=16, hidden_size=32, **SMALL)),
                                   {"input_ids": ids}),
 "electra": lambda: (tf.ElectraForSequenceClassification(tf.ElectraConfig(embedding_size=16, hidden_size=32,
                                                                          **SMALL)), {"input_ids": ids}),
 "mistral": lambda: (tf.MistralForCausalLM(tf.MistralConfig(**DECODER)), {"input_ids": ids}),
 "qwen2": lambda: (tf.Qwen2ForCausalLM(tf.Qwen2Config(**DECODER)), {"input_ids": ids}),
 "bart": lambda: (tf.BartForConditionalGeneration(tf.BartConfig(
     vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False)),
     {"input_ids": ids, "decoder_input_ids": ids}),
 "t5": lambda: (tf.T5ForConditionalGeneration(tf.T5Config(
     vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, use_cache=False)),
     {"input_ids": ids, "decoder_input_ids": ids}),
 "convnext": lambda: (tf.ConvNextForImageClassification(with_labels(tf.ConvNextConfig(
     num_channels=3, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1]))), {"pixel_values": img}),
 "swin": lambda: (tf.SwinForImageClassification(with_labels(tf.SwinConfig(
     image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4))),
     {"pixel_values": img}),
 "mobilenet_v2": lambda: (tf.MobileNetV2ForImageClassification(with_labels(tf.MobileNetV2Config(
     image_size=32, depth_multiplier=0.25))), {"pixel_values": img}),
 "regnet": lambda: (tf.RegNetForImageClassification(with_labels(tf.RegNetConfig(
     embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], groups_width=8))),
     {"pixel_values": img}),
}
names = sys.argv[1:] or list(cases)
print("model | frontend | layers (default passes) | stages | result | compile s")
print("--- | --- | --- | --- | --- | ---")
for name in names:
    try:
        model, inputs = cases[name]()
        model.eval()
        t = time.perf_counter()
        probe = flatpack.compile(model, inputs, stages=1)
        assert probe.graph is not None, "a model compiled in this process keeps its layer graph"
        layers = len(probe.graph.layers)
        c = flatpack.compile(model, inputs, stages=min(3, layers))
        dt = time.perf_counter() - t
        check_equivalence(model, c.as_module(), inputs).assert_close()
        print(f"{name} | {c.frontend} | {layers} | {len(c.plan.stages)} | equivalent | {dt:.1f}", flush=True)
    except Exception as e:
        print(f"{name} | - | - | - | FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]} | -", flush=True)
