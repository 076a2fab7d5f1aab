"""Which of megatron-core's fused kernels run (megatron_hexi.fusions), from faked environments: off
on CPU, each on CUDA where its requirements are met, each switched off by its Megatron-LM flag;
and the fp32 `main_grad` honours a fused weight-gradient GEMM's `grad_added_to_main_grad`."""

import dataclasses

import pytest
import torch

from megatron_hexi.arguments import parse_args, run_config
from megatron_hexi.config import FusionConfig
from megatron_hexi.fusions import FUSIONS, FusionEnvironment, Fusions, choose_fusions
from megatron_hexi.grad_sync import FP32MainGrads

BARE_CUDA = FusionEnvironment(
    cuda=True,
    te=False,
    apex_wgrad=False,
    softmax_kernels=False,
    swiglu=True,
    add_bias_linear=False,
    main_grad=True,
    transformer_impl="local",
    holds_output=True,
)
EVERYTHING = dataclasses.replace(BARE_CUDA, te=True, apex_wgrad=True, softmax_kernels=True)


def _on(f: Fusions) -> set[str]:
    return {name for name in FUSIONS if getattr(f, name)}


def test_cpu_runs_no_fusion():
    everything_allowed = FusionConfig(cross_entropy_loss_fusion=True)
    f = choose_fusions(everything_allowed, dataclasses.replace(EVERYTHING, cuda=False))
    assert _on(f) == set()
    assert f.config_fields() == {name: False for name in FUSIONS}
    assert f.line() == "fusions on: none (CPU runs the reference layers)"


def test_cuda_without_extensions_runs_the_jit_fusions():
    f = choose_fusions(FusionConfig(), BARE_CUDA)
    assert _on(f) == {"bias_activation_fusion", "bias_dropout_fusion"}
    why = dict(f.why_not)
    assert why["apply_rope_fusion"] == "needs Transformer Engine"
    assert why["masked_softmax_fusion"] == "needs the scaled_masked_softmax_cuda kernels"
    assert why["gradient_accumulation_fusion"] == "needs apex's fused_weight_gradient_mlp_cuda"
    assert why["cross_entropy_loss_fusion"] == "switched off"  # off by default, as Megatron-LM


def test_cuda_with_te_and_apex_runs_every_fusion_allowed():
    assert _on(choose_fusions(FusionConfig(), EVERYTHING)) == set(FUSIONS) - {
        "cross_entropy_loss_fusion"
    }
    allowed = FusionConfig(cross_entropy_loss_fusion=True)
    assert _on(choose_fusions(allowed, EVERYTHING)) == set(FUSIONS)


def test_requirements_of_the_stage():
    fp32 = choose_fusions(
        FusionConfig(cross_entropy_loss_fusion=True),
        dataclasses.replace(EVERYTHING, main_grad=False),
    )
    assert dict(fp32.why_not) == {
        "gradient_accumulation_fusion": "fp32 parameters have no main_grad",
        "cross_entropy_loss_fusion": "bf16 runs only",
    }
    gelu_no_bias = dataclasses.replace(EVERYTHING, swiglu=False, add_bias_linear=False)
    assert not choose_fusions(FusionConfig(), gelu_no_bias).bias_activation_fusion
    gelu_bias = dataclasses.replace(gelu_no_bias, add_bias_linear=True)
    assert choose_fusions(FusionConfig(), gelu_bias).bias_activation_fusion
    # TE's linear layers fuse the weight-gradient accumulation themselves; megatron-core's own
    # output layer still needs apex
    te = dataclasses.replace(BARE_CUDA, te=True, transformer_impl="transformer_engine")
    assert choose_fusions(
        FusionConfig(), dataclasses.replace(te, holds_output=False)
    ).gradient_accumulation_fusion
    assert not choose_fusions(FusionConfig(), te).gradient_accumulation_fusion


@pytest.mark.parametrize(
    "flag,field",
    [
        ("--no-bias-swiglu-fusion", "bias_activation_fusion"),
        ("--no-bias-gelu-fusion", "bias_activation_fusion"),
        ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
        ("--no-rope-fusion", "apply_rope_fusion"),
        ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
        ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
    ],
)
def test_megatron_flags_switch_each_fusion_off(flag, field):
    base = ["--hetero-plan-path", "p.json", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
    assert run_config(parse_args(base)).fusions == FusionConfig()
    allowed = run_config(parse_args([*base, flag])).fusions
    assert allowed == dataclasses.replace(FusionConfig(), **{field: False})
    f = choose_fusions(allowed, EVERYTHING)
    assert not getattr(f, field) and dict(f.why_not)[field] == "switched off"
    ce = run_config(parse_args([*base, "--cross-entropy-loss-fusion"])).fusions
    assert ce.cross_entropy_loss_fusion


def test_stage_config_carries_the_fusions():
    from megatron_hexi.model import stage_config
    from planner.models import load_model
    from planner.plan import build_plan
    from runtime.plans import cpu_cluster, one_stage

    model = load_model("tiny")
    pipeline = {"micro_batch_size": 1, "num_microbatches": 2, "stages": [one_stage(1)]}
    plan = build_plan(cpu_cluster(1), model, 2, [pipeline])
    view = plan.rank_view(0)
    assert not any(
        getattr(stage_config(plan, view), name) for name in FUSIONS
    )  # no fusions given: the reference layers
    on = Fusions(bias_activation_fusion=True, bias_dropout_fusion=True)
    cfg = stage_config(plan, view, fusions=on)
    assert cfg.bias_activation_fusion and cfg.bias_dropout_fusion
    assert not (cfg.apply_rope_fusion or cfg.gradient_accumulation_fusion)


class _FusedWgradLinear(torch.autograd.Function):
    """What megatron-core's linear layer does under gradient_accumulation_fusion (its CUDA
    kernel replaced by the same sum): the weight gradient goes straight into `main_grad`, autograd
    gets a dummy gradient (uninitialised, or zeros with `zero_out_wgrad`), and the flag is set."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        weight.main_grad.add_(grad_out.t() @ x)
        zero = getattr(weight, "zero_out_wgrad", False)
        dummy = (torch.zeros_like if zero else torch.empty_like)(weight)
        if not zero:
            dummy.fill_(1e6)  # garbage that must never reach main_grad
        weight.grad_added_to_main_grad = True
        return grad_out @ weight, dummy


@pytest.mark.parametrize("tied", [False, True])
def test_main_grad_honours_grad_added_to_main_grad(tied):
    """Two micro-batches through a fused layer (and, tied, the same weight also used unfused, as
    a tied embedding): main_grad holds each gradient once, exactly the unfused sum."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(4, 3, generator=gen)
    xs = [torch.randn(5, 3, generator=gen) for _ in range(2)]

    def loss(w, x, fused):
        y = _FusedWgradLinear.apply(x, w) if fused else x @ w.t()
        out = (y**2).sum()
        return out + (w * x[:4]).sum() if tied else out

    ref = w0.clone().requires_grad_(True)
    for x in xs:
        loss(ref, x, fused=False).backward()
    w = torch.nn.Parameter(w0.clone())
    if tied:
        w.zero_out_wgrad = True  # megatron-core's mark of a weight shared on one stage
    main = FP32MainGrads([w])
    for _ in range(2):
        main.zero()
        assert w.grad_added_to_main_grad is False
        for x in xs:
            loss(w, x, fused=True).backward()
        assert w.grad is None
        torch.testing.assert_close(w.main_grad, ref.grad, rtol=1e-6, atol=1e-6)


def _cross_entropy_both_ways():
    """Per-token loss and logits gradient of one TP rank's uneven vocabulary shard (30 and 20
    of 50 rows), unfused and through the fused arithmetic. megatron-core's `jit_fuser` is turned
    into a no-op first (torch.compile of it is what CUDA runs; this checks the arithmetic and
    the shard offsets around it). The rank forks from a process that imported megatron-core's
    models, which import `fused_cross_entropy` with torch.compile as its decorator: it is
    imported again under the no-op (else each rank compiles it with inductor, seconds on CPU)."""
    import importlib

    import megatron.core.jit as jit
    import torch.distributed as dist

    jit.disable_jit_fuser()
    from megatron.core.fusions import fused_cross_entropy

    importlib.reload(fused_cross_entropy)
    assert not hasattr(fused_cross_entropy.calculate_logits_max, "_torchdynamo_orig_callable")
    from megatron_hexi.loss import sharded_cross_entropy

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(16, 2, 50, generator=gen)
    target = torch.randint(0, 50, (16, 2), generator=gen)
    start, size = ((0, 30), (30, 20))[rank]
    out = []
    for fused in (False, True):
        x = full[..., start : start + size].clone().requires_grad_(True)
        loss = sharded_cross_entropy(x, target, start, dist.group.WORLD, 2, fused=fused)
        (loss * torch.arange(32.0).view(16, 2)).sum().backward()
        out.append((loss.detach(), x.grad))
    (loss, grad), (fused_loss, fused_grad) = out
    reference = torch.nn.functional.cross_entropy(
        full.view(-1, 50), target.view(-1), reduction="none"
    )
    return (
        (fused_loss - loss).abs().max().item(),
        (loss.view(-1) - reference).abs().max().item(),
        # megatron-core's fused backward returns the gradient in bf16
        torch.equal(fused_grad, grad.bfloat16().float()),
    )


def test_fused_cross_entropy_matches_the_unfused_one():
    from harness import run_distributed

    for loss_diff, reference_diff, grads_equal in run_distributed(
        _cross_entropy_both_ways, 2, timeout=240
    ):
        assert loss_diff < 1e-6 and reference_diff < 1e-5 and grads_equal
