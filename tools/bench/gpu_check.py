"""One-GPU check of the runtime on CUDA and NCCL, and its speed against plain megatron-core.

    python tools/bench/gpu_check.py                   # one GPU, its own CUDA torch (<= 8 min)
    python tools/bench/gpu_check.py --device cpu      # the same cases, tiny models, CPU (gloo)
    python tools/bench/gpu_check.py --recheck docs/results/gpu/FILE.json   # checks again
    python tools/bench/gpu_check.py --table docs/results/gpu/FILE.json     # benchmark table

Performance cases, most important first (a run cut by --budget-s keeps them): each trains the
performance model (TinyLlama-1.1B's shape: 22 layers, hidden 2048, FFN 5632, 32 heads in 4 query
groups, vocabulary 32000, RMSNorm, SwiGLU, untied embeddings; seq 4096, bf16, fused attention
`auto`) on one GPU, as IMPL-VARIANT-SHAPE:

  IMPL     hexi: this runtime, `torchrun --nproc-per-node 1 pretrain_gpt.py --hetero-device
           cuda` on a one-rank plan made with the planner (planner.plan.build_plan);
           megatron: plain megatron-core on the same plan's model, spec, batch, attention,
           fusions and CUDA graphs, with megatron-core's own pieces and no runtime code in the
           loop: initialize_model_parallel(1, 1), model_parallel_cuda_manual_seed (graph-safe
           under graphs), the runtime's TransformerConfig for that plan with megatron-core's
           initialisation, the runtime's layer spec (the local spec with SDPAttention, or
           megatron-core's TE spec), GPTModel computing its loss from labels, Float16Module,
           DistributedDataParallel (grad_reduce_in_fp32), get_megatron_optimizer,
           OptimizerParamScheduler, finalize_model_grads and forward_backward_no_pipelining
  VARIANT  eager: every fusion off (megatron_hexi.config.FusionConfig all False);
           fused: FusionConfig's defaults; graphs: fused + megatron-core's local per-layer CUDA
           graphs (the plan's training.cuda_graph_impl local); te: Transformer Engine's spec
           (the plan's transformer_impl) + fusions; te_graphs: te + TE's graphs
  SHAPE    1x8: 8 micro-batches of 1 sample; 8x1: one of 8

The megatron case of a variant takes the fusion settings the runtime's TransformerConfig had in
the hexi case (recorded by it; where that case did not run, the ones the runtime's rule in
megatron_hexi.fusions would choose), so both run the same kernels. Each reports the median
synchronised step time, tokens/s and MFU after the warm-up (local graphs are captured after 3
eager steps), peak allocated memory, the host time per layer pass of the last step (profiled,
not timed; _gpu_check_train says how) and the planner's prediction for the same plan (`hexi-plan
simulate`), and the runtime's tokens/s over plain megatron-core's. TE cases need an importable
Transformer Engine and are skipped with one line where it is not; te_graphs is skipped while the
runtime refuses TE graphs; graphs are skipped on CPU. All performance cases are skipped when the
planner predicts a peak above the GPU's memory.

Correctness cases (a ~270M-parameter model, batch 2 x 4; on CPU every case trains one tiny model
with the same 8-sample batch): bf16; fp32; distopt (the distributed optimizer); recompute; save
(bf16, saves at iteration K) and resume (loads K, runs on; deterministic algorithms requested);
cpu (the fp32 plan on the CPU, one iteration).

Checks (exit 1 if one fails): every case finishes with finite losses, a first loss near
ln(vocab) and a last loss below the first; bf16 against fp32 at iteration 1; the distributed
optimizer and recompute against bf16; fused against unfused attention (on CPU, where both train
one model); each variant's 1 x 8 against its 8 x 1 (one global batch, the same gradient);
fusions against eager and TE against local (GPU: other kernels, bf16 precision), CUDA graphs
against the eager fused steps (the same kernels replayed), each on losses and the first gradient
norm; the resumed losses against the uninterrupted ones; the first CUDA fp32 loss against the CPU
one; recompute lowers the peak. A missing prerequisite (no CUDA, megatron-core missing or another
version, GPU not in the catalog) is one line and exit 2.

Results: --results FILE (default on CUDA: docs/results/gpu/DATE-GPU.json; on CPU none) is the raw
result, rewritten after every case so that a run cut short keeps what it measured; it holds the
date, GPU, driver, CUDA, torch, megatron-core and Transformer Engine versions, every metric and
check. --out (runs/gpu_check/) gets gpu_check.json and gpu_check.md (the report) at the end.
"""

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_check_cases import (  # noqa: E402
    CASES,
    PRESETS,
    ROOT,
    TOLERANCES,
    Missing,
    case_launch,
    check_prerequisites,
    device_gpu,
    expected_s,
    launch,
    make_plans,
    perf_fits,
    perf_parts,
    skip_reason,
    te_unavailable,
    versions,
)
from _gpu_check_report import (  # noqa: E402
    against_megatron,
    benchmark_table,
    evaluate,
    performance,
    report,
)

BUDGET_S = 450  # the whole check on an H200, start-up included, under 8 minutes


def read_metrics(path):
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def save_result(result, path):
    """Rewrite the raw result file (atomically: a reader never sees half of it)."""
    if not path:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def default_results(device, name):
    """docs/results/gpu/DATE-GPU.json on CUDA (GPU as letters, digits and dashes); None on CPU."""
    if device != "cuda":
        return None
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return ROOT / "docs" / "results" / "gpu" / f"{day}-{slug}.json"


def finish(result, out_dir, results_path):
    result["checks"] = evaluate(result)
    result["against_megatron"] = against_megatron(performance(result))
    save_result(result, results_path)
    text = report(result)
    print(text, flush=True)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
        (out_dir / "gpu_check.md").write_text(text)
        print(f"results: {out_dir / 'gpu_check.json'}, {out_dir / 'gpu_check.md'}")
    if results_path:
        print(f"raw result file: {results_path}")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


def run(a):
    device = a.device
    check_prerequisites(device)
    import torch

    start = time.monotonic()
    gpu = device_gpu(device)
    preset = json.loads(json.dumps(PRESETS[device]))
    for key in ("iters", "warmup", "save_at"):
        if getattr(a, key) is not None:
            preset[key] = getattr(a, key)
            if key in preset["perf"]:  # --iters and --warmup: the performance cases' too
                preset["perf"][key] = getattr(a, key)
    selected = [c for c in CASES if c in (a.cases or CASES)]
    if "resume" in selected and "save" not in selected:
        raise Missing("--cases resume needs the save case too")
    if not 0 < preset["save_at"] < preset["iters"]:
        raise Missing(
            f"--save-at {preset['save_at']} must lie between 0 and --iters {preset['iters']}"
        )
    name = gpu if device == "cpu" else torch.cuda.get_device_name(0)
    results_path = Path(a.results) if a.results else default_results(device, name)
    result = {
        "device": device,
        "device_name": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": versions(device),
        "config": preset,
        "tolerances": TOLERANCES[device],
        "budget_s": a.budget_s,
        "cases": {},
        "skipped": [],
    }
    script = Path(__file__).resolve()
    with tempfile.TemporaryDirectory(prefix="hexi-gpu-check-") as tmp:
        work = Path(tmp)
        plans, result["estimates"], result["parameters"], result["perf_parameters"] = make_plans(
            preset, gpu, work
        )
        too_big = perf_fits(result["estimates"]["fused-1x8"], device)
        no_te = te_unavailable(device)
        said = set()
        for case in selected:
            why = (too_big if perf_parts(case) else None) or skip_reason(case, device, no_te)
            left = a.budget_s - (time.monotonic() - start)
            if why is None and left < expected_s(case):
                why = f"{case} not run: {left:.0f} s of the {a.budget_s:g} s budget left"
            if why:
                if why not in said:
                    print(why, flush=True)
                    said.add(why)
                    result["skipped"].append(why)
                continue
            entry, args, env = case_launch(case, device, preset, plans, work, script)
            metrics = work / f"{case}.jsonl"
            print(f"== {case}", flush=True)
            args = [*args, "--hetero-metrics-path", metrics]
            code, secs, tail = launch(entry, args, env, min(a.timeout, left))
            rows = read_metrics(metrics)
            result["cases"][case] = {"rc": code, "wall_s": secs, "metrics": rows}
            if code != 0:
                result["cases"][case]["output_tail"] = tail
                print(f"   exit {code} after {secs:.1f} s; output tail:\n{tail}", flush=True)
            else:
                losses = " ".join(f"{r['lm_loss']:.6f}" for r in rows)
                print(f"   {secs:.1f} s, losses {losses}", flush=True)
            result["wall_s"] = time.monotonic() - start
            save_result(result, results_path)  # a run cut short keeps what it measured
    result["wall_s"] = time.monotonic() - start
    return finish(result, Path(a.out) if a.out else None, results_path)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    inside = {"train-deterministic", "train-runtime", "megatron"}  # run inside torchrun
    if argv[:1] and argv[0] in inside:
        import _gpu_check_train as train

        fn = {
            "train-deterministic": train.train_deterministic,
            "train-runtime": train.train_runtime,
            "megatron": train.train_megatron,
        }[argv[0]]
        return fn(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cuda (default): the GPU check; cpu: the same cases, tiny models",
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
        metavar="CASE",
        help="run only these cases, in the check's order (resume needs save); checks that "
        f"compare a case with one left out are skipped. Cases: {' '.join(CASES)}",
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds per launch at most")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help=f"start no case past this many seconds of the whole check (default {BUDGET_S})",
    )
    ap.add_argument(
        "--results",
        default=None,
        help="the raw result file, rewritten after each case (default on CUDA: "
        "docs/results/gpu/DATE-GPU.json; on CPU: none)",
    )
    ap.add_argument(
        "--out",
        default=str(ROOT / "runs" / "gpu_check"),
        help="folder for gpu_check.json and gpu_check.md ('' for none)",
    )
    ap.add_argument(
        "--recheck",
        default=None,
        metavar="JSON",
        help="evaluate the checks of a result file again, without training",
    )
    ap.add_argument(
        "--table",
        default=None,
        metavar="JSON",
        help="print a result file's performance cases as docs/benchmarks.md's table",
    )
    a = ap.parse_args(argv)
    try:
        if a.table:
            print(benchmark_table(json.loads(Path(a.table).read_text())), end="")
            return 0
        if a.recheck:
            return finish(json.loads(Path(a.recheck).read_text()), None, None)
        return run(a)
    except Missing as e:
        print(f"gpu_check: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
