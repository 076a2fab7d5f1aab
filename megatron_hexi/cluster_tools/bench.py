"""`hexi-cluster bench`: measured bandwidth and latency between nodes, as cluster-spec `links:`.

Run it as a torch.distributed job over the nodes to measure (torchrun, or a launcher from
`hexi-launch`, e.g. `hexi-launch slurm PLAN --entry-module megatron_hexi.cluster_tools.bench --
-o links.yaml`). gloo on CPU, nccl on CUDA. For every pair of nodes, the first rank of each plays
ping-pong with messages of each size; within a node, its first two ranks do the same. Pairs run
one at a time (a barrier between them) so they do not share the wire. Every collective and
point-to-point call has a timeout, and a watchdog ends the process if the whole run overstays.

Node identity follows the runtime: $HEXI_PLAN_NODE, else this host matched against the plan's (or
cluster file's) hostnames, else the host name itself. Rank 0 writes the YAML:

    links:
      - {between: [a100-0, rtx4090-0], bandwidth: "1.17 GB/s", latency: "62.5 us"}

bandwidth = the best of size / one-way time over the sizes; latency = the one-way time of the
smallest size. Within-node figures are written as comments (they belong in `intra_node:`).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from planner.cli_args import with_examples
from planner.units import format_bandwidth, format_latency, parse_size

if TYPE_CHECKING:
    import torch

DEFAULT_SIZES = ["8B", "64KB", "1MB", "16MB", "64MB"]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="hexi-cluster bench",
        description=__doc__.split("\n")[0],
        **with_examples(
            "torchrun --nproc-per-node 2 --no-python hexi-cluster bench --sizes 8B 1MB "
            "--iters 3 -o links.yaml",
            "hexi-launch slurm plan.json --partition gpu --entry-module "
            "megatron_hexi.cluster_tools.bench -o bench.sbatch -- -o links.yaml",
            note="Run it as a torch.distributed job, one or more processes per node: the first "
            "example measures this machine alone, the second every pair of a plan's nodes.",
        ),
    )
    ap.add_argument("-o", "--output", help="links YAML (default: stdout of rank 0)")
    ap.add_argument(
        "--sizes",
        nargs="+",
        default=DEFAULT_SIZES,
        help=f"message sizes (default {' '.join(DEFAULT_SIZES)})",
    )
    ap.add_argument("--iters", type=int, default=10, help="timed round trips per size")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--timeout-s",
        type=float,
        default=60,
        help="limit for each collective / point-to-point call",
    )
    ap.add_argument(
        "--total-timeout-s",
        type=float,
        default=1800,
        help="watchdog for the whole run: exit 124 past it",
    )
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    ap.add_argument(
        "--hetero-plan-path",
        "--plan",
        dest="plan",
        help="plan whose cluster maps host names to node names",
    )
    ap.add_argument("--cluster", help="cluster YAML that maps host names to node names")
    ap.add_argument("--no-intra", action="store_true", help="skip within-node pairs")
    args = ap.parse_args(argv)
    try:
        args.size_bytes = sorted({max(1, int(parse_size(s, "--sizes"))) for s in args.sizes})
    except Exception as e:  # SpecError: one line
        ap.error(str(e))
    return args


def node_name(args: argparse.Namespace) -> str:
    """This process's node: HEXI_PLAN_NODE, else hostname matched in the plan/cluster, else host."""
    if os.environ.get("HEXI_PLAN_NODE"):
        return os.environ["HEXI_PLAN_NODE"]
    host = socket.gethostname()
    cluster = None
    if args.plan:
        from planner.plan import load_plan

        cluster = load_plan(args.plan).cluster
    elif args.cluster:
        from planner.cluster import load_cluster

        cluster = load_cluster(args.cluster)
    if cluster is not None:
        for n in cluster.nodes:
            if n.hostname and n.hostname in (host, host.split(".")[0]):
                return n.name
    return host


def _watchdog(seconds: float) -> threading.Timer:
    def fire() -> None:
        print(
            f"hexi-cluster bench: gave up after {seconds:g} s (--total-timeout-s)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(124)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


def pingpong(
    dist: types.ModuleType,
    torch: types.ModuleType,
    me: int,
    peer: int,
    leader: bool,
    size: int,
    iters: int,
    warmup: int,
    timeout: timedelta,
    device: torch.device,
) -> float:
    """One-way seconds per message (median over iters); only the leader's value matters."""
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for it in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        if leader:
            dist.isend(buf, peer).wait(timeout)
            dist.irecv(buf, peer).wait(timeout)
        else:
            dist.irecv(buf, peer).wait(timeout)
            dist.isend(buf, peer).wait(timeout)
        sync()
        if it >= warmup:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def run_bench(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    watchdog = _watchdog(args.total_timeout_s)
    timeout = timedelta(seconds=args.timeout_s)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    me = {"node": node_name(args), "host": socket.gethostname(), "rank": rank}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, me)
    order: list[str] = []
    ranks_of: dict[str, list[int]] = {}
    for x in everyone:
        if x["node"] not in ranks_of:
            order.append(x["node"])
            ranks_of[x["node"]] = []
        ranks_of[x["node"]].append(x["rank"])
    pairs = [
        ("link", a, b, ranks_of[a][0], ranks_of[b][0])
        for i, a in enumerate(order)
        for b in order[i + 1 :]
    ]
    if not args.no_intra:
        pairs += [
            ("intra", a, a, ranks_of[a][0], ranks_of[a][1]) for a in order if len(ranks_of[a]) > 1
        ]
    if rank == 0:
        print(
            f"hexi-cluster bench: {backend}, {world} ranks on {len(order)} node(s) "
            f"({', '.join(order)}), {len(pairs)} pair(s), sizes {args.size_bytes}",
            flush=True,
        )
    mine = []
    for kind, a, b, ra, rb in pairs:
        if rank in (ra, rb):
            leader = rank == ra
            per_size = {
                s: pingpong(
                    dist,
                    torch,
                    rank,
                    rb if leader else ra,
                    leader,
                    s,
                    args.iters,
                    args.warmup,
                    timeout,
                    device,
                )
                for s in args.size_bytes
            }
            if leader:
                smallest = args.size_bytes[0]
                latency = per_size[smallest]
                bw = max(s / t for s, t in per_size.items() if t > 0)
                mine.append(
                    {
                        "kind": kind,
                        "between": [a, b],
                        "bandwidth": bw,
                        "latency": latency,
                        "per_size": per_size,
                    }
                )
        dist.barrier()
    results: list[Any] = [None] * world
    dist.all_gather_object(results, mine)
    dist.barrier()
    dist.destroy_process_group()
    watchdog.cancel()
    if rank != 0:
        return 0
    found = [r for rs in results for r in rs]
    text = to_yaml(found, backend, args, world, order)
    if args.output:
        tmp = f"{args.output}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.output)
        print(f"hexi-cluster bench: wrote {args.output}", flush=True)
    else:
        sys.stdout.write(text)
    return 0


def to_yaml(
    found: Sequence[Mapping[str, Any]],
    backend: str,
    args: argparse.Namespace,
    world: int,
    order: Sequence[str],
) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# hexi-cluster bench, {stamp}: {backend}, {world} ranks on {len(order)} node(s); "
        f"ping-pong, median of {args.iters} one-way times per size "
        f"({', '.join(str(s) for s in args.size_bytes)} bytes).",
        "# Paste `links:` into the cluster spec (or merge it); bandwidth = best size/time, "
        "latency = smallest message.",
    ]
    intra = [r for r in found if r["kind"] == "intra"]
    if intra:
        lines.append("# Within a node (use for the node group's `intra_node:`):")
        for r in intra:
            lines.append(
                f"#   {r['between'][0]}: {format_bandwidth(r['bandwidth'])}, "
                f"{format_latency(r['latency'])}"
            )
    links = [r for r in found if r["kind"] == "link"]
    if not links:
        lines.append("# only one node: no links between nodes to measure")
        lines.append("links: []")
    else:
        lines.append("links:")
        for r in links:
            a, b = r["between"]
            lines.append(
                f'  - {{between: ["{a}", "{b}"], '
                f'bandwidth: "{format_bandwidth(r["bandwidth"])}", '
                f'latency: "{format_latency(r["latency"])}"}}'
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    return run_bench(args)


if __name__ == "__main__":
    from megatron_hexi.process_exit import exit_process

    exit_process(main())
