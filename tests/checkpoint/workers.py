"""Functions the checkpoint tests run on every rank (module level, so spawned ranks find them)."""

import torch

# As tests/runtime/workers.py (Adam eps 1e-4 keeps rounding noise from being amplified), with a
# linear lr decay so that the scheduler state matters on resume.
BASE_FLAGS = [
    "--adam-eps",
    "1e-4",
    "--mock-data",
    "--lr",
    "1e-3",
    "--lr-decay-style",
    "linear",
    "--seed",
    "1234",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--log-interval",
    "1000",
    "--weight-decay",
    "0.01",
]


def train(plan_path, flags=()):
    """Train as pretrain_gpt.py does; returns this run's losses and grad norms, the checkpoint
    events, and on launch rank 0 the final parameters gathered to full tensors."""
    import torch.distributed as dist

    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.training import init_distributed, run
    from planner.plan import load_plan

    args = parse_args(["--hetero-plan-path", str(plan_path), *BASE_FLAGS, *flags])
    plan, config = load_plan(args.hetero_plan_path), run_config(args)
    device = init_distributed(plan, config)
    trainer, history = run(plan, config, device)
    full = trainer.full_parameters()
    out = {
        "iterations": [h["iteration"] for h in history],
        "losses": [h["lm_loss"] for h in history],
        "grad_norms": [h["grad_norm"] for h in history],
        "events": trainer.checkpoint_events,
    }
    if dist.get_rank() == 0:
        out["params"] = {k: v.clone() for k, v in full.items()}
    return out


def logits(plan_path, load_dir, tokens):
    """Load `load_dir` under the plan and return the full logits of `tokens` (launch rank 0)."""
    from megatron_hexi import checkpoint
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.inference import forward_logits
    from megatron_hexi.training import Trainer, init_distributed
    from planner.plan import load_plan

    args = parse_args(
        [
            "--hetero-plan-path",
            str(plan_path),
            *BASE_FLAGS,
            "--train-iters",
            "1",
            "--load",
            str(load_dir),
        ]
    )
    plan, config = load_plan(args.hetero_plan_path), run_config(args)
    trainer = Trainer(plan, config, init_distributed(plan, config))
    checkpoint.load(trainer, config.checkpoint)
    return forward_logits(trainer, tokens)


def max_relative_difference(a, b):
    if isinstance(a, torch.Tensor):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
    return abs(a - b) / max(abs(b), 1e-6)


def load_each(plan_path, cases, save_dir):
    """Under the plan, in one process group: load each (label, directory, step) of `cases`,
    {label: "ok" or the error}; then a save into `save_dir` whose checkpoint.json write fails
    with a full disk (label "disk full"), a save with an inf in an Adam moment of launch rank 1
    only ("non-finite"), what they left in `save_dir` ("left over") and the iteration `save_dir`
    then loads ("after failed saves")."""
    import dataclasses
    import errno
    import math
    import os

    import torch.distributed as dist

    from megatron_hexi import checkpoint
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.training import Trainer, init_distributed
    from planner.plan import load_plan

    args = parse_args(
        [
            "--hetero-plan-path",
            str(plan_path),
            *BASE_FLAGS,
            "--train-iters",
            "4",
            "--load",
            str(save_dir),
        ]
    )
    plan, config = load_plan(args.hetero_plan_path), run_config(args)
    trainer = Trainer(plan, config, init_distributed(plan, config))
    out = {}
    for label, directory, step in cases:
        case = dataclasses.replace(config.checkpoint, load=str(directory), ckpt_step=step)
        try:
            checkpoint.load(trainer, case)
            out[label] = "ok"
        except checkpoint.CheckpointError as e:
            out[label] = str(e)

    # A failed load leaves the trainer half overwritten (the "nan" case put its NaN there): the
    # saves start from the intact checkpoint.
    checkpoint.load(trainer, config.checkpoint)

    def disk_full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    from megatron_hexi.checkpoint import writer

    write_json, writer.write_json = writer.write_json, disk_full
    try:
        checkpoint.save(trainer, str(save_dir), 6)
        out["disk full"] = "saved"
    except checkpoint.CheckpointError as e:
        out["disk full"] = str(e)
    finally:
        writer.write_json = write_json

    moment = checkpoint.owned_ranges(trainer)[-1].tensors["exp_avg_sq"]
    first = (0,) * moment.dim()
    kept = moment[first].item()
    if dist.get_rank() == 1:
        moment[first] = math.inf
    try:
        checkpoint.save(trainer, str(save_dir), 8)
        out["non-finite"] = "saved"
    except checkpoint.CheckpointError as e:
        out["non-finite"] = str(e)
    finally:
        moment[first] = kept
    out["left over"] = sorted(n for n in os.listdir(save_dir) if n.startswith("."))
    out["after failed saves"] = checkpoint.load(trainer, config.checkpoint)[0]
    return out
