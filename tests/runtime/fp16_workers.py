"""What the fp16 tests run on every rank: several trainings one after another in one process
group (one launch checks several things), each optionally with an inf put into one rank's
gradient at given iterations, or with a defect.

An inf is written into the first element of one rank's first local parameter gradient as
autograd produces it (a tensor hook, before it is accumulated and before any bucket of an
overlapped sync starts): what an fp16 overflow in that rank's backward alone leaves behind.
After the sync it reaches only that segment's holders (under the distributed optimizer only its
owner), so every other rank skips the step only if the found-inf flag is agreed over the whole
world.
"""

import torch

from runtime.workers import BASE_FLAGS

# fp16 with dynamic loss scaling; the scale (256, then 128, 64, ...) is far below what overflows
# these tiny models (the logits' gradient of a label token is about -scale, fp16's largest
# finite value is 65504), so only the put-in infs skip steps, on the reference as under a plan.
FP16_FLAGS = [
    "--fp16",
    "--initial-loss-scale",
    "256",
    "--loss-scale-window",
    "2",
    "--hysteresis",
    "2",
    "--train-iters",
    "7",
]


def _defect(name):
    """Patch one loss-scaling defect into this process; returns the undo function."""
    from megatron.core.optimizer.grad_scaler import MegatronGradScaler

    from megatron_hexi.distributed_optimizer import HeteroDistributedOptimizer

    if name == "no_unscale":
        # The gradients stay scaled: clipping and the reported norm see scale x the gradient.
        real = MegatronGradScaler.inv_scale
        MegatronGradScaler.inv_scale = property(lambda self: torch.ones_like(self._scale))

        def undo():
            MegatronGradScaler.inv_scale = real

        return undo
    if name == "pipeline_found_inf":
        # megatron-core's group: the found-inf flag agreed over one pipeline (its model-parallel
        # ranks), not the world; `pipeline_group` is set once the trainer exists
        real_group = HeteroDistributedOptimizer.get_grad_stats_parallel_group
        HeteroDistributedOptimizer.get_grad_stats_parallel_group = lambda self: self.pipeline_group

        def undo():
            HeteroDistributedOptimizer.get_grad_stats_parallel_group = real_group

        return undo
    if name is not None:
        raise ValueError(name)
    return lambda: None


def train_fp16_runs(runs):
    """Train each run in turn: {"plan", "flags", "inject": (plan rank, [iterations]) or None,
    "defect": None or a `_defect` name, "initial": gather the initial parameters}. Returns, on
    launch rank 0, per run: losses, grad norms, loss scales, iterations, final (and initial)
    parameters as full canonical tensors, and from every rank its skip decisions, whether its
    own synced gradients held an inf or NaN (per iteration), scheduler steps, Adam steps and
    final scaler state."""
    return [_train_one(spec) for spec in runs]


def _train_one(spec):
    import torch.distributed as dist

    from megatron_hexi import training
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.checkpoint.state import adam_steps, scaler_state
    from megatron_hexi.grad_sync import param_grad
    from planner.plan import load_plan

    real_step, real_finalize, real_init = (
        training.Trainer.train_step,
        training.Trainer._finalize_grads,
        training.Trainer.__init__,
    )
    inject, initial = spec.get("inject"), {}

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if spec.get("defect") == "pipeline_found_inf":
            for p, pipe in enumerate(self.plan.pipelines):  # every rank makes every group
                group = dist.new_group(sorted(self.groups.launch_of[r] for r in pipe.ranks))
                if p == self.view.pipeline:
                    self.optimizer.pipeline_group = group
        if spec.get("initial"):
            initial.update(self.full_parameters() or {})
        if inject and self.rank == inject[0]:
            trainer = self

            def overflow(grad):
                if trainer.fp16_iteration not in inject[1]:
                    return grad
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
                return grad

            self.params[0][1].register_hook(overflow)

    def train_step(self, iteration):
        self.fp16_iteration = iteration + 1
        return real_step(self, iteration)

    def finalize(self, *args, **kwargs):
        real_finalize(self, *args, **kwargs)
        # what this rank's own unscale-and-check reads: the synced gradients it holds (the
        # distributed optimizer: its master parts')
        opt = self.optimizer
        grads = (
            opt.get_main_grads_for_grad_norm()
            if hasattr(opt, "parts")
            else [param_grad(p) for _, p in self.params]
        )
        local = any(not bool(torch.isfinite(g).all()) for g in grads)
        self.fp16_local_inf = [*getattr(self, "fp16_local_inf", []), local]

    training.Trainer.__init__ = init
    training.Trainer.train_step = train_step
    training.Trainer._finalize_grads = finalize
    undo = _defect(spec.get("defect"))
    try:
        args = parse_args(["--hetero-plan-path", str(spec["plan"]), *BASE_FLAGS, *spec["flags"]])
        plan, config = load_plan(args.hetero_plan_path), run_config(args)
        trainer, history = training.run(plan, config, training.init_distributed(plan, config))
        full = trainer.full_parameters()
    finally:
        training.Trainer.__init__ = real_init
        training.Trainer.train_step = real_step
        training.Trainer._finalize_grads = real_finalize
        undo()
    mine = {
        "plan_rank": trainer.rank,
        "success": [h["success"] for h in history],
        "scheduler_steps": trainer.scheduler.num_steps,
        "adam_steps": sorted(adam_steps(trainer.optimizer)),
        "scaler": scaler_state(trainer.optimizer),
        "local_inf": getattr(trainer, "fp16_local_inf", []),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    embedding = trainer.model.embedding.word_embeddings if trainer.view.holds_embedding else None
    out = {
        "iterations": [h["iteration"] for h in history],
        "losses": [h["lm_loss"] for h in history],
        "grad_norms": [h["grad_norm"] for h in history],
        "loss_scales": [h["loss_scale"] for h in history],
        "dtype": None if embedding is None else str(embedding.weight.dtype),
        "ranks": sorted(everyone, key=lambda e: e["plan_rank"]),
    }
    if dist.get_rank() == 0:
        out["params"] = {k: v.float().clone() for k, v in full.items()}
        if spec.get("initial"):
            out["initial"] = {k: v.float().clone() for k, v in initial.items()}
    return out
