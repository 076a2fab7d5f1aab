"""Device time of a layer pass on a catalog GPU, kernel by kernel.

A flat fraction of peak is right for the large GEMMs of a large model and wrong for the small
ones a fast GPU runs with small micro-batches: a GEMM of 10 us does not reach the rate of one of
10 ms, a kernel has a floor of a few microseconds however little it does, and the norms,
residual adds, rotary embedding and activation move bytes rather than FLOPs. This module times
one TP rank's share of a layer as the sum of its kernels (the eager runtime runs them one after
another on one stream):

- a GEMM of F FLOPs moving B bytes takes max(GEMM_FLOOR_S, ideal + min(ideal, GEMM_TAIL_S),
  B / bandwidth), where ideal = F / (peak x GEMM_FRACTION_OF_PEAK): the tail is the ramp-up and
  the last partial wave of thread blocks, which weighs as much as the work itself on a small
  GEMM and nothing on a large one;
- an elementwise kernel moving B bytes takes max(ELEMENTWISE_FLOOR_S, B / bandwidth);
- backward runs each GEMM twice (input and weight gradients) and moves each elementwise
  kernel's bytes twice (the saved input and the incoming gradient read, the gradient written).

Only catalog GPUs are timed this way (`Device.kernels`); a CPU row and a measured profile keep
their own rates (planner.costmodel). Every constant names its source. Pure Python.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from planner.flops import LayerShape

# A large bf16 GEMM of a transformer layer's shapes reaches 0.6 of the catalog's dense peak here.
# Stated assumption, placed between two published figures: the best achievable matmul rate is
# 0.8-0.87 of peak on A100 and H100 (S. Bekman, "Machine Learning Engineering", maximum
# achievable matmul FLOPS table: A100 SXM 271 of 312 TFLOP/s, H100 SXM about 0.8 of 989), and a
# whole training step reaches 0.52-0.56 (Narayanan et al. 2021; Korthikanti et al. 2022, Table
# 5). With this module's elementwise and attention terms added, a large layer comes out at about
# the whole step's 0.55, the flat fraction the cost model used before.
GEMM_FRACTION_OF_PEAK = 0.6

# Shortest GEMM: a kernel launch and one wave of tiles, about 3 us on A100/H100-class GPUs
# (stated assumption, of the order NVIDIA's CUDA best-practices guide gives for launch overhead).
GEMM_FLOOR_S = 3e-6

# Ramp-up and the last partial wave of thread blocks: a GEMM whose ideal time is t takes
# t + min(t, GEMM_TAIL_S). Stated assumption: it makes a 1-2 us GEMM run at about half its ideal
# rate and leaves a millisecond one unchanged, the shape of cuBLAS's rate against size.
GEMM_TAIL_S = 5e-6

# Shortest elementwise kernel (launch and one pass), stated assumption like GEMM_FLOOR_S.
ELEMENTWISE_FLOOR_S = 2e-6

# A fused attention kernel (FlashAttention-2, cuDNN's fused attention: what SDPA and the plan's
# fused backends run) keeps the scores on chip and reaches a lower fraction of peak than a
# GEMM: FlashAttention-2 reaches about 35 % of an H100's dense peak (Shah et al. 2024,
# "FlashAttention-3", section 1), 50-73 % of an A100's forward (Dao 2023, "FlashAttention-2").
# The H100 figure is taken for every GPU: the GPU check measured 0.5475 s per step of the 1.1B
# model at 8 x 4,096 tokens on an H200, where this model gives 0.53 s with it and 0.70 s when
# the scores are charged as two GEMMs writing and reading them.
FLASH_FRACTION_OF_PEAK = 0.35
# Causal masking skips the blocks above the diagonal: half the score FLOPs (FlashAttention-2,
# section 3.1.1). The backward recomputes the scores and runs five products against the
# forward's two: 2.5x the forward's FLOPs (the FLOP count FlashAttention-2's benchmarks use).
CAUSAL_FRACTION = 0.5
FLASH_BWD_FACTOR = 2.5

# Streaming kernels reach about 0.8 of the catalog memory bandwidth (stated assumption: the
# typical STREAM-copy fraction of HBM and GDDR peaks).
BANDWIDTH_FRACTION = 0.8

ACT_BYTES = 2  # bf16 activations
FP32 = 4

# Bytes per element an elementwise pass moves, counted from megatron-core's modules (forward):
NORM_BYTES = 2 * ACT_BYTES  # read the input, write the output
ADD_BYTES = 3 * ACT_BYTES  # residual add: read both, write the sum
ROPE_BYTES = 2 * ACT_BYTES  # read q or k, write it rotated
SWIGLU_BYTES_PER_COLUMN = 3 * ACT_BYTES  # read gate and up, write their product
GELU_BYTES_PER_COLUMN = 2 * ACT_BYTES
# Cross entropy over a rank's logits: read them in bf16, write and read an fp32 copy for the max
# and the sum of exponentials (forward); write the fp32 softmax gradient and its bf16 cast
# (backward).
CROSS_ENTROPY_FWD_BYTES = ACT_BYTES + 3 * FP32
CROSS_ENTROPY_BWD_BYTES = 2 * FP32 + ACT_BYTES


class KernelDevice(NamedTuple):
    """What the kernel model reads of a GPU: its dense bf16 peak and its memory bandwidth."""

    peak_flops: float
    mem_bw: float


class PassTimes(NamedTuple):
    """Seconds of one part of a layer on one rank: forward and backward."""

    fwd: float
    bwd: float


def gemm_time(dev: KernelDevice, flops: float, nbytes: float) -> float:
    """Seconds of one GEMM (or one batched GEMM kernel) of `flops` moving `nbytes` (none for an
    empty one: a rank without a share of the block runs no kernel)."""
    if flops <= 0:
        return 0.0
    ideal = flops / (dev.peak_flops * GEMM_FRACTION_OF_PEAK)
    moved = nbytes / (dev.mem_bw * BANDWIDTH_FRACTION)
    return max(GEMM_FLOOR_S, ideal + min(ideal, GEMM_TAIL_S), moved)


def matmul_time(dev: KernelDevice, m: int, k: int, n: int, batch: int = 1) -> float:
    """Seconds of `batch` products of [m, k] x [k, n] in one kernel, bf16 in and out."""
    return gemm_time(dev, 2.0 * batch * m * k * n, batch * (m * k + k * n + m * n) * ACT_BYTES)


def elementwise_time(dev: KernelDevice, nbytes: float) -> float:
    """Seconds of one memory-bound kernel moving `nbytes` (none for nothing)."""
    if nbytes <= 0:
        return 0.0
    return max(ELEMENTWISE_FLOOR_S, nbytes / (dev.mem_bw * BANDWIDTH_FRACTION))


def fused_attention_times(dev: KernelDevice, s: int, d: int, heads: int, mbs: int) -> PassTimes:
    """One fused causal attention kernel over `mbs` x `heads` heads of length `s` and size `d`:
    the causal half of the two score products at FLASH_FRACTION_OF_PEAK, reading q, k and v
    and writing the output once (no s x s tensor); backward FLASH_BWD_FACTOR times the FLOPs."""
    if heads <= 0:
        return PassTimes(0.0, 0.0)
    flops = CAUSAL_FRACTION * 2 * (2.0 * mbs * heads * s * s * d)
    moved = 4 * mbs * heads * s * d * ACT_BYTES / (dev.mem_bw * BANDWIDTH_FRACTION)
    rate = dev.peak_flops * FLASH_FRACTION_OF_PEAK
    return PassTimes(
        max(GEMM_FLOOR_S, flops / rate, moved),
        max(GEMM_FLOOR_S, FLASH_BWD_FACTOR * flops / rate, 2 * moved),
    )


@lru_cache(maxsize=65536)
def attention_times(
    dev: KernelDevice, m: LayerShape, mbs: int, query_groups: int, fused: bool = False
) -> PassTimes:
    """One rank's attention block with `query_groups` of the model's groups: its input norm,
    the q/k/v projection, rotary embedding of q and k, the scores (`fused`: one fused causal
    kernel; else the two batched products Q.K^T and P.V over the whole s x s tensor, as many
    heads as the rank holds, with the unfused backend's softmax traffic added by the cost
    model), the output projection and the residual add."""
    s, h, d = m.seq_length, m.hidden_size, m.head_dim
    tokens = mbs * s
    heads = query_groups * m.num_attention_heads // m.num_query_groups
    gemms = matmul_time(dev, tokens, h, (heads + 2 * query_groups) * d) + matmul_time(
        dev, tokens, heads * d, h
    )
    if fused:
        scores = fused_attention_times(dev, s, d, heads, mbs)
    else:
        both = matmul_time(dev, s, d, s, batch=mbs * heads) + matmul_time(
            dev, s, s, d, batch=mbs * heads
        )
        scores = PassTimes(both, 2 * both)
    moved = (
        elementwise_time(dev, NORM_BYTES * tokens * h)
        + elementwise_time(dev, ROPE_BYTES * tokens * heads * d)
        + elementwise_time(dev, ROPE_BYTES * tokens * query_groups * d)
        + elementwise_time(dev, ADD_BYTES * tokens * h)
    )
    return PassTimes(gemms + moved + scores.fwd, 2 * (gemms + moved) + scores.bwd)


@lru_cache(maxsize=65536)
def mlp_times(dev: KernelDevice, m: LayerShape, mbs: int, columns: int) -> PassTimes:
    """One rank's MLP block with `columns` of the FFN's columns: its input norm, fc1 (gate and up
    under SwiGLU), the activation, fc2 and the residual add."""
    tokens, h = mbs * m.seq_length, m.hidden_size
    up = 2 * columns if m.swiglu else columns
    act = SWIGLU_BYTES_PER_COLUMN if m.swiglu else GELU_BYTES_PER_COLUMN
    gemms = matmul_time(dev, tokens, h, up) + matmul_time(dev, tokens, columns, h)
    moved = (
        elementwise_time(dev, NORM_BYTES * tokens * h)
        + elementwise_time(dev, act * tokens * columns)
        + elementwise_time(dev, ADD_BYTES * tokens * h)
    )
    return PassTimes(gemms + moved, 2 * (gemms + moved))


def head_times(dev: KernelDevice, tokens: int, hidden: int, rows: int) -> PassTimes:
    """One rank's LM head with `rows` vocabulary rows and its part of the cross entropy (the
    final norm is counted with the last layer's adds)."""
    gemm = matmul_time(dev, tokens, hidden, rows)
    return PassTimes(
        gemm + elementwise_time(dev, CROSS_ENTROPY_FWD_BYTES * tokens * rows),
        2 * gemm + elementwise_time(dev, CROSS_ENTROPY_BWD_BYTES * tokens * rows),
    )


__all__ = [
    "GEMM_FRACTION_OF_PEAK",
    "GEMM_FLOOR_S",
    "GEMM_TAIL_S",
    "FLASH_FRACTION_OF_PEAK",
    "CAUSAL_FRACTION",
    "FLASH_BWD_FACTOR",
    "ELEMENTWISE_FLOOR_S",
    "BANDWIDTH_FRACTION",
    "KernelDevice",
    "PassTimes",
    "gemm_time",
    "matmul_time",
    "elementwise_time",
    "fused_attention_times",
    "attention_times",
    "mlp_times",
    "head_times",
]
