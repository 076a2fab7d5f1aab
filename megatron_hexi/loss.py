"""Cross-entropy over a vocabulary shard held by this stage's TP group, at explicit offsets.

megatron-core 0.16.1's vocab-parallel cross-entropy reads the *global* TP group and assumes even
vocabulary shards (rank x shard size). This autograd function takes the stage's own group and
the shard's offset, and reuses megatron-core's own arithmetic helpers for the rest: the plain
ones, or with `fused` (the cross-entropy fusion, megatron_hexi.fusions) those of megatron-core's
`fused_cross_entropy`, compiled by its `jit_fuser`, which also sum the predicted logits and the
exponentials in one all-reduce and return the logits' gradient in bf16, as megatron-core does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as _Math


def _all_reduce(
    t: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None
) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


class _ShardedCrossEntropy(torch.autograd.Function):
    """Plain arithmetic (`fused` False) or megatron-core's fused one, which sums the predicted
    logits and the exponentials in one all-reduce."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        fused: bool,
    ) -> torch.Tensor:
        math: Any = _Math
        if fused:  # imported only where used: it compiles with megatron-core's jit_fuser
            from megatron.core.fusions import fused_cross_entropy

            math = fused_cross_entropy
        logits, logits_max = math.calculate_logits_max(logits)
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)
        vocab_end = vocab_start + logits.size(-1)
        if fused:
            target_mask, masked_target_1d, predicted_and_sum, exp_logits = (
                math.calculate_predicted_logits(logits, target, logits_max, vocab_start, vocab_end)
            )
            _all_reduce(predicted_and_sum, dist.ReduceOp.SUM, group)
            softmax, loss = math.calculate_cross_entropy_loss(exp_logits, predicted_and_sum)
        else:
            target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
                math.calculate_predicted_logits(logits, target, logits_max, vocab_start, vocab_end)
            )
            _all_reduce(predicted, dist.ReduceOp.SUM, group)
            _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
            softmax, loss = math.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.fused = fused
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        if ctx.fused:
            from megatron.core.fusions import fused_cross_entropy

            grad_input = fused_cross_entropy.calculate_gradients(
                softmax, grad_output, target_mask, masked_target_1d
            )
        else:
            grad_2d, arange_1d, update, grad_input = _Math.prepare_gradient_calculation_operands(
                softmax, target_mask
            )
            grad_input = _Math.calculate_gradients(
                grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output
            )
        return grad_input, None, None, None, None


def sharded_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | None,
    tp_size: int,
    *,
    fused: bool = False,
) -> torch.Tensor:
    """Per-token loss [..] from logits [.., local vocab] of the shard starting at vocab_start;
    `fused`: megatron-core's fused arithmetic (CUDA, bf16 runs: megatron_hexi.fusions)."""
    return _ShardedCrossEntropy.apply(
        logits, target, vocab_start, group if tp_size > 1 else None, fused
    )
