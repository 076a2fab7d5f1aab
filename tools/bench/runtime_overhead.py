"""Step time of this runtime against plain megatron-core, same parallel sizes, model and run, CPU.

    python tools/bench/runtime_overhead.py [--iters 10] [--warmup 3] [--rounds 2] [--timeout 300]

What is compared. For each case, gloo processes (one per plan rank):
  TP2  one pipeline, one stage of TP=2 (4 micro-batches of 2)
  PP2  one pipeline, two TP=1 stages (1F1B, 4 micro-batches of 2)
  DP2  two one-rank pipelines (2 micro-batches of 2 each); plain: megatron's
       DistributedDataParallel (contiguous grad buffer, no overlap) and finalize_model_grads
  HET4/TP2xDP2, HET4/PP2xDP2  4 ranks: this runtime trains a TP2 pipeline beside a two-stage
       pipeline (4 samples each, the same FLOPs per rank); plain megatron-core, which needs
       uniform replicas, trains the closest uniform plans (two TP2, or two PP2, replicas). The
       ratio then also holds what the plans differ in (a pipeline bubble on one side). These
       cases need 4 cores at one thread per rank and are skipped where they do not fit.
"ours" builds a plan (planner.plan.build_plan over a CPU cluster of that size) and steps
megatron_hexi.training.Trainer: per-rank stage models, its StageCommunicator for the stage
boundary, the weighted segment gradient sync with its token all-reduce, the sharded loss, the
exact grad norm and the per-step stats all-reduce. "plain" is megatron-core alone with the same
sizes: parallel_state.initialize_model_parallel(tp, pp), GPTModel with get_gpt_layer_local_spec,
forward_backward_no_pipelining (TP2) / forward_backward_pipelining_without_interleaving with
megatron's own P2P (batch_p2p_comm=False) (PP2), model(..., labels=...) loss, FP32Optimizer around
torch AdamW, megatron's per-token scaling (what finalize_model_grads does at DP=1, untied).
Both read the same pre-materialised mock samples (megatron-core's MockGPTDataset), fp32,
dropout 0, same TransformerConfig, so the difference is the runtime's own overhead.

Why. The runtime adds work megatron-core does not do (boundary send/recv through its own
communicator, segment all-reduces, exact grad norm over the world, stats); on a homogeneous plan
that should cost next to nothing. Target: paired ours / plain <= 1.05 (TARGET), on the uniform
cases (the heterogeneous ones also hold what their plans differ in).

How. Each run is one run_distributed job (tests/harness.py: spawned ranks, hard timeout). The
variants alternate (ours, plain, ours, plain, ...) to cancel machine-load drift. A step is timed
from a barrier to its end on each rank; a step's time is the slowest rank's; the table shows the
median over all timed steps of all rounds (warm-up steps dropped). The breakdown splits that into
forward/backward (schedule incl. P2P, without the finalize), gradient finalize (our token
all-reduce + segment sync, or megatron's token broadcast + scaling) and the rest (optimizer with
grad norm and clipping, scheduler, and in ours the stats all-reduce).
"""

import os

# Compute threads per rank, fixed before torch is imported (here, in the workers module, and in
# every rank: the spawned ranks start with this environment). THREADS ranks' threads must fit the
# cores, or the ranks wait for a core inside every collective and the ratio means nothing.
THREADS = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The repository root first (as under `python -m pytest` from it): tests/planner is a test folder
# that would otherwise shadow the planner package as a namespace package, here and in the ranks.
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent), str(ROOT / "tests")]

import yaml  # noqa: E402

import _overhead_workers as workers  # noqa: E402
from harness import DistributedTimeout, run_distributed  # noqa: E402
from megatron_hexi.training import available_cores  # noqa: E402

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


# Each gloo process group runs a TCP event-loop thread that wakes every 10 ms (epoll_wait's
# timeout in gloo's tcp transport), and plain megatron-core builds about 30 groups where the
# runtime builds a few. On an otherwise idle VM those wake-ups keep the cores out of deep idle, and
# every collective, whose ranks sleep and wake several times per call, completes sooner: measured
# on TP2, a process that only wakes every 0.5 ms beside each rank made ours 12% faster and plain 4%
# faster, and with one beside each rank in both variants the two were equal (1.00x). So both
# variants run beside the same sidecars, which do nothing but wake up, and the ratio is the
# runtime's own overhead; --no-keep-awake shows the raw figure.
KEEP_AWAKE = "import time\nwhile True:\n    time.sleep(0.0005)"


@contextlib.contextmanager
def keep_awake(processes):
    """`processes` sidecar processes that wake every 0.5 ms, for the duration of the block."""
    sidecars = [subprocess.Popen([sys.executable, "-c", KEEP_AWAKE]) for _ in range(processes)]
    try:
        yield
    finally:
        for s in sidecars:
            s.kill()
            s.wait()


def build_plans(directory, cases):
    """{(case, variant): Plan}; the ranks get the Plan objects themselves (no plan files)."""
    from planner.models import load_model
    from planner.plan import build_plan
    from runtime.plans import cpu_cluster

    model_path = directory / "model.yaml"
    model_path.write_text(yaml.safe_dump(MODEL))
    model = load_model(str(model_path))
    plans = {}
    for case in cases:
        cluster = cpu_cluster(world_size(case))  # one node of `world` CPU "GPUs"
        for variant in ("ours", "plain"):
            pipelines = getattr(CASES[case], variant)
            plans[case, variant] = build_plan(cluster, model, GLOBAL_BATCH, pipelines)
    return plans


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--rounds", type=int, default=2, help="ours/plain pairs per case")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run (harness)")
    p.add_argument(
        "--no-keep-awake",
        dest="keep_awake",
        action="store_false",
        help="run without the wake-up sidecars (see KEEP_AWAKE): the ratio then also measures "
        "how often each variant's idle threads wake the cores",
    )
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
    ranks = max(world_size(c) for c in cases)
    print(
        f"model {MODEL['num_layers']}L h{MODEL['hidden_size']} ffn{MODEL['ffn_hidden_size']} "
        f"heads {MODEL['num_attention_heads']} vocab {MODEL['vocab_size']} seq "
        f"{MODEL['seq_length']}, global batch {GLOBAL_BATCH} in micro-batches of 2, fp32, gloo, "
        f"{a.warmup} warm-up + {a.iters} timed steps x {a.rounds} rounds",
        flush=True,
    )
    iters = a.warmup + a.iters
    load0 = os.getloadavg()[0]
    results = {(c, v): [] for c in cases for v in ("ours", "plain")}
    round_medians = {(c, v): [] for c in cases for v in ("ours", "plain")}
    losses = {}
    start = time.monotonic()
    print(
        f"cores kept awake: {'yes, ' + str(ranks) + ' sidecar processes' if a.keep_awake else 'no'}"
        f" (--no-keep-awake; KEEP_AWAKE in this file says why)",
        flush=True,
    )
    with (
        contextlib.ExitStack() as stack,
        tempfile.TemporaryDirectory(prefix="hexi-overhead-") as tmp,
    ):
        if a.keep_awake:
            stack.enter_context(keep_awake(ranks))
        plans = build_plans(Path(tmp), cases)
        for r in range(a.rounds):
            for case in cases:
                for variant in ("ours", "plain"):
                    t = time.monotonic()
                    try:
                        out = run_distributed(
                            getattr(workers, variant),
                            plans[case, variant].world_size,
                            plans[case, variant],
                            iters,
                            timeout=a.timeout,
                            env={"OMP_NUM_THREADS": str(THREADS)},
                        )[0]
                    except DistributedTimeout as e:
                        print(
                            f"  round {r + 1} {case} {variant:<5} TIMED OUT after "
                            f"{a.timeout:g} s (load {os.getloadavg()[0]:.1f}): "
                            f"{str(e).splitlines()[0]}",
                            flush=True,
                        )
                        round_medians[case, variant].append(float("nan"))
                        continue
                    if out["threads"] != THREADS:
                        raise SystemExit(
                            f"a rank ran {out['threads']} threads, not OMP_NUM_THREADS={THREADS}"
                        )
                    steps = list(
                        zip(out["step_s"], out["fwd_bwd_s"], out["finalize_s"], out["cpu_s"])
                    )[a.warmup :]
                    results[case, variant] += steps
                    losses[case, variant] = out["losses"]
                    med = statistics.median(s[0] for s in steps)
                    round_medians[case, variant].append(med)
                    print(
                        f"  round {r + 1} {case} {variant:<5} median step {med * 1e3:7.1f} ms, "
                        f"cpu {statistics.median(s[3] for s in steps) * 1e3:7.1f} ms "
                        f"(run {time.monotonic() - t:4.1f} s, load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )

    def med(case, variant, i):
        vals = [s[i] for s in results[case, variant]]
        return statistics.median(vals) * 1e3 if vals else float("nan")

    print(
        f"\n{'case':<12} {'ours_ms':>8} {'plain_ms':>9} {'ratio':>6} {'paired':>7}   "
        f"{'ours_cpu':>8} {'plain_cpu':>9} {'ratio':>6}"
    )
    worst = 0.0
    for case in cases:
        o, pl = med(case, "ours", 0), med(case, "plain", 0)
        pairs = [
            x / y
            for x, y in zip(round_medians[case, "ours"], round_medians[case, "plain"])
            if x == x and y == y
        ]
        paired = statistics.median(pairs) if pairs else float("nan")
        oc, pc = med(case, "ours", 3), med(case, "plain", 3)
        if not case.startswith("HET"):
            worst = max(worst, paired) if paired == paired else float("inf")
        print(
            f"{case:<12} {o:8.1f} {pl:9.1f} {o / pl:5.2f}x {paired:6.2f}x   {oc:8.1f} {pc:9.1f} "
            f"{oc / pc:5.2f}x"
        )
    print(
        "(ratio: of the medians over all timed steps; paired: median over rounds of the ratio "
        "of adjacent runs; cpu: process CPU time per step summed over the ranks)"
    )
    print("\nbreakdown, median ms per step (fwd/bwd incl. P2P | grad finalize | optimizer+rest):")
    for case in cases:
        for v in ("ours", "plain"):
            rest = [st[0] - st[1] - st[2] for st in results[case, v]]
            rest_ms = statistics.median(rest) * 1e3 if rest else float("nan")
            print(
                f"  {case} {v:<5} {med(case, v, 1):8.1f} | {med(case, v, 2):6.2f} | {rest_ms:6.1f}"
            )
    print("\nloss per step (first, last), same samples, different initialisations:")
    for (case, v), ls in sorted(losses.items()):
        print(f"  {case} {v:<5} {ls[0]:.4f} -> {ls[-1]:.4f}")
    load1 = os.getloadavg()[0]
    verdict = "OK" if worst <= TARGET else "INCOMPLETE" if worst == float("inf") else "OVER"
    print(
        f"\nworst paired ratio of the uniform cases {worst:.2f}x (target <= {TARGET}): {verdict}; "
        f"total {time.monotonic() - start:.0f} s; load average {load0:.1f} -> {load1:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    if max(load0, load1) > os.cpu_count() + 0.5:
        print(
            "WARNING: the machine was busy with other work; wall times are inflated and noisy "
            "(compare the paired and cpu columns, or rerun when idle)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
