"""Hugging Face tensor names <-> this project's canonical (one-device megatron-core) tensors.

Mapping (megatron-core names on the left, per layer i; no weight permutation is needed: with
rotary_interleaved=False megatron-core rotates halves exactly like HF's rotate_half):
    embedding.word_embeddings.weight             model.embed_tokens.weight
    decoder.layers.i.input_layernorm.weight      model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv   q_proj, k_proj, v_proj interleaved per query
        .weight (and .bias, Qwen2)               group g: [q heads of g; k_g; v_g] (GQA)
    decoder.layers.i.self_attention.linear_proj  o_proj
    decoder.layers.i.pre_mlp_layernorm.weight    post_attention_layernorm
    decoder.layers.i.mlp.linear_fc1.weight       [gate_proj; up_proj] (SwiGLU: silu(gate) x up)
    decoder.layers.i.mlp.linear_fc2.weight       down_proj
    decoder.final_layernorm.weight               model.norm.weight
    output_layer.weight                          lm_head.weight (absent when tied)
Tensors keep their dtype, so HF -> ours -> HF gives identical tensors.
"""

from __future__ import annotations

import torch

from planner.errors import SpecError
from planner.models import ModelSpec

_QKV = ("q_proj", "k_proj", "v_proj")


def _shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Each HF tensor's shape, by its name (per-layer names without the layer prefix)."""
    d, groups = model.head_dim, model.num_query_groups
    hidden, ffn, heads = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (model.vocab_size, hidden),
        "lm_head.weight": (model.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * d, hidden),
        "self_attn.k_proj.weight": (groups * d, hidden),
        "self_attn.v_proj.weight": (groups * d, hidden),
        "self_attn.o_proj.weight": (hidden, heads * d),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    for proj in _QKV:
        shapes[f"self_attn.{proj}.bias"] = shapes[f"self_attn.{proj}.weight"][:1]
    return shapes


def _interleave(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelSpec
) -> torch.Tensor:
    """[q heads of g; k_g; v_g] per query group g, along the first dimension."""
    d, hpg, groups = model.head_dim, model.heads_per_group, model.num_query_groups
    rest = q.shape[1:]
    parts = (q.view(groups, hpg * d, *rest), k.view(groups, d, *rest), v.view(groups, d, *rest))
    return torch.cat(parts, 1).reshape(-1, *rest)


def _split(qkv: torch.Tensor, model: ModelSpec) -> list[torch.Tensor]:
    """q, k and v of a per-group interleaved tensor (the inverse of `_interleave`)."""
    d, hpg, groups = model.head_dim, model.heads_per_group, model.num_query_groups
    rest = qkv.shape[1:]
    g = qkv.view(groups, (hpg + 2) * d, *rest)
    cuts = (g[:, : hpg * d], g[:, hpg * d : (hpg + 1) * d], g[:, (hpg + 1) * d :])
    return [c.reshape(-1, *rest).contiguous() for c in cuts]


def hf_to_canonical(hf: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """{canonical name: tensor} from {HF name: tensor}. Every HF tensor must be used."""
    shapes = _shapes(model)
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise SpecError(f"HF checkpoint: missing tensor {name}")
        shape = shapes[name.split(".", 3)[-1] if name.startswith("model.layers.") else name]
        if tuple(hf[name].shape) != shape:
            raise SpecError(
                f"HF checkpoint: {name} has shape {tuple(hf[name].shape)}, config.json "
                f"gives {shape}"
            )
        used.add(name)
        return hf[name]

    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
    for i in range(model.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mp + "input_layernorm.weight"] = take(hp + "input_layernorm.weight")
        q, k, v = (take(f"{hp}self_attn.{p}.weight") for p in _QKV)
        out[mp + "self_attention.linear_qkv.weight"] = _interleave(q, k, v, model)
        if model.qkv_bias:
            qb, kb, vb = (take(f"{hp}self_attn.{p}.bias") for p in _QKV)
            out[mp + "self_attention.linear_qkv.bias"] = _interleave(qb, kb, vb, model)
        out[mp + "self_attention.linear_proj.weight"] = take(hp + "self_attn.o_proj.weight")
        out[mp + "pre_mlp_layernorm.weight"] = take(hp + "post_attention_layernorm.weight")
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")], 0
        )
        out[mp + "mlp.linear_fc2.weight"] = take(hp + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if model.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in hf:
        if not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise SpecError(
                "HF checkpoint: tie_word_embeddings is true but lm_head.weight differs "
                "from model.embed_tokens.weight"
            )
        used.add("lm_head.weight")
    unused = sorted(n for n in set(hf) - used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise SpecError(
            f"HF checkpoint: tensors this converter does not map: {unused[:8]}"
            f"{' ...' if len(unused) > 8 else ''}"
        )
    return out


def canonical_to_hf(canon: dict[str, torch.Tensor], model: ModelSpec) -> dict[str, torch.Tensor]:
    """{HF name: tensor} from {canonical name: tensor}."""
    out = {"model.embed_tokens.weight": canon["embedding.word_embeddings.weight"]}
    for i in range(model.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[hp + "input_layernorm.weight"] = canon[mp + "input_layernorm.weight"]
        qkv = _split(canon[mp + "self_attention.linear_qkv.weight"], model)
        for proj, t in zip(_QKV, qkv):
            out[f"{hp}self_attn.{proj}.weight"] = t
        if model.qkv_bias:
            for proj, t in zip(_QKV, _split(canon[mp + "self_attention.linear_qkv.bias"], model)):
                out[f"{hp}self_attn.{proj}.bias"] = t
        out[hp + "self_attn.o_proj.weight"] = canon[mp + "self_attention.linear_proj.weight"]
        out[hp + "post_attention_layernorm.weight"] = canon[mp + "pre_mlp_layernorm.weight"]
        gate, up = canon[mp + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[hp + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hp + "mlp.up_proj.weight"] = up.contiguous()
        out[hp + "mlp.down_proj.weight"] = canon[mp + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = canon["decoder.final_layernorm.weight"]
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = canon["output_layer.weight"]
    return out
