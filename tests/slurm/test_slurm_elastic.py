"""An elastic job (`hexi-launch slurm --elastic`) on the localhost Slurm loses a node and finishes.

The cluster file matches the localhost Slurm's nodes (two A100 nodes on partition a100, one RTX
4090 node on partition rtx4090), one process each, emulated on the CPU: a heterogeneous job of
three torchrun agents in one c10d rendezvous. After a checkpoint, every process of plan node
a100-1 (the second Slurm node; the first hosts the rendezvous) is SIGKILLed, as when its machine
is lost. The job goes on: the two other agents re-rendezvous, their workers re-plan for two nodes,
resume from the checkpoint and finish the training; the job exits 0 and names the lost node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from harness import free_port
from launch.hexi_launch_helpers import hexi_launch
from runtime.plans import EXACT_FLAGS

pytestmark = pytest.mark.slurm

# Plan nodes a100-0, a100-1 (Slurm nodes a100-1, a100-2) and rtx4090-0 (Slurm node rtx4090-1).
CLUSTER = """\
name: localhost-slurm
nodes:
  - {name: a100, count: 2, gpu: A100-SXM-80GB, gpus_per_node: 1, intra_node: pcie4,
     nic: "10 Gbit/s"}
  - {name: rtx4090, count: 1, gpu: RTX-4090, gpus_per_node: 1, intra_node: pcie4,
     nic: "10 Gbit/s"}
"""
PARTS = ["--partition", "A100-SXM-80GB=a100", "--partition", "RTX-4090=rtx4090"]
LOST = "a100-1"  # plan node; not the first node, whose agent hosts the rendezvous
TRAIN_ITERS = 30
SAVE_INTERVAL = 10
# Seconds: a dead agent is dropped after keep_alive_interval x keep_alive_max_attempt without a
# heartbeat; a round closes last_call_timeout after its minimum of nodes have joined.
RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
JOB_TIMEOUT_S = 180


def metrics(path):
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def job_processes(rdzv_id):
    """{pid: (HEXI_PLAN_NODE, ppid, command line)} of the job's node processes: those whose
    environment has the job's rendezvous id and a plan node (timeout, agent, worker)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if env.get(b"HEXI_RDZV_ID") == rdzv_id.encode() and b"HEXI_PLAN_NODE" in env:
            found[int(entry)] = (env[b"HEXI_PLAN_NODE"].decode(), ppid, cmd)
    return found


def signal_pids(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def test_elastic_job_loses_a_node(slurm_cluster, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    save, metrics_path = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    name = f"hexi-elastic-{uuid.uuid4().hex[:8]}"
    job = tmp_path / "job.sbatch"
    r = hexi_launch(
        "slurm",
        "--elastic",
        cluster,
        "--model",
        "tiny",
        "--min-nodes",
        "2",
        "--rdzv-id",
        name,
        "--rdzv-conf",
        RDZV_CONF,
        *PARTS,
        "--job-name",
        name,
        "--time",
        "5",
        "--log",
        tmp_path / "job-%j.out",
        "--timeout-s",
        "150",
        "--master-port",
        free_port(),
        "--python",
        sys.executable,
        "-o",
        job,
        "--",
        *EXACT_FLAGS,
        "--train-iters",
        TRAIN_ITERS,
        "--global-batch-size",
        "8",
        "--save",
        save,
        "--load",
        save,
        "--hetero-load-if-exists",
        "--save-interval",
        SAVE_INTERVAL,
        "--hetero-metrics-path",
        metrics_path,
        "--hetero-device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    text = job.read_text()
    assert "#SBATCH hetjob" in text and "--no-kill --kill-on-bad-exit=0" in text

    # CPU processes stand for the GPUs: one compute thread each (3 ranks share the cores);
    # TMPDIR for torchrun's temp dirs and the job's step output
    env = {**slurm_cluster.env, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    sbatch_out = tmp_path / "sbatch.out"
    with open(sbatch_out, "w") as out:
        # --parsable prints the job id at once; --wait returns when the job ends, with its code
        proc = subprocess.Popen(
            ["sbatch", "--wait", "--parsable", str(job)],
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    job_id = None

    def job_output():
        logs = sorted(tmp_path.glob("job-*.out"))
        return "\n".join(f"==== {p.name}\n{p.read_text()[-6000:]}" for p in logs)

    def wait_for(what, condition):
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{job_output()}")
            if proc.poll() is not None:
                raise AssertionError(
                    f"the job ended (sbatch rc {proc.returncode}: {sbatch_out.read_text()}) "
                    f"while waiting for {what}\n{job_output()}"
                )
            time.sleep(0.1)

    try:
        wait_for("the job id", lambda: sbatch_out.read_text().strip().split(";")[0].isdigit())
        job_id = sbatch_out.read_text().split()[0].split(";")[0]
        rdzv_id = f"{name}-{job_id}"
        wait_for(
            "two steps past a checkpoint on three nodes",
            lambda: any(
                row["world_size"] == 3 and row["iteration"] >= SAVE_INTERVAL + 2
                for row in metrics(metrics_path)
            ),
        )
        # The moment of the loss is decided here: every worker (a child of an agent) stops,
        # the lost node's processes are SIGKILLed all at once, the others go on.
        procs = job_processes(rdzv_id)
        agents = {pid for pid, (_, _, cmd) in procs.items() if "torch.distributed.run" in cmd}
        workers = {pid for pid, (_, ppid, _) in procs.items() if ppid in agents}
        assert {procs[p][0] for p in agents} == {"a100-0", "a100-1", "rtx4090-0"}, procs
        assert {procs[p][0] for p in workers} == {"a100-0", "a100-1", "rtx4090-0"}, procs
        signal_pids(workers, signal.SIGSTOP)
        lost_after = max(row["iteration"] for row in metrics(metrics_path))
        signal_pids([p for p, (node, _, _) in procs.items() if node == LOST], signal.SIGKILL)
        signal_pids([p for p in workers if procs[p][0] != LOST], signal.SIGCONT)
        remaining = max(1.0, deadline - time.monotonic())
        try:
            rc = proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the job did not end in {JOB_TIMEOUT_S} s\n{job_output()}"
            ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            if job_id is not None:
                slurm_cluster.run("scancel", job_id)
            else:
                slurm_cluster.run("scancel", f"--name={name}")

    out = (tmp_path / f"job-{job_id}.out").read_text()
    # the training finished on the two other nodes: the job succeeds and names the lost node
    assert rc == 0, f"sbatch --wait rc {rc}\n{out}"
    assert f"hexi: job {job_id} finished" in out, out
    assert "hexi: node exit: plan node a100-0 on a100-1: torchrun exit 0" in out, out
    assert "hexi: node exit: plan node rtx4090-0 on rtx4090-1: torchrun exit 0" in out, out
    assert f"hexi: plan node(s) {LOST} failed or were lost" in out, out

    rows = metrics(metrics_path)
    runs = [rows[0]["world_size"]]
    for row in rows[1:]:
        if row["world_size"] != runs[-1]:
            runs.append(row["world_size"])
    assert runs == [3, 2], (runs, out)
    assert rows[-1]["iteration"] == TRAIN_ITERS, (rows[-1], out)
    # the two resumed from the last checkpoint before the loss
    first_two = next(i for i, row in enumerate(rows) if row["world_size"] == 2)
    resumed_at = rows[first_two]["iteration"] - 1
    assert resumed_at % SAVE_INTERVAL == 0 and SAVE_INTERVAL <= resumed_at <= lost_after
    assert [row["iteration"] for row in rows[first_two:]] == list(
        range(resumed_at + 1, TRAIN_ITERS + 1)
    )
    # rank 0 of the restarted run says the training finished
    assert f"done: iterations {resumed_at + 1}-{TRAIN_ITERS} " in out, out
    # each start's plan is kept: the whole cluster's, then one without the lost node
    assert sorted(os.listdir(save / "plans")) == sorted(["plan_0.json", f"plan_{resumed_at}.json"])
    assert rows[0]["plan"] == "plan_0.json" and rows[-1]["plan"] == f"plan_{resumed_at}.json"
    for plan_name, world, nodes in (
        ("plan_0.json", 3, {"a100-0", "a100-1", "rtx4090-0"}),
        (f"plan_{resumed_at}.json", 2, {"a100-0", "rtx4090-0"}),
    ):
        plan = json.loads((save / "plans" / plan_name).read_text())
        assert len(plan["ranks"]) == world, plan_name
        assert {r["node"] for r in plan["ranks"]} == nodes, plan_name
