"""One-GPU check of the runtime on CUDA and NCCL, in one command.

    python tools/bench/gpu_check.py                   # one GPU, its own CUDA torch (~5 minutes)
    python tools/bench/gpu_check.py --device cpu      # the same cases, tiny model, CPU (gloo)
    python tools/bench/gpu_check.py --recheck runs/gpu_check/gpu_check.json   # checks again

Every case is a one-rank plan made with the planner (planner.plan.build_plan) for the GPU torch
sees, trained by `torchrun --nproc-per-node 1 pretrain_gpt.py --hetero-device cuda` (NCCL) with
--hetero-metrics-path, on mock data, dropout 0:

  fp32       fp32 weights and Adam
  bf16       bf16 with fp32 master weights
  distopt    bf16, distributed optimizer (the plan's training.use_distributed_optimizer)
  recompute  bf16, full activation recompute (the plan's training.recompute)
  sdpa       bf16, fused attention (the plan's training.attention_backend auto: torch's
             scaled_dot_product_attention in the local spec; the other cases run unfused)
  save       bf16, saves at iteration K and runs to N      } deterministic algorithms requested
  resume     bf16, loads iteration K of `save`, runs to N  } (and CUBLAS_WORKSPACE_CONFIG)
  cpu        the fp32 plan on the CPU (gloo, CPU patches), one iteration

Checks (exit 1 if one fails): every case finishes with finite losses, a first loss near ln(vocab)
and a last loss below the first; bf16 against fp32 at iteration 1; the distributed optimizer and
recompute against bf16; the resumed losses against the uninterrupted ones; the first CUDA fp32
loss against the CPU one. Tolerances depend on the device and are printed with each check.
Reported, not checked: step time (metrics' step_time_s, median after warm-up), MFU and peak
memory per case against the planner's prediction (planner.simulator.simulate; the planner models
bf16 mixed precision, so the fp32 case has none). A missing prerequisite (no CUDA, megatron-core
missing or another version, GPU not in the catalog) is one line and exit 2.

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
# few GB: fits any 24 GB card); a step takes well under a second on an H100-class GPU.
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
    },
    "cpu": {
        "model": {
            "num_layers": 2,
            "hidden_size": 64,
            "ffn_hidden_size": 128,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "vocab_size": 128,
            "seq_length": 32,
            "name": "gpu-check-tiny",
        },
        "micro_batch_size": 2,
        "num_microbatches": 2,
        "iters": 4,
        "warmup": 1,
        "save_at": 2,
    },
}
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
    },
    "cpu": {
        "bf16_vs_fp32": 2e-2,
        "same_math": 1e-3,
        "same_grad": 1e-5,
        "resume": 0.0,
        "cpu_vs_device": 1e-5,
    },
}
CASES = ("fp32", "bf16", "distopt", "recompute", "sdpa", "save", "resume", "cpu")
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
    """The three plans, written to `folder` with their estimates: plain (fp32, bf16, save,
    resume and the CPU reference), distopt and recompute. Returns name -> path, name -> the
    planner's estimate, and the model's parameter count."""
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
    model = model_from_dict(preset["model"])
    mbs, nmb = preset["micro_batch_size"], preset["num_microbatches"]
    pipelines = [
        {
            "micro_batch_size": mbs,
            "num_microbatches": nmb,
            "stages": [{"ranks": [0], "layers": [0, model.num_layers]}],
        }
    ]
    paths, estimates = {}, {}
    for name, kw in {
        "plain": {},
        "distopt": {"use_distributed_optimizer": True},
        "recompute": {"recompute": True},
        "sdpa": {"attention_backend": "auto"},
    }.items():
        plan = build_plan(cluster, model, mbs * nmb, pipelines, **kw)
        est = simulate(plan)
        plan = build_plan(cluster, model, mbs * nmb, pipelines, estimate=est.to_dict(), **kw)
        paths[name] = folder / f"plan-{name}.json"
        save_plan(plan, paths[name])
        estimates[name] = est.to_dict()
    return paths, estimates, total_params(model)


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
        "sdpa": (pretrain, ["--hetero-plan-path", plans["sdpa"], "--bf16", *base], dev_env),
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


# ---------------------------------------------------------------------------------- checks


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def evaluate(result):
    """The list of checks (name, ok, detail) for a result dict (fresh or loaded)."""
    device, tol, cfg = result["device"], result["tolerances"], result["config"]
    runs = result["cases"]
    n, k = cfg["iters"], cfg["save_at"]
    ln_v = math.log(cfg["model"]["vocab_size"])
    checks = []

    def add(name, ok, detail):
        checks.append({"check": name, "ok": bool(ok), "detail": detail})

    def losses(case, key="lm_loss"):
        return [r[key] for r in runs.get(case, {}).get("metrics", [])]

    expected = {c: (1 if c == "cpu" else n - k if c == "resume" else n) for c in runs}
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
            add(
                f"{case}: first loss near ln(vocab)",
                finite and rel(got[0], ln_v) <= 0.1,
                f"{got[0]:.6f} vs ln({cfg['model']['vocab_size']}) = {ln_v:.4f} (10 %)",
            )
        if case not in ("resume", "cpu"):
            add(
                f"{case}: loss decreases",
                finite and got[-1] < got[0],
                f"{got[0]:.6f} -> {got[-1]:.6f}",
            )

    def compare(name, a, b, tolerance, what, first_only=False, key="lm_loss"):
        la, lb = losses(a, key), losses(b, key)
        if a not in runs or b not in runs:  # not selected (--cases)
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
    if device == "cuda" and complete.get("sdpa") and complete.get("bf16"):
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
        "save": None,
        "resume": None,
        "cpu": None,
    }
    for case, run in result["cases"].items():
        m = run["metrics"]
        timed = m[cfg["warmup"] :] if len(m) > cfg["warmup"] else m
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
        "",
        f"| case | step s (median) | predicted s | MFU | predicted MFU | peak GB ({mem_note}) "
        "| predicted GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in performance(result):
        lines.append(
            f"| {r['case']} | {_fmt(r.get('step_s'), '.4f')} | "
            f"{_fmt(r.get('pred_step_s'), '.4f')} | {_fmt(r.get('mfu'), '.1%')} | "
            f"{_fmt(r.get('pred_mfu'), '.1%')} | {_fmt(r.get('peak_gb'), '.2f')} | "
            f"{_fmt(r.get('pred_peak_gb'), '.2f')} |"
        )
    lines += [
        "",
        "(predictions: planner.simulator for the bf16 plans; fp32, save, resume and "
        "the CPU reference have none)",
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


def finish(result, out_dir):
    result["checks"] = evaluate(result)
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
        plans, result["estimates"], result["parameters"] = make_plans(preset, gpu, work)
        for case, (entry, args, env) in cases(device, preset, plans, work).items():
            if case not in selected:
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default): the GPU check; cpu: the same cases, tiny model",
    )
    ap.add_argument("--iters", type=int, default=None, help="iterations per case")
    ap.add_argument("--warmup", type=int, default=None, help="iterations not timed")
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
