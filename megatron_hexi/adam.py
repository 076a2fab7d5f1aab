"""The Adam(W) (or SGD) inside the runtime's optimizers: torch's fused kernels, on every device.

`torch.optim.AdamW(fused=True)` updates every parameter of a dtype in one multi-tensor kernel and
keeps its step count beside the parameters, so the step needs no host read (torch's other AdamW
implementations read each step count back to the host). Transformer Engine's and apex's
FusedAdam, which megatron-core prefers, are not used: they keep Adam's step count per parameter
group rather than per parameter (`state["step"]`), the layout megatron_hexi.checkpoint saves and
restores. torch has a fused CPU kernel too, so the CPU equivalence tests run the same optimizer.

`--optimizer sgd` is megatron-core's SGD (torch.optim.SGD: momentum, L2 weight decay added to
the gradient, dampening 0); its state, the momentum buffer, has the parameter's layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import OptimizerConfig


def adamw(
    param_groups: Iterable[dict[str, Any]],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    fused: bool = True,
) -> torch.optim.AdamW:
    """AdamW over `param_groups` (fp32 masters, or the fp32 parameters themselves); `fused`
    False: torch's default implementation (the fused kernel's reference in the tests)."""
    return torch.optim.AdamW(
        list(param_groups),
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        fused=fused or None,
    )


def inner_optimizer(
    param_groups: Iterable[dict[str, Any]], config: OptimizerConfig
) -> torch.optim.Optimizer:
    """megatron-core's choice by `config.optimizer`: AdamW (`adamw`) or SGD with momentum."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            list(param_groups),
            lr=config.lr,
            weight_decay=config.weight_decay,
            momentum=config.sgd_momentum,
        )
    return adamw(
        param_groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    )


def step_state(step: int, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Adam's `state["step"]` for `param` restored at `step`, where torch keeps it: on the
    parameter's device for the fused (or capturable) kernel, else on the host."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return torch.tensor(
        float(step), dtype=torch.float32, device=param.device if on_device else "cpu"
    )
