"""A launch whose order differs from the plan's still trains the one-rank model exactly.

Two torchrun agents start the plan's two nodes in reverse order (the agent with node rank 0 runs
the plan's second node), so launch ranks 0-1 are plan ranks 2-3 (for the memory shards, the same
launch's workers are forked with the agents' environment). Process groups number their
members by launch rank; any buffer laid out in plan order would then be cut wrongly. Before the
distributed optimizer placed its regions by group rank, this launch was off by 6 % in loss and
5-14 % in grad norm (even and memory shards), with no error; now it agrees to 1e-7. The GPU types
differ per node, so the memory-proportional shards differ per rank too.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from harness import (
    CPU_ONLY_ENV,
    DistributedTimeout,
    _kill_tree,
    check_no_abort,
    free_port,
    run_script,
    start_script,
)
from planner.cluster import load_cluster_dict
from planner.models import load_model
from planner.plan import build_plan, save_plan
from runtime.plans import GLOBAL_BATCH, REFERENCE, cpu_cluster
from runtime.workers import BASE_FLAGS, max_relative_difference

TOLERANCE = 1e-5
TWO_NODES = {
    "name": "two-nodes",
    "nodes": [
        {
            "name": "n0",
            "gpu": "A100-SXM-80GB",
            "gpus_per_node": 2,
            "intra_node": "nvlink",
            "nic": "10 Gbit/s",
        },
        {
            "name": "n1",
            "gpu": "RTX-4090",
            "gpus_per_node": 2,
            "intra_node": "host",
            "nic": "10 Gbit/s",
        },
    ],
}
# Pipeline 0: TP=2 uneven on n0, then one rank of n1; pipeline 1: the other rank of n1. Every
# gradient segment is held by a rank of n0 and both ranks of n1.
PIPELINES = [
    {
        "micro_batch_size": 1,
        "num_microbatches": 6,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 3],
                "shards": {"query_groups": [3, 1], "ffn": [192, 64], "vocab": [96, 32]},
            },
            {"ranks": [2], "layers": [3, 4]},
        ],
    },
    {"micro_batch_size": 2, "num_microbatches": 1, "stages": [{"ranks": [3], "layers": [0, 4]}]},
]


def _agents(argv, nodes, timeout=300):
    """One torchrun agent per entry of `nodes` (plan node names, in launch order), 2 processes
    each, on this machine; returns each agent's (exit code, stderr)."""
    port = str(free_port())
    procs = []
    for node_rank, node in enumerate(nodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(nodes)),
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "pretrain_gpt.py",
            *map(str, argv),
        ]
        env = {**os.environ, "HEXI_PLAN_NODE": node, "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
    except subprocess.TimeoutExpired:
        raise DistributedTimeout(f"torchrun agents for {nodes} ran past {timeout} s")
    finally:
        for p in procs:
            if p.returncode is None:
                _kill_tree(p.pid, group=True)
                p.wait()
    return out


def _forked(argv, nodes, folder, timeout=300):
    """The same launch as `_agents` without the agents: each worker forked from the harness's
    forkserver with the environment torchrun gives it (launch rank, local rank, node rank, the
    node's process count, HEXI_PLAN_NODE). Returns each worker's (exit code, stderr)."""
    port, procs = str(free_port()), []
    for node_rank, node in enumerate(nodes):
        for local in range(2):
            rank = 2 * node_rank + local
            env = {
                **os.environ,
                **CPU_ONLY_ENV,
                "HEXI_PLAN_NODE": node,
                "OMP_NUM_THREADS": "1",
                "RANK": str(rank),
                "LOCAL_RANK": str(local),
                "GROUP_RANK": str(node_rank),
                "LOCAL_WORLD_SIZE": "2",
                "WORLD_SIZE": str(2 * len(nodes)),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            out, err = folder / f"rank{rank}.out", folder / f"rank{rank}.err"
            procs.append((start_script(["pretrain_gpt.py", *argv], env, REPO, out, err), err))
    try:
        deadline = time.monotonic() + timeout
        codes = [p.wait(max(deadline - time.monotonic(), 0)) for p, _ in procs]
        if None in codes:
            raise DistributedTimeout(f"workers for {nodes} ran past {timeout} s")
        check_no_abort(codes, "pretrain_gpt.py")
        return [(code, err.read_text()) for code, (_, err) in zip(codes, procs)]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _metrics(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["lm_loss"] for r in rows], [r["grad_norm"] for r in rows]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    d = tmp_path_factory.mktemp("one-rank")
    plan = build_plan(cpu_cluster(1), load_model("tiny"), GLOBAL_BATCH, REFERENCE)
    save_plan(plan, d / "plan.json")
    code, _, err = run_script(
        ["pretrain_gpt.py", "--hetero-plan-path", d / "plan.json", *BASE_FLAGS]
        + ["--hetero-metrics-path", d / "m.jsonl"],
        cwd=REPO,
        timeout=300,
    )
    assert code == 0, err[-3000:]
    return _metrics(d / "m.jsonl")


@pytest.mark.parametrize("shard", ["even", "memory"])
def test_distributed_optimizer_under_reversed_node_order(shard, one_rank, tmp_path):
    plan = build_plan(
        load_cluster_dict(TWO_NODES),
        load_model("tiny"),
        GLOBAL_BATCH,
        PIPELINES,
        use_distributed_optimizer=True,
        optimizer_shard=shard,
    )
    save_plan(plan, tmp_path / "plan.json")
    metrics = tmp_path / "m.jsonl"
    argv = ["--hetero-plan-path", tmp_path / "plan.json", *BASE_FLAGS]
    argv += ["--hetero-metrics-path", metrics]
    # torchrun's agents for one layout; the other differs in the shards only, so its workers
    # are forked with the environment the agents give them (the same launch order)
    if shard == "even":
        exits = _agents(argv, ["n1", "n0"])
    else:
        exits = _forked(argv, ["n1", "n0"], tmp_path)
    assert [code for code, _ in exits] == [0] * len(exits), [err[-3000:] for _, err in exits]
    losses, norms = _metrics(metrics)
    ref_losses, ref_norms = one_rank
    loss = max(max_relative_difference(a, b) for a, b in zip(losses, ref_losses))
    norm = max(max_relative_difference(a, b) for a, b in zip(norms, ref_norms))
    print(f"reversed node order, {shard} shards: loss {loss:.2e}, grad norm {norm:.2e}")
    assert len(losses) == len(ref_losses) == 3
    assert loss < TOLERANCE and norm < TOLERANCE, (losses, ref_losses, norms, ref_norms)
