"""Plain megatron-core's Adam and constant-weight-decay scheduler, as Megatron-LM's training loop
builds them: the baseline the GPU check and the runtime-overhead benchmark both compare with."""

from __future__ import annotations

from typing import Any


def megatron_adam(
    model: Any, o: Any, *, decay_steps: int, decay_style: str, min_lr: float, bf16: bool
) -> tuple[Any, Any]:
    """(optimizer, scheduler) for `model` from `o`, anything with Megatron's optimizer fields
    (lr, min_lr, weight_decay, adam_beta1/2, adam_eps, clip_grad)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
        ),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=min_lr,
        lr_warmup_steps=0,
        lr_decay_steps=decay_steps,
        lr_decay_style=decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
