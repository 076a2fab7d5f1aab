"""Tiny random Llama checkpoints in Hugging Face's format, and the converter
(tools/convert_hf_llama.py) loaded as a module: what the conversion and integrity tests share."""

import importlib.util

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import REPO

# hidden, heads, key/value groups, head_dim (None: hidden/heads), the TP=2 stage's shards
SIZES = {
    "gqa": (64, 4, 2, None, {"ffn": [100, 60], "vocab": [90, 38]}),
    "head_dim": (72, 6, 3, 16, {"query_groups": [2, 1], "ffn": [100, 60], "vocab": [90, 38]}),
}


def converter():
    spec = importlib.util.spec_from_file_location(
        "convert_hf_llama", REPO / "tools" / "convert_hf_llama.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_llama(directory, tie=False, layers=4, sizes="gqa"):
    hidden, heads, groups, head_dim, _ = SIZES[sizes]
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        max_position_embeddings=64,
        attn_implementation="eager",
        initializer_range=0.25,
    )  # large enough for sharp attention patterns
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones would hide a mix-up of the norms
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(directory)
    return model
