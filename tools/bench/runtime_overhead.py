"""Step time of this runtime against plain megatron-core, same parallel sizes, model and run, CPU.

    python tools/bench/runtime_overhead.py [--iters 5] [--warmup 3] [--rounds 12] [--timeout 600]

What is compared. For each case, gloo processes (one per plan rank):
  TP2  one pipeline, one stage of TP=2 (4 micro-batches of 2)
  PP2  one pipeline, two TP=1 stages (1F1B, 4 micro-batches of 2)
  DP2  two one-rank pipelines (2 micro-batches of 2 each)
  HET4/TP2xDP2, HET4/PP2xDP2  4 ranks: this runtime trains a TP2 pipeline beside a two-stage
       pipeline (4 samples each, the same FLOPs per rank); plain megatron-core, which needs
       uniform replicas, trains the closest uniform plans (two TP2, or two PP2, replicas). The
       ratio then also holds what the plans differ in (a pipeline bubble on one side). These
       cases need 4 cores at one thread per rank and are skipped where they do not fit.
"ours" builds a plan (planner.plan.build_plan over a CPU cluster of that size) and steps
megatron_hexi.training.Trainer: per-rank stage models, its StageCommunicator for the stage
boundary, the weighted segment gradient sync with its token all-reduce, the sharded loss, the
exact grad norm and the per-step stats all-reduce. "plain" is megatron-core alone with the same
sizes, as Megatron-LM's training loop runs it (tools/bench/_overhead_workers.py: build_plain):
parallel_state.initialize_model_parallel(tp, pp), GPTModel with the same local layer spec and
the same initial weights, DistributedDataParallel (contiguous grad buffer, no overlap),
get_forward_backward_func with megatron's own P2P (batch_p2p_comm=False),
finalize_model_grads, get_megatron_optimizer (Adam, clipping), OptimizerParamScheduler, and
Megatron-LM's data-parallel loss reduction. Both read the same pre-materialised mock samples
(megatron-core's MockGPTDataset), fp32, dropout 0, so both compute the same losses (printed:
the runtime is exact under any plan), and the difference in time is the runtime's own.

Why. The runtime adds work megatron-core does not do (boundary send/recv through its own
communicator, segment all-reduces, exact grad norm over the world, stats); on a homogeneous plan
that should cost next to nothing. Target: paired ours / plain <= 1.05 (TARGET), on the uniform
cases (the heterogeneous ones also hold what their plans differ in).

How. Each case is one run_distributed job (tests/harness.py: spawned ranks, hard timeout) in
which every rank builds both variants in its own process and alternates their steps (ours,
plain, ours, ...; rounds start with either in turn), each step from a barrier. Pairing steps in
the same processes cancels machine-load drift, and both variants run beside the same threads:
each gloo process group runs an event-loop thread that wakes every 10 ms, plain megatron-core
builds about 30 groups where the runtime builds a few, and on an idle VM those wake-ups alone
made collectives faster (docs/benchmarks.md); in one process both variants get them alike. A
step's time is the slowest rank's; its CPU time is the process CPU time (all threads) summed
over ranks. A round's ratio is ours / plain of the median step time of its steps; the paired
ratio is the median of the round ratios, printed with their range (the same for CPU time).
The breakdown splits a step into forward/backward (schedule incl. P2P, without the finalize),
gradient finalize (our token all-reduce + segment sync, or megatron's DDP sync, token
broadcast + scaling) and the rest (optimizer with grad norm and clipping, scheduler, loss and
stats reduction).
"""

import os

# Compute threads per rank, fixed before torch is imported (here, in the workers module, and in
# every rank: the spawned ranks start with this environment). THREADS ranks' threads must fit the
# cores, or the ranks wait for a core inside every collective and the ratio means nothing.
THREADS = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))

import argparse  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The repository root first (as under `python -m pytest` from it): tests/planner is a test folder
# that would otherwise shadow the planner package as a namespace package, here and in the ranks.
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent), str(ROOT / "tests")]

import _overhead_workers as workers  # noqa: E402
from harness import DistributedTimeout, run_distributed  # noqa: E402
from megatron_hexi.distributed import available_cores  # noqa: E402

MODEL = {
    "num_layers": 4,
    "hidden_size": 256,
    "ffn_hidden_size": 1024,
    "num_attention_heads": 8,
    "num_query_groups": 8,
    "vocab_size": 1024,
    "seq_length": 128,
    "name": "bench-small",
}
GLOBAL_BATCH = 8
TARGET = 1.05  # paired ours / plain, uniform cases


class Case(NamedTuple):
    """The pipelines this runtime trains and those plain megatron-core trains (uniform
    replicas: one data-parallel replica per pipeline)."""

    ours: list[dict]
    plain: list[dict]


def _uniform(pipelines):
    return Case(pipelines, pipelines)


def _tp2(ranks, samples):
    return {
        "micro_batch_size": 2,
        "num_microbatches": samples // 2,
        "stages": [{"ranks": ranks, "layers": [0, 4]}],
    }


def _whole(rank, samples):
    return {
        "micro_batch_size": 2,
        "num_microbatches": samples // 2,
        "stages": [{"ranks": [rank], "layers": [0, 4]}],
    }


def _pp2(first, second, samples):
    return {
        "micro_batch_size": 2,
        "num_microbatches": samples // 2,
        "stages": [{"ranks": [first], "layers": [0, 2]}, {"ranks": [second], "layers": [2, 4]}],
    }


# A heterogeneous plan: a TP2 pipeline beside a two-stage one, 4 samples each (the same FLOPs
# per rank), against the two uniform plans plain megatron-core can run that are closest to it.
HETEROGENEOUS = [_tp2([0, 1], 4), _pp2(2, 3, 4)]
CASES = {
    "TP2": _uniform([_tp2([0, 1], 8)]),
    "PP2": _uniform([_pp2(0, 1, 8)]),
    "DP2": _uniform([_whole(0, 4), _whole(1, 4)]),
    "HET4/TP2xDP2": Case(HETEROGENEOUS, [_tp2([0, 1], 4), _tp2([2, 3], 4)]),
    "HET4/PP2xDP2": Case(HETEROGENEOUS, [_pp2(0, 1, 4), _pp2(2, 3, 4)]),
}


def world_size(case):
    return 1 + max(r for p in CASES[case].ours for s in p["stages"] for r in s["ranks"])


def build_plans(cases):
    """{(case, variant): Plan}; the ranks get the Plan objects themselves (no plan files)."""
    from planner.models import model_from_dict
    from planner.plan import build_plan
    from runtime.plans import cpu_cluster

    model = model_from_dict(MODEL)
    plans = {}
    for case in cases:
        cluster = cpu_cluster(world_size(case))  # one node of `world` CPU "GPUs"
        for variant in ("ours", "plain"):
            pipelines = getattr(CASES[case], variant)
            plans[case, variant] = build_plan(cluster, model, GLOBAL_BATCH, pipelines)
    return plans


class Spread(NamedTuple):
    """The median and range of a case's round ratios."""

    median: float
    low: float
    high: float

    def __str__(self):
        return f"{self.median:.3f}x [{self.low:.3f}-{self.high:.3f}]"


def round_ratios(out, key, warmup, rounds, iters):
    """Per round, ours / plain of the median `key` over the round's steps (a median, so that one
    step disturbed by other work does not move the round)."""
    ratios = []
    for r in range(rounds):
        lo, hi = warmup + r * iters, warmup + (r + 1) * iters
        ours, plain = out["ours"][key][lo:hi], out["plain"][key][lo:hi]
        ratios.append(statistics.median(ours) / statistics.median(plain))
    return ratios


def spread(ratios):
    return Spread(statistics.median(ratios), min(ratios), max(ratios))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=5, help="timed steps of each variant per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant")
    p.add_argument("--rounds", type=int, default=12, help="rounds per case")
    p.add_argument("--timeout", type=float, default=600, help="seconds per case (harness)")
    p.add_argument(
        "--cases",
        nargs="+",
        choices=list(CASES),
        default=list(CASES),
        help="default: every case whose ranks fit the cores",
    )
    p.add_argument(
        "--allow-oversubscription",
        action="store_true",
        help="report even when the ranks' threads exceed the cores (the figures are then noise)",
    )
    a = p.parse_args(argv)
    if a.iters < 1 or a.rounds < 1 or a.warmup < 0:
        p.error("--iters and --rounds must be at least 1, --warmup not negative")
    print("$ " + " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]), flush=True)
    cores = available_cores()
    print(f"threads: OMP_NUM_THREADS={THREADS} per rank, {cores} cores", flush=True)
    cases = []
    for case in a.cases:
        if THREADS * world_size(case) > cores and not a.allow_oversubscription:
            print(
                f"  {case}: skipped: {world_size(case)} ranks x {THREADS} threads oversubscribe "
                f"{cores} cores (needs {THREADS * world_size(case)}; --allow-oversubscription "
                f"reports it anyway, as noise)",
                flush=True,
            )
        else:
            cases.append(case)
    if not cases:
        print("runtime_overhead.py: no case fits the cores", file=sys.stderr)
        return 2
    print(
        f"model {MODEL['num_layers']}L h{MODEL['hidden_size']} ffn{MODEL['ffn_hidden_size']} "
        f"heads {MODEL['num_attention_heads']} vocab {MODEL['vocab_size']} seq "
        f"{MODEL['seq_length']}, global batch {GLOBAL_BATCH} in micro-batches of 2, fp32, gloo; "
        f"both variants in each rank's process, {a.warmup} warm-up + {a.rounds} rounds x "
        f"{a.iters} steps of each, alternating",
        flush=True,
    )
    load0 = os.getloadavg()[0]
    start = time.monotonic()
    plans = build_plans(cases)
    results = {}
    for case in cases:
        t = time.monotonic()
        try:
            out = run_distributed(
                workers.paired,
                world_size(case),
                plans[case, "ours"],
                plans[case, "plain"],
                a.warmup,
                a.rounds,
                a.iters,
                timeout=a.timeout,
                fresh=True,  # fresh interpreters: threads fixed before torch is imported
                env={"OMP_NUM_THREADS": str(THREADS)},
            )[0]
        except DistributedTimeout as e:
            print(
                f"  {case}: TIMED OUT after {a.timeout:g} s (load {os.getloadavg()[0]:.1f}): "
                f"{str(e).splitlines()[0]}",
                flush=True,
            )
            continue
        if out["threads"] != THREADS:
            raise SystemExit(f"a rank ran {out['threads']} threads, not OMP_NUM_THREADS={THREADS}")
        results[case] = out
        walls = round_ratios(out, "step_s", a.warmup, a.rounds, a.iters)
        print(
            f"  {case}: round ratios (wall) {' '.join(f'{x:.3f}' for x in walls)} "
            f"(run {time.monotonic() - t:.0f} s, load {os.getloadavg()[0]:.1f})",
            flush=True,
        )

    def med(case, variant, key):
        return statistics.median(results[case][variant][key][a.warmup :]) * 1e3

    print(
        f"\n{'case':<12} {'ours_ms':>8} {'plain_ms':>9}   {'paired ratio [range]':<22} "
        f"{'ours_cpu':>8} {'plain_cpu':>9}   {'CPU paired ratio [range]':<24} loss ours / plain"
    )
    worst = 0.0
    for case in cases:
        if case not in results:
            if not case.startswith("HET"):
                worst = float("inf")
            print(f"{case:<12} (timed out)")
            continue
        out = results[case]
        wall = spread(round_ratios(out, "step_s", a.warmup, a.rounds, a.iters))
        cpu = spread(round_ratios(out, "cpu_s", a.warmup, a.rounds, a.iters))
        if not case.startswith("HET"):
            worst = max(worst, wall.median)
        lo, lp = out["ours"]["losses"], out["plain"]["losses"]
        diff = max(abs(x - y) / abs(y) for x, y in zip(lo, lp))
        print(
            f"{case:<12} {med(case, 'ours', 'step_s'):8.1f} {med(case, 'plain', 'step_s'):9.1f}"
            f"   {str(wall):<22} {med(case, 'ours', 'cpu_s'):8.1f} "
            f"{med(case, 'plain', 'cpu_s'):9.1f}   {str(cpu):<24} {lo[0]:.4f} -> {lo[-1]:.4f}"
            f" / {lp[0]:.4f} -> {lp[-1]:.4f} (largest relative difference {diff:.1e})"
        )
    print(
        "(ms: median step over all timed steps; paired ratio: median over rounds of ours / "
        "plain of the round's median step times, [lowest-highest round]; cpu: process CPU time "
        "per step summed over the ranks; loss: first -> last step, same samples and weights)"
    )
    print("\nbreakdown, median ms per step (fwd/bwd incl. P2P | grad finalize | optimizer+rest):")
    for case in results:
        for v in ("ours", "plain"):
            st = results[case][v]
            rest = [t - f - g for t, f, g in zip(st["step_s"], st["fwd_bwd_s"], st["finalize_s"])][
                a.warmup :
            ]
            print(
                f"  {case} {v:<5} {med(case, v, 'fwd_bwd_s'):8.1f} | "
                f"{med(case, v, 'finalize_s'):6.2f} | {statistics.median(rest) * 1e3:6.1f}"
            )
    load1 = os.getloadavg()[0]
    verdict = "OK" if worst <= TARGET else "INCOMPLETE" if worst == float("inf") else "OVER"
    where = (
        f"total {time.monotonic() - start:.0f} s; load average {load0:.1f} -> {load1:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    if any(not c.startswith("HET") for c in cases):
        print(
            f"\nworst paired ratio of the uniform cases {worst:.3f}x (target <= {TARGET}): "
            f"{verdict}; {where}"
        )
    else:
        print(f"\nno uniform case measured (the target is for those); {where}")
    if max(load0, load1) > os.cpu_count() + 0.5:
        print(
            "WARNING: the machine was busy with other work; wall times are inflated and noisy "
            "(compare the CPU columns, or rerun when idle)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
