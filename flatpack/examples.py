"""Built-in example models for the command line and the demo: ``factory() -> (model, inputs)``.

The HuggingFace ones build from small configs with random weights (nothing is downloaded)
and need ``pip install 'flatpack[hf]'``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from flatpack.errors import InputError


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + x)


class TinyResNet(nn.Module):
    """A small ResNet: stem, residual blocks, pooling, classifier."""

    def __init__(self, channels: int = 16, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*(ResidualBlock(channels) for _ in range(blocks)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(features, 1), 1))


def tiny_resnet() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return TinyResNet().eval(), (torch.randn(8, 3, 16, 16),)


def mlp() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 10)), (torch.randn(16, 64),)


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:   # optional dependency: HuggingFace transformers (pip install 'flatpack[hf]')
        import transformers
    except ImportError:
        raise InputError("this example needs HuggingFace transformers, the [hf] extra: pip install -e '.[hf]' "
                         "in a clone of flatpack (pip install 'flatpack[hf]' from a package index)") from None
    transformers.logging.set_verbosity_error()
    return transformers


def bert() -> tuple[nn.Module, dict]:
    """BertForMaskedLM, 4 layers of width 64, random weights."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=64)
    model = tf.BertForMaskedLM(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    return model, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def gpt2() -> tuple[nn.Module, dict]:
    """GPT2LMHeadModel, 4 layers of width 64, keyword input_ids, random weights."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=64, use_cache=False)
    model = tf.GPT2LMHeadModel(config).eval()
    return model, {"input_ids": torch.randint(0, config.vocab_size, (2, 16))}


def llama() -> tuple[nn.Module, dict]:
    """LlamaForCausalLM: RoPE under torch.no_grad(), grouped-query attention."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            use_cache=False)
    return tf.LlamaForCausalLM(config).eval(), {"input_ids": torch.randint(0, config.vocab_size, (2, 16))}


def vit() -> tuple[nn.Module, dict]:
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=4,
                          num_attention_heads=4, intermediate_size=128, num_labels=10)
    return tf.ViTForImageClassification(config).eval(), {"pixel_values": torch.randn(2, 3, 32, 32)}


def hf_resnet() -> tuple[nn.Module, dict]:
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 64],
                             depths=[1, 1, 1, 1], layer_type="basic", num_labels=10)
    return tf.ResNetForImageClassification(config).eval(), {"pixel_values": torch.randn(2, 3, 32, 32)}


EXAMPLES: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "tiny-resnet": tiny_resnet,
    "mlp": mlp,
    "bert": bert,
    "hf-gpt2": gpt2,      # the zoo's "gpt2" is GPT-2 at tiny or full (124M) size, called positionally
    "llama": llama,
    "vit": vit,
    "hf-resnet": hf_resnet,
}
