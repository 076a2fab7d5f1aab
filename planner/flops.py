"""FLOP formulas of a transformer layer, the LM head and a training sample.

The one place they are written: the cost model times compute with them, a measured profile
weighs a rank's share of a layer with them, and the runtime reports MFU with them. Pure
Python, no planner imports: any module may use it.

Notation (Megatron's): b micro-batch size, s sequence length, h hidden size, a attention heads,
g query groups, d head size (kv_channels), f FFN hidden size, V vocabulary, L layers. A
multiply-add counts as 2 FLOPs. `m` is any object with the ModelSpec fields used (seq_length,
hidden_size, num_attention_heads, num_query_groups, head_dim, ffn_hidden_size, swiglu,
vocab_size, num_layers): `LayerShape` for a layer's formulas, `ModelShape` for the whole model's.
"""

from __future__ import annotations

from typing import Protocol


class LayerShape(Protocol):
    """The sizes the FLOP formulas of one layer read (a ModelSpec has them)."""

    @property
    def seq_length(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_query_groups(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_hidden_size(self) -> int: ...
    @property
    def swiglu(self) -> bool: ...


class ModelShape(LayerShape, Protocol):
    """A LayerShape with the vocabulary and the layer count: a whole model's formulas."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...


def attention_flops(m: LayerShape, b: int) -> int:
    """Forward FLOPs of one layer's attention block, whole (unsharded), for a micro-batch of b.

    QKV: 2*b*s*h*(a*d + 2*g*d) (q is h x a*d, k and v are h x g*d each); scores Q.K^T and context
    P.V: 2*b*s^2*a*d each, causal mask NOT halved (Megatron's MFU convention); output projection
    2*b*s*a*d*h.
    """
    s, h, a = m.seq_length, m.hidden_size, m.num_attention_heads
    g, d = m.num_query_groups, m.head_dim
    qkv = 2 * b * s * h * (a * d + 2 * g * d)
    scores_and_context = 2 * (2 * b * s * s * a * d)
    proj = 2 * b * s * a * d * h
    return qkv + scores_and_context + proj


def mlp_flops(m: LayerShape, b: int) -> int:
    """Forward FLOPs of one layer's MLP: SwiGLU has 3 matmuls of h x f (2*b*s*h*f each), else 2."""
    n_mat = 3 if m.swiglu else 2
    return n_mat * 2 * b * m.seq_length * m.hidden_size * m.ffn_hidden_size


def layer_flops(m: LayerShape, b: int) -> int:
    """Forward FLOPs of one transformer layer (attention + MLP)."""
    return attention_flops(m, b) + mlp_flops(m, b)


def attention_fraction(m: LayerShape) -> float:
    """Attention's part of a layer's FLOPs: weighs a rank's query groups against its FFN columns
    when one measured layer time is shared out by shard (planner.profiles)."""
    att = attention_flops(m, 1)
    return att / (att + mlp_flops(m, 1))


def head_flops(m: ModelShape, b: int) -> int:
    """Forward FLOPs of the output layer (LM head): 2*b*s*h*V, on the last stage only."""
    return 2 * b * m.seq_length * m.hidden_size * m.vocab_size


def model_flops_per_sample(m: ModelShape) -> int:
    """Training FLOPs of one sample without recompute: 3 x forward (backward = 2 x forward)."""
    return 3 * (m.num_layers * layer_flops(m, 1) + head_flops(m, 1))
