"""The two training loops the overhead benches compare, and their per-rank bodies.

`build_ours` trains a plan through megatron_hexi.training.Trainer (built from the Plan and a
RunConfig, no command line). `build_plain` trains the same model (the same initial weights, the
runtime's canonical ones), sizes, micro-batches and samples with megatron-core alone, as
Megatron-LM's training loop does: parallel_state, GPTModel, megatron's DistributedDataParallel,
get_forward_backward_func, finalize_model_grads, get_megatron_optimizer, OptimizerParamScheduler
and the data-parallel loss reduction of Megatron-LM's train_step. Each returns a `Loop` whose
`step(iteration)` trains one step and returns its `Step` (times, CPU time, global loss).

Both benches build the two loops in the same process (`build_both`) and alternate their steps
(`alternate`): tools/bench/runtime_overhead.py on gloo ranks (one process per plan rank,
`paired`), tools/bench/host_overhead.py on one rank.
"""

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from _megatron_adam import megatron_adam


class Step(NamedTuple):
    """One training step on this rank: wall seconds of the whole step, of forward/backward
    (schedule incl. P2P, without the gradient finalize) and of the gradient finalize; process
    CPU seconds of the step; the global loss (token-weighted mean over every pipeline)."""

    total: float
    fwd_bwd: float
    finalize: float
    cpu: float
    loss: float


class Loop(NamedTuple):
    """A built variant: `step(iteration)` trains one step (no barrier of its own)."""

    step: Callable[[int], Step]


def run_config(iters):
    """Both variants' settings: mock data, fp32 Adam at a constant lr, no dropout, CPU."""
    from megatron_hexi.config import (
        DataConfig,
        DropoutConfig,
        LRScheduleConfig,
        OptimizerConfig,
        RunConfig,
        RuntimeConfig,
        TrainingConfig,
    )

    return RunConfig(
        training=TrainingConfig(train_iters=iters, seed=1234),
        optimizer=OptimizerConfig(lr=1e-4, weight_decay=0.01, adam_eps=1e-8, clip_grad=1.0),
        lr_schedule=LRScheduleConfig(lr_decay_style="constant"),
        dropout=DropoutConfig(attention_dropout=0.0, hidden_dropout=0.0),
        data=DataConfig(mock_data=True),
        runtime=RuntimeConfig(device="cpu"),
    )


def _samples(config, plan):
    """Every sample the run reads, materialised once (same tokens for both variants, and no
    data-loading cost inside the timed step)."""
    from megatron_hexi.run_datasets import build_dataset

    ds = build_dataset(plan, config, None)  # mock data: no tokenizer
    return [ds[i] for i in range(config.training.train_iters * plan.global_batch_size)]


class _Clock:
    """Accumulates the time spent in a wrapped callable (per step)."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - t


def build_ours(plan, iters, samples=None):
    """This runtime's Trainer on `plan` (the process group exists); `samples`: the run's
    materialised samples (_samples), shared with the other variant in one process."""
    from megatron_hexi.training import Trainer, init_distributed

    config = run_config(iters)
    device = init_distributed(plan, config)
    trainer = Trainer(plan, config, device)
    if trainer.dataset is not None:
        trainer.dataset = samples if samples is not None else _samples(config, plan)
    fin = _Clock(trainer.transformer_config.finalize_model_grads_func)
    trainer.transformer_config.finalize_model_grads_func = fin
    sch = trainer._schedule = _Clock(trainer._schedule)  # the instance's, looked up per step

    def step(it):
        fin.total = sch.total = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        m = trainer.train_step(it)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        return Step(total, sch.total - fin.total, fin.total, cpu, m["lm_loss"])

    return Loop(step)


def build_plain(plan, iters, samples=None):
    """megatron-core alone, as Megatron-LM's training loop: same sizes as the plan's pipelines
    (uniform TP and PP; one pipeline per data-parallel replica, DP = the number of pipelines),
    the plan's model, layer spec and initial weights."""
    from functools import partial

    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_hexi.layer_specs import local_layer_spec
    from megatron_hexi.model import initialise_weights, local_parameters
    from megatron_hexi.patches import apply_cpu_patches
    from planner.attention import keeps_scores

    apply_cpu_patches()
    run = run_config(iters)
    o = run.optimizer
    pipe = plan.pipelines[0]
    tp, pp = pipe.stages[0].tp_size, len(pipe.stages)
    assert all(
        (len(q.stages), q.micro_batch_size, q.num_microbatches, q.stages[0].tp_size)
        == (pp, pipe.micro_batch_size, pipe.num_microbatches, tp)
        for q in plan.pipelines
    ), "plain megatron-core runs uniform replicas only"
    assert plan.training.transformer_impl == "local", "the local layer spec only"
    mbs, nmb = pipe.micro_batch_size, pipe.num_microbatches
    m = plan.model

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    model_parallel_cuda_manual_seed(run.training.seed)
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    replica = parallel_state.get_data_parallel_rank()
    # the plan rank in megatron's place: megatron orders ranks TP, DP, PP; the plan by pipeline
    stage = plan.pipelines[replica].stages[parallel_state.get_pipeline_model_parallel_rank()]
    plan_rank = stage.ranks[parallel_state.get_tensor_model_parallel_rank()]
    config = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=True,
        # megatron initialises (which also marks the tensor-parallel weights its grad norm counts
        # on every TP rank), then the runtime's canonical weights replace the values, below
        perform_initialization=True,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=False,
    )
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    model = GPTModel(
        config=config,
        # the plan's core attention (megatron-core's local spec when unfused)
        transformer_layer_spec=local_layer_spec(
            m.normalization, not keeps_scores(plan.training.attention_backend)
        ),
        vocab_size=m.vocab_size,
        max_sequence_length=m.seq_length,
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=m.rotary_base,
    )
    initialise_weights(plan, local_parameters(plan, plan_rank, model), run.training.seed)
    # megatron's data parallelism at every DP size, as Megatron-LM: DDP's contiguous grad
    # buffer, all-reduced (no overlap, as the runtime's default) by finalize_model_grads,
    # which also scales per token
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=False, overlap_grad_reduce=False
        ),
        module=model,
    )
    config.no_sync_func = model.no_sync
    fin = _Clock(finalize_model_grads)
    config.finalize_model_grads_func = fin
    config.grad_scale_func = None
    opt, sched = megatron_adam(
        model, o, decay_steps=iters, decay_style="constant", min_lr=0.0, bf16=False
    )

    if first or last:
        samples = samples if samples is not None else _samples(run, plan)

    def batches(it):
        base = it * plan.global_batch_size + replica * mbs * nmb
        for k in range(nmb):
            group = samples[base + k * mbs : base + (k + 1) * mbs]
            yield {
                key: torch.stack([s[key] for s in group])
                for key in ("tokens", "labels", "loss_mask", "position_ids")
            }

    def loss_func(loss_mask, per_token):  # Megatron-LM's pretrain_gpt loss, per-token sums
        mask = loss_mask.float()
        loss_sum = (per_token.float() * mask).sum()
        return (
            loss_sum,
            mask.sum().to(torch.int),
            {"lm loss": torch.stack([loss_sum.detach().double(), mask.sum().double()])},
        )

    def forward_step(data_iterator, model):
        b = next(data_iterator) if (first or last) else None
        tokens = b["tokens"] if first else None
        positions = b["position_ids"] if first else None
        labels = b["labels"] if last else None
        out = model(tokens, positions, None, labels=labels)
        return out, (partial(loss_func, b["loss_mask"]) if last else None)

    forward_backward = get_forward_backward_func()
    dp_group = parallel_state.get_data_parallel_group()
    # the loss counts once per pipeline: from its last stage's TP rank 0
    counts = last and parallel_state.get_tensor_model_parallel_rank() == 0

    def step(it):
        fin.total = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        model.train()
        model.zero_grad_buffer()
        opt.zero_grad()
        data = batches(it) if (first or last) else iter(())
        store = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[model],
            num_microbatches=nmb,
            seq_length=m.seq_length,
            micro_batch_size=mbs,
            forward_only=False,
        )
        t1 = time.perf_counter()
        opt.step()
        sched.step(increment=1)
        # Megatron-LM's train_step: the loss summed over micro-batches, all-reduced over DP
        # on the last stages, and read for the log
        reported = torch.zeros(2, dtype=torch.float64)
        if last:
            reported = torch.stack([x["lm loss"] for x in store]).sum(0)
            dist.all_reduce(reported, group=dp_group)
            reported.tolist()
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        # outside the step: the global loss on every rank, for the comparison
        world = reported if counts else torch.zeros(2, dtype=torch.float64)
        dist.all_reduce(world)
        return Step(total, t1 - t0 - fin.total, fin.total, cpu, (world[0] / world[1]).item())

    return Loop(step)


def alternate(loops, first, iters, it):
    """`iters` steps of each of `loops` ({"ours": Loop, "plain": Loop}), alternating step by
    step, starting with `first`; each step starts from a barrier when there are several ranks.
    `it`: each variant's next iteration (advanced). Returns {variant: [Step]}."""
    order = [first, "plain" if first == "ours" else "ours"]
    several = dist.get_world_size() > 1
    out = {"ours": [], "plain": []}
    for _ in range(iters):
        for v in order:
            if several:
                dist.barrier()
            out[v].append(loops[v].step(it[v]))
            it[v] += 1
    return out


def build_both(ours_plan, plain_plan, iters):
    """Both Loops in this process (the process group exists), on the same samples. Plain
    megatron-core is built first: its initialize_model_parallel insists on creating the global
    buffers the runtime's model builder reuses."""
    config = run_config(iters)
    samples = _samples(config, plain_plan)
    plain = build_plain(plain_plan, iters, samples)
    return {"ours": build_ours(ours_plan, iters, samples), "plain": plain}


def _gather_max(values):
    """Element-wise max over ranks of a list of floats."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def paired(ours_plan, plain_plan, warmup, rounds, iters):
    """A rank of runtime_overhead.py: both variants in this process, `warmup` untimed steps of
    each, then `rounds` rounds of `iters` steps of each, alternating (rounds start with ours and
    plain in turn). Rank 0 returns, per variant, every step's slowest-rank times, the CPU time
    summed over ranks (all threads, gloo's included) and the losses; round r's steps are
    [warmup + r x iters, warmup + (r + 1) x iters)."""
    loops = build_both(ours_plan, plain_plan, warmup + rounds * iters)
    it = {"ours": 0, "plain": 0}
    steps = alternate(loops, "ours", warmup, it)
    for r in range(rounds):
        got = alternate(loops, "ours" if r % 2 == 0 else "plain", iters, it)
        for v in steps:
            steps[v] += got[v]
    out = {}
    for v, ss in steps.items():
        cpu = torch.tensor([s.cpu for s in ss], dtype=torch.float64)
        dist.all_reduce(cpu)
        out[v] = {
            "step_s": _gather_max([s.total for s in ss]),
            "fwd_bwd_s": _gather_max([s.fwd_bwd for s in ss]),
            "finalize_s": _gather_max([s.finalize for s in ss]),
            "cpu_s": cpu.tolist(),
            "losses": [s.loss for s in ss],
        }
    out["threads"] = torch.get_num_threads()
    return out if dist.get_rank() == 0 else None
