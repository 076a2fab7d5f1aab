"""Build this rank's pipeline stage as a megatron-core GPTModel with its own uneven shards.

Each rank gets its own TransformerConfig whose "full" sizes are the rank's shard times the stage's
TP degree: num_attention_heads = local heads x TP, num_query_groups = local groups x TP,
ffn_hidden_size = local FFN x TP, and the vocabulary likewise. megatron-core divides them by TP
again, so every layer allocates exactly this rank's shard, while the TP collectives (all-reduce of
[s, b, h] activations, or under sequence parallelism reduce-scatter and all-gather of even
sequence parts) are unchanged because they do not depend on shard sizes. Heads stay whole
query groups, and kv_channels is the model's real head size. The only fix-up after construction is
the embedding's vocabulary range (megatron-core assumes rank x per-partition size).

Initial weights are defined block by block, so that a rank draws only its shards, yet every plan
starts from the same model. Each canonical tensor is cut along the one dimension the layout ever
splits it along (rows of embedding, output layer, QKV and FC1; columns of linear_proj and FC2) into
blocks of INIT_BLOCK, and block k of the model is drawn from its own generator seeded from
(seed, k). Blocks along a fixed dimension suffice because no parameter is cut along two: a piece
costs its own elements plus at most a partial block at each end. Norm weights and biases need no
generator. Start-up thus costs a shard, not the full tensors (a 128k-vocabulary embedding is
2.1 GB in fp32, on every rank of a node).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from megatron_hexi.cuda_graphs import config_fields, rng_tracker_options, set_megatron_globals
from megatron_hexi.fusions import Fusions
from megatron_hexi.layer_specs import stage_block_spec, te_to_local_name
from megatron_hexi.process_groups import SingleRank
from planner.layout import canonical_shards, rank_param_shards

if TYPE_CHECKING:
    import torch.distributed as dist

    from planner.layout import ParamShard
    from planner.models import ModelSpec
    from planner.plan import Plan, Training


class StagePlan(Protocol):
    """What stage_config and build_stage_model read of a plan (a planner.plan.Plan, or the
    profiler's stand-alone stage)."""

    @property
    def model(self) -> ModelSpec: ...

    @property
    def training(self) -> Training: ...


class StageView(Protocol):
    """What stage_config and build_stage_model read of a rank's view (a planner.plan.RankView,
    or the profiler's stand-alone stage view): the stage's layers and this rank's shards."""

    @property
    def tp_size(self) -> int: ...

    @property
    def stage(self) -> int: ...  # megatron_hexi.cuda_graphs.set_megatron_globals

    @property
    def num_stages(self) -> int: ...  # megatron_hexi.cuda_graphs.set_megatron_globals

    @property
    def layers(self) -> tuple[int, ...]: ...

    @property
    def query_groups(self) -> tuple[int, int]: ...

    @property
    def heads(self) -> tuple[int, int]: ...

    @property
    def ffn(self) -> tuple[int, int]: ...

    @property
    def vocab(self) -> tuple[int, int] | None: ...

    @property
    def holds_embedding(self) -> bool: ...

    @property
    def holds_output(self) -> bool: ...

    @property
    def sequence_parallel(self) -> bool: ...


# {canonical name: (block dimension, number of its first block)}: see init_blocks.
Blocks = Mapping[str, tuple[int, int]]


def stage_config(
    plan: StagePlan,
    view: StageView,
    *,
    params_dtype: torch.dtype = torch.float32,
    hidden_dropout: float = 0.0,
    attention_dropout: float = 0.0,
    recompute: bool = False,
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    transformer_impl: str = "local",
    attention_backend: str = "auto",
    fusions: Fusions | None = None,
) -> TransformerConfig:
    """The TransformerConfig of one rank's stage (see the module docstring for the sizes).
    Under Transformer Engine it also carries the plan's attention backend, which megatron-core
    hands to TE's attention (megatron_hexi.layer_specs), and parameters are created on the GPU;
    the local spec picks its core attention from the spec instead and keeps megatron-core's
    default. The plan's CUDA graphs (megatron_hexi.cuda_graphs) are the config's. `fusions`:
    the fused kernels that run (megatron_hexi.fusions.choose_fusions); None: none, the
    reference layers."""
    m, tp = plan.model, view.tp_size
    kwargs: dict[str, object] = config_fields(plan.training)
    if transformer_impl == "transformer_engine":
        from megatron.core.transformer.enums import AttnBackend

        kwargs["attention_backend"] = AttnBackend[attention_backend]
    if recompute:  # the method megatron_hexi.plan_flags allows under the plan
        kwargs.update(
            recompute_granularity="full",
            recompute_method=recompute_method,
            recompute_num_layers=recompute_num_layers,
        )
    return TransformerConfig(
        num_layers=view.layers[1] - view.layers[0],
        hidden_size=m.hidden_size,
        ffn_hidden_size=view.ffn[0] * tp,
        num_attention_heads=view.heads[0] * tp,
        num_query_groups=view.query_groups[0] * tp,
        kv_channels=m.head_dim,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        init_method_std=m.init_method_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        calculate_per_token_loss=True,
        perform_initialization=False,
        # TE's layers would build a full-size CPU master of every weight under CPU
        # initialisation (its wrappers do so whether or not they initialise); on the GPU they
        # allocate only the shard, which initialise_weights fills
        use_cpu_initialization=transformer_impl != "transformer_engine",
        persist_layer_norm=False,
        **(fusions or Fusions()).config_fields(),
        sequence_parallel=view.sequence_parallel,
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=False,
        **kwargs,
    )


def build_stage_model(
    plan: StagePlan,
    view: StageView,
    tp_group: dist.ProcessGroup | None,
    config: TransformerConfig,
    device: torch.device,
    *,
    attention_backend: str,
    transformer_impl: str = "local",
) -> GPTModel:
    """A GPTModel holding exactly `view`'s layers and shards, on `device`, not yet initialised.
    `attention_backend`: the plan's (planner.attention): with the local spec, fused ones run
    megatron_hexi.attention's SDPAttention, unfused ones megatron-core's DotProductAttention.
    `transformer_impl`: the plan's (planner.transformer_impl), the layer spec (megatron_hexi.
    layer_specs; `config` from stage_config with the same implementation). Under the plan's sequence
    parallelism (`config.sequence_parallel`), the stage's activations outside attention and MLP
    hold this rank's part of the sequence."""
    m, tp = plan.model, view.tp_size
    pg = ProcessGroupCollection(tp=tp_group, cp=SingleRank(), pp=None, embd=None, pos_embd=None)
    vocab = view.vocab[0] * tp if view.vocab else m.vocab_size
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # attention's scratch buffer
        parallel_state._set_global_memory_buffer()
    set_megatron_globals(config, view)
    model = GPTModel(
        config=config,
        transformer_layer_spec=stage_block_spec(config, attention_backend, transformer_impl),
        vocab_size=vocab,
        max_sequence_length=m.position_rows or m.seq_length,
        pre_process=view.holds_embedding,
        post_process=view.holds_output,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rope_scaling=m.rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        pg_collection=pg,
    )
    if view.holds_embedding:
        assert view.vocab is not None  # a stage with the embedding holds vocabulary rows
        emb = model.embedding.word_embeddings
        emb.vocab_start_index = view.vocab[1]
        emb.vocab_end_index = view.vocab[1] + view.vocab[0]
    model = model.to(device)
    if config.bf16:
        # As Megatron-LM's Float16Module: every parameter in bf16, norms included (torch norms
        # are created in fp32); the optimizer keeps fp32 master copies.
        model = model.bfloat16()
    elif config.fp16:
        model = model.half()  # the same under fp16
    return model


def seed_rng(seed: int, tp_rank: int, cuda_graph_impl: str = "none") -> None:
    """Megatron's RNG tracker (dropout in TP regions), seeded the way Megatron-LM does; a
    graph-safe one under the plan's CUDA graphs (megatron_hexi.cuda_graphs). The tracker is made
    anew, so its kind follows this call and not an earlier one in the process."""
    model_parallel_cuda_manual_seed(
        seed,
        tp_rank=tp_rank,
        ep_rank=0,
        etp_rank=0,
        force_reset_rng=True,
        **rng_tracker_options(cuda_graph_impl),
    )


# Rows (or columns) per independently seeded block of a canonical tensor. A constant of the
# initial model, never of a plan: changing it changes every initial weight.
INIT_BLOCK = 64
_SEED_STRIDE = 0x9E3779B1  # odd, so block number -> seed is a bijection modulo 2**32


def init_blocks(m: ModelSpec) -> dict[str, tuple[int, int]]:
    """{canonical name: (block dimension, number of its first block)} for model spec `m`.

    A parameter is cut into blocks along the dimension the layout splits it along (rows of the
    embedding, output layer, QKV and FC1; columns of linear_proj and FC2), so a shard covers whole
    blocks except at most one partial block at each end of each piece. Block numbers run through
    the model in canonical order, so no two blocks of one model share a seed.
    """
    out: dict[str, tuple[int, int]] = {}
    k = 0
    for s in canonical_shards(m):
        out[s.name] = (s.dim, k)
        k += -(-s.shape[s.dim] // INIT_BLOCK)
    if k > 2**32:
        raise ValueError(f"{k} initialisation blocks: more than the 2**32 distinct seeds")
    return out


def block_seed(seed: int, block: int) -> int:
    """The generator seed of one block. torch's CPU generator keeps only 32 bits of a seed, so
    seeds are made distinct by construction (a bijection of the block number) rather than by a
    wide hash, whose 32-bit truncations would collide in models with ~100k blocks."""
    base = int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=4).digest(), "little")
    return (base + block * _SEED_STRIDE) % 2**32


def _init_scale(shard: ParamShard, std: float, num_layers: int) -> float:
    """Megatron's init: N(0, std), output projections N(0, std / sqrt(2 x layers))."""
    return std / (2.0 * num_layers) ** 0.5 if shard.init == "scaled_normal" else std


def _draw_block(shape: Sequence[int], seed32: int, scale: float) -> torch.Tensor:
    """One block's values, fp32 on CPU: the same wherever and whenever it is drawn."""
    gen = torch.Generator().manual_seed(seed32)
    return torch.empty(shape).normal_(0.0, scale, generator=gen)


def _range_blocks(
    shard: ParamShard, start: int, length: int, seed: int, m: ModelSpec, blocks: Blocks
) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset from `start`, values) for elements [start, start + length) along the block
    dimension of `shard`'s canonical tensor, one overlapping block at a time."""
    dim, first = blocks[shard.name]
    if dim != shard.dim:
        raise ValueError(
            f"{shard.name}: pieces along dimension {shard.dim}, initialisation blocks along {dim}"
        )
    scale = _init_scale(shard, m.init_method_std, m.num_layers)
    size = shard.shape[dim]
    for j in range(start // INIT_BLOCK, -(-(start + length) // INIT_BLOCK)):
        b0, b1 = j * INIT_BLOCK, min((j + 1) * INIT_BLOCK, size)
        block_shape = list(shard.shape)
        block_shape[dim] = b1 - b0
        block = _draw_block(block_shape, block_seed(seed, first + j), scale)
        lo, hi = max(b0, start), min(b1, start + length)
        yield lo - start, block.narrow(dim, lo - b0, hi - lo)


def fill_range(
    out: torch.Tensor, shard: ParamShard, start: int, seed: int, m: ModelSpec, blocks: Blocks
) -> torch.Tensor:
    """Write elements [start, start + out.shape[dim]) of `shard`'s canonical tensor into `out`
    (any device and dtype), drawing only the blocks that overlap them. `blocks`: init_blocks(m)."""
    if shard.init in ("ones", "zeros"):
        out.fill_(1.0 if shard.init == "ones" else 0.0)
        return out
    dim = shard.dim
    for offset, values in _range_blocks(shard, start, out.shape[dim], seed, m, blocks):
        out.narrow(dim, offset, values.shape[dim]).copy_(values)
    return out


def full_tensor(
    shard: ParamShard, seed: int, m: ModelSpec, blocks: Blocks | None = None
) -> torch.Tensor:
    """The canonical full tensor of a parameter: the same on every rank under every plan."""
    return fill_range(torch.empty(shard.shape), shard, 0, seed, m, blocks or init_blocks(m))


def take_pieces(full: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """This rank's local tensor cut out of a canonical tensor, pieces concatenated."""
    return torch.cat(
        [full.narrow(shard.dim, p.global_start, p.length) for p in shard.pieces], dim=shard.dim
    )


def local_parameters(
    plan: Plan, rank: int, model: torch.nn.Module
) -> list[tuple[ParamShard, torch.nn.Parameter]]:
    """[(ParamShard, parameter)] for every parameter of the stage model, checked against the plan.

    A mismatch means the layout and megatron-core disagree: fail loudly rather than train wrong.
    Transformer Engine's names of its fused norms are read as the local spec's (te_to_local_name).
    """
    params = {te_to_local_name(n): p for n, p in model.named_parameters()}
    shards = rank_param_shards(plan, rank)
    expected = {s.local_name for s in shards}
    if set(params) != expected:
        raise RuntimeError(
            f"stage model parameters {sorted(set(params) ^ expected)} do not match "
            f"the plan's layout (megatron-core version mismatch?)"
        )
    out = []
    for s in shards:
        p = params[s.local_name]
        if tuple(p.shape) != s.local_shape:
            raise RuntimeError(
                f"{s.local_name}: local shape {tuple(p.shape)}, layout says {s.local_shape}"
            )
        out.append((s, p))
    return out


@torch.no_grad()
def initialise_weights(
    plan: Plan, params: Iterable[tuple[ParamShard, torch.Tensor]], seed: int
) -> None:
    """Fill every local parameter with its slices of the canonical initial tensors.

    Each piece is drawn on its own (only the blocks it overlaps), so host memory and time are
    those of this rank's shard plus a block of slack at each end of each piece, not those of the
    full tensors.
    """
    blocks = init_blocks(plan.model)
    for shard, p in params:
        for piece in shard.pieces:
            fill_range(
                p.narrow(shard.dim, piece.local_start, piece.length),
                shard,
                piece.global_start,
                seed,
                plan.model,
                blocks,
            )
