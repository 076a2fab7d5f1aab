"""What the GPU check runs inside torchrun: the runtime (pretrain_gpt.py) with a chosen
FusionConfig and one profiled step, plain megatron-core's own training loop on the same plan, and
the deterministic runs of the save/resume cases.

Host time. The profiled step (the last one, left out of the timing) runs under torch.profiler
with CPU and CUDA activities; its host time is the step's wall time less the time the stepping
thread spent in CUDA synchronize calls (the profiler's CPU-side runtime events), and the host
time per layer pass is that divided by layers x micro-batches x 2 (a forward and a backward). It
counts everything the host does in the step (embedding, loss, optimizer too), so it is an upper
bound of the layers' own dispatch, and when the GPU is the bottleneck the host also waits in
kernel launches (the launch queue is full): then it approaches the device time.
"""

import contextlib
import dataclasses
import json
import os
import threading
import time
from pathlib import Path

WAITS = ("Synchronize",)  # cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize


def host_seconds(prof, wall_s):
    """The profiled step's host time: `wall_s` less the stepping thread's synchronize calls."""
    me = threading.get_native_id()
    waits = [e for e in prof.events() if any(w in e.name for w in WAITS)]
    mine = [e for e in waits if e.thread == me] or waits
    waited = sum(e.time_range.end - e.time_range.start for e in mine) / 1e6
    return max(wall_s - waited, 0.0)


@contextlib.contextmanager
def profiled(device):
    """torch.profiler around one step: yields a dict that gets `host_s` and `profiled_wall_s`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = {}
    with profile(activities=acts) as prof:
        start = time.perf_counter()
        yield out
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    out.update(host_s=host_seconds(prof, wall), profiled=True)


def fusion_fields():
    from megatron_hexi.config import FusionConfig

    return [f.name for f in dataclasses.fields(FusionConfig)]


EAGER_FLAGS = (
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-masked-softmax-fusion",
    "--no-gradient-accumulation-fusion",
)
"""pretrain_gpt.py's flags that turn every fusion of FusionConfig off (the eager variant)."""


def fusion_config(on):
    """FusionConfig's defaults (`on`), or every fusion off (the eager variant)."""
    from megatron_hexi.config import FusionConfig

    return FusionConfig() if on else FusionConfig(**{f: False for f in fusion_fields()})


def train_deterministic(argv):
    """pretrain_gpt.py with deterministic algorithms where torch has them (save/resume cases)."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    from megatron_hexi.entry import cli

    cli(argv)


def train_runtime(argv):
    """`gpu_check.py train-runtime on|off FUSIONS_JSON PROFILE_AT ARGS...`: pretrain_gpt.py ARGS
    with RunConfig.fusions set (FusionConfig's defaults, or all off), the fusion settings of the
    stage's TransformerConfig written to FUSIONS_JSON (plain megatron-core's case of the same
    variant uses them), and iteration PROFILE_AT (1-based) profiled (module docstring)."""
    on, record, profile_at, args = argv[0] == "on", Path(argv[1]), int(argv[2]), argv[3:]
    from megatron_hexi import training
    from megatron_hexi.entry import cli

    if not on:  # Megatron-LM's switches; the fused cross-entropy is off by default
        args = [*args, *EAGER_FLAGS]
    build, step = training.Trainer.__init__, training.Trainer.train_step

    def init(self, *a, **k):
        build(self, *a, **k)
        tc = self.transformer_config
        record.write_text(json.dumps({f: getattr(tc, f) for f in fusion_fields()}))

    def train_step(self, iteration):
        if iteration + 1 != profile_at:
            return step(self, iteration)
        with profiled(self.device) as p:
            m = step(self, iteration)
        return {**m, **p}

    training.Trainer.__init__ = init
    training.Trainer.train_step = train_step
    cli(args)


def train_megatron(argv):
    """`gpu_check.py megatron on|off FUSIONS_JSON PROFILE_AT ARGS...`, inside torchrun: plain
    megatron-core on the plan's model, spec (transformer_impl), batch, attention and CUDA graphs,
    with the fusion settings the runtime's case recorded in FUSIONS_JSON (where it has not run,
    those the runtime would choose: `megatron_fusions`). Takes pretrain_gpt.py's flags of the
    other cases; writes the metrics lines the table reads. gpu_check.py's docstring says what it
    builds."""
    import argparse

    from megatron_hexi.config import OptimizerConfig as RuntimeOptimizer

    on, record, profile_at, argv = argv[0] == "on", Path(argv[1]), int(argv[2]), argv[3:]
    defaults = {f.name: f.default for f in dataclasses.fields(RuntimeOptimizer)}
    ap = argparse.ArgumentParser(prog="gpu_check.py megatron")
    ap.add_argument("--hetero-plan-path", required=True)
    ap.add_argument("--hetero-device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--hetero-metrics-path", required=True)
    ap.add_argument("--train-iters", type=int, required=True)
    ap.add_argument("--bf16", action="store_true", required=True)
    ap.add_argument("--mock-data", action="store_true")  # random tokens here (docstring)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--lr-decay-style", choices=["constant"], default="constant")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--attention-dropout", type=float, default=0.0)
    ap.add_argument("--hidden-dropout", type=float, default=0.0)
    for name in ("min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=defaults[name])
    ap.add_argument("--log-interval", type=int, default=1)
    a = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from planner.plan import load_plan

    plan = load_plan(a.hetero_plan_path)
    if plan.world_size != 1:
        raise SystemExit(f"gpu_check.py megatron: a one-rank plan, not {plan.world_size} ranks")
    if a.hetero_device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        from megatron_hexi.patches import apply_cpu_patches

        apply_cpu_patches()  # before megatron-core builds anything (as pretrain_gpt.py)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    fusions = megatron_fusions(record, on, device.type == "cuda", plan)
    _megatron_loop(a, plan, device, fusions, profile_at)


def megatron_fusions(record, on, cuda, plan):
    """The fusion settings of plain megatron-core's case: those the runtime's case recorded in
    `record`, else the ones the runtime would choose here for `plan`'s one stage by its own rule
    (megatron_hexi.fusions: FusionConfig's defaults or all off, less those this process lacks
    the kernels for, e.g. RoPE's without Transformer Engine)."""
    if record.exists():
        return json.loads(record.read_text())
    from megatron_hexi.fusions import stage_fusions

    training = plan.training
    chosen = stage_fusions(
        fusion_config(on),
        cuda,
        plan.model,
        bf16=True,  # the performance cases train in bf16
        transformer_impl=training.transformer_impl,
        holds_output=True,  # one stage holds the whole model
    )
    return chosen.config_fields()


def _megatron_loop(a, plan, device, fusions, profile_at):
    import resource
    from functools import partial

    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from _megatron_adam import megatron_adam  # tools/bench, on the path as for every bench
    from megatron_hexi.cuda_graphs import rng_tracker_options
    from megatron_hexi.layer_specs import local_layer_spec, te_layer_spec
    from megatron_hexi.model import stage_config
    from planner.catalog import get_gpu
    from planner.flops import model_flops_per_sample

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(a.seed)
    graphs = plan.training.cuda_graph_impl
    model_parallel_cuda_manual_seed(a.seed, **rng_tracker_options(graphs))  # graph-safe if so
    m, view = plan.model, plan.rank_view(0)
    impl, backend = plan.training.transformer_impl, plan.training.attention_backend
    if impl == "transformer_engine":
        layer_spec = te_layer_spec(backend)  # megatron-core's TE spec
    else:
        layer_spec = local_layer_spec(m.normalization, fused_attention=True)  # the runtime's
    mbs, nmb, seq = view.micro_batch_size, view.num_microbatches, m.seq_length
    # The runtime's TransformerConfig for this plan (it is only a config: the plan's CUDA graphs
    # included) with the runtime's fusion settings and megatron-core's own weight
    # initialisation, on the GPU where there is one (Megatron-LM's default).
    tc = dataclasses.replace(
        stage_config(
            plan,
            view,
            params_dtype=torch.bfloat16,
            hidden_dropout=a.hidden_dropout,
            attention_dropout=a.attention_dropout,
            transformer_impl=impl,
            attention_backend=backend,
        ),
        perform_initialization=True,
        use_cpu_initialization=device.type == "cpu",
        **fusions,
    )
    model = GPTModel(
        config=tc,
        transformer_layer_spec=layer_spec,
        vocab_size=m.vocab_size,
        max_sequence_length=seq,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=m.rotary_base,
    )
    model = Float16Module(tc, model.to(device))
    model = DistributedDataParallel(
        config=tc,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=model,
    )
    n = a.train_iters
    optimizer, scheduler = megatron_adam(
        model,
        a,
        decay_steps=max(n, 1),
        decay_style=a.lr_decay_style,
        min_lr=a.min_lr,
        bf16=True,
    )
    tc.finalize_model_grads_func = finalize_model_grads  # as Megatron-LM's training loop
    tc.grad_scale_func = optimizer.scale_loss

    gen = torch.Generator().manual_seed(a.seed)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, seq)
    batches = []
    for _ in range(nmb):
        sample = torch.randint(0, m.vocab_size, (mbs, seq + 1), generator=gen).to(device)
        batches.append(
            {
                "tokens": sample[:, :-1].contiguous(),
                "labels": sample[:, 1:].contiguous(),
                "loss_mask": torch.ones(mbs, seq, device=device),
            }
        )

    def loss_func(loss_mask, output_tensor):  # pretrain_gpt.py's, per-token loss sums
        losses = output_tensor.view(-1).float()
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
        return loss, num_tokens, {"lm loss": report}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        output = model(b["tokens"], positions, None, labels=b["labels"])
        return output, partial(loss_func, b["loss_mask"])

    def synchronize():  # as megatron_hexi.distributed.synchronize
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def peak_memory_gb():  # as megatron_hexi.metrics.peak_memory_gb
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device) / 1e9
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9

    def step():
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        store = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=nmb,
            seq_length=seq,
            micro_batch_size=mbs,
            decoder_seq_length=seq,
            forward_only=False,
        )
        success, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        return store, success, grad_norm

    # MFU as the runtime's: planner.flops against the catalog peak of the device
    peak = (get_gpu("CPU") if device.type == "cpu" else get_gpu(plan.ranks[0].gpu)).peak_flops
    flops = model_flops_per_sample(m) * plan.global_batch_size
    tokens_per_iter = plan.global_batch_size * seq
    forward_backward = get_forward_backward_func()
    with open(a.hetero_metrics_path, "w") as metrics:
        for it in range(n):
            synchronize()
            start = time.perf_counter()
            extra = {}
            if it + 1 == profile_at:
                with profiled(device) as extra:
                    store, success, grad_norm = step()
            else:
                store, success, grad_norm = step()
            synchronize()
            step_time = time.perf_counter() - start
            loss_sum = sum(float(s["lm loss"][0]) for s in store)
            tokens = sum(float(s["lm loss"][1]) for s in store)
            row = {
                "lm_loss": loss_sum / tokens,
                "grad_norm": float(grad_norm),
                "success": bool(success),
                "step_time_s": step_time,
                "peak_memory_gb": [peak_memory_gb()],
                "tokens": tokens,
                "lr": optimizer.param_groups[0]["lr"],
                "iteration": it + 1,
                "tokens_per_s": tokens_per_iter / step_time,
                "mfu": flops / (step_time * peak),
                "world_size": 1,
                "plan": os.path.basename(a.hetero_plan_path),
                "fusions": fusions,
                **extra,
            }
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            if (it + 1) % a.log_interval == 0:
                print(
                    f" iteration {it + 1}/{n} | lm loss {row['lm_loss']:.6f} | grad norm "
                    f"{row['grad_norm']:.4f} | step {step_time:.4f} s | MFU {row['mfu']:.2%} | "
                    f"peak {row['peak_memory_gb'][0]:.2f} GB",
                    flush=True,
                )
    from megatron_hexi.process_exit import exit_process

    exit_process(0)  # megatron-core objects hold process groups (process_exit: why)
