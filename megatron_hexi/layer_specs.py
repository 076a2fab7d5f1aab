"""The transformer block spec of one stage: megatron-core's local layer spec, with the core
attention the plan asks for and norms that allow sequence parallelism.

Everything here takes the stage's own TransformerConfig (megatron_hexi.model.stage_config), which
gives each rank its uneven shard, so the shard logic exists once whatever the spec.

Norms. Without apex, megatron-core's local spec builds `WrappedTorchNorm`, which refuses
`sequence_parallel` although a torch LayerNorm or RMSNorm normalises each token on its own and so
gives the same result on a part of the sequence as on the whole. `SequenceParallelTorchNorm`
builds the same torch norm without that refusal. Under sequence parallelism each TP rank's norm
weights then see only its part of the sequence: their gradients are summed over the stage's TP
ranks by the gradient sync (planner.layout.gradient_segments makes every TP rank a contributor),
where megatron-core's finalize_model_grads would all-reduce them over TP. apex's FusedLayerNorm
supports sequence parallelism already and is kept where it is installed.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_hexi.attention import SDPAttention

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec


class SequenceParallelTorchNorm:
    """`WrappedTorchNorm`'s torch LayerNorm / RMSNorm, also under sequence parallelism (module
    docstring: why that is exact). Its parameters carry megatron's `sequence_parallel` mark."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma and memory-efficient norms need apex")
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r}: LayerNorm or RMSNorm")
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def local_layer_spec(normalization: str, fused_attention: bool) -> ModuleSpec:
    """megatron-core's local GPT layer spec, with `SDPAttention` as its core attention when
    `fused_attention` (else megatron-core's unfused `DotProductAttention`), and
    `SequenceParallelTorchNorm` in place of `WrappedTorchNorm`."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    if fused_attention:
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    for slot in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, slot) is WrappedTorchNorm:
            setattr(spec.submodules, slot, SequenceParallelTorchNorm)
    return spec


def stage_block_spec(
    config: TransformerConfig, fused_attention: bool
) -> TransformerBlockSubmodules:
    """The block of one stage: `config.num_layers` local layers and the final norm, the same kind
    of norm as the layers'."""
    layer = local_layer_spec(config.normalization, fused_attention)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers, layer_norm=layer.submodules.input_layernorm
    )
