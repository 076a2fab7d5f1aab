"""Megatron-LM flags whose meaning depends on the plan or on each other: the training length in
samples or iterations, warm-up as a fraction, recompute method, query groups, position rows,
vocabulary padding, fused attention under an `auto` plan; and the flags accepted with no effect.

Pure Python (no torch): pretrain_gpt.py checks a whole command line before it imports torch.
"""

from __future__ import annotations

import argparse
import math
from functools import reduce
from typing import TYPE_CHECKING

from planner.catalog import get_gpu
from planner.errors import SpecError

if TYPE_CHECKING:
    from planner.plan import Plan

# Flags accepted with no effect, and why (the docs table shows the why).
ACCEPTED = {
    "use_mcore_models": "the model is always megatron-core's GPTModel",
    "timing_log_level": "one level of timers: iteration and pipeline step times, always logged",
    "log_timers_to_tensorboard": "iteration-time and pipeline-step-time are always written",
    "log_validation_ppl_to_tensorboard": "lm loss validation ppl is always written",
    "log_memory_to_tensorboard": "peak-memory-gb per rank is always written",
    "log_batch_size_to_tensorboard": "batch-size is always written",
    "accumulate_allreduce_grads_in_fp32": "gradients are always accumulated and reduced in fp32",
    "calculate_per_token_loss": "the loss and its gradient are always the sum over the global "
    "batch's loss-masked tokens divided by their count, as this flag makes Megatron-LM's (plans "
    "with different micro-batch sizes then weigh every token alike)",
    "attention_softmax_in_fp32": "the fused attention's softmax is fp32; the unfused one is "
    "megatron-core's default",
    "no_persist_layer_norm": "Apex's persistent layer norm does not run here",
    "hetero_load_if_exists": "--load of a folder with no checkpoint starts fresh anyway",
    "use_cpu_initialization": "every rank fills its parameters with its slices of the seed's "
    "canonical tensors: the same weights wherever they are computed",
    "no_create_attention_mask_in_dataloader": "the data never builds an attention mask (the "
    "attention is causal)",
    "tensorboard_queue_size": "the TensorBoard writer's own queue is used",
}


def schedule_problems(args: argparse.Namespace) -> list[str]:
    """Training length and lr schedule given in one unit, as Megatron-LM requires: iterations
    (--train-iters, --lr-decay-iters, --lr-warmup-iters) or samples (--train-samples,
    --lr-decay-samples, --lr-warmup-samples), and warm-up as a count or as a fraction."""
    if (args.train_iters is None) == (args.train_samples is None):
        both = args.train_iters is not None
        return [
            f"give one of --train-iters and --train-samples, got {'both' if both else 'neither'}"
        ]
    problems = []
    if args.train_iters is not None:
        for flag, value, instead in (
            ("--lr-decay-samples", args.lr_decay_samples, "--lr-decay-iters"),
            ("--lr-warmup-samples", args.lr_warmup_samples or None, "--lr-warmup-iters"),
        ):
            if value is not None:
                problems.append(
                    f"{flag} goes with --train-samples; with --train-iters use {instead}"
                )
    else:
        for flag, value, instead in (
            ("--lr-decay-iters", args.lr_decay_iters, "--lr-decay-samples"),
            ("--lr-warmup-iters", args.lr_warmup_iters or None, "--lr-warmup-samples"),
        ):
            if value is not None:
                problems.append(
                    f"{flag} goes with --train-iters; with --train-samples use {instead}"
                )
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        problems.append(
            "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both give the "
            "warm-up; keep one"
        )
    return problems


def iterations(
    args: argparse.Namespace, global_batch_size: int | None
) -> tuple[int, int | None, int]:
    """(train iterations, lr decay iterations or None, lr warm-up iterations): the flags in
    iterations, or their samples divided by the global batch, which must divide each of them
    (Megatron-LM without batch ramp-up)."""
    given = (args.train_samples, args.lr_decay_samples, args.lr_warmup_samples)
    if given[0] is None:
        return args.train_iters, args.lr_decay_iters, args.lr_warmup_iters
    if global_batch_size is None:
        raise SpecError(
            "--train-samples needs the global batch size: give --global-batch-size, or a plan file"
        )
    problems: list[str] = []
    out: list[int | None] = []
    for flag, samples in zip(
        ("--train-samples", "--lr-decay-samples", "--lr-warmup-samples"), given, strict=True
    ):
        if samples is not None and samples % global_batch_size:
            problems.append(
                f"{flag} {samples} is not a multiple of the global batch size "
                f"{global_batch_size}; give a multiple (iterations are whole global batches)"
            )
        out.append(None if samples is None else samples // global_batch_size)
    if problems:
        raise SpecError(problems)
    assert out[0] is not None
    return out[0], out[1], out[2] or 0


def padded_vocab(size: int, divisible_by: int, tp_sizes: list[int]) -> int:
    """Megatron-LM's padding: up to a multiple of divisible_by x TP; under a plan with several
    TP degrees, of their least common multiple (every stage's vocabulary shards are equal)."""
    multiple = divisible_by * reduce(math.lcm, tp_sizes, 1)
    return -(-size // multiple) * multiple


def vocab_problem(tokens: int, divisible_by: int | None, plan: Plan, source: str) -> str | None:
    """--make-vocab-size-divisible-by: the vocabulary of `source` (`tokens` entries) padded as
    Megatron-LM pads it must be the plan's model vocab_size."""
    if divisible_by is None:
        return None
    tps = sorted({s.tp_size for p in plan.pipelines for s in p.stages})
    padded = padded_vocab(tokens, divisible_by, tps)
    if padded == plan.model.vocab_size:
        return None
    return (
        f"--make-vocab-size-divisible-by {divisible_by}: {source} ({tokens} tokens) pads to "
        f"{padded} (a multiple of {divisible_by} x TP {reduce(math.lcm, tps, 1)}), but the "
        f"plan's model vocab_size is {plan.model.vocab_size}; plan with vocab_size {padded}, "
        f"or give a value that pads to {plan.model.vocab_size}"
    )


def recompute_problems(args: argparse.Namespace, plan: Plan) -> list[str]:
    """--recompute-method / --recompute-num-layers where the plan's recompute allows them: the
    plan counts every layer recomputed, one at a time (uniform 1; block N with N at least each
    stage's layers is the same)."""
    method, layers = args.recompute_method, args.recompute_num_layers
    if method is None and layers is None:
        return []
    given = " ".join(
        f"--recompute-{k} {v}" for k, v in (("method", method), ("num-layers", layers)) if v
    )
    if not plan.training.recompute:
        return [
            f"{given} contradicts the plan (recompute: false); re-plan with hexi-plan ... "
            f"--recompute, or drop the flag"
        ]
    most = max(s.layers[1] - s.layers[0] for p in plan.pipelines for s in p.stages)
    n = 1 if layers is None else layers
    if (method or "uniform") == "uniform" and n != 1:
        return [
            f"{given}: the plan (recompute: true) holds one recomputed layer at a time, not "
            f"{n}; give --recompute-num-layers 1"
        ]
    if method == "block" and n < most:
        return [
            f"{given}: block leaves layers past the first {n} of a stage unrecomputed, but the "
            f"plan (recompute: true) recomputes all ({most} in its largest stage); give "
            f"--recompute-num-layers {most} or --recompute-method uniform"
        ]
    return []


def plan_flag_problems(args: argparse.Namespace, plan: Plan) -> list[str]:
    """The flags of this module checked against the plan (megatron_hexi.arguments checks the
    rest): query groups, position rows and type, recompute, bf16 on GPUs without it, and the
    mock vocabulary."""
    m, problems = plan.model, []
    if args.group_query_attention and args.num_query_groups is None and m.num_query_groups != 1:
        problems.append(
            f"--group-query-attention without --num-query-groups means 1 query group "
            f"(Megatron-LM's default), but the plan's model has num_query_groups "
            f"{m.num_query_groups}; add --num-query-groups {m.num_query_groups}"
        )
    if args.position_embedding_type is not None and args.position_embedding_type != (
        m.position_embedding_type
    ):
        problems.append(
            f"--position-embedding-type {args.position_embedding_type} contradicts the plan's "
            f"model ({m.position_embedding_type})"
        )
    if args.use_rope_scaling is not None and not m.rope_scaling:
        problems.append("--use-rope-scaling contradicts the plan's model (rope_scaling: false)")
    if args.rotary_percent is not None and args.rotary_percent != 1.0:
        problems.append(
            f"--rotary-percent {args.rotary_percent:g}: the plan's model rotates the whole head "
            f"(1.0); drop the flag"
        )
    if args.use_rotary_position_embeddings and m.position_embedding_type != "rope":
        problems.append(
            f"--use-rotary-position-embeddings contradicts the plan's model "
            f"({m.position_embedding_type} positions)"
        )
    if args.no_position_embedding and m.position_embedding_type == "learned_absolute":
        problems.append(
            "--no-position-embedding contradicts the plan's model (learned_absolute positions)"
        )
    rows = args.max_position_embeddings
    if rows is not None:
        seq = args.seq_length if args.seq_length is not None else m.seq_length
        if rows < seq:
            problems.append(
                f"--max-position-embeddings {rows} is below the sequence length {seq}; give at "
                f"least {seq}"
            )
        elif m.position_embedding_type == "learned_absolute" and rows != m.position_rows:
            problems.append(
                f"--max-position-embeddings {rows} contradicts the plan's model "
                f"(learned_absolute positions, {m.position_rows} rows)"
            )
    problems += recompute_problems(args, plan)
    no_bf16 = sorted({g.gpu for g in plan.cluster.groups if not get_gpu(g.gpu).bf16})
    if args.bf16 and no_bf16:
        problems.append(
            f"--bf16: the plan's {', '.join(no_bf16)} have no bf16 tensor cores; train with "
            f"--fp16 (loss scaling), or plan without them"
        )
    if args.mock_data and not args.data_path:
        vocab = vocab_problem(
            m.vocab_size, args.make_vocab_size_divisible_by, plan, "the mock data's vocabulary"
        )
        if vocab:
            problems.append(vocab)
    return problems
