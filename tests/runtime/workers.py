"""Functions the runtime tests run on every rank (module level, so spawned processes find them).

`train` trains a plan for a few steps exactly as pretrain_gpt.py does and returns, on launch
rank 0, the per-iteration losses and grad norms and the final parameters gathered to full
tensors. `defect` deliberately breaks the gradient sync the way the HexiScale code does, to prove
the equivalence tests catch it.
"""

import contextlib

import torch

# Adam's eps is 1e-4 here, not 1e-8: in the first steps Adam divides each gradient element by its
# own magnitude, so with eps 1e-8 elements whose gradient is ~0 turn float rounding (sums taken in
# another order across pipelines) into lr-sized updates. Measured on the two-pipeline plan: eps
# 1e-8 gives losses and grad norms equal to 7e-8 but parameters only to 1.3e-4 relative (4e-6
# absolute, at lr 1e-3); eps 1e-4 gives parameters to ~1e-6. The gradients are what the runtime
# computes; this keeps the optimizer from amplifying rounding noise in the comparison.
BASE_FLAGS = [
    "--adam-eps",
    "1e-4",
    "--mock-data",
    "--train-iters",
    "3",
    "--lr",
    "1e-3",
    "--lr-decay-style",
    "constant",
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


def _break_sync(defect):
    """Monkeypatch one HexiScale defect into this process's runtime."""
    import dataclasses

    from megatron_hexi.grad_sync import GradientSync
    from planner import layout

    if defect == "misaligned_fused":
        # Sync as if each rank's fused [q; k; v] and [gate; up] rows were one contiguous block
        # at offset tp_rank x local rows (the weights themselves are still initialised right).
        real = layout.rank_param_shards

        def misaligned(plan, rank):
            tp_rank = plan.rank_view(rank).tp_rank
            shards = []
            for s in real(plan, rank):
                if "linear_qkv" in s.name or "linear_fc1" in s.name:
                    n = sum(p.length for p in s.pieces)
                    s = dataclasses.replace(s, pieces=(layout.Piece(0, tp_rank * n, n),))
                shards.append(s)
            return shards

        layout.rank_param_shards = misaligned
    elif defect == "equal_weighting":
        # Each pipeline averages over its own tokens, then pipelines are averaged equally.
        real_sync = GradientSync.sync

        def equal(self, num_tokens):
            trainer_tokens = self._own_pipeline_tokens
            for p in {id(s.param): s.param for _, _, sl in self.buckets for s in sl}.values():
                if p.grad is not None:
                    p.grad.mul_(num_tokens / trainer_tokens / self._num_pipelines)
            real_sync(self, num_tokens)

        GradientSync.sync = equal
    elif defect == "tp_weighted_replicated":
        # Every TP replica of a norm contributes, so stages of TP t count it t times.
        real_init = GradientSync.__init__

        def init(self, plan_rank, params, segments, groups, **kwargs):
            segments = [dataclasses.replace(s, contributors=frozenset(s.ranks)) for s in segments]
            real_init(self, plan_rank, params, segments, groups, **kwargs)

        GradientSync.__init__ = init
    elif defect == "sp_norms_unsummed":
        # Under sequence parallelism, norm gradients as if every TP rank held the whole sum
        # (one contributor per stage, as without it): the other ranks' sequence parts are lost.
        from megatron_hexi import training

        real_segments = training.island_segments

        def without_sequence_split(plan):
            t = dataclasses.replace(plan.training, sequence_parallel=False)
            return real_segments(dataclasses.replace(plan, training=t))

        training.island_segments = without_sequence_split
    elif defect is not None:
        raise ValueError(defect)


def train(plan_path, defect=None, extra_flags=()):
    import torch.distributed as dist

    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.training import init_distributed, run
    from planner.plan import load_plan

    args = parse_args(["--hetero-plan-path", str(plan_path), *BASE_FLAGS, *extra_flags])
    plan, config = load_plan(args.hetero_plan_path), run_config(args)
    device = init_distributed(plan, config)
    _break_sync(defect)
    if defect == "equal_weighting":
        from megatron_hexi.grad_sync import GradientSync

        pipe = plan.pipelines[plan.rank_view(dist.get_rank()).pipeline]  # launched in plan order
        GradientSync._own_pipeline_tokens = pipe.num_samples * plan.model.seq_length
        GradientSync._num_pipelines = len(plan.pipelines)
    trainer, history = run(plan, config, device)
    full = trainer.full_parameters()
    out = {
        "losses": [h["lm_loss"] for h in history],
        "grad_norms": [h["grad_norm"] for h in history],
        "grad_sync_exposed_s": [h["grad_sync_exposed_s"] for h in history],
        "sync_bytes": trainer.grad_sync.bytes_per_step,
        "plan_rank": trainer.rank,
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(
        everyone,
        {
            "plan_rank": trainer.rank,
            "sync_bytes": trainer.grad_sync.bytes_per_step,
            "optimizer_bytes": optimizer_state_bytes(trainer.optimizer),
        },
    )
    if dist.get_rank() == 0:
        out["params"] = {k: v.clone() for k, v in full.items()}
        out["sync_bytes_per_rank"] = {e["plan_rank"]: e["sync_bytes"] for e in everyone}
        out["optimizer_bytes_per_rank"] = {e["plan_rank"]: e["optimizer_bytes"] for e in everyone}
    return out


def optimizer_state_bytes(optimizer):
    """Bytes of fp32 master weights (where separate) and Adam moments the optimizer holds."""
    total = 0
    for group in optimizer.optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.optimizer.state.get(p, {})
            total += sum(
                t.numel() * t.element_size()
                for k, t in state.items()
                if torch.is_tensor(t) and k != "step"
            )
            if hasattr(optimizer, "parts"):  # sharded: fp32 masters are separate
                total += p.numel() * p.element_size()
    return total


def max_relative_difference(a, b):
    """max |a - b| / max(|b|, 1e-6) over matching scalars or tensors."""
    if isinstance(a, torch.Tensor):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
    return abs(a - b) / max(abs(b), 1e-6)


def _record_trainers():
    """Keep every Trainer this process builds (the helpers below inspect it after `train`)."""
    from megatron_hexi import training

    made = []
    real_init = training.Trainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    training.Trainer.__init__ = init
    return made


def train_with_first_grads(plan_path, extra_flags=(), defect=None):
    """`train`, plus the first iteration's synced gradient (the mean over the global batch,
    before clipping) gathered to full canonical fp32 tensors under "grads" on launch rank 0.
    Not for the distributed optimizer, whose synced gradient lives in its master parts."""
    import torch.distributed as dist

    from megatron_hexi import training
    from megatron_hexi.gather import gather_full_parameters
    from megatron_hexi.grad_sync import param_grad

    made = _record_trainers()
    first = {}
    real_finalize = training.Trainer._finalize_grads

    def finalize(self, *args, **kwargs):
        real_finalize(self, *args, **kwargs)
        if not first:
            first["grads"] = [
                (shard, param_grad(p).detach().float().clone()) for shard, p in self.params
            ]

    training.Trainer._finalize_grads = finalize
    out = train(plan_path, defect=defect, extra_flags=extra_flags)
    trainer = made[0]
    full = gather_full_parameters(trainer.plan, trainer.rank, first["grads"], trainer.groups)
    if dist.get_rank() == 0:
        out["grads"] = full
    return out


class NonContiguousKernelInput(RuntimeError):
    """A multi-tensor kernel was handed a strided tensor (apex and Transformer Engine refuse)."""


def train_strict_kernels(plan_path, extra_flags=()):
    """`train` with the multi-tensor entry points (megatron-core's l2norm, scale and copy
    kernels, and torch's `_foreach_mul_`, which scales the gradients when clipping: its fast
    CUDA path takes dense tensors only) replaced by a stand-in that raises on any
    non-contiguous tensor, as the fused CUDA kernels do; the CPU fallback accepts them, so the
    CPU suite could not otherwise see such inputs. Adds, summed over the ranks: the stand-in's
    calls and tensors, and how many owned gradient slices are strided views of their
    parameter (column slices), i.e. inputs the norm must read in place."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import torch.distributed as dist

    counts = {"calls": 0, "tensors": 0}

    def strict(applier):
        def apply(op, noop_flag, tensor_lists, *args):
            for i, tensors in enumerate(tensor_lists):
                for j, t in enumerate(tensors):
                    if not t.is_contiguous():
                        raise NonContiguousKernelInput(
                            f"{getattr(op, '__name__', op)}: tensor {j} of list {i} is not "
                            f"contiguous (shape {tuple(t.shape)}, stride {t.stride()})"
                        )
                counts["tensors"] += len(tensors)
            counts["calls"] += 1
            return applier(op, noop_flag, tensor_lists, *args)

        return apply

    for module in (clip_grads, optimizer):
        module.multi_tensor_applier = strict(module.multi_tensor_applier)
    foreach_mul = strict(lambda op, noop_flag, tensor_lists, *args: op(*tensor_lists, *args))
    real_mul = torch._foreach_mul_
    torch._foreach_mul_ = lambda tensors, scalar: foreach_mul(real_mul, None, [tensors], scalar)
    made = _record_trainers()
    out = train(plan_path, extra_flags=extra_flags)
    trainer = made[0]
    strided = sum(
        not s.param.narrow(s.dim, s.start, s.length).is_contiguous()
        for s in trainer.grad_sync.owned
    )
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (counts["calls"], counts["tensors"], strided))
    out["kernel_calls"] = sum(e[0] for e in everyone)
    out["kernel_tensors"] = sum(e[1] for e in everyone)
    out["strided_owned_slices"] = sum(e[2] for e in everyone)
    return out


def train_and_evaluate(plan_path, runs, defects=None):
    """Trains `runs` (each a full flag list after --hetero-plan-path) one after another in this
    process group; returns on launch rank 0, per run, the training losses and every validation
    loss as (iteration, end of run, loss, tokens). `defects` maps a run's index to a defect of
    the evaluation to put in for that run (see `_pipeline_mean_evaluation`)."""
    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.training import init_distributed, run
    from planner.plan import load_plan

    results = []
    for index, flags in enumerate(runs):
        args = parse_args(["--hetero-plan-path", str(plan_path), *flags])
        plan, config = load_plan(args.hetero_plan_path), run_config(args)
        device = init_distributed(plan, config)
        with _pipeline_mean_evaluation(enabled=(defects or {}).get(index) == "pipeline_mean"):
            trainer, history = run(plan, config, device)
        results.append(
            {
                "losses": [h["lm_loss"] for h in history],
                "evaluations": [
                    (e["iteration"], e["end"], e["lm_loss"], e["tokens"])
                    for e in trainer.evaluations
                ],
            }
        )
    return results


@contextlib.contextmanager
def _pipeline_mean_evaluation(enabled):
    """A wrong validation loss: each pipeline's own mean, the pipelines weighted equally (as
    averaging per data-parallel replica would do), instead of the token-weighted mean. The
    evaluation's one all-reduce ([loss sum, tokens] in float64) gets each rank's own mean."""
    if not enabled:
        yield
        return
    import megatron_hexi.training as training

    real_evaluate, real_all_reduce = training.Trainer.evaluate, training.dist.all_reduce

    def own_mean(tensor, *args, **kwargs):
        if tensor.dtype == torch.float64 and tensor.numel() == 2 and tensor[1] > 0:
            tensor.copy_(torch.stack([tensor[0] / tensor[1], tensor.new_tensor(1.0)]))
        return real_all_reduce(tensor, *args, **kwargs)

    def evaluate(self, window):
        training.dist.all_reduce = own_mean
        try:
            return real_evaluate(self, window)
        finally:
            training.dist.all_reduce = real_all_reduce

    training.Trainer.evaluate = evaluate
    try:
        yield
    finally:
        training.Trainer.evaluate = real_evaluate


def train_each(runs):
    """`train` once per (plan path, extra flags) in `runs`, one after another in the same
    processes (one launch checks several plans); per run, `train`'s result plus, per plan rank,
    the gradient buckets, how many of them started during the backward pass and whether its
    stage ran sequence-parallel, and the core attention modules launch rank 0 built."""
    import torch.distributed as dist

    made = _record_trainers()
    results = []
    for plan_path, extra_flags in runs:
        out = train(plan_path, extra_flags=extra_flags)
        sync = made[-1].grad_sync
        everyone = [None] * dist.get_world_size()
        split = made[-1].transformer_config.sequence_parallel
        dist.all_gather_object(
            everyone,
            (made[-1].rank, len(sync.buckets), sync.started_in_backward, split),
        )
        out["buckets"] = {r: n for r, n, _, _ in everyone}
        out["started_in_backward"] = {r: n for r, _, n, _ in everyone}
        out["sequence_parallel"] = {r: s for r, _, _, s in everyone}
        out["core_attention"] = sorted(
            {
                type(m).__name__
                for m in made[-1].model.modules()
                if m._get_name().endswith("Attention")
            }
            - {"SelfAttention"}
        )
        results.append(out)
    return results


def train_listing_buckets(plan_path, extra_flags=()):
    """`train`, plus every plan rank's gradient buckets in the order it starts them: per bucket
    its rank set and the canonical slices it holds ((name, dim, start, length) each)."""
    import torch.distributed as dist

    made = _record_trainers()
    out = train(plan_path, extra_flags=extra_flags)
    trainer = made[0]
    mine = [
        (b.ranks, tuple((s.name, s.dim, s.global_start, s.length) for s in b.slots))
        for b in trainer.grad_sync.buckets
    ]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (trainer.rank, mine, trainer.grad_sync.started_in_backward))
    out["bucket_order"] = {r: order for r, order, _ in everyone}
    out["started_in_backward"] = {r: n for r, _, n in everyone}
    return out
