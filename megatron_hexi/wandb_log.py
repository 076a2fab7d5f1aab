"""Optional wandb logging (--wandb-project), with the TensorBoard scalars' names and steps.

The last launch rank writes, as in Megatron-LM. `wandb` is an optional extra
(`pip install 'megatron-hexi[wandb]'`); WANDB_MODE=offline writes the run to disk only, for
machines without a network (sync it later with `wandb sync`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from planner.errors import SpecError

if TYPE_CHECKING:
    from megatron_hexi.config import LoggingConfig


def check_available() -> None:
    """Raise a one-line SpecError if wandb cannot be imported."""
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise SpecError(
            f"--wandb-project needs the wandb package ({e}); install it with "
            f"pip install 'megatron-hexi[wandb]' (or pip install wandb)"
        ) from None


def save_dir(log: LoggingConfig, save: str | None) -> str:
    """Where wandb writes: --wandb-save-dir, else SAVE/wandb (Megatron-LM's default), else
    ./wandb."""
    return log.wandb_save_dir or os.path.join(save or ".", "wandb")


class WandbLogger:
    """One wandb run; scalars every `log_interval` iterations (validation whenever computed)."""

    def __init__(self, log: LoggingConfig, save: str | None, config: Mapping[str, Any]) -> None:
        check_available()
        import wandb

        directory = save_dir(log, save)
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(
            project=log.wandb_project,
            name=log.wandb_exp_name,
            dir=directory,
            config=dict(config),
        )
        self.log_interval = max(1, log.tensorboard_log_interval)

    def log(self, iteration: int, scalars: Mapping[str, float], *, always: bool = False) -> None:
        if iteration % self.log_interval and not always:
            return
        self.run.log(dict(scalars), step=iteration)

    def summary(self, text: str, iteration: int) -> None:
        self.run.summary["summary"] = text

    def close(self) -> None:
        self.run.finish()
