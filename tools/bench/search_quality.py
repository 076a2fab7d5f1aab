"""Search quality: hexi vs exhaustive and vs uniform, throughput ratios (min and median).

- >= 20 random clusters of <= 16 GPUs where exhaustive runs: hexi / exhaustive tokens/s;
- the same clusters, the example clusters and random clusters of <= 64 GPUs: hexi / uniform.
Model: examples/models/small-1b.yaml (16 layers, ~1 B parameters), global batch 32.

    python tools/bench/search_quality.py [--clusters 20] [--max-gpus 16]
"""

import argparse
import glob
import os
import statistics
import time

from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.models import load_model
from planner.random_clusters import random_cluster
from planner.search import search_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tps(cluster, model, gbs, strategy):
    return search_plan(cluster, model, gbs, strategy=strategy).estimate["tokens_per_s"]


def summary(name, xs):
    print(
        f"{name}: n={len(xs)} min={min(xs):.3f} median={statistics.median(xs):.3f} "
        f"max={max(xs):.3f}",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=20)
    ap.add_argument("--max-gpus", type=int, default=16)
    ap.add_argument("--uniform-extra", type=int, default=20, help="random clusters <= 64 GPUs")
    ap.add_argument("--gbs", type=int, default=32)
    args = ap.parse_args()
    model = load_model(os.path.join(ROOT, "examples/models/small-1b.yaml"))
    vs_x, vs_u = [], []
    seed = 1000
    while len(vs_x) < args.clusters:
        seed += 1
        c = random_cluster(seed, max_gpus=args.max_gpus)
        t = time.perf_counter()
        try:
            x = tps(c, model, args.gbs, "exhaustive")
        except SpecError as e:
            if "too large" in str(e):
                continue
            print(f"seed {seed}: {e}")
            continue
        h = tps(c, model, args.gbs, "hexi")
        u = tps(c, model, args.gbs, "uniform")
        vs_x.append(h / x)
        vs_u.append(h / u)
        print(
            f"seed {seed}: {c.num_gpus:>2} GPUs {len(c.nodes)} machines  hexi/exhaustive "
            f"{h / x:.3f}  hexi/uniform {h / u:.3f}  ({time.perf_counter() - t:.1f} s)",
            flush=True,
        )
    for path in sorted(glob.glob(os.path.join(ROOT, "examples/clusters/*.yaml"))):
        c = load_cluster(path)
        m = load_model("tiny") if c.num_gpus <= 4 else model
        r = tps(c, m, 64, "hexi") / tps(c, m, 64, "uniform")
        vs_u.append(r)
        print(f"{os.path.basename(path)}: hexi/uniform {r:.3f}", flush=True)
    for s in range(args.uniform_extra):
        c = random_cluster(5000 + s, max_gpus=64)
        try:
            h = tps(c, model, args.gbs, "hexi")
        except SpecError as e:
            print(f"random-{5000 + s}: hexi: {e}")
            continue
        try:
            r = h / tps(c, model, args.gbs, "uniform")
        except SpecError:
            print(f"random-{5000 + s} ({c.num_gpus} GPUs): no uniform plan fits, hexi does")
            continue
        vs_u.append(r)
        print(f"random-{5000 + s} ({c.num_gpus} GPUs): hexi/uniform {r:.3f}", flush=True)
    summary("hexi / exhaustive", vs_x)
    summary("hexi / uniform", vs_u)


if __name__ == "__main__":
    main()
