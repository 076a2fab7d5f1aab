"""Under --bf16 the gradients are summed in fp32, as megatron-core's `main_grad`.

Each backward's bf16 `.grad` goes into an fp32 buffer at once; the sync and the norm read it and
the fp32 master weights take it as their gradient. Summed in bf16 instead, a pipeline with many
micro-batches loses bits at every addition, and comparing with a one-rank bf16 run (same
rounding) cannot see it: the comparison here is with a one-rank fp32 run.
"""

import pytest
import torch

from harness import run_distributed
from planner.models import load_model
from planner.plan import build_plan, save_plan
from runtime.plans import cpu_cluster
from runtime.workers import max_relative_difference, train_with_first_grads

# 128 sequences of micro-batch 1: 96 micro-batches in the TP=2 then TP=1 pipeline, 32 beside it.
GLOBAL_BATCH = 128
PIPELINES = [
    {
        "micro_batch_size": 1,
        "num_microbatches": 96,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 3],
                "shards": {"query_groups": [3, 1], "ffn": [192, 64], "vocab": [96, 32]},
            },
            {"ranks": [2], "layers": [3, 4]},
        ],
    },
    {"micro_batch_size": 1, "num_microbatches": 32, "stages": [{"ranks": [3], "layers": [0, 4]}]},
]
ONE_RANK = [
    {
        "micro_batch_size": GLOBAL_BATCH,
        "num_microbatches": 1,
        "stages": [{"ranks": [0], "layers": [0, 4]}],
    }
]
FLAGS = ["--train-iters", "2"]
# Measured on this plan, relative to the fp32 run (first iteration's gradient, all parameters;
# its grad norm): summed in bf16 7.8e-3 and 3.5e-4; summed in fp32 3.0e-3 and 5.4e-5 (one rank
# in bf16, with no accumulation at all: 5.6e-3 and 9.5e-5). What is left is bf16 compute.
MAX_GRAD_ERROR = 4.5e-3
MAX_NORM_ERROR = 1.5e-4


def write(directory, name, world, pipelines):
    plan = build_plan(cpu_cluster(world), load_model("tiny"), GLOBAL_BATCH, pipelines)
    path = directory / f"{name}.json"
    save_plan(plan, path)
    return path


def test_bf16_many_microbatches_match_fp32(tmp_path):
    ref = run_distributed(
        train_with_first_grads,
        1,
        write(tmp_path, "one-rank", 1, ONE_RANK),
        extra_flags=FLAGS,
        timeout=300,
    )[0]
    result = run_distributed(
        train_with_first_grads,
        4,
        write(tmp_path, "bf16", 4, PIPELINES),
        extra_flags=FLAGS + ["--bf16"],
        timeout=600,
    )[0]
    assert result["grads"].keys() == ref["grads"].keys()
    diff = sum(((result["grads"][k] - ref["grads"][k]) ** 2).sum() for k in ref["grads"])
    size = sum((ref["grads"][k] ** 2).sum() for k in ref["grads"])
    grad_error = (diff / size).sqrt().item()
    norm_error = max_relative_difference(result["grad_norms"][0], ref["grad_norms"][0])
    loss = [max_relative_difference(a, b) for a, b in zip(result["losses"], ref["losses"])]
    print(
        f"bf16, {GLOBAL_BATCH} micro-batches: gradient error {grad_error:.2e}, grad norm "
        f"{norm_error:.2e}, losses {', '.join(f'{x:.2e}' for x in loss)} (relative to fp32)"
    )
    assert grad_error < MAX_GRAD_ERROR and norm_error < MAX_NORM_ERROR
    assert max(loss) < 1e-3


def _linear_grads(steps, checkpointed):
    """A bf16 linear layer, `steps` backward passes into FP32MainGrads: (main_grad, the passes'
    bf16 weight gradients summed exactly and summed in bf16, whether `.grad` was always
    dropped)."""
    from torch.utils.checkpoint import checkpoint

    from megatron_hexi.grad_sync import FP32MainGrads

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(32, 32, bias=True).to(torch.bfloat16)
    FP32MainGrads(layer.parameters())
    exact = torch.zeros(32, 32, dtype=torch.float64)
    in_bf16 = torch.zeros(32, 32, dtype=torch.bfloat16)
    dropped = True
    for _ in range(steps):
        x = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
        w = layer.weight.detach().requires_grad_()
        torch.nn.functional.linear(x, w, layer.bias.detach()).float().square().sum().backward()
        exact += w.grad.double()  # the same bf16 gradient, summed exactly
        in_bf16 += w.grad
        if checkpointed:  # re-entrant, like megatron-core's recompute
            out = checkpoint(layer, x.requires_grad_(), use_reentrant=True)
        else:
            out = layer(x)
        out.float().square().sum().backward()
        dropped = dropped and layer.weight.grad is None and layer.bias.grad is None
    return layer.weight.main_grad, exact, in_bf16, dropped


@pytest.mark.parametrize("checkpointed", [False, True])
def test_main_grad_sums_backward_passes_in_fp32(checkpointed):
    """Every backward (also one re-entered by activation checkpointing) adds to `main_grad` and
    leaves `.grad` empty; the sum keeps fp32 precision, where a bf16 sum of the same gradients
    does not."""
    main, exact, in_bf16, dropped = _linear_grads(200, checkpointed)
    assert dropped
    assert main.dtype == torch.float32

    def error(t):
        return ((t.double() - exact).norm() / exact.norm()).item()

    print(f"200 bf16 gradients summed in fp32: {error(main):.1e}, in bf16: {error(in_bf16):.1e}")
    assert error(main) < 1e-6 < 1e-4 < error(in_bf16)


def test_bf16_tied_embeddings_with_recompute_match_fp32(tmp_path):
    """main_grad where one parameter has two uses (a tied embedding and output layer on one
    stage, and across stages of TP 2 and 1) and where recompute runs a second forward inside
    the backward: the first gradient must still be the fp32 one-rank gradient to bf16
    precision; a use counted twice, or one dropped, would be off by its whole size."""
    from runtime.plans import PLANS

    model, world, pipelines = PLANS["tied_embeddings_across_tp"]
    ref_plan = build_plan(
        cpu_cluster(1),
        load_model(model),
        8,
        [
            {
                "micro_batch_size": 8,
                "num_microbatches": 1,
                "stages": [{"ranks": [0], "layers": [0, 4]}],
            }
        ],
    )
    save_plan(ref_plan, tmp_path / "one-rank.json")
    plan = build_plan(cpu_cluster(world), load_model(model), 8, pipelines, recompute=True)
    save_plan(plan, tmp_path / "tied.json")
    ref = run_distributed(
        train_with_first_grads, 1, tmp_path / "one-rank.json", extra_flags=FLAGS, timeout=300
    )[0]
    result = run_distributed(
        train_with_first_grads,
        world,
        tmp_path / "tied.json",
        extra_flags=FLAGS + ["--bf16"],
        timeout=600,
    )[0]
    errors = {
        k: ((result["grads"][k] - ref["grads"][k]).norm() / ref["grads"][k].norm()).item()
        for k in ref["grads"]
        if ref["grads"][k].norm() > 0
    }
    worst = max(errors, key=errors.get)
    print(
        f"bf16 tied + recompute: worst parameter gradient {worst} {errors[worst]:.2e}, "
        f"embedding {errors['embedding.word_embeddings.weight']:.2e}"
    )
    assert errors[worst] < 3e-2, errors
