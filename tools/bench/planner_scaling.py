"""Planner scaling: CPU seconds and peak memory (RSS) of the `hexi` search vs cluster size.

Two cluster shapes (--clusters): `scaled`, 8-GPU machines with 4 GPU types in equal shares (A100
NVLink, A100-PCIe, RTX 4090, RTX 3090), 100 Gbit/s between machines; `mixed`, four machine
kinds on four NIC speeds in equal GPU shares (A100 x8 on 200 Gbit/s, A100 x4 on 100, RTX 4090
x8 on 25, RTX 3090 x8 on 10: planner.random_clusters.mixed_nic_cluster). llama2-7b, global
batch = 2 x GPUs, micro-batch 1,
recompute auto, and the runtime settings `hexi-plan plan` plans for on GPUs: gradient sync
overlapped with the backward (--no-overlap-grad-reduce: serial), attention `auto`
(--attention-backend) and sequence parallelism (--no-sequence-parallel: off). Each size runs in
its own process so that peak memory is its own. `cpu s` is the CPU time of the planning alone
(time.process_time around the search, in the child: other jobs on the machine inflate wall
time far more than CPU time) and `load` the 1-minute load average before the run. `yard s` is the
CPU time of a fixed pure-Python workload (yardstick.py), the mean of runs just before and just
after the search in the same process, and `cpu/yard` the search's CPU time in its units: this
machine's speed moves by up to 1.8x between days, the ratio far less.
Targets: <= 10 CPU s at 1024 GPUs (both shapes), <= 60 CPU s for 8192 mixed, near-linear growth.

    python tools/bench/planner_scaling.py [--sizes 64 256 1024 4096 8192] [--clusters scaled mixed]
        [--no-overlap-grad-reduce] [--attention-backend auto|flash|fused|unfused|local]
        [--no-sequence-parallel]
"""

import argparse
import json
import os
import subprocess
import sys

from planner.attention import ATTENTION_BACKENDS, CLI_DEFAULT_BACKEND

ONE = r"""
import json, resource, sys, time
from planner.models import load_model
from planner.random_clusters import mixed_nic_cluster, scaled_cluster
from planner.search import search_plan
n, model, overlap, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
sp, shape = sys.argv[5] == "1", sys.argv[6]
sys.path.insert(0, sys.argv[7])
from yardstick import yardstick_cpu_s
cluster = scaled_cluster(n, types=4) if shape == "scaled" else mixed_nic_cluster(n)
yard = yardstick_cpu_s()
c = time.process_time()
plan = search_plan(cluster, load_model(model), 2 * n, micro_batch_size=1,
                   overlap_grad_reduce=overlap, attention_backend=backend, sequence_parallel=sp)
cpu = time.process_time() - c
yard = (yard + yardstick_cpu_s()) / 2
print(json.dumps({"gpus": n, "cpu": cpu, "yard": yard, "pipelines": len(plan.pipelines),
                  "mfu": plan.estimate["mfu"],
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192])
    ap.add_argument(
        "--clusters", nargs="+", choices=("scaled", "mixed"), default=["scaled", "mixed"]
    )
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=CLI_DEFAULT_BACKEND)
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    print(
        f"{'cluster':>7} {'GPUs':>6} {'cpu s':>7} {'yard s':>6} {'cpu/yard':>8} {'load':>5} "
        f"{'peak MB':>8} {'pipelines':>9} {'MFU':>6}",
        flush=True,
    )
    for shape, n in ((c, n) for c in args.clusters for n in args.sizes):
        load = os.getloadavg()[0]
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                ONE,
                str(n),
                args.model,
                str(int(args.overlap_grad_reduce)),
                args.attention_backend,
                str(int(args.sequence_parallel)),
                shape,
                os.path.dirname(os.path.abspath(__file__)),
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            print(f"{shape:>7} {n:>6} failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{shape:>7} {n:>6} {r['cpu']:>7.2f} {r['yard']:>6.3f} {r['cpu'] / r['yard']:>8.1f} "
            f"{load:>5.1f} {r['peak_mb']:>8.1f} "
            f"{r['pipelines']:>9} {r['mfu']:>6.1%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
