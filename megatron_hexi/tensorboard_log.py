"""Optional TensorBoard scalars (--tensorboard-dir), through torch.utils.tensorboard.

Launch rank 0 writes them: it holds every all-reduced metric of the iteration. Names follow
Megatron-LM's where it has one ("lm loss", "learning-rate", "grad-norm", "loss-scale",
"iteration-time", "batch-size", "lm loss validation"; no grad norm for a step skipped under loss
scaling, as there), plus tokens per second, MFU, each pipeline's step time and
each rank's peak memory. `iteration_scalars` and `validation_scalars` own the names: wandb
(megatron_hexi.wandb_log) logs the same ones.
"""

import math
import os
from collections.abc import Mapping
from typing import Any

from planner.errors import SpecError


def check_available() -> None:
    """Raise a one-line SpecError if torch.utils.tensorboard cannot be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise SpecError(
            f"--tensorboard-dir needs the tensorboard package ({e}); install it with "
            f"pip install 'megatron-hexi[tensorboard]' (or pip install tensorboard)"
        )


def iteration_scalars(m: Mapping[str, Any], global_batch_size: int) -> dict[str, float]:
    """The scalars of one training iteration's metrics (training.Trainer.train_step), by name."""
    scalars = {
        "lm loss": m["lm_loss"],
        "learning-rate": m["lr"],
        "loss-scale": m["loss_scale"],
        "iteration-time": m["step_time_s"],
        "batch-size": float(global_batch_size),
        "tokens-per-second": m["tokens_per_s"],
        "mfu": m["mfu"],
    }
    if m["grad_norm"] is not None:
        scalars["grad-norm"] = m["grad_norm"]
    if "params_norm" in m:  # --log-params-norm
        scalars["params-norm"] = m["params_norm"]
    for p, t in enumerate(m["pipelines"]):
        scalars[f"pipeline-step-time/pipeline-{p}"] = t
    for r, gb in enumerate(m["peak_memory_gb"]):
        scalars[f"peak-memory-gb/rank-{r}"] = gb
    return scalars


def validation_scalars(lm_loss: float) -> dict[str, float]:
    """Megatron-LM's names for a validation loss and its perplexity."""
    return {"lm loss validation": lm_loss, "lm loss validation ppl": perplexity(lm_loss)}


def perplexity(lm_loss: float) -> float:
    """exp(loss), capped as Megatron-LM caps it (exp(20)) so a diverged run prints a number."""
    return math.exp(min(20.0, lm_loss))


class TensorBoardLogger:
    """Scalars every `log_interval` iterations (validation scalars whenever computed)."""

    def __init__(self, log_dir: str | os.PathLike[str], log_interval: int = 1) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)
        self.log_interval = max(1, log_interval)

    def log(self, iteration: int, scalars: Mapping[str, float], *, always: bool = False) -> None:
        if iteration % self.log_interval and not always:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, iteration)

    def summary(self, text: str, iteration: int) -> None:
        self.writer.add_text("summary", text, iteration)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
