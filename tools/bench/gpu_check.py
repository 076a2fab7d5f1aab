"""One-GPU check of the runtime on CUDA and NCCL, in one command.

    python tools/bench/gpu_check.py                   # one GPU, its own CUDA torch (~7 minutes)
    python tools/bench/gpu_check.py --device cpu      # the same cases, tiny models, CPU (gloo)
    python tools/bench/gpu_check.py --recheck runs/gpu_check/gpu_check.json   # checks again

Every case but `megatron` is a one-rank plan made with the planner (planner.plan.build_plan) for
the GPU torch sees, trained by `torchrun --nproc-per-node 1 pretrain_gpt.py --hetero-device cuda`
(NCCL) with --hetero-metrics-path, on mock data, dropout 0:

  fp32       fp32 weights and Adam
  bf16       bf16 with fp32 master weights
  distopt    bf16, distributed optimizer (the plan's training.use_distributed_optimizer)
  recompute  bf16, full activation recompute (the plan's training.recompute)
  sdpa       bf16, fused attention (the plan's training.attention_backend auto: torch's
             scaled_dot_product_attention in the local spec; the other cases run unfused), on
             the performance model (below)
  megatron   plain megatron-core on the sdpa case's model, spec and batch: no megatron_hexi
             runtime code in the loop (`gpu_check.py megatron`, one torchrun process)
  te         bf16, Transformer Engine (the plan's training.transformer_impl transformer_engine:
             megatron-core's TE layer spec, TE's attention with backend auto), on the
             performance model
  megatron_te  plain megatron-core on the te case's model, TE spec and batch
  save       bf16, saves at iteration K and runs to N      } deterministic algorithms requested
  resume     bf16, loads iteration K of `save`, runs to N  } (and CUBLAS_WORKSPACE_CONFIG)
  cpu        the fp32 plan on the CPU (gloo, CPU patches), one iteration

Models. On CUDA, sdpa and megatron train the performance model: TinyLlama-1.1B's shape (22
layers, hidden 2048, FFN 5632, 32 heads in 4 query groups, vocabulary 32000, RMSNorm, SwiGLU,
untied embeddings), seq 4096, bf16, micro-batch 1 x 8, 20 iterations timed after 5; when the
planner predicts a peak above the GPU's memory, both are skipped with one line (not a failure).
The other cases train a ~270M model that fits any 24 GB card. On CPU every case trains the same
tiny model.

The megatron case is the baseline of the runtime's speed: it reads the sdpa plan only for the
model, micro-batch size and count and seq length, and trains with megatron-core's own pieces:
initialize_model_parallel(1, 1), model_parallel_cuda_manual_seed, the runtime's TransformerConfig
for that model with megatron-core's own initialisation (perform_initialization), the runtime's
layer spec (megatron-core's local spec, SDPAttention as core attention), GPTModel computing its own
loss from labels, Float16Module (bf16), megatron-core's DistributedDataParallel
(grad_reduce_in_fp32), get_megatron_optimizer (Adam, bf16 with fp32 masters, the flags' lr,
betas, eps, weight decay and clipping), OptimizerParamScheduler, finalize_model_grads and
get_forward_backward_func (forward_backward_no_pipelining), with per-token loss sums
(calculate_per_token_loss, as the runtime). Its data: the same micro-batches of random tokens
every iteration (fixed generator seed; labels are the tokens shifted by one, loss mask ones), so
its loss starts at ln(vocab) and falls as it memorises them. megatron_te is the same loop on the
te plan: megatron-core's Transformer Engine layer spec. It is timed as the runtime times a
step (synchronize, perf_counter around schedule and optimizer step) and writes the metrics lines
the runtime writes (MFU with planner.flops against the catalog peak of the device; peak memory:
CUDA allocator peak, on CPU the process peak RSS). On CPU the project's CPU patches come first.

Checks (exit 1 if one fails): every case finishes with finite losses, a first loss near ln(vocab)
and a last loss below the first; bf16 against fp32 at iteration 1; the distributed optimizer and
recompute against bf16; fused attention against bf16 at iteration 1 where both train the same
model (on CPU; on CUDA sdpa trains the larger model); the resumed losses against the
uninterrupted ones; the first CUDA fp32 loss against the CPU one; Transformer Engine against
local + SDPA on the same plan and initial weights (te against sdpa: every iteration's loss and
the first gradient norm, to bf16 precision). Tolerances depend on the device
and are printed with each check. Reported, not checked: step time (metrics' step_time_s, median
after warm-up), MFU and peak memory per case against the planner's prediction
(planner.simulator.simulate; the planner models bf16 mixed precision, so the fp32 case has none;
megatron's are those of the sdpa plan, megatron_te's of the te plan), and the speed ratios
"sdpa vs megatron" and "te vs megatron_te" (the runtime's step time and MFU divided by plain
megatron-core's with the same spec) and "te vs sdpa" (a measurement, no threshold). The te and
megatron_te cases need CUDA and an importable Transformer Engine: elsewhere they are skipped with
one line saying why (not a failure), as are the performance cases when the planner predicts a
peak above the GPU's memory. A missing prerequisite (no CUDA,
megatron-core missing or another version, GPU not in the catalog) is one line and exit 2.

Results go to --out (gpu_check.json with every metric and check, gpu_check.md with the table);
--recheck FILE evaluates the checks and prints the table again from such a JSON, without training.
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the runtime, and the test harness's
from harness import _kill_tree, free_port  # noqa: E402  process helpers (as the other benches)

# Sizes per device. cuda: a ~270M-parameter llama-like model (bf16 + Adam ~5 GB, activations a
# few GB: fits any 24 GB card); a step takes well under a second on an H100-class GPU. `perf`: the
# model, batch and iterations of the sdpa and megatron cases (PERF_CASES). On CUDA TinyLlama-1.1B's
# public shape at seq 4096: bf16 weights, fp32 main grads, fp32 masters and Adam ~20 GB, the
# planner predicts a 29 GB peak (a 40 GB card or larger); a step of 8 x 4096 tokens is 0.28 PFLOP
# (planner.flops), the planner predicts 0.5 s on an H200. On CPU the tiny model of the other
# cases, so that fused attention is compared with unfused there.
_TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "vocab_size": 128,
    "seq_length": 32,
    "name": "gpu-check-tiny",
}
PRESETS = {
    "cuda": {
        "model": {
            "num_layers": 16,
            "hidden_size": 1024,
            "ffn_hidden_size": 2816,
            "num_attention_heads": 16,
            "num_query_groups": 8,
            "vocab_size": 32000,
            "seq_length": 1024,
            "name": "gpu-check-270m",
        },
        "micro_batch_size": 2,
        "num_microbatches": 4,
        "iters": 10,
        "warmup": 3,
        "save_at": 6,
        "perf": {
            "model": {
                "num_layers": 22,
                "hidden_size": 2048,
                "ffn_hidden_size": 5632,
                "num_attention_heads": 32,
                "num_query_groups": 4,
                "vocab_size": 32000,
                "seq_length": 4096,
                "name": "gpu-check-1.1b",  # TinyLlama-1.1B
            },
            "micro_batch_size": 1,
            "num_microbatches": 8,
            "iters": 20,
            "warmup": 5,
        },
    },
    "cpu": {
        "model": _TINY,
        "micro_batch_size": 2,
        "num_microbatches": 2,
        "iters": 4,
        "warmup": 1,
        "save_at": 2,
        "perf": {
            "model": _TINY,
            "micro_batch_size": 2,
            "num_microbatches": 2,
            "iters": 4,
            "warmup": 1,
        },
    },
}
PERF_CASES = ("sdpa", "megatron", "te", "megatron_te")  # they train PRESETS[device]["perf"]
TE_CASES = ("te", "megatron_te")  # they need CUDA and Transformer Engine (te_unavailable)
# (case, baseline) pairs whose step time and MFU the report divides (speed_ratio)
SPEED_RATIOS = (("sdpa", "megatron"), ("te", "megatron_te"), ("te", "sdpa"))

# Relative tolerances. CPU (one gloo rank, same kernels every run): a resume and a repeated fp32
# run are bit-identical, and so was recompute; the distributed optimizer rounds differently in
# bf16 (measured 6e-6 to 4e-5 over 4 iterations). CUDA: floating-point atomics (embedding and
# attention backward) make repeated runs differ in the last bits unless every kernel has a
# deterministic version, and bf16 differences grow over the iterations. Losses barely react to a
# wrongly scaled gradient (Adam normalises it), so the first iteration's gradient norm is compared
# too: recompute and the distributed optimizer compute the same gradient as plain bf16.
TOLERANCES = {
    "cuda": {
        "bf16_vs_fp32": 2e-2,
        "same_math": 1e-2,
        "same_grad": 1e-3,
        "resume": 1e-4,
        "cpu_vs_device": 1e-4,
        # TE against local + SDPA: other kernels (fused LayerNorm + GEMM, cuDNN or flash
        # attention) on the same bf16 weights; the bf16-vs-fp32 bound, as the first GPU run
        # measures it
        "te_vs_local": 2e-2,
    },
    "cpu": {
        "bf16_vs_fp32": 2e-2,
        "same_math": 1e-3,
        "same_grad": 1e-5,
        "resume": 0.0,
        "cpu_vs_device": 1e-5,
        "te_vs_local": 2e-2,
    },
}
CASES = (
    "fp32",
    "bf16",
    "distopt",
    "recompute",
    "sdpa",
    "megatron",
    "te",
    "megatron_te",
    "save",
    "resume",
    "cpu",
)
FLAGS = [
    "--mock-data",
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
    "--weight-decay",
    "0.01",
    "--log-interval",
    "1",
]
REQUIRED = [
    ("megatron.core", "megatron-core==0.16.1"),
    ("einops", "einops"),
    ("yaml", "pyyaml"),
    ("safetensors", "safetensors"),
    ("numpy", "numpy"),
]


class Missing(Exception):
    """A prerequisite is missing: the message is the one line to print."""


# ---------------------------------------------------------------------------- prerequisites


def check_prerequisites(device):
    """Raise Missing with one line naming the first thing this machine lacks for `device`."""
    if importlib.util.find_spec("torch") is None:
        raise Missing(
            "torch is not installed: install the torch build for your CUDA, then "
            "`pip install -e .` in the checkout"
        )
    for module, package in REQUIRED:
        if importlib.util.find_spec(module.split(".")[0]) is None or (
            "." in module and importlib.util.find_spec(module) is None
        ):
            raise Missing(
                f"{package} is missing: `pip install -e .` in the checkout (or "
                f"`pip install {package}` / its wheel)"
            )
    from importlib.metadata import PackageNotFoundError, version

    try:
        mc = version("megatron-core")
    except PackageNotFoundError:
        mc = None
    if mc != "0.16.1":
        raise Missing(
            f"megatron-core {mc} is installed; the runtime is checked against 0.16.1 "
            "only: `pip install megatron-core==0.16.1`"
        )
    if (
        importlib.util.find_spec("megatron_hexi") is None
        or importlib.util.find_spec("megatron_hexi.patches") is None
    ):
        raise Missing(
            "megatron_hexi is not installed: `pip install -e .` in the checkout (it "
            "keeps the environment's torch)"
        )
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise Missing(
                f"no CUDA device visible to torch {torch.__version__} (CUDA build "
                f"{torch.version.cuda}); run on a GPU machine or use --device cpu"
            )
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise Missing(f"torch {torch.__version__} has no NCCL backend")


def device_gpu(device):
    """Catalog name of the device the plan is made for (the runtime checks it on CUDA)."""
    if device == "cpu":
        return "CPU"
    import torch

    from planner.catalog import match_device_name

    name = torch.cuda.get_device_name(0)
    gpu = match_device_name(name)
    if gpu is None:
        raise Missing(
            f"GPU {name!r} is not in planner/data/gpus.yaml: add its row (or its "
            "name to a row's aliases) so that plans can name it"
        )
    return gpu.name


# -------------------------------------------------------------------------------- planning


def make_plans(preset, gpu, folder):
    """The five plans, written to `folder` with their estimates: plain (fp32, bf16, save,
    resume and the CPU reference), distopt, recompute, sdpa and te (the performance model, whose
    model and batch the megatron and megatron_te cases read too). Returns name -> path,
    name -> the planner's estimate, and the parameter counts of the model and of the
    performance model."""
    from planner.cluster import load_cluster_dict
    from planner.layout import total_params
    from planner.models import model_from_dict
    from planner.plan import build_plan, save_plan
    from planner.simulator import simulate

    cluster = load_cluster_dict(
        {
            "name": "gpu-check",
            "nodes": [
                {
                    "name": "node",
                    "gpu": gpu,
                    "gpus_per_node": 1,
                    "intra_node": "host",
                    "nic": "10 Gbit/s",
                }
            ],
        }
    )

    def shape(sizes):
        model = model_from_dict(sizes["model"])
        mbs, nmb = sizes["micro_batch_size"], sizes["num_microbatches"]
        pipelines = [
            {
                "micro_batch_size": mbs,
                "num_microbatches": nmb,
                "stages": [{"ranks": [0], "layers": [0, model.num_layers]}],
            }
        ]
        return model, mbs * nmb, pipelines

    main, perf = shape(preset), shape(preset["perf"])
    paths, estimates = {}, {}
    for name, (model, batch, pipelines), kw in (
        ("plain", main, {}),
        ("distopt", main, {"use_distributed_optimizer": True}),
        ("recompute", main, {"recompute": True}),
        ("sdpa", perf, {"attention_backend": "auto"}),
        ("te", perf, {"attention_backend": "auto", "transformer_impl": "transformer_engine"}),
    ):
        plan = build_plan(cluster, model, batch, pipelines, **kw)
        est = simulate(plan)
        plan = build_plan(cluster, model, batch, pipelines, estimate=est.to_dict(), **kw)
        paths[name] = folder / f"plan-{name}.json"
        save_plan(plan, paths[name])
        estimates[name] = est.to_dict()
    return paths, estimates, total_params(main[0]), total_params(perf[0])


def case_config(cfg, case):
    """The model, batch and iteration counts `case` ran with: the performance preset's for
    PERF_CASES (results written before it existed have none: the preset's), else the preset's."""
    return cfg["perf"] if case in PERF_CASES and "perf" in cfg else cfg


def te_unavailable(device):
    """None when the te and megatron_te cases can run here (CUDA and an importable Transformer
    Engine), else the line saying why they are skipped."""
    if device != "cuda":
        return "te and megatron_te skipped: Transformer Engine runs on CUDA only"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - missing or broken: the same for this check
        return (
            f"te and megatron_te skipped: Transformer Engine cannot be imported here "
            f"({type(e).__name__}: {e})"
        )
    return None


def perf_fits(estimate, device):
    """None when the planner's predicted peak of the performance plan fits the GPU's memory,
    else the line saying it does not (the sdpa and megatron cases are then skipped)."""
    if device != "cuda":
        return None
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    peak = estimate["peak_memory_gb"][0]
    if peak <= total:
        return None
    return (
        f"sdpa and megatron skipped: the planner predicts a peak of {peak:.1f} GB for the "
        f"performance model's plan, the GPU has {total:.1f} GB"
    )


# ------------------------------------------------------------------------------- launching


def launch(entry, args, env, timeout):
    """torchrun, one process; returns (exit code, seconds, output tail). Past `timeout` the
    launch's whole process group is killed (exit code 124)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(entry),
        *map(str, args),
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid, group=True)
        out, _ = proc.communicate()
        code, out = 124, f"{out}\ntimed out after {timeout:g} s; process group killed"
    return code, time.monotonic() - start, out[-4000:]


def read_metrics(path):
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def cases(device, preset, plans, work):
    """name -> (entry script, pretrain_gpt.py arguments, extra environment)."""
    n, k = preset["iters"], preset["save_at"]
    pretrain = ROOT / "pretrain_gpt.py"
    this = Path(__file__).resolve()
    base = ["--hetero-device", device, "--train-iters", n, *FLAGS]
    perf = ["--hetero-device", device, "--train-iters", preset["perf"]["iters"], *FLAGS]
    ckpt = work / "ckpt"
    deterministic = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    cpu_env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    # Every tensor collective is checked against the run's device (NCCL's rule; see
    # megatron_hexi/strict_collectives.py): a CPU tensor fails the case with its name.
    dev_env = {**(cpu_env if device == "cpu" else {}), "HEXI_STRICT_COLLECTIVES": "1"}
    out = {
        "fp32": (pretrain, ["--hetero-plan-path", plans["plain"], *base], dev_env),
        "bf16": (pretrain, ["--hetero-plan-path", plans["plain"], "--bf16", *base], dev_env),
        "distopt": (pretrain, ["--hetero-plan-path", plans["distopt"], "--bf16", *base], dev_env),
        "recompute": (
            pretrain,
            ["--hetero-plan-path", plans["recompute"], "--bf16", *base],
            dev_env,
        ),
        "sdpa": (pretrain, ["--hetero-plan-path", plans["sdpa"], "--bf16", *perf], dev_env),
        "megatron": (
            this,
            ["megatron", "--hetero-plan-path", plans["sdpa"], "--bf16", *perf],
            dev_env,
        ),
        "te": (pretrain, ["--hetero-plan-path", plans["te"], "--bf16", *perf], dev_env),
        "megatron_te": (
            this,
            ["megatron", "--hetero-plan-path", plans["te"], "--bf16", *perf],
            dev_env,
        ),
        "save": (
            this,
            [
                "train-deterministic",
                "--hetero-plan-path",
                plans["plain"],
                "--bf16",
                *base,
                "--save",
                ckpt,
                "--save-interval",
                k,
            ],
            {**dev_env, **deterministic},
        ),
        "resume": (
            this,
            [
                "train-deterministic",
                "--hetero-plan-path",
                plans["plain"],
                "--bf16",
                *base,
                "--load",
                ckpt,
                "--ckpt-step",
                k,
            ],
            {**dev_env, **deterministic},
        ),
        "cpu": (
            pretrain,
            [
                "--hetero-plan-path",
                plans["plain"],
                "--hetero-device",
                "cpu",
                "--train-iters",
                1,
                *FLAGS,
            ],
            cpu_env,
        ),
    }
    return out


def train_deterministic(argv):
    """pretrain_gpt.py with deterministic algorithms where torch has them (save/resume cases)."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    from megatron_hexi.training import cli

    cli(argv)


def train_megatron(argv):
    """The megatron and megatron_te cases, inside torchrun: plain megatron-core on the plan's
    model, spec (the plan's transformer_impl) and batch (module docstring). Takes
    pretrain_gpt.py's flags of the other cases; writes the metrics lines the table reads."""
    import dataclasses

    from megatron_hexi.config import OptimizerConfig as RuntimeOptimizer

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

    import resource
    from functools import partial

    import torch
    import torch.distributed as dist

    from planner.catalog import get_gpu
    from planner.flops import model_flops_per_sample
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

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron_hexi.layer_specs import local_layer_spec, te_layer_spec
    from megatron_hexi.model import stage_config

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(a.seed)
    model_parallel_cuda_manual_seed(a.seed)
    m, view = plan.model, plan.rank_view(0)
    impl, backend = plan.training.transformer_impl, plan.training.attention_backend
    if impl == "transformer_engine":
        layer_spec = te_layer_spec(backend)  # megatron-core's TE spec
    else:
        layer_spec = local_layer_spec(m.normalization, fused_attention=True)  # sdpa's
    mbs, nmb, seq = view.micro_batch_size, view.num_microbatches, m.seq_length
    # The runtime's TransformerConfig for this model (it is only a config), with megatron-core's
    # own weight initialisation, on the GPU where there is one (Megatron-LM's default).
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
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=a.lr,
            min_lr=a.min_lr,
            weight_decay=a.weight_decay,
            adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2,
            adam_eps=a.adam_eps,
            clip_grad=a.clip_grad,
            bf16=True,
            params_dtype=torch.bfloat16,
        ),
        [model],
    )
    n = a.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=a.lr,
        min_lr=a.min_lr,
        lr_warmup_steps=0,
        lr_decay_steps=max(n, 1),
        lr_decay_style=a.lr_decay_style,
        start_wd=a.weight_decay,
        end_wd=a.weight_decay,
        wd_incr_steps=max(n, 1),
        wd_incr_style="constant",
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

    def synchronize():  # as megatron_hexi.training.synchronize
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def peak_memory_gb():  # as megatron_hexi.training.peak_memory_gb
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device) / 1e9
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9

    # MFU as the runtime's: planner.flops against the catalog peak of the device
    peak = (get_gpu("CPU") if device.type == "cpu" else get_gpu(plan.ranks[0].gpu)).peak_flops
    flops = model_flops_per_sample(m) * plan.global_batch_size
    tokens_per_iter = plan.global_batch_size * seq
    forward_backward = get_forward_backward_func()
    with open(a.hetero_metrics_path, "w") as metrics:
        for it in range(n):
            model.train()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            synchronize()
            start = time.perf_counter()
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


# ---------------------------------------------------------------------------------- checks


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def evaluate(result):
    """The list of checks (name, ok, detail) for a result dict (fresh or loaded)."""
    device, tol, cfg = result["device"], result["tolerances"], result["config"]
    runs = result["cases"]
    n, k = cfg["iters"], cfg["save_at"]
    checks = []

    def add(name, ok, detail):
        checks.append({"check": name, "ok": bool(ok), "detail": detail})

    def losses(case, key="lm_loss"):
        return [r[key] for r in runs.get(case, {}).get("metrics", [])]

    expected = {
        c: (1 if c == "cpu" else n - k if c == "resume" else case_config(cfg, c)["iters"])
        for c in runs
    }
    complete = {}
    for case, run in runs.items():
        got = losses(case)
        complete[case] = run["rc"] == 0 and len(got) == expected[case]
        add(
            f"{case}: finished",
            complete[case],
            f"exit {run['rc']}, {len(got)}/{expected[case]} iterations, {run['wall_s']:.1f} s",
        )
        if not got:
            continue
        finite = all(math.isfinite(x) for x in got)
        add(f"{case}: losses finite", finite, f"{len(got)} losses")
        if case != "resume":
            vocab = case_config(cfg, case)["model"]["vocab_size"]
            ln_v = math.log(vocab)
            add(
                f"{case}: first loss near ln(vocab)",
                finite and rel(got[0], ln_v) <= 0.1,
                f"{got[0]:.6f} vs ln({vocab}) = {ln_v:.4f} (10 %)",
            )
        if case not in ("resume", "cpu"):
            add(
                f"{case}: loss decreases",
                finite and got[-1] < got[0],
                f"{got[0]:.6f} -> {got[-1]:.6f}",
            )

    def same_model(a, b):
        keys = ("model", "micro_batch_size", "num_microbatches")
        return all(case_config(cfg, a)[x] == case_config(cfg, b)[x] for x in keys)

    def compare(name, a, b, tolerance, what, first_only=False, key="lm_loss"):
        la, lb = losses(a, key), losses(b, key)
        if a not in runs or b not in runs:  # not selected (--cases)
            return
        if not same_model(a, b):  # sdpa trains the performance model on CUDA
            return
        if not (complete.get(a) and complete.get(b)):
            add(name, False, f"{a} or {b} did not finish")
            return
        pairs = list(zip(la, lb))[:1] if first_only else list(zip(la, lb))
        worst = max(rel(x, y) for x, y in pairs)
        add(name, worst <= tolerance, f"{what}: max rel diff {worst:.2e} (tolerance {tolerance:g})")

    compare("bf16 vs fp32", "bf16", "fp32", tol["bf16_vs_fp32"], "iteration 1", first_only=True)
    compare(
        "distributed optimizer vs bf16", "distopt", "bf16", tol["same_math"], f"iterations 1-{n}"
    )
    compare("recompute vs bf16", "recompute", "bf16", tol["same_math"], f"iterations 1-{n}")
    # other attention kernels: the same model to bf16 precision at the first iteration
    compare("fused attention vs bf16", "sdpa", "bf16", tol["bf16_vs_fp32"], "iteration 1", True)
    # Transformer Engine against local + SDPA: the same plan and initial weights, other kernels
    compare(
        "Transformer Engine vs local + SDPA",
        "te",
        "sdpa",
        tol["te_vs_local"],
        f"iterations 1-{case_config(cfg, 'te')['iters']}",
    )
    compare(
        "Transformer Engine vs local + SDPA, grad norm",
        "te",
        "sdpa",
        tol["te_vs_local"],
        "iteration 1",
        first_only=True,
        key="grad_norm",
    )
    compare(
        "bf16 vs fp32, grad norm",
        "bf16",
        "fp32",
        tol["bf16_vs_fp32"],
        "iteration 1",
        first_only=True,
        key="grad_norm",
    )
    compare(
        "distributed optimizer vs bf16, grad norm",
        "distopt",
        "bf16",
        tol["same_grad"],
        "iteration 1",
        first_only=True,
        key="grad_norm",
    )
    compare(
        "recompute vs bf16, grad norm",
        "recompute",
        "bf16",
        tol["same_grad"],
        "iteration 1",
        first_only=True,
        key="grad_norm",
    )
    if "resume" in runs:
        if complete.get("save") and complete.get("resume"):
            tail, resumed = losses("save")[k:], losses("resume")
            worst = max(rel(x, y) for x, y in zip(resumed, tail))
            same = resumed == tail
            add(
                "resume vs uninterrupted",
                worst <= tol["resume"],
                f"iterations {k + 1}-{n}: {'identical' if same else f'max rel diff {worst:.2e}'}"
                f" (tolerance {tol['resume']:g})",
            )
        else:
            add("resume vs uninterrupted", False, "save or resume did not finish")
    if device != "cpu":
        compare(
            f"{device} fp32 vs cpu, first loss",
            "fp32",
            "cpu",
            tol["cpu_vs_device"],
            "iteration 1",
            first_only=True,
        )
    else:
        compare(
            "cpu reference vs fp32, first loss",
            "cpu",
            "fp32",
            tol["cpu_vs_device"],
            "iteration 1",
            first_only=True,
        )
    if (
        device == "cuda"
        and complete.get("sdpa")
        and complete.get("bf16")
        and same_model("sdpa", "bf16")
    ):
        peak = {
            c: max(r["peak_memory_gb"][0] for r in runs[c]["metrics"]) for c in ("bf16", "sdpa")
        }
        add(
            "fused attention uses less memory",
            peak["sdpa"] < peak["bf16"],
            f"peak {peak['sdpa']:.2f} GB vs {peak['bf16']:.2f} GB (unfused)",
        )
    if device == "cuda" and complete.get("recompute") and complete.get("bf16"):
        peak = {
            c: max(r["peak_memory_gb"][0] for r in runs[c]["metrics"])
            for c in ("bf16", "recompute")
        }
        add(
            "recompute uses less memory",
            peak["recompute"] < peak["bf16"],
            f"peak {peak['recompute']:.2f} GB vs {peak['bf16']:.2f} GB",
        )
    return checks


def performance(result):
    """Per case: measured step time, MFU, peak memory and the planner's predictions."""
    cfg, rows = result["config"], []
    plan_of = {
        "fp32": None,
        "bf16": "plain",
        "distopt": "distopt",
        "recompute": "recompute",
        "sdpa": "sdpa",
        "megatron": "sdpa",  # the same model and batch, trained by plain megatron-core
        "te": "te",
        "megatron_te": "te",
        "save": None,
        "resume": None,
        "cpu": None,
    }
    for case, run in result["cases"].items():
        m = run["metrics"]
        warmup = case_config(cfg, case)["warmup"]
        timed = m[warmup:] if len(m) > warmup else m
        row = {"case": case, "iterations": len(m)}
        if timed:
            row["step_s"] = statistics.median(r["step_time_s"] for r in timed)
            # The CPU reference's MFU is against the catalog's CPU row (this project's small test
            # machine), not the host it ran on: not a figure about this machine, so left out.
            if case != "cpu" or result["device"] == "cpu":
                row["mfu"] = statistics.median(r["mfu"] for r in timed)
            row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in timed)
            row["peak_gb"] = max(r["peak_memory_gb"][0] for r in m)
        est = result["estimates"].get(plan_of.get(case) or "", None)
        if est and case != "cpu":
            row["pred_step_s"] = est["iteration_time_s"]
            row["pred_mfu"] = est["mfu"]
            row["pred_peak_gb"] = est["peak_memory_gb"][0]
        rows.append(row)
    return rows


def speed_ratio(rows, case, base):
    """`case`'s median step time and MFU divided by `base`'s (SPEED_RATIOS); None unless both
    have them."""
    by = {r["case"]: r for r in rows}
    a, b = by.get(case, {}), by.get(base, {})
    if not all(k in r for r in (a, b) for k in ("step_s", "mfu")):
        return None
    return {
        "step_time_ratio": a["step_s"] / b["step_s"],
        "mfu_ratio": a["mfu"] / b["mfu"] if b["mfu"] else None,
        "step_s": {case: a["step_s"], base: b["step_s"]},
        "mfu": {case: a["mfu"], base: b["mfu"]},
    }


def speed_ratios(rows):
    """{"CASE_vs_BASE": speed_ratio} for the SPEED_RATIOS both of whose cases ran."""
    out = {f"{c}_vs_{b}": speed_ratio(rows, c, b) for c, b in SPEED_RATIOS}
    return {k: v for k, v in out.items() if v is not None}


# what each ratio compares, for the report
RATIO_WHAT = {
    "sdpa_vs_megatron": "the runtime against plain megatron-core, local spec + SDPA",
    "te_vs_megatron_te": "the runtime against plain megatron-core, Transformer Engine spec",
    "te_vs_sdpa": "the runtime's Transformer Engine spec against its local spec + SDPA",
}


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def report(result):
    """Markdown text: the configuration, the performance table and the checks."""
    cfg = result["config"]
    mem_note = (
        "CUDA allocator peak"
        if result["device"] == "cuda"
        else "process peak RSS, libraries included"
    )
    lines = [
        f"# gpu_check: {result['device_name']} ({result['device']}), {result['date']}",
        "",
        f"model {cfg['model']['name']}: {result['parameters'] / 1e6:.1f}M parameters, "
        f"{cfg['model']['num_layers']} layers, hidden {cfg['model']['hidden_size']}, "
        f"seq {cfg['model']['seq_length']}, vocab {cfg['model']['vocab_size']}; batch "
        f"{cfg['micro_batch_size']} x {cfg['num_microbatches']}; {cfg['iters']} iterations, "
        f"timed after {cfg['warmup']}; save at {cfg['save_at']}; torch "
        f"{result['torch']}, megatron-core {result['megatron_core']}",
        *_perf_lines(result),
        "",
        f"| case | step s (median) | predicted s | MFU | predicted MFU | peak GB ({mem_note}) "
        "| predicted GB |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = performance(result)
    for r in rows:
        lines.append(
            f"| {r['case']} | {_fmt(r.get('step_s'), '.4f')} | "
            f"{_fmt(r.get('pred_step_s'), '.4f')} | {_fmt(r.get('mfu'), '.1%')} | "
            f"{_fmt(r.get('pred_mfu'), '.1%')} | {_fmt(r.get('peak_gb'), '.2f')} | "
            f"{_fmt(r.get('pred_peak_gb'), '.2f')} |"
        )
    lines += [
        "",
        "(predictions: planner.simulator for the bf16 plans, megatron's those of the sdpa plan; "
        "fp32, save, resume and the CPU reference have none)",
    ]
    for name, ratio in speed_ratios(rows).items():
        case, base = name.split("_vs_")
        lines += [
            "",
            f"{case} vs {base}: step-time ratio {ratio['step_time_ratio']:.3f}, MFU ratio "
            f"{_fmt(ratio['mfu_ratio'], '.3f')} ({RATIO_WHAT[name]}, the same model and batch: "
            f"{ratio['step_s'][case]:.4f} s vs {ratio['step_s'][base]:.4f} s per step)",
        ]
    for key in ("skipped", "skipped_te"):
        if result.get(key):
            lines += ["", result[key]]
    lines += [
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    for c in result["checks"]:
        lines.append(f"| {c['check']} | {'ok' if c['ok'] else 'FAIL'} | {c['detail']} |")
    failed = sum(not c["ok"] for c in result["checks"])
    lines += [
        "",
        f"{len(result['checks']) - failed}/{len(result['checks'])} checks passed"
        + (f", {failed} FAILED" if failed else "")
        + f"; total {result['wall_s']:.0f} s",
    ]
    return "\n".join(lines) + "\n"


def _perf_lines(result):
    """The performance model's line of the report, when the sdpa or megatron case ran on it and
    it is not the model of the other cases."""
    cfg = result["config"]
    perf = cfg.get("perf")
    if not perf or not (any(c in result["cases"] for c in PERF_CASES) or result.get("skipped")):
        return []
    if all(perf[k] == cfg[k] for k in perf):  # the CPU preset: the line above says it all
        return []
    pm = perf["model"]
    return [
        "",
        f"sdpa and megatron: model {pm['name']}: "
        f"{result.get('perf_parameters', 0) / 1e6:.1f}M parameters, {pm['num_layers']} layers, "
        f"hidden {pm['hidden_size']}, seq {pm['seq_length']}, vocab {pm['vocab_size']}; batch "
        f"{perf['micro_batch_size']} x {perf['num_microbatches']}; {perf['iters']} iterations, "
        f"timed after {perf['warmup']}",
    ]


def finish(result, out_dir):
    result["checks"] = evaluate(result)
    result.update(speed_ratios(performance(result)))
    text = report(result)
    print(text, flush=True)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
        (out_dir / "gpu_check.md").write_text(text)
        print(f"results: {out_dir / 'gpu_check.json'}, {out_dir / 'gpu_check.md'}")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


# ------------------------------------------------------------------------------------ main


def run(a):
    device = a.device
    check_prerequisites(device)
    from importlib.metadata import version

    import torch

    gpu = device_gpu(device)
    preset = json.loads(json.dumps(PRESETS[device]))
    for key in ("iters", "warmup", "save_at"):
        if getattr(a, key) is not None:
            preset[key] = getattr(a, key)
            if key in preset["perf"]:  # --iters and --warmup: the performance cases' too
                preset["perf"][key] = getattr(a, key)
    selected = a.cases or CASES
    if "resume" in selected and "save" not in selected:
        raise Missing("--cases resume needs the save case too")
    if not 0 < preset["save_at"] < preset["iters"]:
        raise Missing(
            f"--save-at {preset['save_at']} must lie between 0 and --iters {preset['iters']}"
        )
    start = time.monotonic()
    result = {
        "device": device,
        "device_name": gpu if device == "cpu" else torch.cuda.get_device_name(0),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "megatron_core": version("megatron-core"),
        "config": preset,
        "tolerances": TOLERANCES[device],
        "cases": {},
    }
    with tempfile.TemporaryDirectory(prefix="hexi-gpu-check-") as tmp:
        work = Path(tmp)
        plans, result["estimates"], result["parameters"], result["perf_parameters"] = make_plans(
            preset, gpu, work
        )
        too_big = perf_fits(result["estimates"]["sdpa"], device)
        if too_big and any(c in selected for c in PERF_CASES):
            print(too_big, flush=True)
            result["skipped"] = too_big
        no_te = None if too_big else te_unavailable(device)
        if no_te and any(c in selected for c in TE_CASES):
            print(no_te, flush=True)
            result["skipped_te"] = no_te
        for case, (entry, args, env) in cases(device, preset, plans, work).items():
            skip = (too_big and case in PERF_CASES) or (no_te and case in TE_CASES)
            if case not in selected or skip:
                continue
            metrics = work / f"{case}.jsonl"
            print(f"== {case}", flush=True)
            code, secs, tail = launch(
                entry, [*args, "--hetero-metrics-path", metrics], env, a.timeout
            )
            rows = read_metrics(metrics)
            result["cases"][case] = {"rc": code, "wall_s": secs, "metrics": rows}
            if code != 0:
                result["cases"][case]["output_tail"] = tail
                print(f"   exit {code} after {secs:.1f} s; output tail:\n{tail}", flush=True)
            else:
                losses = " ".join(f"{r['lm_loss']:.6f}" for r in rows)
                print(f"   {secs:.1f} s, losses {losses}", flush=True)
    result["wall_s"] = time.monotonic() - start
    return finish(result, Path(a.out) if a.out else None)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train-deterministic"]:  # inside torchrun, for the save/resume cases
        return train_deterministic(argv[1:])
    if argv[:1] == ["megatron"]:  # inside torchrun, for the megatron case
        return train_megatron(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default): the GPU check; cpu: the same cases, tiny models",
    )
    ap.add_argument(
        "--iters", type=int, default=None, help="iterations per case (sdpa and megatron too)"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="iterations not timed (sdpa and megatron too)"
    )
    ap.add_argument(
        "--save-at",
        dest="save_at",
        type=int,
        default=None,
        help="iteration the save case saves and the resume case loads",
    )
    ap.add_argument(
        "--cases",
        nargs="+",
        choices=CASES,
        default=None,
        help="run only these cases (resume needs save); the checks that compare "
        "a case with one left out are skipped",
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    ap.add_argument(
        "--out",
        default=str(ROOT / "runs" / "gpu_check"),
        help="folder for gpu_check.json and gpu_check.md ('' for none)",
    )
    ap.add_argument(
        "--recheck",
        default=None,
        metavar="JSON",
        help="evaluate the checks of a gpu_check.json again, without training",
    )
    a = ap.parse_args(argv)
    try:
        if a.recheck:
            result = json.loads(Path(a.recheck).read_text())
            return finish(result, None)
        return run(a)
    except Missing as e:
        print(f"gpu_check: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
