"""Attention backends: the names a plan records (`training.attention_backend`) and which of them
keep the s x s attention scores in device memory.

The names are Megatron-LM's `--attention-backend` choices. `auto`, `flash` and `fused` run a
fused kernel (torch's scaled_dot_product_attention: FlashAttention or the memory-efficient kernel
on CUDA, the fused kernel on CPU) that keeps no s x s tensor; `unfused` and `local` run
megatron-core's DotProductAttention, which writes the scores, their softmax and its dropout to
device memory and keeps the last two (and the dropout mask) for backward.

The one place the planner (validation, cost model, CLI) and the runtime read these from, with
what the unfused backends' s x s tensors cost in time (the memory they keep is the cost model's
5as/h term, planner/costmodel.py). Pure Python, no planner imports at run time: any module may
use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.flops import LayerShape

# every name a plan or a flag may give, in the order --help lists them
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
# the backends that compute attention in one fused kernel: no s x s tensor is kept or written
FUSED_BACKENDS = frozenset({"auto", "flash", "fused"})
# what a plan without `training.attention_backend` means: what every plan meant before the field
PLAN_DEFAULT_BACKEND = "unfused"
# what `hexi-plan plan`, `manual` and `min-nodes` plan for when --attention-backend is not given
CLI_DEFAULT_BACKEND = "auto"


def keeps_scores(backend: str) -> bool:
    """Whether `backend` keeps (and writes and reads) the s x s attention scores: the unfused
    ones. Raises ValueError for a name that is not in ATTENTION_BACKENDS."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}"
        )
    return backend not in FUSED_BACKENDS


# Device-memory traffic of unfused attention's s x s tensors, in bytes per element of the
# [b, a, s, s] scores (bf16: 2 B; the dropout mask: 1 B), counted from megatron-core's
# DotProductAttention (Q.K^T into the scores, scale-mask-softmax, attention dropout, P.V). The
# tensors are those of Korthikanti et al. 2022 (5as/h: softmax output 2 + dropout mask 1 +
# dropout output 2) plus the raw scores; that standard attention writes S and P to device memory
# and reads them back, forward and backward, while a fused kernel keeps its tiles on chip, is
# FlashAttention's argument (Dao et al. 2022, Algorithm 0 and Sec. 3.2: Theta(N^2) memory
# accesses against Theta(N^2 d^2 / M)).
#   forward: write S 2, read S 2 (softmax), write P 2, read P 2 (dropout), write the mask 1 and
#     the dropout output 2, read the dropout output 2 (P.V) = 13
#   backward: read the dropout output 2 (dV = P^T.dO), write its gradient 2 (dO.V^T), read that 2
#     and the mask 1 and write dP 2 (dropout), read dP 2 and P 2 and write dS 2 (softmax), read
#     dS twice 4 (dQ = dS.K, dK = dS^T.Q) = 19
# Seconds = bytes x b x a_rank x s^2 / the device's memory bandwidth, on top of the FLOPs (the
# matmuls' own reads and writes of Q, K, V and the context are in the sustained rate). Full
# recompute repeats the forward's traffic in backward. A measured layer time (a detailed
# profile) already holds whatever its attention moved: nothing is added to it.
UNFUSED_SCORES_FWD_BYTES = 13
UNFUSED_SCORES_BWD_BYTES = 19


def unfused_attention_times(
    m: LayerShape, mbs: int, query_groups: int, mem_bw: float
) -> tuple[float, float]:
    """(forward, backward) seconds one layer's unfused attention spends moving its s x s tensors
    on a rank holding `query_groups` of the model's query groups (its heads' share):
    UNFUSED_SCORES_{FWD,BWD}_BYTES x b x a x s^2 x qg/g / mem_bw."""
    s = m.seq_length
    elements = mbs * m.num_attention_heads * s * s * query_groups / m.num_query_groups
    return (
        UNFUSED_SCORES_FWD_BYTES * elements / mem_bw,
        UNFUSED_SCORES_BWD_BYTES * elements / mem_bw,
    )


__all__ = [
    "ATTENTION_BACKENDS",
    "FUSED_BACKENDS",
    "PLAN_DEFAULT_BACKEND",
    "CLI_DEFAULT_BACKEND",
    "keeps_scores",
    "UNFUSED_SCORES_FWD_BYTES",
    "UNFUSED_SCORES_BWD_BYTES",
    "unfused_attention_times",
]
