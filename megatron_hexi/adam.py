"""The Adam(W) inside the runtime's optimizers: torch's fused kernel on CUDA.

`torch.optim.AdamW(fused=True)` updates every parameter of a dtype in one multi-tensor kernel and
keeps its step count on the device, so the step needs no host read (torch's foreach AdamW reads
each step count back to the host). Transformer Engine's and apex's FusedAdam, which megatron-core
prefers, are not used: they keep Adam's step count per parameter group rather than per parameter
(`state["step"]`), the layout megatron_hexi.checkpoint saves and restores. On CPU the optimizer is
torch's default AdamW, so the CPU equivalence tests compare what they always did.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def adamw(
    param_groups: Iterable[dict[str, Any]],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    device: torch.device,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW over `param_groups` (fp32 masters or fp32 parameters on `device`); `fused`: None
    means fused on CUDA, the default implementation elsewhere."""
    if fused is None:
        fused = device.type == "cuda"
    return torch.optim.AdamW(
        list(param_groups),
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        fused=fused or None,
    )


def step_state(step: int, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Adam's `state["step"]` for `param` restored at `step`, where torch keeps it: on the
    parameter's device for the fused (or capturable) kernel, else on the host."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return torch.tensor(
        float(step), dtype=torch.float32, device=param.device if on_device else "cpu"
    )
