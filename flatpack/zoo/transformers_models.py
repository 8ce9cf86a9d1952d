"""BERT-Large and GPT-2 from HuggingFace configs: random weights, nothing downloaded.

transformers is imported inside the builders so ``import flatpack.zoo`` stays light.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from flatpack.errors import InputError

# FuncPipe trains BERT-Large with masked LM on WikiText-2; 128 tokens is BERT's usual
# pre-training length and gives activations close to FuncPipe's 263 MB per sample.
BERT_FULL_TOKENS = 128
GPT2_FULL_TOKENS = 1024  # GPT-2's context length


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:   # optional dependency: HuggingFace transformers (pip install 'flatpack[hf]')
        import transformers
    except ImportError:
        raise InputError("this zoo model needs HuggingFace transformers: "
                         "pip install 'flatpack[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def bert_large(size: str = "tiny", batch: int = 1) -> tuple[nn.Module, tuple]:
    """BertModel: 24 layers, 1024 wide, 16 heads (tiny: 2 layers, 32 wide, 2 heads, 8 tokens)."""
    tf = _transformers()
    if size == "full":
        config = tf.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                               intermediate_size=4096)
        tokens = BERT_FULL_TOKENS
    else:
        config = tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=64)
        tokens = 8
    return tf.BertModel(config).eval(), (torch.randint(0, config.vocab_size, (batch, tokens)),)


def gpt2(size: str = "tiny", batch: int = 1) -> tuple[nn.Module, tuple]:
    """GPT2LMHeadModel, the 124M default config (tiny: 2 layers, 32 wide, 2 heads, 8 tokens)."""
    tf = _transformers()
    if size == "full":
        config = tf.GPT2Config(use_cache=False)
        tokens = GPT2_FULL_TOKENS
    else:
        config = tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                               use_cache=False)
        tokens = 8
    return tf.GPT2LMHeadModel(config).eval(), (torch.randint(0, config.vocab_size, (batch, tokens)),)
