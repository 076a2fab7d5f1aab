"""Loading a checkpoint into a trainer (collective): weights, optimizer state, the learning-rate
schedule and RNG states, under any plan of the same model.

`load` runs every check inside its status exchange, so all ranks report the same error. The
checks run on a few threads while the data is copied into the trainer; a failed load leaves the
trainer unusable and ends the process.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_hexi.checkpoint.commit import agree
from megatron_hexi.checkpoint.format import island_kind
from megatron_hexi.checkpoint.reader import Checkpoint
from megatron_hexi.checkpoint.state import (
    TrainState,
    restore_optimizer,
    restore_scaler,
    set_rng_state,
)
from megatron_hexi.checkpoint_files import METADATA, CheckpointError
from planner.errors import SpecError
from planner.island_match import island_sites, source_islands

if TYPE_CHECKING:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_hexi.config import CheckpointConfig
    from planner.plan import Plan


class Loaded(NamedTuple):
    """What `load` restored. RNG states come back only under the plan that saved them (a rank
    of another plan draws other numbers); with dropout 0 nothing depends on them."""

    iteration: int
    seconds: float
    optimizer: bool  # Adam moments and step
    rng: bool


def load(trainer: TrainState, config: CheckpointConfig, verify: bool = True) -> Loaded:
    """Load `config.load` (a CheckpointConfig, megatron_hexi.config) into the trainer
    (collective) and say what was restored (Loaded). Every check, verification included, runs
    before the status exchange, so every rank raises the same CheckpointError; `verify=False`
    only serves to measure what verification costs."""
    start = time.perf_counter()
    plan = trainer.plan
    finetune = config.finetune
    load_optim = not (finetune or config.no_load_optim)
    load_rng = not (finetune or config.no_load_rng)
    error: str | None = None
    ckpt: Checkpoint | None = None
    notes: list[str] = []
    moments = rng_restored = False
    try:
        # The checks run while the trainer is filled and are reported on leaving the `with`
        # (Checkpoint._verified_slice: a failed load leaves the trainer unusable).
        with Checkpoint(config.load or "", config.ckpt_step, verify=verify) as ckpt:
            ckpt.check_model(plan.model)
            saved_gbs = ckpt.meta.get("global_batch_size")
            if (
                not finetune
                and ckpt.iteration
                and saved_gbs is not None
                and saved_gbs != plan.global_batch_size
            ):
                raise CheckpointError(
                    f"{ckpt.dir}: saved with global batch size {saved_gbs}, this plan has "
                    f"{plan.global_batch_size}: the data position (global batch i = samples "
                    f"[i x G, (i + 1) x G)) cannot continue; use --finetune to start at "
                    f"iteration 0 from these weights"
                )
            islands, saved = len(plan.island_pipelines()), ckpt.meta.get("islands", 1)
            has_outer = any(kind == "outer_param" for kind, _ in ckpt.index)
            joinable = plan.training.outer is not None and load_optim and has_outer
            sources = _source_islands(ckpt, plan, joinable)
            # a one-island checkpoint starts every island from its weights and optimizer state;
            # otherwise each island continues from the saved island of its site, and one on a
            # site the checkpoint has none of joins: from the outer parameters, with the inner
            # optimizer state of the first island that continues (every island's Adam step
            # stays the same)
            source = sources[plan.rank_view(trainer.rank).island]
            joined = [i for i, s in enumerate(sources) if s is None]
            state_of = source if source is not None else next(s for s in sources if s is not None)
            param_kind = island_kind("param", state_of) if source is not None else "outer_param"
            with torch.no_grad():
                for shard, param in trainer.params:
                    param.copy_(ckpt.read_local(shard, param_kind, param.dtype))
                # each optimizer its own state: Adam's moments and step, or SGD's momentum
                if trainer.optimizer.config.optimizer == "sgd":
                    moments = load_optim and bool(ckpt.meta.get("sgd_momentum_state"))
                    step = 0 if moments else None
                    restore_optimizer(trainer, ckpt, step, True, state_of, param_kind)
                else:
                    moments = load_optim and ckpt.has_optimizer_state
                    step = ckpt.meta["adam_step"] if moments else None
                    restore_optimizer(trainer, ckpt, step, island=state_of, weights=param_kind)
                if plan.training.outer is not None and saved == 1 < islands:
                    trainer.outer.restore(None, [])  # theta_outer = the weights, momentum 0
                    notes.append(
                        f"a one-island checkpoint: each of the {islands} islands starts from "
                        f"its weights, the outer step afresh"
                    )
                elif plan.training.outer is not None:
                    notes += _restore_outer(trainer, ckpt, load_optim)
                elif saved > 1 == islands:  # one island left, synchronous: no outer state
                    notes.append(
                        f"saved with {saved} islands; this plan's one island continues from "
                        f"saved island {source}, synchronously (the outer state and any outer "
                        f"step not yet written are dropped)"
                    )
                if 1 < islands and 1 < saved and sources != list(range(islands)):
                    notes.append(
                        f"islands continue from saved islands {sources} (by site"
                        + (f"; islands {joined} join from the outer parameters" if joined else "")
                        + f"); the outer steps from here average over these {islands}"
                    )
        if load_optim and not moments:
            notes.append("no optimizer state for this optimizer in the checkpoint: it starts fresh")
        meta_path = os.path.join(ckpt.dir, METADATA)
        if not finetune and ckpt.meta["scheduler"]:
            try:
                _load_scheduler(trainer.scheduler, ckpt.meta["scheduler"], config)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - a key missing or of the wrong type
                raise CheckpointError(
                    f"{meta_path}: scheduler: malformed ({type(e).__name__}: {e})"
                )
        if load_optim and getattr(trainer.optimizer, "grad_scaler", None) is not None:
            # with the optimizer state, as in Megatron-LM (absent from saves before it existed)
            saved_scaler = ckpt.meta.get("grad_scaler")
            try:
                restored = isinstance(saved_scaler, dict) and restore_scaler(
                    trainer.optimizer, saved_scaler
                )
            except Exception as e:  # noqa: BLE001 - a key missing or of the wrong type
                raise CheckpointError(
                    f"{meta_path}: grad_scaler: malformed ({type(e).__name__}: {e})"
                )
            if not restored and not _constant_scale(trainer):
                notes.append(
                    "no loss scaler state in the checkpoint: the loss scale starts at "
                    "--initial-loss-scale"
                )
        same_plan = (ckpt.meta["plan"] or {}).get("pipelines") == plan.to_dict()["pipelines"]
        if load_rng and ckpt.meta["rng"]:
            if same_plan and str(trainer.rank) in ckpt.meta["rng"]:
                try:
                    set_rng_state(ckpt.meta["rng"][str(trainer.rank)])
                    rng_restored = True
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(
                        f"{meta_path}: rng.{trainer.rank}: malformed ({type(e).__name__}: {e})"
                    )
            else:
                notes.append(
                    "RNG states not restored: the checkpoint's plan differs (RNGs stay "
                    "seeded from --seed)"
                )
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    agree(error, f"loading checkpoint {config.load}")
    assert ckpt is not None  # opened, or `agree` raised

    iteration = 0 if finetune else ckpt.iteration
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(
            f" loaded checkpoint from {ckpt.dir} at iteration {iteration} in {seconds:.3f} s"
            + "".join(f"; {n}" for n in notes),
            flush=True,
        )
    return Loaded(iteration, seconds, moments, rng_restored)


def _source_islands(ckpt: Checkpoint, plan: Plan, joinable: bool) -> list[int | None]:
    """The saved island each of the plan's islands continues from (planner.island_match: by
    site; by index where the checkpoint or the plan names none; None: it joins)."""
    saved, sites = ckpt.meta.get("islands", 1), ckpt.meta.get("island_sites")
    if sites is not None and not (
        isinstance(sites, list)
        and len(sites) == saved
        and all(s is None or isinstance(s, str) for s in sites)
    ):
        raise CheckpointError(
            f"{os.path.join(ckpt.dir, METADATA)}: island_sites must be a list of {saved} site "
            f"names (or nulls), got {str(sites)[:60]}"
        )
    try:
        return source_islands(saved, sites, island_sites(plan), joinable)
    except SpecError as e:
        raise CheckpointError(f"{ckpt.dir}: {e.problems[0]}")


def _restore_outer(trainer: TrainState, ckpt: Checkpoint, load_optim: bool) -> list[str]:
    """The outer state (islands): theta_outer, the momentum and the fragments whose outer step
    waits to be written, read by canonical ranges; without it in the checkpoint (or with the
    optimizer state not loaded) the outer step starts afresh from the loaded weights."""
    shapes = {shard.name: shard.shape for shard, _ in trainer.params}
    if not (load_optim and any(kind == "outer_param" for kind, _ in ckpt.index)):
        trainer.outer.restore(None, [])
        return ["no outer state loaded: the outer step starts from the loaded weights"]

    def read(kind: str, held: Any, out: torch.Tensor) -> None:
        seg = held.range.segment
        ckpt.read_range(
            kind, seg.name, seg.dim, seg.start, seg.end - seg.start, shapes[seg.name], out
        )

    trainer.outer.restore(read, list(ckpt.meta.get("outer_landed", [])))
    return []


def _constant_scale(trainer: TrainState) -> bool:
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    return isinstance(getattr(trainer.optimizer, "grad_scaler", None), ConstantGradScaler)


def _load_scheduler(
    scheduler: OptimizerParamScheduler, saved: dict[str, Any], config: CheckpointConfig
) -> None:
    """Megatron's rule: the run's schedule must match the checkpoint's (one clear error naming
    the field) unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler."""
    mine = scheduler.state_dict()
    if config.override_opt_param_scheduler:
        scheduler.override_opt_param_scheduler = True
    elif config.use_checkpoint_opt_param_scheduler:
        scheduler.use_checkpoint_opt_param_scheduler = True
    else:
        ignored = {"num_steps"} | (
            {"wd_incr_steps"} if mine.get("wd_incr_style") == "constant" else set()
        )
        diff = [
            f"{k}: checkpoint {saved[k]!r}, this run {mine[k]!r}"
            for k in mine
            if k not in ignored and k in saved and saved[k] != mine[k]
        ]
        if diff:
            raise CheckpointError(
                f"--load {config.load}: the learning-rate schedule differs from the checkpoint's "
                f"({'; '.join(diff)}); give the same --lr/--min-lr/--lr-*/--train-iters, or "
                f"--use-checkpoint-opt_param-scheduler / --override-opt_param-scheduler"
            )
        saved = {**saved, "wd_incr_steps": mine["wd_incr_steps"]}
    scheduler.load_state_dict(saved)
