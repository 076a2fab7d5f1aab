"""The flags of how a run logs, evaluates, stops and checkpoints (one argument group each);
megatron_hexi.flags adds them to pretrain_gpt.py's parser."""

from __future__ import annotations

import argparse

from megatron_hexi.flag_parsing import finite_float


def add_run_flags(p: argparse.ArgumentParser) -> None:
    _logging(p)
    _validation(p)
    _stopping(p)
    _checkpoints(p)


def _logging(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("logging")
    d.add_argument(
        "--log-interval",
        type=int,
        default=1,
        help="print one line every N iterations, averaged over them (as Megatron-LM)",
    )
    d.add_argument(
        "--log-throughput",
        action="store_true",
        help="add the model TFLOP/s per GPU to the iteration line",
    )
    d.add_argument(
        "--log-params-norm",
        action="store_true",
        help="add the parameters' L2 norm (each element once over all ranks) to the iteration "
        "line and TensorBoard (params-norm)",
    )
    d.add_argument(
        "--timing-log-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="accepted: the runtime has one level of timers (the iteration and each "
        "pipeline's step time, always logged)",
    )
    d.add_argument(
        "--tensorboard-dir", default=None, help="write TensorBoard scalars here (default: none)"
    )
    d.add_argument(
        "--tensorboard-log-interval", type=int, default=1, help="scalars every N iterations"
    )
    d.add_argument(
        "--tensorboard-queue-size",
        type=int,
        default=1000,
        help="accepted: the TensorBoard writer's own queue is used",
    )
    for flag, what in (
        ("--log-timers-to-tensorboard", "iteration-time and each pipeline's step time"),
        ("--log-validation-ppl-to-tensorboard", "lm loss validation ppl"),
        ("--log-memory-to-tensorboard", "each rank's peak memory"),
        ("--log-batch-size-to-tensorboard", "batch-size"),
    ):
        d.add_argument(flag, action="store_true", help=f"accepted: {what} is always written")
    d.add_argument(
        "--log-world-size-to-tensorboard",
        action="store_true",
        help="write the world size (world-size) with each iteration's scalars",
    )
    d.add_argument(
        "--wandb-project",
        default=None,
        help="log the TensorBoard scalars to this wandb project (default: none)",
    )
    d.add_argument("--wandb-exp-name", default=None, help="the wandb run's name (default: wandb's)")
    d.add_argument(
        "--wandb-save-dir",
        default=None,
        help="where wandb writes (default: SAVE/wandb with --save, else ./wandb)",
    )
    d.add_argument(
        "--distributed-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="default: nccl on CUDA, gloo on CPU (nccl needs CUDA)",
    )
    d.add_argument(
        "--distributed-timeout-minutes",
        type=finite_float,
        default=10.0,
        help="collective timeout; fractions allowed (a dead or hung peer fails every "
        "rank within it)",
    )


def _validation(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group("validation")
    v.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="validation loss every N iterations and at the end of training (default: at the "
        "end only, when evaluating)",
    )
    v.add_argument(
        "--eval-iters",
        type=int,
        default=None,
        help="global batches per evaluation (default 100 when evaluating; 0: none)",
    )
    v.add_argument(
        "--skip-train",
        action="store_true",
        help="evaluate the loaded (or initial) weights without training",
    )
    v.add_argument(
        "--valid-data-path",
        nargs="+",
        default=None,
        help="validation prefixes, as --data-path (default: the validation split of --split)",
    )


def _stopping(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("stopping and garbage collection")
    s.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="keep training when the loss or the gradient norm is NaN or infinite "
        "(default: stop with an error, as Megatron-LM does)",
    )
    s.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (saving first, with --save) when the iteration is a multiple of it "
        "(default: none)",
    )
    s.add_argument(
        "--exit-duration-in-mins",
        type=finite_float,
        default=None,
        help="stop (saving first, with --save) after the iteration during which this many "
        "minutes since start-up have passed on any rank (default: none)",
    )
    s.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on SIGTERM, finish the current step, save (with --save) and exit 0",
    )
    s.add_argument(
        "--manual-gc",
        action="store_true",
        help="disable Python's automatic garbage collection (every rank then collects at the "
        "same points: --manual-gc-interval, before and after each evaluation)",
    )
    s.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="with --manual-gc: collect every N iterations (0: never during training)",
    )


def _checkpoints(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("checkpoints")
    c.add_argument("--save", default=None, help="checkpoint directory to save to (default: none)")
    c.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="save every N iterations (default: only at the end, with --save)",
    )
    c.add_argument(
        "--load",
        default=None,
        help="checkpoint directory to resume from; one that holds no checkpoint at all starts "
        "fresh with a warning, as in Megatron-LM (default: none)",
    )
    c.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="with --load: a directory that holds no checkpoint is an error",
    )
    c.add_argument(
        "--hetero-load-if-exists",
        action="store_true",
        help="accepted (what --load does): start fresh if DIR holds no checkpoint at all; a "
        "missing or corrupt part of one is still an error",
    )
    c.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="load this iteration (default: latest_checkpointed_iteration.txt's)",
    )
    c.add_argument(
        "--finetune",
        action="store_true",
        help="load weights only: iteration 0, fresh Adam state and RNGs",
    )
    c.add_argument("--no-load-optim", action="store_true", help="do not load Adam state")
    c.add_argument("--no-load-rng", action="store_true", help="do not load RNG states")
    c.add_argument(
        "--override-opt_param-scheduler",
        action="store_true",
        dest="override_opt_param_scheduler",
        help="use this run's lr schedule, not the checkpoint's",
    )
    c.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        action="store_true",
        dest="use_checkpoint_opt_param_scheduler",
        help="use the checkpoint's lr schedule",
    )
