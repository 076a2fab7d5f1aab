"""Predicted islands vs synchronous training on the paper's clusters split over two sites.

    python tools/bench/islands_planner.py [--model llama2-7b] [--gbs 64]
        [--links "1 Gbit/s" "100 Mbit/s"] [--latency "10 ms"] [--clusters paper-hetero-a ...]

Each paper cluster (examples/clusters/paper-*) is cut into two sites of about equal peak FLOPS
(node groups go whole to the site with less so far, largest first; a group of several machines
alone on a site is cut in two), joined by each link of --links. Per cluster and link, the table
gives:
- the synchronous plan (`hexi-plan plan`, islands off): tokens/s and the share of its step that
  the site links cost (planner.search_islands.site_link_share: against the same plan and the
  plan searched with site links as fast as the NICs), which `--islands auto` compares with 10 %;
- islands by site (`hexi-plan plan --islands sites`, outer sync at most 10 % of the step): the
  batch split, H, tokens/s and the bytes crossing sites per step (amortised), with fp32 outer
  gradients (one fragment) and with int8 and 4 fragments;
- the speed-up of islands over synchronous, and what `--islands auto` picks.
The sites' plans do not depend on the link between the sites: they are searched once per
cluster. Prints a markdown table and the total wall seconds.
"""

import argparse
import json
import os
import sys
import time

from planner.attention import CLI_DEFAULT_BACKEND
from planner.catalog import get_gpu
from planner.cluster import load_cluster, load_cluster_dict
from planner.errors import SpecError
from planner.membership import PlanningOptions, plan_for
from planner.models import load_model
from planner.search import overlap_by_default, runs_on_gpus
from planner.search_islands import (
    IslandRequest,
    balanced_island_plans,
    islands_plan,
    site_link_share,
)
from planner.transformer_impl import default_impl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTERS = [
    "paper-hetero-a",
    "paper-hetero-consumer",
    "paper-a100-pcie-2x8",
    "paper-hetero-b",
    "paper-a100-pcie-4x8",
]
SHARE = 0.10


def two_sites(cluster: dict, bandwidth: str, latency: str) -> dict:
    """The cluster file's dict cut into sites s0 and s1 of about equal peak FLOPS."""
    groups = []
    for g in cluster["nodes"]:
        g = {k: v for k, v in g.items() if k != "hostnames"}
        groups.append(g)
    if len(groups) == 1 and groups[0].get("count", 1) > 1:
        g = groups[0]
        half = g["count"] // 2
        groups = [{**g, "name": f"{g['name']}-a", "count": half}]
        groups.append({**g, "name": f"{g['name']}-b", "count": g["count"] - half})
        for x in groups:
            if x["count"] == 1:
                del x["count"]

    def flops(g: dict) -> float:
        return get_gpu(g["gpu"]).peak_flops * g["gpus_per_node"] * g.get("count", 1)

    load = [0.0, 0.0]
    for g in sorted(groups, key=flops, reverse=True):
        s = load.index(min(load))
        g["site"] = f"s{s}"
        load[s] += flops(g)
    sites = {"default": {"bandwidth": bandwidth, "latency": latency}}
    return {"name": f"{cluster['name']}-2sites", "nodes": groups, "sites": sites}


def _options(cluster, args) -> PlanningOptions:
    """`hexi-plan plan`'s defaults: overlapped gradient sync on GPUs, fused attention, sequence
    parallelism, the layer implementation for this machine."""
    return PlanningOptions(
        args.gbs,
        overlap_grad_reduce=overlap_by_default(cluster),
        attention_backend=CLI_DEFAULT_BACKEND,
        sequence_parallel=True,
        transformer_impl=default_impl(runs_on_gpus(cluster)),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--gbs", type=int, default=64)
    ap.add_argument("--links", nargs="+", default=["1 Gbit/s", "100 Mbit/s"])
    ap.add_argument("--latency", default="10 ms")
    ap.add_argument("--clusters", nargs="+", default=CLUSTERS)
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    rows = []
    model = load_model(args.model)
    start = time.perf_counter()
    print(
        f"{args.model}, global batch {args.gbs}, two sites joined by each link ({args.latency} "
        f"one way); islands: exposed outer sync at most {SHARE:.0%} of the step\n"
    )
    print(
        "| cluster (sites s0 / s1) | link | sync tokens/s | sync: site links | islands batch | "
        "H fp32 | islands tokens/s | MB/step fp32 | H int8 x4 | MB/step int8 x4 | "
        "islands / sync | auto |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.clusters:
        raw = load_cluster(os.path.join(ROOT, "examples", "clusters", f"{name}.yaml")).to_dict()
        first = load_cluster_dict(two_sites(raw, args.links[0], args.latency))
        options = _options(first, args)
        try:
            sites_plans = balanced_island_plans(first, model, options)
        except SpecError as e:
            print(f"| {name} | - | islands: {e.problems[0][:80]} |")
            continue
        label = " / ".join(
            "+".join(g.name for g in first.groups if g.site == s) for s in ("s0", "s1")
        )
        for link in args.links:
            cluster = load_cluster_dict(two_sites(raw, link, args.latency))
            sync = plan_for(cluster, model, options)
            sync_tps = sync.estimate["tokens_per_s"]
            share = site_link_share(sync, model, options)
            fp32, _ = islands_plan(cluster, model, options, IslandRequest("sites"), sites_plans)
            int8, _ = islands_plan(
                cluster,
                model,
                options,
                IslandRequest("sites", outer={"compression": "int8", "fragments": 4}),
                sites_plans,
            )
            e32, e8 = fp32.estimate, int8.estimate
            batches = "/".join(
                str(sum(fp32.pipelines[p].num_samples for p in pipes)) for pipes in fp32.islands
            )
            auto = "islands" if share > SHARE and e32["tokens_per_s"] > sync_tps else "sync"
            print(
                f"| {name} ({label}) | {link} | {sync_tps:,.0f} | {share:.0%} | {batches} | "
                f"{fp32.training.outer.interval} | {e32['tokens_per_s']:,.0f} | "
                f"{e32['cross_site_bytes_per_step'] / 1e6:,.1f} | "
                f"{int8.training.outer.interval} | {e8['cross_site_bytes_per_step'] / 1e6:,.1f} | "
                f"{e32['tokens_per_s'] / sync_tps:.2f}x | {auto} |"
            )
            sys.stdout.flush()
            rows.append(
                {
                    "cluster": name,
                    "link": link,
                    "sync_tokens_per_s": sync_tps,
                    "site_link_share": share,
                    "islands_tokens_per_s": e32["tokens_per_s"],
                    "interval_fp32": fp32.training.outer.interval,
                    "bytes_per_step_fp32": e32["cross_site_bytes_per_step"],
                    "interval_int8_x4": int8.training.outer.interval,
                    "bytes_per_step_int8_x4": e8["cross_site_bytes_per_step"],
                    "auto": auto,
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\nwall {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
