"""Overlapped gradient sync on CPU: step time and exposed sync, with and without overlap, measured
in one run beside the planner's prediction for both.

    python tools/bench/overlap.py [--profile cpu.json] [--rounds 3] [--steps 6] [--warmup 2]

Two one-stage pipelines of one process each (the two processes this 2-core machine holds), one
micro-batch each, of a model whose gradient (25.2 M parameters, 101 MB in fp32) is a noticeable
part of the step: every step all-reduces it between the two. Buckets hold at most --bucket-size
elements (default 1 M, about a third of a layer; Megatron-LM's 40 M default would make one
bucket of this small model, ready only at the end of the backward), in the runs and in the
prediction alike. The same plan is trained with
`overlap_grad_reduce` off and on (a fresh launch each, OMP_NUM_THREADS=1 per process, as torchrun
and the test harness run ranks), alternating over --rounds rounds so a slow spell of the shared
machine hits both alike. Per variant: the fastest step after warm-up (the undisturbed cost, as
the fidelity bench takes it) and the median, the median `grad_sync_exposed_s` (end of a rank's
last backward to the end of its gradient sync, the maximum over ranks) and the simulator's
iteration time and exposed sync for the plan, costed with a hexi-profile of this machine
(measured first unless --profile gives one).

gloo runs a collective on its own threads, so the all-reduce really runs beside the backward;
on 2 cores those threads share the cores with the compute, which the ratio includes.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent), str(ROOT / "tests")]

MODEL = {
    "num_layers": 4,
    "hidden_size": 512,
    "ffn_hidden_size": 2048,
    "num_attention_heads": 8,
    "num_query_groups": 8,
    "vocab_size": 8192,
    "seq_length": 64,
    "name": "bench-sync-heavy",
}
PIPELINES = [
    {"micro_batch_size": 1, "num_microbatches": 1, "stages": [{"ranks": [0], "layers": [0, 4]}]},
    {"micro_batch_size": 1, "num_microbatches": 1, "stages": [{"ranks": [1], "layers": [0, 4]}]},
]
VARIANTS = {"serial": False, "overlapped": True}


def train_rank(plan, iters, bucket_size):
    """One rank: `iters` steps of the plan; per step its step time and exposed sync."""
    import torch.distributed as dist

    from fidelity import run_config
    from megatron_hexi.training import Trainer, init_distributed

    config = run_config(iters, "cpu", bucket_size)
    device = init_distributed(plan, config)
    trainer = Trainer(plan, config, device)
    steps = [trainer.train_step(it) for it in range(iters)]
    out = {
        "step_s": [m["step_time_s"] for m in steps],
        "exposed_s": [m["grad_sync_exposed_s"] for m in steps],
        "started_in_backward": trainer.grad_sync.started_in_backward,
        "buckets": len(trainer.grad_sync.buckets),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    return everyone


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    ap.add_argument("--max-profile-seconds", type=float, default=90)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per launch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-size", type=int, default=1_000_000, help="--ddp-bucket-size")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args(argv)
    import yaml

    import overlap as this
    from fidelity import _cluster, _profile, report_load
    from harness import run_distributed
    from megatron_hexi.profile.measure import DEFAULT_ATTENTION_BACKEND
    from planner.models import load_model
    from planner.plan import build_plan
    from planner.simulator import simulate

    report_load()
    with tempfile.TemporaryDirectory(prefix="hexi-overlap-") as tmp:
        tmp = Path(tmp)
        model_path = tmp / "model.yaml"
        model_path.write_text(yaml.safe_dump(MODEL))
        model = load_model(str(model_path))
        prof = Path(a.profile).resolve() if a.profile else tmp / "profile.json"
        if not a.profile:
            _profile(model_path, prof, a.max_profile_seconds, "cpu")
        plans = {
            name: build_plan(
                _cluster(2, prof),
                model,
                2,
                PIPELINES,
                overlap_grad_reduce=overlapped,
                attention_backend=DEFAULT_ATTENTION_BACKEND,  # what the profile measured
            )
            for name, overlapped in VARIANTS.items()
        }
        steps = {name: [] for name in VARIANTS}
        exposed = {name: [] for name in VARIANTS}
        for rnd in range(a.rounds):
            for name, plan in plans.items():
                per_rank = run_distributed(
                    this.train_rank,
                    2,
                    plan,
                    a.warmup + a.steps,
                    a.bucket_size,
                    timeout=a.timeout,
                    fresh=True,  # fresh interpreters: threads fixed before torch is imported
                    env={"OMP_NUM_THREADS": "1"},
                )[0]
                rank0 = per_rank[0]
                if VARIANTS[name]:
                    early = [r["started_in_backward"] for r in per_rank]
                    assert early == [r["buckets"] for r in per_rank], "nothing overlapped"
                steps[name] += rank0["step_s"][a.warmup :]
                exposed[name] += rank0["exposed_s"][a.warmup :]
                print(
                    f"round {rnd + 1} {name:>10}: steps (ms) "
                    f"{[round(s * 1e3, 1) for s in rank0['step_s'][a.warmup :]]}, exposed sync "
                    f"(ms) {[round(s * 1e3, 1) for s in rank0['exposed_s'][a.warmup :]]}",
                    flush=True,
                )
        estimates = {
            name: simulate(plan, bucket_elements=a.bucket_size) for name, plan in plans.items()
        }
    print(f"load average {os.getloadavg()[0]:.1f} after the run", flush=True)
    print(
        f"\nmodel {MODEL['name']}: {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"FFN {MODEL['ffn_hidden_size']}, vocab {MODEL['vocab_size']}, seq {MODEL['seq_length']}; "
        f"two one-rank pipelines, 1 micro-batch each, fp32, gloo, buckets of <= "
        f"{a.bucket_size:,} elements"
    )
    header = (
        f"{'variant':>10} | {'fastest step ms':>15} | {'median step ms':>14} | "
        f"{'median exposed sync ms':>22} | {'predicted step ms':>17} | {'predicted exposed ms':>20}"
    )
    print(header)
    print("-" * len(header))
    fastest = {}
    for name in VARIANTS:
        fastest[name] = min(steps[name])
        est = estimates[name]
        print(
            f"{name:>10} | {fastest[name] * 1e3:>15.1f} | "
            f"{statistics.median(steps[name]) * 1e3:>14.1f} | "
            f"{statistics.median(exposed[name]) * 1e3:>22.1f} | "
            f"{est.iteration_time_s * 1e3:>17.1f} | {est.grad_sync_time_s * 1e3:>20.1f}"
        )
    measured = fastest["overlapped"] / fastest["serial"]
    predicted = estimates["overlapped"].iteration_time_s / estimates["serial"].iteration_time_s
    print(
        f"\noverlapped / serial step time: measured {measured:.3f} (fastest steps), "
        f"{statistics.median(steps['overlapped']) / statistics.median(steps['serial']):.3f} "
        f"(medians); predicted {predicted:.3f}"
    )
    for name in VARIANTS:
        err = estimates[name].iteration_time_s / fastest[name] - 1
        print(f"prediction error {name}: {err * 100:+.1f} % (fidelity page bound: 20 %)")
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}]")


if __name__ == "__main__":
    main()
