"""What the data tests run on every rank: train a plan on real data exactly as pretrain_gpt.py
does (tests/runtime/workers.py's flags, --data-path instead of --mock-data), recording the
micro-batches each rank's pipeline read."""

import torch

from runtime.workers import BASE_FLAGS

REAL_FLAGS = [f for f in BASE_FLAGS if f != "--mock-data"]


def train_real(plan_path, extra_flags):
    """Returns on launch rank 0: losses, grad norms, and per plan rank the tokens and labels it
    read in each iteration ([samples, seq]), with its pipeline and whether it holds the
    embedding/output."""
    import torch.distributed as dist

    import megatron_hexi.data as data
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.training import init_distributed, run
    from planner.plan import load_plan

    read = {}
    real = data.pipeline_microbatches

    def recording(dataset, plan, view, iteration):
        for batch in real(dataset, plan, view, iteration):
            read.setdefault(iteration, []).append(
                (batch["tokens"].clone(), batch["labels"].clone())
            )
            yield batch

    data.pipeline_microbatches = recording  # training.py imports it at each step
    try:
        args = parse_args(["--hetero-plan-path", str(plan_path), *REAL_FLAGS, *extra_flags])
        plan, config = load_plan(args.hetero_plan_path), run_config(args)
        device = init_distributed(plan, config)
        trainer, history = run(plan, config, device)
    finally:
        data.pipeline_microbatches = real
    v = trainer.view
    mine = {
        "plan_rank": trainer.rank,
        "pipeline": v.pipeline,
        "samples": tuple(v.samples),
        "embedding": v.holds_embedding,
        "output": v.holds_output,
        "read": {
            it: (torch.cat([t for t, _ in mbs]), torch.cat([lb for _, lb in mbs]))
            for it, mbs in read.items()
        },
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {
        "losses": [h["lm_loss"] for h in history],
        "grad_norms": [h["grad_norm"] for h in history],
        "ranks": {e["plan_rank"]: e for e in everyone},
    }


def train_each(plan_path, runs):
    """train_real for each {name: extra flags} in turn, in one launch (each launch costs seconds
    of start-up); returns {name: train_real's result} on launch rank 0."""
    return {name: train_real(plan_path, flags) for name, flags in runs.items()}
