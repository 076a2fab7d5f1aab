"""What the island tests run on every rank: train a plan with islands as pretrain_gpt.py does and
return, on launch rank 0, the losses, the outer-step metrics and every island's parameters
(each island holds its own copy between outer steps)."""

import torch

from runtime.workers import BASE_FLAGS


def _break_outer(defect):
    """Monkeypatch one defect into this process's outer step (or its checkpoint load)."""
    from megatron_hexi import outer_step

    if defect == "equal_weights":  # islands averaged equally, not by their tokens
        outer_step.island_weights = lambda plan: (
            [1 / len(plan.island_pipelines())] * len(plan.island_pipelines())
        )
    elif defect == "momentum_dropped":  # the outer momentum not kept between outer steps
        real_apply = outer_step.OuterStep._apply

        def apply(self, bucket, delta):
            for h in bucket.held:
                self.momentum[h.index].zero_()
            real_apply(self, bucket, delta)

        outer_step.OuterStep._apply = apply
    elif defect == "islands_by_index":  # a checkpoint's islands matched by index, not site
        from megatron_hexi.checkpoint import loader

        loader._source_islands = lambda ckpt, plan, joinable: list(
            range(len(plan.island_pipelines()))
        )
    elif defect is not None:
        raise ValueError(defect)


def island_parameters(trainer):
    """On launch rank 0: [{name: full fp32 tensor}] per island, from that island's ranks."""
    import torch.distributed as dist

    mine = (
        trainer.view.island,
        [(shard, p.detach().float().clone()) for shard, p in trainer.params],
    )
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    out = {}
    for island, shards in everyone:
        full = out.setdefault(island, {})
        for shard, t in shards:
            whole = full.setdefault(shard.name, torch.zeros(shard.shape))
            for piece in shard.pieces:
                whole.narrow(shard.dim, piece.global_start, piece.length).copy_(
                    t.narrow(shard.dim, piece.local_start, piece.length)
                )
    return [out[k] for k in sorted(out)]


def train_islands(plan_path, extra_flags=(), defect=None):
    import torch.distributed as dist

    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.training import init_distributed, run
    from planner.plan import load_plan

    args = parse_args(["--hetero-plan-path", str(plan_path), *BASE_FLAGS, *extra_flags])
    plan, config = load_plan(args.hetero_plan_path), run_config(args)
    device = init_distributed(plan, config)
    _break_outer(defect)
    trainer, history = run(plan, config, device)
    trainer.settle_parameters()
    params = island_parameters(trainer)
    if dist.get_rank() != 0:
        return None
    return {
        "losses": [h["lm_loss"] for h in history],
        "outer_step": [h.get("outer_step") for h in history],
        "outer_sync_bytes": [h.get("outer_sync_bytes") for h in history],
        "islands": params,
    }
