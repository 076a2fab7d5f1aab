"""What weight initialisation costs one rank at start-up: drawing full tensors then slicing, against
drawing only the rank's blocks (megatron_hexi.model.initialise_weights), same run, CPU, fp32.

    python tools/bench/init_startup.py [--model llama2-7b] [--tp 8] [--rank 3] [--layers 4]
                                       [--rounds 3]

What is measured. The first stage of a pipeline: `--layers` layers and the embedding, one TP group
of `--tp` ranks with even shards; the rest of the model sits on one-rank stages that are not
measured. Rank `--rank` of the group initialises its parameters (plain fp32 CPU tensors of the
layout's local shapes, already allocated and touched, as the stage model's are), in a fresh
process per measurement:
  full tensors   the previous method, reproduced here: each parameter's full canonical tensor
                 drawn from one generator, the rank's pieces cut out (torch.cat), copied in;
  blocks         initialise_weights: only the blocks the rank's pieces overlap.
The two draw different numbers (other seeds and streams); both are what a run would do at start.
Reported per method: median seconds of the initialisation alone, and the process's peak RSS
(getrusage) with the part above what it held before initialising (imports and the shard itself).
Order alternates between rounds to cancel drift. OMP_NUM_THREADS=1; normal_ with a generator runs
on one thread anyway. Wall times need an idle machine: the load average is printed before and
after.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in the children

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SEED = 1234
METHODS = ("full tensors", "blocks")


def stage_plan(model_name, tp, layers):
    """A valid plan whose first stage is a TP=`tp` group holding `layers` layers and the
    embedding; the remaining layers go to one-rank stages of `layers` layers each."""
    from planner.cluster import load_cluster_dict
    from planner.models import load_model
    from planner.plan import build_plan

    m = load_model(model_name)
    if m.num_layers % layers:
        raise SystemExit(f"--layers {layers} must divide the model's {m.num_layers} layers")
    stages = [{"ranks": list(range(tp)), "layers": [0, layers]}]
    for first in range(layers, m.num_layers, layers):
        stages.append({"ranks": [tp + len(stages) - 1], "layers": [first, first + layers]})
    world = tp + len(stages) - 1
    cluster = load_cluster_dict(
        {
            "name": "bench",
            "nodes": [
                {
                    "name": "cpu",
                    "gpu": "CPU",
                    "gpus_per_node": world,
                    "intra_node": "host",
                    "nic": "10 Gbit/s",
                }
            ],
        }
    )
    return build_plan(
        cluster,
        m,
        len(stages),
        [{"micro_batch_size": 1, "num_microbatches": len(stages), "stages": stages}],
    )


def full_tensors_init(plan, params, seed):
    """The previous initialisation: each full canonical tensor from one seeded generator, sliced."""
    import torch

    from megatron_hexi.model import take_pieces

    m = plan.model
    with torch.no_grad():
        for shard, p in params:
            if shard.init in ("ones", "zeros"):
                full = (torch.ones if shard.init == "ones" else torch.zeros)(shard.shape)
            else:
                gen = torch.Generator().manual_seed(
                    (seed * 1_000_003 + zlib.crc32(shard.name.encode())) % (2**63)
                )
                scale = (
                    m.init_method_std / (2.0 * m.num_layers) ** 0.5
                    if shard.init == "scaled_normal"
                    else m.init_method_std
                )
                full = torch.empty(shard.shape).normal_(0.0, scale, generator=gen)
            p.copy_(take_pieces(full, shard).to(p.dtype))
            del full


def child(args):
    """One measurement in this fresh process; prints one JSON line."""
    import torch

    from megatron_hexi.model import initialise_weights
    from planner.layout import rank_param_shards

    torch.set_num_threads(1)
    plan = stage_plan(args.model, args.tp, args.layers)
    shards = rank_param_shards(plan, args.rank)
    params = [(s, torch.zeros(s.local_shape)) for s in shards]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    init = full_tensors_init if args.child == "full tensors" else initialise_weights
    t0 = time.perf_counter()
    init(plan, params, SEED)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak": peak,
                "before": before,
                "shard_bytes": sum(4 * p.numel() for _, p in params),
                "full_bytes": sum(4 * math.prod(s.shape) for s in shards),
            }
        )
    )


def measure(args, method):
    cmd = [
        sys.executable,
        __file__,
        "--child",
        method,
        "--model",
        args.model,
        "--tp",
        str(args.tp),
        "--rank",
        str(args.rank),
        "--layers",
        str(args.layers),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{method}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--rank", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    load0 = os.getloadavg()
    runs = {m: [] for m in METHODS}
    for i in range(args.rounds):
        for method in METHODS if i % 2 == 0 else METHODS[::-1]:
            runs[method].append(measure(args, method))
            r = runs[method][-1]
            print(
                f"round {i + 1} {method}: {r['seconds']:.2f} s, peak RSS "
                f"{r['peak'] / 2**30:.2f} GiB",
                flush=True,
            )
    load1 = os.getloadavg()
    first = runs[METHODS[0]][0]
    print(
        f"\n{args.model}, rank {args.rank} of a TP={args.tp} stage of {args.layers} layers and "
        f"the embedding; shard {first['shard_bytes'] / 2**30:.2f} GiB fp32 of full tensors "
        f"{first['full_bytes'] / 2**30:.2f} GiB; {args.rounds} rounds; load average "
        f"{load0[0]:.1f} -> {load1[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print("| method | seconds (median) | peak RSS | above the shard and imports |")
    print("|---|---|---|---|")
    med = {}
    for method in METHODS:
        rs = runs[method]
        med[method] = (
            statistics.median(r["seconds"] for r in rs),
            statistics.median(r["peak"] for r in rs),
            statistics.median(r["peak"] - r["before"] for r in rs),
        )
        s, peak, extra = med[method]
        print(f"| {method} | {s:.2f} | {peak / 2**30:.2f} GiB | {extra / 2**30:.3f} GiB |")
    (s0, p0, e0), (s1, p1, e1) = med[METHODS[0]], med[METHODS[1]]
    print(
        f"\nblocks against full tensors: {s0 / s1:.1f}x faster, peak RSS {p0 / p1:.1f}x lower, "
        f"memory above the shard {e0 / max(e1, 1):.0f}x lower"
    )


if __name__ == "__main__":
    main()
