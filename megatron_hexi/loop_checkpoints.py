"""The training loop's checkpoint steps: what --load resumes from (or a fresh start, as
Megatron-LM makes one when the folder holds no checkpoint) and a save with Megatron-LM's line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from megatron_hexi import checkpoint
from megatron_hexi.checkpoint.state import TrainState
from megatron_hexi.report import AgreedError

if TYPE_CHECKING:
    from megatron_hexi.config import RunConfig


class Trainer(TrainState, Protocol):
    """What the loop's checkpoint steps use of a trainer (megatron_hexi.training.Trainer): the
    checkpoint's state, the run's settings, the event list the run reports, and the parameter
    settling a save needs first."""

    @property
    def config(self) -> RunConfig: ...

    @property
    def checkpoint_events(self) -> list[dict[str, Any]]: ...

    def settle_parameters(self) -> None: ...


def load_at_start(trainer: Trainer) -> int:
    """--load: the checkpoint's iteration (0: a fresh start, the folder holds none)."""
    ckpt = trainer.config.checkpoint
    if not ckpt.load:
        return 0
    found = [checkpoint.checkpoint_exists(ckpt.load) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)  # one decision for every rank
    if not found[0]:  # Megatron-LM: a warning and a fresh start, or an error when asked
        if ckpt.exit_on_missing_checkpoint:
            raise AgreedError(
                f"--load {ckpt.load} holds no checkpoint (--exit-on-missing-checkpoint); "
                f"give a folder with one, or drop the flag to start fresh"
            )
        if dist.get_rank() == 0:
            print(
                f" WARNING: no checkpoint in {ckpt.load}: starting from iteration 0",
                flush=True,
            )
        return 0
    loaded = checkpoint.load(trainer, ckpt)
    trainer.checkpoint_events.append(
        {
            "load_iteration": loaded.iteration,
            "seconds": loaded.seconds,
            "optimizer_restored": loaded.optimizer,
            "rng_restored": loaded.rng,
        }
    )
    return loaded.iteration


def save_at(trainer: Trainer, save: str, iteration: int) -> None:
    """Save `iteration` (every rank) and print Megatron-LM's line."""
    trainer.settle_parameters()
    seconds, size = checkpoint.save(trainer, save, iteration)
    trainer.checkpoint_events.append(
        {"save_iteration": iteration, "seconds": seconds, "bytes": size}
    )
    if dist.get_rank() == 0:
        print(
            f" successfully saved checkpoint from iteration {iteration:>7d} to {save} "
            f"[ {seconds:.3f} s, {size / 1e6:.2f} MB ]",
            flush=True,
        )
