"""Heterogeneous Slurm jobs on the localhost Slurm (two fake GPU types), torchrun over gloo/CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slurm

TORCHRUN_TIMEOUT_S = 120  # per node, `timeout -k 10 N torchrun ...`
JOB_TIMEOUT_S = 300  # sbatch --wait, from the test's side

ALLREDUCE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    me = {k: os.environ.get(v) for k, v in [
        ("node", "SLURMD_NODENAME"),
        ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"), ("slurm_nodeid", "SLURM_NODEID"),
        ("local_rank", "LOCAL_RANK")]}
    me.update(rank=rank, sum=t.item())
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    expected = world * (world + 1) / 2
    if rank == 0:
        out = sys.argv[1]
        with open(out + ".tmp", "w") as f:
            json.dump({"world_size": world, "sum": t.item(), "expected": expected,
                       "ranks": everyone}, f)
        os.replace(out + ".tmp", out)
    dist.barrier()
    from megatron_hexi.process_exit import exit_process
    exit_process(0 if t.item() == expected else 3)   # never SIGABRT at interpreter exit
    """
)


def _job_id(stdout: str) -> str:
    m = re.match(r"\s*(\d+)", stdout)
    assert m, f"no job id in sbatch output {stdout!r}"
    return m.group(1)


def test_cluster_json_matches_sinfo(slurm_cluster):
    """cluster.json (what job generators read) describes the running cluster."""
    r = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %P %G %t")
    assert r.returncode == 0, r.stderr
    seen: dict[str, set[str]] = {}
    for line in r.stdout.splitlines():
        node, part, gres, state = line.split()
        seen.setdefault(part.rstrip("*"), set()).add(node)
        gpu = slurm_cluster.info["nodes"][node]
        assert gres.startswith(f"gpu:{gpu['gpu_type']}:{gpu['gpus']}"), line
        assert state == "idle", line
    want = {p: set(v["nodes"]) for p, v in slurm_cluster.info["partitions"].items()}
    assert seen == want


def test_heterogeneous_job_allreduce(slurm_cluster, tmp_path):
    """One het job (a100 + rtx4090 component), one srun over both, torchrun per node, all_reduce."""
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    result = tmp_path / "result.json"
    job = tmp_path / "job.sh"
    job.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/bash
            #SBATCH --job-name=hexi-het-allreduce
            #SBATCH --output={tmp_path}/job-%j.out
            #SBATCH --time=10
            #SBATCH --partition=a100
            #SBATCH --nodes=1
            #SBATCH --ntasks-per-node=1
            #SBATCH --cpus-per-task=2
            #SBATCH --gres=gpu:a100:1
            #SBATCH hetjob
            #SBATCH --partition=rtx4090
            #SBATCH --nodes=1
            #SBATCH --ntasks-per-node=1
            #SBATCH --cpus-per-task=2
            #SBATCH --gres=gpu:rtx4090:1
            set -euo pipefail
            echo "het size $SLURM_HET_SIZE:" \\
                "$SLURM_JOB_NODELIST_HET_GROUP_0 + $SLURM_JOB_NODELIST_HET_GROUP_1"
            MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)
            NNODES=0
            for ((i = 0; i < SLURM_HET_SIZE; i++)); do
                v=SLURM_JOB_NUM_NODES_HET_GROUP_$i; NNODES=$((NNODES + ${{!v}}))
            done
            MASTER_PORT=$((25000 + SLURM_JOB_ID % 5000))
            export MASTER_ADDR MASTER_PORT NNODES TMPDIR={tmp_path}  # torchrun's temp dirs
            srun --het-group=0-$((SLURM_HET_SIZE - 1)) --kill-on-bad-exit=1 bash -c \\
                'exec timeout -k 10 {TORCHRUN_TIMEOUT_S} "$0" -m torch.distributed.run \\
                    --nnodes="$NNODES" --nproc_per_node=1 --node_rank="$SLURM_NODEID" \\
                    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" "$1" "$2"' \\
                "{sys.executable}" "{script}" "{result}"
            echo HEXI_JOB_DONE
            """
        )
    )
    try:
        r = slurm_cluster.run("sbatch", "--wait", "--parsable", str(job), timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        slurm_cluster.run("scancel", "--name=hexi-het-allreduce")
        raise
    out_files = sorted(tmp_path.glob("job-*.out"))
    log = "\n".join(f.read_text() for f in out_files)
    assert r.returncode == 0, f"sbatch --wait: rc {r.returncode}\n{r.stderr}\n{log}"
    job_id = _job_id(r.stdout)
    # sbatch --wait also returns 0 for a job cancelled while pending: check what the job wrote
    out = tmp_path / f"job-{job_id}.out"
    assert out.exists(), f"no job output {out}; sbatch said {r.stdout!r} {r.stderr!r}"
    assert "HEXI_JOB_DONE" in out.read_text(), out.read_text()
    assert result.exists(), out.read_text()

    res = json.loads(result.read_text())
    assert res["world_size"] == 2
    assert res["sum"] == res["expected"] == 3.0
    ranks = sorted(res["ranks"], key=lambda x: x["rank"])
    nodes = [x["node"] for x in ranks]
    assert nodes[0] in slurm_cluster.info["partitions"]["a100"]["nodes"], ranks
    assert nodes[1] in slurm_cluster.info["partitions"]["rtx4090"]["nodes"], ranks
    assert [x["slurm_nodeid"] for x in ranks] == ["0", "1"], ranks
    for x in ranks:  # --gres=gpu:<type>:1 gives each component one (fake) GPU
        assert x["cuda_visible_devices"] not in (None, ""), ranks
        assert len(x["cuda_visible_devices"].split(",")) == 1, ranks
        assert x["sum"] == 3.0


@pytest.mark.parametrize("partition", ["a100", None])
def test_unknown_gpu_type_refused_at_submission(slurm_cluster, tmp_path, partition):
    """A GPU type no node has is refused by sbatch at once (EnforcePartLimits), not left pending."""
    args = ["sbatch", "--parsable", f"--output={tmp_path}/never-%j.out", "--gres=gpu:h100:1"]
    if partition:
        args.append(f"--partition={partition}")
    r = slurm_cluster.run(*args, "--wrap=true", timeout=30)
    assert r.returncode != 0, f"job was accepted: {r.stdout!r}"
    assert r.stdout.strip() == ""
    assert "Requested node configuration is not available" in r.stderr, r.stderr
    assert not list(tmp_path.glob("never-*.out"))
