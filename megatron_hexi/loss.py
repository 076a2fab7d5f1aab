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


class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        logits, logits_max = _Math.calculate_logits_max(logits)
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        vocab_end = vocab_start + logits.size(-1)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            _Math.calculate_predicted_logits(logits, target, logits_max, vocab_start, vocab_end)
        )
        if group is not None:
            dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        softmax, loss = _Math.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = _Math.prepare_gradient_calculation_operands(
            softmax, target_mask
        )
        grad_input = _Math.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output
        )
        return grad_input, None, None, None


class _FusedShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        from megatron.core.fusions import fused_cross_entropy as fused

        logits, logits_max = fused.calculate_logits_max(logits)
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        vocab_end = vocab_start + logits.size(-1)
        target_mask, masked_target_1d, predicted_and_sum, exp_logits = (
            fused.calculate_predicted_logits(logits, target, logits_max, vocab_start, vocab_end)
        )
        if group is not None:
            dist.all_reduce(predicted_and_sum, op=dist.ReduceOp.SUM, group=group)
        softmax, loss = fused.calculate_cross_entropy_loss(exp_logits, predicted_and_sum)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        from megatron.core.fusions import fused_cross_entropy as fused

        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = fused.calculate_gradients(softmax, grad_output, target_mask, masked_target_1d)
        return grad_input, None, None, None


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
    fn = _FusedShardedCrossEntropy if fused else _ShardedCrossEntropy
    return fn.apply(logits, target, vocab_start, group if tp_size > 1 else None)
