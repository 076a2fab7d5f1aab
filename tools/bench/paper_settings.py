"""Predicted MFU on the paper's settings: hexi vs uniform per cluster and model (markdown).

    python tools/bench/paper_settings.py [--gbs 64] [--micro-batch-size 1]
        [--no-overlap-grad-reduce] [--attention-backend auto|flash|fused|unfused|local]
        [--[no-]sequence-parallel]
    python tools/bench/paper_settings.py --compare-sequence-parallel [--gbs 64] ...

One table row per cluster (CLUSTERS, from examples/clusters) and model (MODELS), micro-batch 1
(--micro-batch-size N; 0: searched, as `hexi-plan plan` does without the flag; the layout
column then ends with the chosen sizes).
Gradient sync overlapped with the backward as `hexi-plan plan` plans it by default on GPUs
(--no-overlap-grad-reduce: serial, as plans were before the overlap model). Attention as
`hexi-plan plan` plans it by default (auto: a fused kernel, no s x s scores); unfused costs
megatron-core's local attention. Sequence parallelism wherever TP > 1, as `hexi-plan plan` plans
it by default (--no-sequence-parallel: off, as plans were before it existed).

--compare-sequence-parallel: the same searches with sequence parallelism off and on, one row per
setting: MFU, tokens/s, layout (pipelines x stages per pipeline, rc: full recompute, the TP
degrees used), the change in tokens/s, the largest predicted peak memory, the uniform baseline's
MFU and each hexi search's wall time. The last line gives the total search seconds of each side.
"""

import argparse
import os
import sys
import time

from planner.attention import ATTENTION_BACKENDS, CLI_DEFAULT_BACKEND
from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.models import load_model
from planner.search import overlap_by_default, search_plan
from planner.topology import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTERS = [
    "paper-hetero-a",
    "paper-hetero-consumer",
    "paper-a100-pcie-2x8",
    "paper-hetero-b",
    "paper-a100-pcie-4x8",
]
MODELS = ["llama2-7b", "llama2-13b", "llama-30b"]


def _search(args, c, m, strategy, sequence_parallel):
    """(plan or None, wall seconds) of one search with the table's settings."""
    start = time.perf_counter()
    try:
        plan = search_plan(
            c,
            m,
            args.gbs,
            strategy=strategy,
            micro_batch_size=args.micro_batch_size or None,
            overlap_grad_reduce=args.overlap_grad_reduce and overlap_by_default(c),
            attention_backend=args.attention_backend,
            sequence_parallel=sequence_parallel,
        )
    except SpecError:
        plan = None
    return plan, time.perf_counter() - start


def _layout(plan, short=False):
    if plan is None:
        return "-"
    stages = "/".join(str(len(pp.stages)) for pp in plan.pipelines)
    if not short:
        rc = ", recompute" if plan.training.recompute else ""
        sizes = "/".join(str(pp.micro_batch_size) for pp in plan.pipelines)
        mbs = (
            f", micro-batch {sizes}"
            if any(pp.micro_batch_size > 1 for pp in plan.pipelines)
            else ""
        )
        return f"{len(plan.pipelines)} pipe x {stages} stages{rc}{mbs}"
    tps = sorted({len(s.ranks) for pp in plan.pipelines for s in pp.stages})
    rc = ", rc" if plan.training.recompute else ""
    return f"{len(plan.pipelines)} x {stages}{rc} (TP {', '.join(map(str, tps))})"


def _mfu(plan):
    return "no fit" if plan is None else f"{plan.estimate['mfu']:.1%}"


def table(args):
    print(
        "| cluster | GPUs | peak PFLOPS | model | hexi MFU | uniform MFU | hexi tokens/s | "
        "hexi layout |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in CLUSTERS:
        c = load_cluster(os.path.join(ROOT, "examples/clusters", name + ".yaml"))
        topo = Topology(c)
        peak = sum(topo.device_of(r).peak_flops for r in range(c.num_gpus)) / 1e15
        for mname in MODELS:
            m = load_model(mname)
            hexi, _ = _search(args, c, m, "hexi", args.sequence_parallel)
            uniform, _ = _search(args, c, m, "uniform", args.sequence_parallel)
            tok = "-" if hexi is None else f"{hexi.estimate['tokens_per_s']:.0f}"
            print(
                f"| {name} | {c.num_gpus} | {peak:.2f} | {mname} | {_mfu(hexi)} | "
                f"{_mfu(uniform)} | {tok} | {_layout(hexi)} |",
                flush=True,
            )


def compare_sequence_parallel(args):
    print(
        "| cluster | model | SP off: MFU, tokens/s, layout | SP on: MFU, tokens/s, layout | "
        "tokens/s | peak GB off / on | uniform MFU off / on | search s off / on |"
    )
    print("|---|---|---|---|---|---|---|---|")
    total = {False: 0.0, True: 0.0}
    for name in CLUSTERS:
        c = load_cluster(os.path.join(ROOT, "examples/clusters", name + ".yaml"))
        for mname in MODELS:
            m = load_model(mname)
            got, uni, secs = {}, {}, {}
            for sp in (False, True):
                got[sp], secs[sp] = _search(args, c, m, "hexi", sp)
                total[sp] += secs[sp]
                uni[sp], _ = _search(args, c, m, "uniform", sp)
            cells, peaks = [], []
            for sp in (False, True):
                p = got[sp]
                if p is None:
                    cells.append("no fit")
                    peaks.append("-")
                    continue
                e = p.estimate
                cells.append(f"{e['mfu']:.1%}, {e['tokens_per_s']:.0f}, {_layout(p, True)}")
                peaks.append(f"{max(e['peak_memory_gb']):.1f}")
            if got[False] is not None and got[True] is not None:
                a, b = (got[x].estimate["tokens_per_s"] for x in (False, True))
                change = f"{b / a - 1:+.1%}"
            else:
                change = "-"
            print(
                f"| {name} | {mname} | {cells[0]} | {cells[1]} | {change} | "
                f"{peaks[0]} / {peaks[1]} | {_mfu(uni[False])} / {_mfu(uni[True])} | "
                f"{secs[False]:.2f} / {secs[True]:.2f} |",
                flush=True,
            )
    print(f"\nhexi search, all rows: {total[False]:.1f} s off, {total[True]:.1f} s on")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbs", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=1, help="0: searched")
    ap.add_argument(
        "--overlap-grad-reduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan for the overlapped gradient sync (default: on, as hexi-plan plan on GPUs)",
    )
    ap.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=CLI_DEFAULT_BACKEND,
        help=f"the attention the plans are made for (default: {CLI_DEFAULT_BACKEND}, as "
        "hexi-plan plan)",
    )
    ap.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan for sequence parallelism wherever TP > 1 (default: on, as hexi-plan plan)",
    )
    ap.add_argument(
        "--compare-sequence-parallel",
        action="store_true",
        help="one table of the same searches with sequence parallelism off and on",
    )
    args = ap.parse_args()
    start = time.perf_counter()
    if args.compare_sequence_parallel:
        compare_sequence_parallel(args)
    else:
        table(args)
    print(f"paper_settings.py: {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
