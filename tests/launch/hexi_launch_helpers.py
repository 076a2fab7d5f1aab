"""Shared by tests/launch and tests/slurm: small plans and a stand-in training script.

`fake_train.py` (next to this file) stands in for pretrain_gpt.py until the runtime is ready: it
maps itself to a plan rank by the runtime contract (HEXI_PLAN_NODE, else host name, else launch
order; LOCAL_RANK), does a gloo all_reduce and has rank 0 write everyone's view as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from planner.cluster import load_cluster_dict
from planner.models import model_from_dict
from planner.plan import build_plan, save_plan

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAKE_TRAIN = HERE / "fake_train.py"
MODEL = {
    "num_layers": 4,
    "hidden_size": 64,
    "ffn_hidden_size": 256,
    "num_attention_heads": 4,
    "num_query_groups": 4,
    "vocab_size": 128,
    "seq_length": 32,
    "name": "tiny",
}
GPU_OF = {"a100": "A100-SXM-80GB", "rtx4090": "RTX-4090", "rtx3090": "RTX-3090", "h100": "H100-SXM"}


def cluster_dict(groups, name="test"):
    """groups: [(group name, gpus_per_node, count, extra dict or None)]; GPU type from the name."""
    nodes = []
    for g in groups:
        gname, gpn, count = g[:3]
        extra = g[3] if len(g) > 3 and g[3] else {}
        d = {
            "name": gname,
            "gpu": GPU_OF[gname.split("_")[0]],
            "gpus_per_node": gpn,
            "count": count,
            "intra_node": "pcie4",
            "nic": "10 Gbit/s",
            **extra,
        }
        nodes.append(d)
    return {"name": name, "nodes": nodes}


def make_plan(path, groups, world=None, name="test"):
    """A data-parallel plan (one single-stage pipeline per rank) over the first `world` GPUs."""
    cluster = load_cluster_dict(cluster_dict(groups, name))
    world = world or cluster.num_gpus
    pipes = [
        {
            "micro_batch_size": 1,
            "num_microbatches": 1,
            "stages": [{"ranks": [r], "layers": [0, MODEL["num_layers"]]}],
        }
        for r in range(world)
    ]
    plan = build_plan(cluster, model_from_dict(MODEL, "model"), world, pipes)
    save_plan(plan, str(path))
    return plan


def hexi_launch(*args, cwd=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "megatron_hexi.launch.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def check_fake_result(result_path, plan):
    """The stand-in script's JSON: every plan rank exactly once, on its plan node, all_reduce ok."""
    res = json.loads(Path(result_path).read_text())
    assert res["world_size"] == plan.world_size, res
    assert res["sum"] == res["expected"], res
    by_rank = {x["plan_rank"]: x for x in res["ranks"]}
    assert sorted(by_rank) == list(range(plan.world_size)), res["ranks"]
    for entry in plan.ranks:
        x = by_rank[entry.rank]
        assert x["plan_node"] == entry.node and x["local_rank"] == entry.local_rank, x
        assert x["torch_rank"] == entry.rank, x  # the launchers make torch rank == plan rank
        assert x["gpu"] == entry.gpu, x
    return res


# ---- an sbatch script run with stand-ins for srun / scontrol / python ----

STUB_SRUN = r"""#!/bin/bash
# stand-in srun: run the command after the options once per "id:host" of $STUB_NODES
while [[ "$1" == -* ]]; do shift; done
for pair in $STUB_NODES; do
    SLURM_NODEID=${pair%%:*} SLURMD_NODENAME=${pair#*:} "$@" || exit $?
done
"""
STUB_SCONTROL = """#!/bin/bash
# stand-in: `scontrol show hostnames a,b,c`
tr ',' '\\n' <<<"$3"
"""
STUB_PYTHON = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["STUB_OUT"], "a") as f:
    f.write(json.dumps({"node": os.environ.get("HEXI_PLAN_NODE"), "argv": sys.argv[1:],
                        "master": os.environ.get("MASTER_ADDR")}) + "\\n")
"""


def run_with_stub_slurm(tmp_path, script, env_extra, ok=True):
    """Run an sbatch script with stand-ins for srun (runs its command once per "id:host" of
    $STUB_NODES), scontrol and the nodes' python (records HEXI_PLAN_NODE, argv, MASTER_ADDR).
    Returns ({plan node: call}, the finished process); with ok, the script must succeed."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in [("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL), ("python", STUB_PYTHON)]:
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    out = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_", "HEXI_"))}
    env.update(
        PATH=f"{bindir}:{env['PATH']}",
        STUB_OUT=str(out),
        PYTHON=str(bindir / "python"),
        SLURM_JOB_ID="7",
        **env_extra,
    )
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return {c["node"]: c for c in calls}, r
