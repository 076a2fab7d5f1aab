"""megatron-core's optimizer (Adam with decoupled weight decay, or SGD; clipping) with an exact
grad norm.

The upstream norm filters TP duplicates with the global parallel state and sums over one model-
parallel group; under a heterogeneous plan that counts elements twice or misses them. Here every
gradient element is counted once, by the owner of its segment, and summed over the world.

Loss scaling (fp16) is megatron-core's: its grad scalers, and its unscale-and-check of the master
gradients, whose found-inf flag it all-reduces over `get_grad_stats_parallel_group()`. Upstream
that is the model-parallel group; here it is the whole world, so a rank whose gradients are
finite still skips the step an inf elsewhere (another pipeline, a TP peer) made every other rank
skip, and the scalers of all ranks stay equal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    MegatronGradScaler,
)
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_hexi.adam import inner_optimizer
from megatron_hexi.grad_sync import GradientSync, clip_by_norm_, global_norm

if TYPE_CHECKING:
    from megatron_hexi.config import PrecisionConfig, RunConfig
    from planner.plan import Plan


class OwnedGrads(Protocol):
    """What the exact grad norm reads of a gradient sync (a grad_sync.GradientSync, or the
    profiler's one-rank stand-in): the gradient slices this rank counts, and the group the norm
    sums over (None: the world)."""

    @property
    def norm_group(self) -> dist.ProcessGroup | None: ...

    def owned_grads(self) -> list[torch.Tensor]: ...


class _ExactNormMixin:
    grad_sync: OwnedGrads | None = None  # build_optimizer sets it

    if TYPE_CHECKING:  # megatron-core's MegatronOptimizer, which every user of the mixin is

        def get_parameters(self) -> list[torch.nn.Parameter]: ...

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        """This rank's owned gradient slices (views; some are strided column slices)."""
        assert self.grad_sync is not None, "build_optimizer sets grad_sync"
        return self.grad_sync.owned_grads()

    def get_grad_norm(self) -> torch.Tensor:
        """The exact global norm (grad_sync.global_norm), not megatron-core's multi-tensor one:
        a device tensor, read at the step's end."""
        assert self.grad_sync is not None, "build_optimizer sets grad_sync"
        grads = self.get_main_grads_for_grad_norm()
        device = grads[0].device if grads else self.get_parameters()[0].device
        return global_norm(grads, device, self.grad_sync.norm_group)

    def clip_grad_norm(self, clip_grad: float) -> torch.Tensor:
        """megatron-core's clipping of the whole, contiguous gradients, with the exact norm and
        without reading it (grad_sync.clip_by_norm_)."""
        grad_norm = self.get_grad_norm()
        grads = [p.grad for p in self.get_parameters() if p.grad is not None]
        clip_by_norm_(grads, clip_grad, grad_norm)
        return grad_norm

    def get_grad_stats_parallel_group(self) -> dist.ProcessGroup:
        """The world: megatron-core agrees the found-inf flag of loss scaling over this group
        (see the module docstring)."""
        world = dist.group.WORLD
        assert world is not None, "the process group exists before the optimizer is built"
        return world


class HeteroFP32Optimizer(_ExactNormMixin, FP32Optimizer):
    """fp32 training (CPU, or GPU in fp32)."""


class HeteroFloat16Optimizer(_ExactNormMixin, Float16OptimizerWithFloat16Params):
    """bf16 or fp16 parameters with fp32 master weights, and loss scaling when a grad scaler is
    given (fp16).

    The gradients are summed and synced in each parameter's fp32 `main_grad`
    (grad_sync.FP32MainGrads). megatron-core's `_copy_model_grads_to_main_grads` prefers
    `main_grad` and, as it is fp32 already, makes it the master's `.grad` without a copy; so the
    norm reads the owned slices of `main_grad` and clipping scales the same tensors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Without main_grad, megatron-core would drop `.grad` before the norm reads it.
        if any(getattr(p, "main_grad", None) is None for g in self.float16_groups for p in g):
            raise RuntimeError(
                "16-bit parameters need a `main_grad` (grad_sync.FP32MainGrads) "
                "before the optimizer is built"
            )


def param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
) -> list[dict[str, Any]]:
    """Megatron's rule: no weight decay on biases and 1-D parameters (norm weights)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in named_params:
        (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [
        {"params": decay, "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False},
        {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False},
    ]
    for g in groups:
        g["default_config"] = True
    return [g for g in groups if g["params"]]


def params_dtype(precision: PrecisionConfig) -> torch.dtype:
    """The parameters' (and activations') dtype of a run."""
    return torch.bfloat16 if precision.bf16 else torch.float16 if precision.fp16 else torch.float32


def build_grad_scaler(precision: PrecisionConfig) -> MegatronGradScaler | None:
    """megatron-core's rule (get_megatron_optimizer): a constant scaler for --loss-scale, else a
    dynamic one under fp16 (doubling after `loss_scale_window` clean steps, halving after
    `hysteresis` steps with inf/NaN), else none."""
    if precision.loss_scale is not None:
        return ConstantGradScaler(precision.loss_scale)
    if precision.fp16:
        return DynamicGradScaler(
            initial_scale=precision.initial_loss_scale,
            min_scale=precision.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=int(precision.loss_scale_window),
            hysteresis=precision.hysteresis,
        )
    return None


def build_optimizer(
    model: torch.nn.Module,
    grad_sync: OwnedGrads,
    config: RunConfig,
    plan: Plan | None = None,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Adam(W) or SGD (`OptimizerConfig.optimizer`) inside megatron-core's optimizer wrapper,
    plus its lr/wd scheduler, from a RunConfig (megatron_hexi.config).

    With the plan's `use_distributed_optimizer`, the fp32 master weights and Adam state are
    sharded over each gradient segment's ranks (megatron_hexi.distributed_optimizer)."""
    o, precision = config.optimizer, config.precision
    core = OptimizerConfig(
        optimizer=o.optimizer,
        sgd_momentum=o.sgd_momentum,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=precision.bf16,
        fp16=precision.fp16,
        params_dtype=params_dtype(precision),
        loss_scale=precision.loss_scale,
        initial_loss_scale=precision.initial_loss_scale,
        min_loss_scale=precision.min_loss_scale,
        loss_scale_window=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
    )
    scaler = build_grad_scaler(precision) if precision.scaled else None
    if plan is not None and plan.training.use_distributed_optimizer:
        from megatron_hexi.distributed_optimizer import HeteroDistributedOptimizer

        if not isinstance(grad_sync, GradientSync):
            raise TypeError("the distributed optimizer shards over a GradientSync's buckets")
        device = next(model.parameters()).device
        opt = HeteroDistributedOptimizer(
            plan, grad_sync, core, plan.training.optimizer_shard, device, model, scaler
        )
    else:
        inner = inner_optimizer(param_groups(model.named_parameters()), core)
        if precision.half:
            opt = HeteroFloat16Optimizer(inner, core, scaler, lambda _: None)
        else:
            opt = HeteroFP32Optimizer(inner, core, lambda _: None)
        opt.grad_sync = grad_sync  # the distributed optimizer keeps its own (its __init__)
    s, train_iters = config.lr_schedule, config.training.train_iters
    decay_iters = s.lr_decay_iters or train_iters
    # Megatron-LM: warm-up steps = fraction x decay steps (a whole number of iterations or not)
    fraction = s.lr_warmup_fraction
    warmup = s.lr_warmup_iters if fraction is None else fraction * decay_iters
    scheduler = OptimizerParamScheduler(
        opt,
        init_lr=s.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=warmup,  # type: ignore[arg-type,unused-ignore]  # used as a float
        lr_decay_steps=max(decay_iters, math.floor(warmup) + 1),
        lr_decay_style=s.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(train_iters, 1),
        wd_incr_style="constant",
    )
    return opt, scheduler
