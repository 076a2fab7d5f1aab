"""Stand-in for pretrain_gpt.py in launcher tests (no megatron): the runtime's rank mapping and one
gloo all_reduce.

    python -m torch.distributed.run ... fake_train.py --hetero-plan-path PLAN
        [--out RESULT.json] ...

Plan rank: megatron_hexi.rank_mapping, as the runtime maps it (node = $HEXI_PLAN_NODE, else this
host's name matched against the cluster's hostname(s), else launch order; local rank =
$LOCAL_RANK). Rank 0 writes
{world_size, sum, expected, ranks: [...]} to --out (or $HEXI_FAKE_OUT). Unknown flags are ignored.
"""

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_hexi.process_exit import exit_process
from megatron_hexi.rank_mapping import local_identity, map_processes
from planner.plan import load_plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hetero-plan-path", required=True)
    ap.add_argument("--out", default=os.environ.get("HEXI_FAKE_OUT"))
    ap.add_argument("--fail-rank", type=int, default=-1)
    args, rest = ap.parse_known_args()
    plan = load_plan(args.hetero_plan_path)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    # The runtime's own mapping (a mismatch is its LaunchError, on every rank).
    node = local_identity(plan.cluster, "cpu").node
    how = (
        "HEXI_PLAN_NODE"
        if os.environ.get("HEXI_PLAN_NODE")
        else "hostname"
        if node
        else "launch order"
    )
    plan_rank = map_processes(plan, "cpu", check_devices=False)[rank]
    if rank == args.fail_rank:
        exit_process(5)
    t = torch.tensor([float(plan_rank + 1)])
    dist.all_reduce(t)
    me = {
        "torch_rank": rank,
        "plan_rank": plan_rank,
        "plan_node": node,
        "how": how,
        "local_rank": local_rank,
        "gpu": plan.ranks[plan_rank].gpu if 0 <= plan_rank < len(plan.ranks) else None,
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "extra_args": rest,
    }
    print(
        f"fake_train: {node}/{local_rank} -> plan rank {plan_rank} (torch rank {rank}, {how})",
        flush=True,
    )
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    expected = world * (world + 1) / 2
    if rank == 0 and args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(
                {"world_size": world, "sum": t.item(), "expected": expected, "ranks": everyone}, f
            )
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    exit_process(0 if t.item() == expected else 3)  # never SIGABRT at interpreter exit


if __name__ == "__main__":
    main()
