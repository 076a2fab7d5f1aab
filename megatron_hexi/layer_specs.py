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

Transformer Engine (the plan's `training.transformer_impl`: transformer_engine) builds megatron-
core's TE layer spec from the same TransformerConfig: TE's linear layers divide the config's
sizes by the TP degree as megatron-core's do, so each rank holds the same uneven shard, and TE's
attention gets the plan's attention backend through `config.attention_backend` (megatron-core
turns it into TE's NVTE_*_ATTN switches); `local` attention runs megatron-core's
DotProductAttention in the TE spec. TE fuses each layer's two norms into the linear layer after
them, so their weights have other names there (`te_to_local_name`); everything else is named as
in the local spec. TE runs on CUDA only: `check_transformer_impl` says so before anything is
built.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_hexi.attention import SDPAttention
from planner.attention import keeps_scores
from planner.errors import SpecError
from planner.transformer_impl import TE_PACKAGE

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec


class SequenceParallelTorchNorm:
    """`WrappedTorchNorm`'s torch LayerNorm / RMSNorm, also under sequence parallelism (module
    docstring: why that is exact). Its parameters carry megatron's `sequence_parallel` mark."""

    # A factory: megatron-core's layer spec builds a norm by calling a class, and this one
    # returns torch's norm module itself, not an instance of this class.
    def __new__(  # type: ignore[misc]
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


def te_layer_spec(attention_backend: str) -> ModuleSpec:
    """megatron-core's Transformer Engine GPT layer spec; with `local` attention, megatron-core's
    DotProductAttention as its core attention (module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    spec = copy.deepcopy(get_gpt_layer_with_transformer_engine_spec())
    if attention_backend == "local":
        spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    return spec


def stage_block_spec(
    config: TransformerConfig, attention_backend: str, transformer_impl: str = "local"
) -> TransformerBlockSubmodules:
    """The block of one stage: `config.num_layers` layers of the plan's implementation and
    attention backend, and the final norm, the same kind of norm as the layers'."""
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        layer = te_layer_spec(attention_backend)
        return TransformerBlockSubmodules(
            layer_specs=[layer] * config.num_layers, layer_norm=TENorm
        )
    layer = local_layer_spec(config.normalization, not keeps_scores(attention_backend))
    return TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers, layer_norm=layer.submodules.input_layernorm
    )


# TE's LayerNorm + linear layers hold the norm that precedes them: (TE name part, local spec
# name part) for the parameters of that norm (`layer_norm_weight`, `layer_norm_bias`).
TE_FUSED_NORMS = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)


def te_to_local_name(name: str) -> str:
    """A stage model's parameter name as the local spec names it (planner.layout's local names):
    a norm fused into a TE linear layer gets its local norm's name; every other name, and every
    name of a local-spec model, is returned as it is."""
    for te, local in TE_FUSED_NORMS:
        if te in name:
            return name.replace(te, local)
    return name


def check_transformer_impl(transformer_impl: str, cuda: bool) -> None:
    """SpecError unless this process can build the plan's `transformer_impl`: Transformer
    Engine needs CUDA and an importable `transformer_engine`. Called before the model is built,
    so a run that cannot build it stops with one clear error."""
    if transformer_impl != "transformer_engine":
        return
    fix = "re-plan with hexi-plan ... --transformer-impl local"
    if not cuda:
        raise SpecError(
            "the plan's training.transformer_impl is transformer_engine, which runs on CUDA "
            f"only, and this run is on the CPU: {fix} to run the plan on CPU processes"
        )
    try:
        __import__(TE_PACKAGE + ".pytorch")
    except Exception as e:  # noqa: BLE001 - any failure to import it (missing, ABI) is the same
        raise SpecError(
            "the plan's training.transformer_impl is transformer_engine, but Transformer Engine "
            f"cannot be imported here ({type(e).__name__}: {e}); install it (pip install "
            f"'.[gpu]') or {fix}"
        ) from e
