"""Memory of one GPU: the bytes a rank holds for weights, grads, optimizer state and activations.

Its own module because the search asks it first (how many layers fit on a rank, `layers_that_fit`)
long before any time is costed, and the simulator reports it term by term (`MemoryUse`). Times live
in planner/costmodel.py, parameter counts in planner/layout.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.attention import PLAN_DEFAULT_BACKEND, keeps_scores
from planner.layout import stage_params

if TYPE_CHECKING:
    from planner.models import ModelSpec

BF16_BYTES = 2
FP32_BYTES = 4

# Memory per parameter in megatron-core bf16 mixed precision with Adam (Megatron's DDP keeps fp32
# main grads): bf16 weight 2 + fp32 grad 4 + fp32 master weight 4 + fp32 Adam m and v 8 = 18.
WEIGHT_BYTES_PER_PARAM = BF16_BYTES
GRAD_BYTES_PER_PARAM = FP32_BYTES  # gradient buffers are fp32 on GPU, also for the reduce
OPTIMIZER_BYTES_PER_PARAM = 3 * FP32_BYTES  # fp32 master + Adam exp_avg + exp_avg_sq

# Memory the framework takes before any tensor: CUDA context with cuBLAS/NCCL workspaces (~0.5-1 GB
# as reported by nvidia-smi for a PyTorch process) plus caching-allocator fragmentation. Stated
# assumption, one value for every device.
FRAMEWORK_RESERVE_BYTES = 1.5e9

# Attention follows the plan's `training.attention_backend` (planner.attention): an unfused one
# (megatron-core's DotProductAttention) keeps the s x s softmax output, its dropout mask and the
# dropout output for backward, the 5as/h term below, and moves its s x s tensors through device
# memory (planner.attention.unfused_attention_times, with its sourced byte counts); a fused one
# (scaled_dot_product_attention's flash or memory-efficient kernel) keeps neither and is timed by
# its FLOPs alone.

# Korthikanti et al. 2022 (Reducing Activation Recomputation in Large Transformer Models), Sec. 4.1,
# activation bytes per layer without sequence parallelism: s*b*h*(34 + 5*a*s/h). Split into the
# part every TP rank stores (10: norms' inputs, QKV and fc1 inputs, dropout masks), the part split
# over TP by attention heads (8 + 5as/h: Q, K, V, softmax terms, projection input) and the part
# split by FFN columns. Their 16 sbh MLP term is a GeLU MLP with F = 4h: fc1 output and GeLU
# output, 2 bf16 tensors of [s, b, F] = 4 bytes per FFN column per token. A SwiGLU MLP keeps fc1's
# gate and up outputs, SiLU(gate) and the product that enters fc2: 8 bytes per FFN column per
# token (the gap showed as 25% too little activation memory against the runtime's saved tensors).
#
# Sequence parallelism (the plan's `training.sequence_parallel`, in every stage of TP degree t > 1;
# Korthikanti et al. 2022, Sec. 4.2.2): the regions outside attention and MLP (norms, dropouts)
# hold this rank's s/t of the sequence, so the 10 sbh every TP rank stored becomes 10 sbh / t and
# a layer keeps s*b*h*(34/t + 5as/(ht)) (their eq. 4). With full recompute the kept layer input
# is cut the same way. A layer's time is unchanged: each of its TP all-reduces becomes a
# reduce-scatter plus an all-gather of the same total volume (same paper and section), which
# `ring_allreduce_time` already charges (2(t-1)/t bytes and 2(t-1) hops per rank either way). What
# does change is at stage boundaries: the received activation needs no all-gather
# (`boundary_times`).
ACT_REPLICATED = 10  # divided by the sequence split under sequence parallelism
ACT_ATTENTION_SHARDED = 8
ACT_MLP_BYTES_PER_FFN_COLUMN = {False: 4, True: 8}  # by swiglu
ACT_SCORES_PER_AS_OVER_H = 5  # unfused attention only (planner.attention.keeps_scores)


def layer_activation_bytes(
    m: ModelSpec,
    mbs: int,
    qg: int,
    ffn: int,
    recompute: bool,
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    *,
    sequence_split: int = 1,
) -> float:
    """Bytes one layer keeps for backward per in-flight micro-batch on a rank (Korthikanti 2022).

    s*b*h*(10/σ + 8*qg/g) + s*b*ffn*(8 SwiGLU | 4 GeLU) [+ 5*a*s^2*b*qg/g with an unfused
    attention backend]: the published s*b*h*(34/t + 5as/(ht)) (GeLU, F = 4h) with the TP-sharded
    terms scaled by this rank's share and the MLP term per FFN column. σ = `sequence_split`: the
    ranks the sequence is cut over outside attention and MLP (the stage's TP degree under
    sequence parallelism, else 1); it divides only the replicated 10 sbh, as the other terms are
    this rank's heads and FFN columns already. With full recompute only the layer input
    [s, b, h] bf16 is kept, its s/σ positions under sequence parallelism.
    """
    if sequence_split < 1:
        raise ValueError(f"sequence_split: must be a positive integer, got {sequence_split}")
    s, h, a = m.seq_length, m.hidden_size, m.num_attention_heads
    sbh = s * mbs * h
    if recompute:  # a whole layer input stays an int, as before sequence parallelism
        kept = sbh * BF16_BYTES
        return kept if sequence_split == 1 else kept / sequence_split
    qf = qg / m.num_query_groups
    act = sbh * (ACT_REPLICATED / sequence_split + ACT_ATTENTION_SHARDED * qf)
    act += s * mbs * ffn * ACT_MLP_BYTES_PER_FFN_COLUMN[m.swiglu]
    if keeps_scores(attention_backend):
        act += ACT_SCORES_PER_AS_OVER_H * a * s * s * mbs * qf
    return act


def sequence_split(tp_degree: int, sequence_parallel: bool) -> int:
    """Ranks a stage's sequence is cut over (layer_activation_bytes' `sequence_split`): its TP
    degree under the plan's sequence parallelism, else 1 (a TP-1 stage holds the whole
    sequence)."""
    return tp_degree if sequence_parallel and tp_degree > 1 else 1


def in_flight_microbatches(position: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage `position` (0-based) holds at once under 1F1B."""
    return min(num_stages - position, num_microbatches)


@dataclass(frozen=True)
class MemoryUse:
    """Bytes on one GPU, by term; `total` is what must fit in the device's memory."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    reserve: float

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.activations
            + self.logits
            + self.reserve
        )

    def terms(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "reserve": self.reserve,
        }


@dataclass(frozen=True)
class RankShape:
    """What memory depends on besides the model and the layer count: one rank's shards, its
    stage's place in the pipeline, the schedule and the options (rank_memory, layers_that_fit)."""

    mbs: int
    query_groups: int  # this rank's shards
    ffn: int
    vocab: int
    first: bool  # the stage holds the embedding
    last: bool  # the stage holds the output layer and the loss
    position: int  # the stage's index in its pipeline
    num_stages: int
    num_microbatches: int
    recompute: bool
    optimizer_fraction: float = 1.0  # share of fp32 master + Adam state (distributed optimizer)
    attention_backend: str = PLAN_DEFAULT_BACKEND  # the plan's (planner.attention)
    # ranks the sequence is cut over outside attention and MLP: the stage's TP degree under the
    # plan's sequence parallelism, else 1 (layer_activation_bytes)
    sequence_split: int = 1


def rank_memory(m: ModelSpec, shape: RankShape, n_layers: int) -> MemoryUse:
    """MemoryUse of one rank holding `n_layers` layers. `shape.optimizer_fraction` is its share
    of its fp32 master + Adam state (1 without the distributed optimizer).

    Activations: `in_flight_microbatches` x layers x `layer_activation_bytes`; with recompute, plus
    one layer's full activations for the micro-batch being recomputed; both with the shape's
    `sequence_split`. Logits: the last stage keeps [s, b, V_rank] fp32 for one micro-batch (its
    backward follows its forward at once; the output layer gathers the whole sequence, so
    sequence parallelism leaves them as they are).
    """
    r = shape
    params = stage_params(m, r.query_groups, r.ffn, r.vocab, n_layers, r.first, r.last)
    inflight = in_flight_microbatches(r.position, r.num_stages, r.num_microbatches)
    backend, split = r.attention_backend, r.sequence_split
    per_layer = layer_activation_bytes(
        m, r.mbs, r.query_groups, r.ffn, r.recompute, backend, sequence_split=split
    )
    act = inflight * n_layers * per_layer
    if r.recompute:
        act += layer_activation_bytes(
            m, r.mbs, r.query_groups, r.ffn, False, backend, sequence_split=split
        )
    logits = m.seq_length * r.mbs * r.vocab * FP32_BYTES if r.last else 0.0
    return MemoryUse(
        params * WEIGHT_BYTES_PER_PARAM,
        params * GRAD_BYTES_PER_PARAM,
        params * OPTIMIZER_BYTES_PER_PARAM * r.optimizer_fraction,
        act,
        logits,
        FRAMEWORK_RESERVE_BYTES,
    )


def layers_that_fit(capacity: float, m: ModelSpec, shape: RankShape) -> int:
    """The most layers a rank of this shape can hold within `capacity` bytes by `rank_memory`
    (0 when not even the stage's embedding / head fits). The search's memory limit per stage."""

    def total(n: int) -> float:
        return rank_memory(m, shape, n).total

    empty = total(0)
    if empty > capacity:
        return 0
    n = int((capacity - empty) // (total(1) - empty))  # memory is linear in the layers
    while n > 0 and total(n) > capacity:  # rounding: settle on rank_memory
        n -= 1
    while total(n + 1) <= capacity:
        n += 1
    return n
