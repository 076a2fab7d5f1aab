"""The GPU check's cases: sizes per device, the plans, what each case launches and in which order,
the prerequisites and the machine's versions (tools/bench/gpu_check.py says what they check).

Performance cases are named IMPL-VARIANT-SHAPE: IMPL `hexi` (this runtime, pretrain_gpt.py) or
`megatron` (plain megatron-core's own loop, _gpu_check_megatron), VARIANT one of VARIANTS and
SHAPE the micro-batches, `1x8` (size 1, 8 of them) or `8x1`. Correctness cases keep their names.
"""

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the runtime, and the test harness's
from harness import _kill_tree, free_port  # noqa: E402  process helpers (as the other benches)

# Sizes per device. cuda: a ~270M-parameter llama-like model for the correctness cases (bf16 +
# Adam ~5 GB: fits any 24 GB card). `perf`: the performance cases' model, TinyLlama-1.1B's public
# shape at seq 4096 (bf16 weights, fp32 main grads, fp32 masters and Adam ~20 GB; the planner
# predicts a 29 GB peak at 1 x 8); a step of 8 x 4096 tokens is 0.28 PFLOP (planner.flops), about
# 0.7 s at 40 % of an H200's dense bf16 peak. On CPU both are one tiny model with the same global
# batch (8 samples), so that the correctness and performance cases can be compared there.
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
            # megatron-core captures local graphs after 3 eager steps (cuda_graph_warmup_steps)
            # and replays them from the 5th: 5 steps are timed, the last one is profiled
            "iters": 11,
            "warmup": 5,
        },
    },
    "cpu": {
        "model": _TINY,
        "micro_batch_size": 2,
        "num_microbatches": 4,
        "iters": 4,
        "warmup": 1,
        "save_at": 2,
        "perf": {"model": _TINY, "iters": 4, "warmup": 1},
    },
}
SHAPES = {"1x8": (1, 8), "8x1": (8, 1)}  # (micro-batch size, micro-batches): 8 samples each


@dataclass(frozen=True)
class Variant:
    """How a performance case runs: megatron-core's fusions (FusionConfig's defaults, or every
    one off), the layer spec and CUDA graphs (the plan's transformer_impl and cuda_graph_impl)."""

    fusions: bool
    transformer_impl: str = "local"
    cuda_graph_impl: str = "none"


VARIANTS = {
    "eager": Variant(fusions=False),
    "fused": Variant(fusions=True),
    "graphs": Variant(fusions=True, cuda_graph_impl="local"),
    "te": Variant(fusions=True, transformer_impl="transformer_engine"),
    "te_graphs": Variant(
        fusions=True, transformer_impl="transformer_engine", cuda_graph_impl="transformer_engine"
    ),
}
IMPLS = ("hexi", "megatron")
# most important first: a run cut short by its time budget keeps these
PERF_ORDER = [
    f"{impl}-{variant}-{shape}"
    for variant, shape in (
        ("graphs", "1x8"),
        ("fused", "1x8"),
        ("eager", "1x8"),
        ("te", "1x8"),
        ("te_graphs", "1x8"),
        ("graphs", "8x1"),
        ("fused", "8x1"),
        ("eager", "8x1"),
    )
    for impl in IMPLS
]
CORRECTNESS = ("bf16", "fp32", "distopt", "recompute", "save", "resume", "cpu")
CASES = (*PERF_ORDER, *CORRECTNESS)
# Seconds each case is expected to take on an H200, start-up included; a case is not started
# when the time budget left is below its expectation. Measured (docs/results/gpu/2026-12-04-*):
# this runtime's performance cases 41-49 s, plain megatron-core's 33-43 s, the 270M model's
# correctness cases 27-29 s (about 20 s of each launch is start-up); the CPU reference case is
# the first run's estimate.
EXPECTED_S = {"hexi": 48.0, "megatron": 43.0, "cpu": 60.0, "other": 30.0}


def perf_parts(case):
    """(impl, variant name, shape) of a performance case; None for a correctness case."""
    parts = case.split("-")
    return tuple(parts) if len(parts) == 3 else None


def expected_s(case):
    parts = perf_parts(case)
    return EXPECTED_S[parts[0] if parts else "cpu" if case == "cpu" else "other"]


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
        # other kernels on the same bf16 weights (fused kernels, TE's LayerNorm + GEMM and
        # attention): the bf16-vs-fp32 bound until a GPU run measures them
        "other_kernels": 2e-2,
    },
    "cpu": {
        "bf16_vs_fp32": 2e-2,
        "same_math": 1e-3,
        "same_grad": 1e-5,
        "resume": 0.0,
        "cpu_vs_device": 1e-5,
        "other_kernels": 2e-2,
    },
}
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


def versions(device):
    """What a result file records of the machine: torch, CUDA, driver, megatron-core and
    Transformer Engine versions (None where there is none)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def package(*names):
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                pass
        return None

    driver = None
    if device == "cuda":
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            driver = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver,
        "megatron_core": package("megatron-core"),
        "transformer_engine": package("transformer-engine", "transformer_engine"),
        "python": sys.version.split()[0],
    }


# -------------------------------------------------------------------------------- planning


def make_plans(preset, gpu, folder):
    """The plans, written to `folder` with their estimates: plain (fp32, bf16, save, resume and
    the CPU reference), distopt and recompute on the correctness model; VARIANT-SHAPE for every
    performance variant and shape on the performance model (fused attention, `auto`). Returns
    name -> path, name -> the planner's estimate, and the parameter counts of the two models."""
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

    def pipelines(model, mbs, nmb):
        return [
            {
                "micro_batch_size": mbs,
                "num_microbatches": nmb,
                "stages": [{"ranks": [0], "layers": [0, model.num_layers]}],
            }
        ]

    main = model_from_dict(preset["model"])
    perf = model_from_dict(preset["perf"]["model"])
    mbs, nmb = preset["micro_batch_size"], preset["num_microbatches"]
    todo = [
        ("plain", main, mbs, nmb, {}),
        ("distopt", main, mbs, nmb, {"use_distributed_optimizer": True}),
        ("recompute", main, mbs, nmb, {"recompute": True}),
    ]
    for name, v in VARIANTS.items():
        kw = {
            "attention_backend": "auto",
            "transformer_impl": v.transformer_impl,
            "cuda_graph_impl": v.cuda_graph_impl,
        }
        for shape, (s, n) in SHAPES.items():
            todo.append((f"{name}-{shape}", perf, s, n, kw))
    paths, estimates = {}, {}
    for name, model, s, n, kw in todo:
        plan = build_plan(cluster, model, s * n, pipelines(model, s, n), **kw)
        est = simulate(plan)
        plan = build_plan(
            cluster, model, s * n, pipelines(model, s, n), estimate=est.to_dict(), **kw
        )
        paths[name] = folder / f"plan-{name}.json"
        save_plan(plan, paths[name])
        estimates[name] = est.to_dict()
    return paths, estimates, total_params(main), total_params(perf)


def plan_of(case):
    """The plan a case trains (its estimate is its prediction); None for fp32 (the planner
    models bf16), save/resume (the plain plan's, no prediction of their own) and the CPU
    reference."""
    parts = perf_parts(case)
    if parts:
        return f"{parts[1]}-{parts[2]}"
    return {"bf16": "plain", "distopt": "distopt", "recompute": "recompute"}.get(case)


def case_config(cfg, case):
    """(model, micro-batch size, micro-batches, iterations, warm-up) of `case`."""
    parts = perf_parts(case)
    if parts:
        perf = cfg["perf"]
        return (perf["model"], *SHAPES[parts[2]], perf["iters"], perf["warmup"])
    return (cfg["model"], cfg["micro_batch_size"], cfg["num_microbatches"], cfg["iters"],
            cfg["warmup"])  # fmt: skip


def te_unavailable(device):
    """None when the TE cases can run here (CUDA and an importable Transformer Engine), else
    the line saying why they are skipped."""
    if device != "cuda":
        return "te cases skipped: Transformer Engine runs on CUDA only"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - missing or broken: the same for this check
        return (
            f"te cases skipped: Transformer Engine cannot be imported here "
            f"({type(e).__name__}: {e})"
        )
    return None


# Why a case cannot run here, by what it needs (skip_reason); each printed once.
GRAPHS_ON_CPU = "graphs cases skipped: CUDA graphs run on CUDA only"
TE_GRAPHS = (
    "te_graphs cases skipped: this runtime does not capture Transformer Engine graphs yet "
    "(megatron-core's TECudaGraphHelper needs Megatron-LM's micro-batch calculator), so "
    "there is no pair to compare"
)


def skip_reason(case, device, no_te):
    """The line saying why `case` cannot run on `device` (`no_te`: te_unavailable's), or None."""
    parts = perf_parts(case)
    if not parts:
        return None
    variant = VARIANTS[parts[1]]
    if variant.transformer_impl == "transformer_engine" and no_te:
        return no_te
    if variant.cuda_graph_impl == "transformer_engine":
        return TE_GRAPHS
    if variant.cuda_graph_impl != "none" and device != "cuda":
        return GRAPHS_ON_CPU
    return None


def perf_fits(estimate, device):
    """None when the planner's predicted peak of the performance plan fits the GPU's memory,
    else the line saying it does not (the performance cases are then skipped)."""
    if device != "cuda":
        return None
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    peak = estimate["peak_memory_gb"][0]
    if peak <= total:
        return None
    return (
        f"performance cases skipped: the planner predicts a peak of {peak:.1f} GB for the "
        f"performance model's plan, the GPU has {total:.1f} GB"
    )


# ------------------------------------------------------------------------------- launching


def launch(entry, args, env, timeout):
    """torchrun, one process; returns (exit code, seconds, output tail, with the checkout's
    paths relative to it: the tail goes into a result file). Past `timeout` the launch's whole
    process group is killed (exit code 124)."""
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
    return code, time.monotonic() - start, out.replace(f"{ROOT}{os.sep}", "")[-4000:]


def case_launch(case, device, preset, plans, work, script):
    """(entry script, arguments, extra environment) of `case`; `script`: gpu_check.py, whose
    subcommands run the wrapped runtime, plain megatron-core and the deterministic runs."""
    n, k = preset["iters"], preset["save_at"]
    pretrain = ROOT / "pretrain_gpt.py"
    base = ["--hetero-device", device, "--train-iters", n, *FLAGS]
    cpu_env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    # Every tensor collective is checked against the run's device (NCCL's rule; see
    # megatron_hexi/strict_collectives.py): a CPU tensor fails the case with its name.
    dev_env = {**(cpu_env if device == "cpu" else {}), "HEXI_STRICT_COLLECTIVES": "1"}
    parts = perf_parts(case)
    if parts:
        impl, variant, shape = parts
        perf = preset["perf"]
        args = [
            "--hetero-plan-path",
            plans[f"{variant}-{shape}"],
            "--bf16",
            "--hetero-device",
            device,
            "--train-iters",
            perf["iters"],
            *FLAGS,
        ]
        # the runtime's fusion settings, as its TransformerConfig has them, for megatron's run
        fusions = work / f"fusions-{variant}-{shape}.json"
        on = "on" if VARIANTS[variant].fusions else "off"
        profile_at = perf["iters"]  # the last iteration, left out of the timing
        sub = "train-runtime" if impl == "hexi" else "megatron"
        return script, [sub, on, fusions, profile_at, *args], dev_env
    deterministic = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    ckpt = work / "ckpt"
    plain = ["--hetero-plan-path", plans["plain"]]
    table = {
        "fp32": (pretrain, [*plain, *base], dev_env),
        "bf16": (pretrain, [*plain, "--bf16", *base], dev_env),
        "distopt": (pretrain, ["--hetero-plan-path", plans["distopt"], "--bf16", *base], dev_env),
        "recompute": (
            pretrain,
            ["--hetero-plan-path", plans["recompute"], "--bf16", *base],
            dev_env,
        ),
        "save": (
            script,
            ["train-deterministic", *plain, "--bf16", *base, "--save", ckpt, "--save-interval", k],
            {**dev_env, **deterministic},
        ),
        "resume": (
            script,
            ["train-deterministic", *plain, "--bf16", *base, "--load", ckpt, "--ckpt-step", k],
            {**dev_env, **deterministic},
        ),
        "cpu": (
            pretrain,
            [*plain, "--hetero-device", "cpu", "--train-iters", 1, *FLAGS],
            cpu_env,
        ),
    }
    return table[case]
