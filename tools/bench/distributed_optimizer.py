"""What the heterogeneous distributed optimizer buys on the paper's clusters (planner predictions).

    python tools/bench/distributed_optimizer.py [--gbs 64] [--no-overlap]

For Llama-2 7B and 13B on each example cluster, plan with `hexi` twice, without and with
--use-distributed-optimizer (fp32 master weights and Adam state sharded over each gradient
segment's ranks), and print the pipelines found, their depth, recompute, memory per rank and the
predicted MFU. A cluster where only the sharded plan fits shows "no fit" on the left. Both plans
overlap the gradient sync with the backward, and the sharded one its parameter all-gather with
the next forward, as `hexi-plan plan` does by default on GPUs (--no-overlap: both serial).
"""

import argparse
import os

from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.models import load_model
from planner.search import search_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTERS = [
    "paper-hetero-a",
    "paper-hetero-consumer",
    "paper-hetero-b",
    "paper-a100-pcie-2x8",
    "paper-a100-pcie-4x8",
]
MODELS = ["llama2-7b", "llama2-13b"]


def describe(plan):
    depth = "/".join(str(len(p.stages)) for p in plan.pipelines)
    return (
        f"{len(plan.pipelines)} x [{depth}]{' rc' if plan.training.recompute else ''}, "
        f"MFU {plan.estimate['mfu']:.1%}, max {max(plan.estimate['peak_memory_gb']):.1f} GB"
    )


def mfu_change(before, after):
    """The MFU gain in percentage points (MFU itself is printed as a percent)."""
    return f"{100 * (after.estimate['mfu'] - before.estimate['mfu']):+.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbs", type=int, default=64)
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    print(
        f"global batch {args.gbs}, micro-batch 1; pipelines x [stages per pipeline], rc = recompute"
    )
    print("| cluster | model | without | with --use-distributed-optimizer | MFU change (points) |")
    print("|---|---|---|---|---|")
    for name in CLUSTERS:
        cluster = load_cluster(os.path.join(ROOT, "examples/clusters", name + ".yaml"))
        for mname in MODELS:
            model = load_model(mname)
            plans = []
            for sharded in (False, True):
                try:
                    plans.append(
                        search_plan(
                            cluster,
                            model,
                            args.gbs,
                            micro_batch_size=1,
                            use_distributed_optimizer=sharded,
                            overlap_grad_reduce=args.overlap,
                            overlap_param_gather=args.overlap and sharded,
                        )
                    )
                except SpecError:
                    plans.append(None)
            cells = [describe(p) if p else "no fit" for p in plans]
            change = mfu_change(*plans) if all(plans) else "-"
            print(f"| {name} | {mname} | {cells[0]} | {cells[1]} | {change} |", flush=True)
    fast_networks(overlap=args.overlap)


FAST_CLUSTERS = [
    ("4x8 RTX-4090", "RTX-4090", 8, 4),
    ("4x8 RTX-3090", "RTX-3090", 8, 4),
    ("2x8 A100-40GB", "A100-SXM-40GB", 8, 2),
]


def fast_networks(gbs=512, overlap=True):
    """Where data parallelism pays (200 Gbit/s, large batch), sharding opens more pipelines."""
    from planner.cluster import load_cluster_dict

    print(f"\n200 Gbit/s between machines, PCIe 4 inside, global batch {gbs}, micro-batch 1")
    print("| cluster | model | without | with --use-distributed-optimizer | MFU change (points) |")
    print("|---|---|---|---|---|")
    for label, gpu, per_node, count in FAST_CLUSTERS:
        cluster = load_cluster_dict(
            {
                "name": label,
                "nodes": [
                    {
                        "name": "m",
                        "gpu": gpu,
                        "gpus_per_node": per_node,
                        "count": count,
                        "intra_node": "pcie4",
                        "nic": "200 Gbit/s",
                    }
                ],
            }
        )
        for mname in MODELS:
            plans = [
                search_plan(
                    cluster,
                    load_model(mname),
                    gbs,
                    micro_batch_size=1,
                    use_distributed_optimizer=sharded,
                    overlap_grad_reduce=overlap,
                    overlap_param_gather=overlap and sharded,
                )
                for sharded in (False, True)
            ]
            print(
                f"| {label} | {mname} | {describe(plans[0])} | {describe(plans[1])} | "
                f"{mfu_change(*plans)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
