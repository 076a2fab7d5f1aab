"""Predicted MFU on the paper's settings: hexi vs uniform per cluster and model (markdown).

    python tools/bench/paper_settings.py [--gbs 64] [--no-overlap-grad-reduce]
        [--attention-backend auto|flash|fused|unfused|local]

One table row per cluster (CLUSTERS, from examples/clusters) and model (MODELS), micro-batch 1.
Gradient sync overlapped with the backward as `hexi-plan plan` plans it by default on GPUs
(--no-overlap-grad-reduce: serial, as plans were before the overlap model). Attention as
`hexi-plan plan` plans it by default (auto: a fused kernel, no s x s scores); unfused costs
megatron-core's local attention.
"""

import argparse
import os

from planner.attention import ATTENTION_BACKENDS, CLI_DEFAULT_BACKEND
from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.models import load_model
from planner.search import overlap_by_default, search_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTERS = [
    "paper-hetero-a",
    "paper-hetero-consumer",
    "paper-a100-pcie-2x8",
    "paper-hetero-b",
    "paper-a100-pcie-4x8",
]
MODELS = ["llama2-7b", "llama2-13b", "llama-30b"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbs", type=int, default=64)
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
    args = ap.parse_args()
    print(
        "| cluster | GPUs | peak PFLOPS | model | hexi MFU | uniform MFU | hexi tokens/s | "
        "hexi layout |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in CLUSTERS:
        c = load_cluster(os.path.join(ROOT, "examples/clusters", name + ".yaml"))
        from planner.costmodel import Topology

        topo = Topology(c)
        peak = sum(topo.device_of(r).peak_flops for r in range(c.num_gpus)) / 1e15
        for mname in MODELS:
            m = load_model(mname)
            row = []
            plan_h = None
            for strategy in ("hexi", "uniform"):
                try:
                    p = search_plan(
                        c,
                        m,
                        args.gbs,
                        strategy=strategy,
                        micro_batch_size=1,
                        overlap_grad_reduce=args.overlap_grad_reduce and overlap_by_default(c),
                        attention_backend=args.attention_backend,
                    )
                    row.append(f"{p.estimate['mfu']:.1%}")
                    if strategy == "hexi":
                        plan_h = p
                except SpecError:
                    row.append("no fit")
            lay = (
                "-"
                if plan_h is None
                else (
                    f"{len(plan_h.pipelines)} pipe x "
                    + "/".join(str(len(pp.stages)) for pp in plan_h.pipelines)
                    + " stages"
                    + (", recompute" if plan_h.training.recompute else "")
                )
            )
            tok = "-" if plan_h is None else f"{plan_h.estimate['tokens_per_s']:.0f}"
            print(
                f"| {name} | {c.num_gpus} | {peak:.2f} | {mname} | {row[0]} | {row[1]} | {tok} "
                f"| {lay} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
