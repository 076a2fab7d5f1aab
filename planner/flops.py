"""Model FLOPs of a Llama-style decoder, counted the way Megatron-LM counts them for MFU.

Matmul FLOPs only (2 per multiply-add); attention scores over the full sequence (causal masking
not halved); backward = 2 x forward; recompute is not model work and is not counted.
"""


def layer_forward_flops_per_token(m):
    """One transformer layer, forward, per token: QKV (GQA), scores, context, proj, MLP."""
    d = m.head_dim
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    qkv = 2 * m.hidden_size * (q + 2 * kv)
    scores = 2 * m.seq_length * q
    context = 2 * m.seq_length * q
    proj = 2 * q * m.hidden_size
    mlp = 2 * m.hidden_size * m.ffn_hidden_size * (3 if m.swiglu else 2)
    return qkv + scores + context + proj + mlp


def head_forward_flops_per_token(m):
    """The output layer (LM head), forward, per token."""
    return 2 * m.hidden_size * m.vocab_size


def model_flops_per_token(m):
    """Forward and backward of the whole model, per token (3 x forward)."""
    return 3 * (m.num_layers * layer_forward_flops_per_token(m) + head_forward_flops_per_token(m))


def iteration_model_flops(m, global_batch_size):
    return model_flops_per_token(m) * global_batch_size * m.seq_length
