"""Core attention through `torch.nn.functional.scaled_dot_product_attention`, for megatron-core's
local layer spec.

megatron-core's `DotProductAttention` computes attention unfused: every layer keeps its
`[b, heads, s, s]` scores, softmax and dropout output for the backward (the `5as/h` activation
term of Korthikanti et al. 2022). `SDPAttention` takes the same constructor and forward
arguments and calls torch's fused attention instead: the flash or memory-efficient kernel on
CUDA, the fused (flash) CPU kernel on CPU, none of which keeps an `s x s` tensor. It is plugged
into the spec's `core_attention` slot (megatron_hexi.layer_specs), so the per-rank uneven shards
are the same as with the unfused module: this rank's heads and query groups come from its own
TransformerConfig (megatron_hexi.model), divided by the stage's TP degree.

Attention dropout draws from megatron's model-parallel RNG tracker, as `DotProductAttention`
does, so the same seed and plan give the same run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig


class SDPAttention(MegatronModule):
    """`DotProductAttention`'s interface on `scaled_dot_product_attention` (GQA, causal or
    explicit mask, dropout, any float dtype)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism is not supported by SDPAttention")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type {config.softmax_type!r} needs the unfused attention")
        tp = pg_collection.tp.size() if pg_collection is not None else 1
        self.attn_mask_type = attn_mask_type
        self.heads = config.num_attention_heads // tp  # this rank's
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """query [sq, b, heads, d], key and value [sk, b, groups, d] -> context [sq, b, heads x d].
        A given `attention_mask` is megatron's (True: masked out); without one the module's mask
        type decides (causal or none)."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention takes neither packed sequences nor attention bias")
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        if self.heads != self.groups:  # GQA: each query group serves heads / groups heads
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        mask = None if attention_mask is None else ~attention_mask
        dropout = self.dropout if self.training else 0.0
        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(
                    q, k, v, mask, dropout, is_causal=causal, scale=self.softmax_scale
                )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, mask, dropout, is_causal=causal, scale=self.softmax_scale
            )
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
