"""Per-rank bodies for tools/bench/runtime_overhead.py (module level, so spawned ranks find them).

`ours` trains a plan through megatron_hexi.training.Trainer (built from the Plan and a RunConfig,
no command line); `plain` trains the same model, sizes, micro-batches and samples with
megatron-core's own path (parallel_state, GPTModel, its schedules
and P2P, FP32Optimizer). Both time each step from a barrier on every rank and return, per step,
the slowest rank's time, a breakdown (forward/backward, gradient finalize, optimizer + rest) and
the CPU time summed over ranks.
"""

import time

import torch
import torch.distributed as dist


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
    from megatron_hexi.training import build_dataset

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


def _gather_max(values):
    """Element-wise max over ranks of a list of floats."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _report(steps, losses):
    """steps: [(total, fwd_bwd, finalize, cpu)] of this rank -> per step, the max over ranks of
    the times and the sum over ranks of the process CPU time (all threads, gloo's included)."""
    total = _gather_max([s[0] for s in steps])
    fwd = _gather_max([s[1] for s in steps])
    fin = _gather_max([s[2] for s in steps])
    cpu = torch.tensor([s[3] for s in steps], dtype=torch.float64)
    dist.all_reduce(cpu)
    return {
        "step_s": total,
        "fwd_bwd_s": fwd,
        "finalize_s": fin,
        "cpu_s": cpu.tolist(),
        "losses": losses,
        "threads": torch.get_num_threads(),
    }


def ours(plan, iters):
    from megatron_hexi.training import Trainer, init_distributed

    config = run_config(iters)
    device = init_distributed(plan, config)
    trainer = Trainer(plan, config, device)
    if trainer.dataset is not None:
        trainer.dataset = _samples(config, plan)
    fin = _Clock(trainer.transformer_config.finalize_model_grads_func)
    trainer.transformer_config.finalize_model_grads_func = fin
    # Trainer.train_step imports the schedule at call time: clock it where it is looked up.
    import megatron.core.pipeline_parallel.schedules as schedules

    sch = _Clock(schedules.forward_backward_pipelining_without_interleaving)
    schedules.forward_backward_pipelining_without_interleaving = sch
    steps, losses = [], []
    for it in range(iters):
        dist.barrier()
        fin.total = sch.total = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        m = trainer.train_step(it)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        steps.append((total, sch.total - fin.total, fin.total, cpu))
        losses.append(m["lm_loss"])
    out = _report(steps, losses)
    return out if dist.get_rank() == 0 else None


def plain(plan, iters):
    """megatron-core alone: same sizes as the plan's pipelines (uniform TP and PP; one pipeline
    per data-parallel replica, DP = the number of pipelines)."""
    from functools import partial

    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_no_pipelining,
        forward_backward_pipelining_without_interleaving,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_hexi.patches import apply_cpu_patches

    apply_cpu_patches()
    run = run_config(iters)
    o = run.optimizer
    pipe = plan.pipelines[0]
    tp, pp = pipe.stages[0].tp_size, len(pipe.stages)
    dp = len(plan.pipelines)
    assert all(
        (len(q.stages), q.micro_batch_size, q.num_microbatches, q.stages[0].tp_size)
        == (pp, pipe.micro_batch_size, pipe.num_microbatches, tp)
        for q in plan.pipelines
    ), "plain megatron-core runs uniform replicas only"
    mbs, nmb = pipe.micro_batch_size, pipe.num_microbatches
    m = plan.model

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    model_parallel_cuda_manual_seed(run.training.seed)
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
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
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=m.normalization),
        vocab_size=m.vocab_size,
        max_sequence_length=m.seq_length,
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=m.rotary_base,
    )

    if dp > 1:
        # megatron-core's data parallelism: DDP's contiguous grad buffer, all-reduced (no
        # overlap, as the runtime) by finalize_model_grads, which also scales per token.
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        model = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=False, overlap_grad_reduce=False
            ),
            module=model,
        )
        config.no_sync_func = model.no_sync

    def finalize(model_chunks, num_tokens, pg_collection=None, force_all_reduce=False):
        if dp > 1:
            return finalize_model_grads(model_chunks, num_tokens)
        # megatron-core's finalize_model_grads at DP=1, untied, no SP: per-token scaling only.
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(
            num_tokens, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=pp_group
        )
        scale = 1.0 / num_tokens.item()
        for chunk in model_chunks:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    fin = _Clock(finalize)
    config.finalize_model_grads_func = fin
    config.grad_scale_func = None

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    groups = [
        {
            "params": g,
            "wd_mult": w,
            "lr_mult": 1.0,
            "is_expert_parallel": False,
            "default_config": True,
        }
        for g, w in ((decay, 1.0), (no_decay, 0.0))
        if g
    ]
    inner = torch.optim.AdamW(
        groups,
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
    )
    opt = FP32Optimizer(
        inner,
        OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            params_dtype=torch.float32,
        ),
        lambda _: None,
    )
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=iters,
        lr_decay_style="constant",
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=iters,
        wd_incr_style="constant",
    )

    samples = _samples(run, plan) if (first or last) else None

    replica = parallel_state.get_data_parallel_rank()

    def batches(it):
        base = it * plan.global_batch_size + replica * mbs * nmb
        for k in range(nmb):
            group = samples[base + k * mbs : base + (k + 1) * mbs]
            yield {
                key: torch.stack([s[key] for s in group])
                for key in ("tokens", "labels", "loss_mask", "position_ids")
            }

    def loss_func(loss_mask, per_token):
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

    schedule = (
        forward_backward_pipelining_without_interleaving
        if pp > 1
        else forward_backward_no_pipelining
    )
    steps, losses = [], []
    for it in range(iters):
        dist.barrier()
        fin.total = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        model.train()
        opt.zero_grad()
        if dp > 1:
            model.zero_grad_buffer()
        data = batches(it) if samples is not None else iter(())
        store = schedule(
            forward_step_func=forward_step,
            data_iterator=data,
            model=[model],
            num_microbatches=nmb,
            seq_length=m.seq_length,
            micro_batch_size=mbs,
        )
        t1 = time.perf_counter()
        opt.step()
        sched.step(increment=1)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        steps.append((total, t1 - t0 - fin.total, fin.total, cpu))
        if last and store:
            s = torch.stack([x["lm loss"] for x in store]).sum(0)
            losses.append(s.tolist())
    # the last stages hold the loss: token-weighted over the replicas
    t = torch.tensor(losses or [[0.0, 0.0]] * iters, dtype=torch.float64)
    dist.all_reduce(t)
    t = t[:, 0] / t[:, 1]
    out = _report(steps, t.tolist())
    parallel_state.destroy_model_parallel()
    return out if dist.get_rank() == 0 else None
