"""hexi-launch sbatch scripts run on the localhost Slurm (tools/slurm/localhost.sh).

Plans over the localhost cluster's node types (A100-SXM-80GB on partition a100: a100-1, a100-2;
RTX-4090 on partition rtx4090: rtx4090-1; 2 fake GPUs each). The stand-in training script
tests/launch/fake_train.py maps each process to its plan rank the way the runtime does and runs a
gloo all_reduce; pretrain_gpt.py replaces it once the runtime is ready.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness import run_distributed
from launch.hexi_launch_helpers import (
    FAKE_TRAIN,
    check_fake_result,
    cluster_dict,
    hexi_launch,
    make_plan,
)
from megatron_hexi.launch.common import default_gres_type
from planner.cluster import load_cluster_dict
from runtime.workers import BASE_FLAGS, train

pytestmark = pytest.mark.slurm

PARTS = ["--partition", "A100-SXM-80GB=a100", "--partition", "RTX-4090=rtx4090"]
JOB_TIMEOUT_S = 240


def submit(slurm_cluster, tmp_path, job, name):
    """sbatch --wait; returns the job's output. Fails with the log on any problem."""
    env = {**slurm_cluster.env, "TMPDIR": str(tmp_path)}  # torchrun's temp dirs
    try:
        r = subprocess.run(
            ["sbatch", "--wait", "--parsable", str(job)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        slurm_cluster.run("scancel", f"--name={name}")
        raise
    logs = {p.name: p.read_text() for p in tmp_path.glob("job-*.out")}
    assert r.returncode == 0, f"sbatch --wait rc {r.returncode}: {r.stderr}\n{logs}"
    job_id = re.match(r"\s*(\d+)", r.stdout).group(1)
    out = logs.get(f"job-{job_id}.out")
    assert out is not None, f"no job output; sbatch said {r.stdout!r} {r.stderr!r}"
    # sbatch --wait also says 0 for a job cancelled while pending: check what the job wrote
    assert f"hexi: job {job_id} finished" in out, out
    return out


def generate(tmp_path, plan_path, name, *extra, entry=("--entry", str(FAKE_TRAIN)), args=()):
    job = tmp_path / "job.sbatch"
    r = hexi_launch(
        "slurm",
        plan_path,
        *PARTS,
        "--job-name",
        name,
        "--time",
        "5",
        "--log",
        tmp_path / "job-%j.out",
        "--timeout-s",
        "120",
        "--python",
        sys.executable,
        *entry,
        *extra,
        "-o",
        job,
        "--",
        *args,
    )
    assert r.returncode == 0, r.stderr
    return job


def check_nodes(slurm_cluster, res):
    """Every rank ran on a Slurm node whose GPU type is the plan's GPU type for it."""
    for x in res["ranks"]:
        assert slurm_cluster.info["nodes"][x["slurm_node"]]["gpu_type"] == default_gres_type(
            x["gpu"]
        ), x


def visible_gpus(x):
    """The GPUs Slurm gave a process (CUDA_VISIBLE_DEVICES from its --gres request)."""
    return len(x["cuda_visible_devices"].split(","))


def test_plain_job(slurm_cluster, tmp_path):
    """One GPU type, 2 ranks on each node: a plain job on partition a100."""
    plan_path = tmp_path / "plan.json"
    plan = make_plan(plan_path, [("a100", 2, 2)])
    job = generate(tmp_path, plan_path, "hexi-plain", args=["--out", tmp_path / "res.json"])
    assert "hetjob" not in job.read_text()
    out = submit(slurm_cluster, tmp_path, job, "hexi-plain")
    res = check_fake_result(tmp_path / "res.json", plan)
    check_nodes(slurm_cluster, res)
    assert "-> plan node a100-1, torchrun node rank 1, 2 process(es)" in out
    assert {x["slurm_node"] for x in res["ranks"]} == {"a100-1", "a100-2"}
    assert all(visible_gpus(x) == 2 for x in res["ranks"]), res["ranks"]


def test_same_gpu_type_different_gpu_counts(slurm_cluster, tmp_path):
    """One GPU type, 2 ranks on one node and 1 on the other (as the README's planning example
    has RTX 4090 machines of 8 and 4 GPUs): a component per count on the same partition, each
    node given exactly the GPUs its ranks use."""
    plan_path = tmp_path / "plan.json"
    plan = make_plan(plan_path, [("a100", 2, 2)], world=3)
    job = generate(tmp_path, plan_path, "hexi-counts", args=["--out", tmp_path / "res.json"])
    text = job.read_text()
    assert text.count("#SBATCH hetjob") == 1 and text.count("#SBATCH --partition=a100") == 2
    assert "#SBATCH --gres=gpu:a100:2\n" in text and "#SBATCH --gres=gpu:a100:1\n" in text
    out = submit(slurm_cluster, tmp_path, job, "hexi-counts")
    res = check_fake_result(tmp_path / "res.json", plan)
    check_nodes(slurm_cluster, res)
    assert "-> plan node a100-1, torchrun node rank 1, 1 process(es)" in out
    assert {x["slurm_node"] for x in res["ranks"]} == {"a100-1", "a100-2"}
    nproc = {"a100-0": 2, "a100-1": 1}
    assert all(visible_gpus(x) == nproc[x["plan_node"]] for x in res["ranks"]), res["ranks"]


def test_het_job_plan_order_differs_from_slurm(slurm_cluster, tmp_path):
    """The plan lists rtx4090 first (rank 0 on the 4090); Slurm's `all` order would be a100 first.
    Every process still finds its plan rank, and torch rank == plan rank."""
    plan_path = tmp_path / "plan.json"
    plan = make_plan(plan_path, [("rtx4090", 2, 1), ("a100", 1, 2)])
    job = generate(
        tmp_path, plan_path, "hexi-het", args=["--out", tmp_path / "res.json", "--x", "a b", "it's"]
    )
    assert job.read_text().count("#SBATCH hetjob") == 1
    out = submit(slurm_cluster, tmp_path, job, "hexi-het")
    res = check_fake_result(tmp_path / "res.json", plan)
    check_nodes(slurm_cluster, res)
    by_rank = {x["plan_rank"]: x for x in res["ranks"]}
    assert by_rank[0]["slurm_node"] == by_rank[1]["slurm_node"] == "rtx4090-1"
    assert {by_rank[2]["slurm_node"], by_rank[3]["slurm_node"]} == {"a100-1", "a100-2"}
    assert all(x["extra_args"] == ["--x", "a b", "it's"] for x in res["ranks"])
    assert all(x["cuda_visible_devices"] for x in res["ranks"]), res["ranks"]
    assert "master rtx4090-1:" in out


def test_plan_that_does_not_fit_is_refused(slurm_cluster, tmp_path):
    """3 A100 nodes on a partition of 2: the generator's sinfo check says so (exit 2, one line)
    and, unchecked, sbatch refuses the job at submission (EnforcePartLimits)."""
    plan_path = tmp_path / "plan.json"
    make_plan(plan_path, [("rtx4090", 2, 1), ("a100", 2, 3)])
    env = slurm_cluster.env
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_hexi.launch.cli",
            "slurm",
            str(plan_path),
            *PARTS,
            "--check-partitions",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        "hexi-launch: error: node group a100 needs 3 node(s) with "
        "gpu:a100:2; partition a100 has 2 (a100-1, a100-2)"
    )
    job = generate(tmp_path, plan_path, "hexi-nofit")
    r = slurm_cluster.run("sbatch", "--parsable", str(job), timeout=30)
    assert r.returncode != 0 and r.stdout.strip() == ""
    # Slurm's own words (22.05): too many nodes for the partition
    assert re.search(
        r"Batch job submission failed: (More processors requested than permitted|"
        r"Requested node configuration is not available|Node count specification "
        r"invalid)",
        r.stderr,
    ), r.stderr
    assert not list(tmp_path.glob("job-*.out"))


def test_bench_under_slurm(slurm_cluster, tmp_path):
    """hexi-cluster bench as the job's entry: a valid `links:` file for the plan's cluster."""
    plan_path = tmp_path / "plan.json"
    groups = [("a100", 2, 1), ("rtx4090", 1, 1)]
    make_plan(plan_path, groups)
    links = tmp_path / "links.yaml"
    job = generate(
        tmp_path,
        plan_path,
        "hexi-bench",
        entry=("--entry-module", "megatron_hexi.cluster_tools.bench"),
        args=[
            "-o",
            links,
            "--sizes",
            "8B",
            "256KB",
            "--iters",
            "3",
            "--timeout-s",
            "30",
            "--total-timeout-s",
            "100",
        ],
    )
    submit(slurm_cluster, tmp_path, job, "hexi-bench")
    data = yaml.safe_load(links.read_text())
    assert [lk["between"] for lk in data["links"]] == [["a100-0", "rtx4090-0"]]
    spec = load_cluster_dict({**cluster_dict(groups), "links": data["links"]})
    bw, lat = spec.link("a100-0", "rtx4090-0")
    assert bw > 1e6 and 0 < lat < 0.1
    assert "#   a100-0: " in links.read_text()


def test_pretrain_gpt_het_job(slurm_cluster, tmp_path):
    """End to end: the real runtime (CPU/gloo) under a generated het job, started through the
    default entry, the installed hexi-train (by absolute path, whatever folder the job is in).
    Plan: pipeline 0 = TP-2 stage on the RTX 4090 node -> stage on a100-0; pipeline 1 = a100-1."""
    from launch.hexi_launch_helpers import MODEL
    from planner.models import model_from_dict
    from planner.plan import build_plan, save_plan

    cluster = load_cluster_dict(cluster_dict([("rtx4090", 2, 1), ("a100", 1, 2)]))
    pipes = [
        {
            "micro_batch_size": 1,
            "num_microbatches": 2,
            "stages": [{"ranks": [0, 1], "layers": [0, 2]}, {"ranks": [2], "layers": [2, 4]}],
        },
        {
            "micro_batch_size": 2,
            "num_microbatches": 1,
            "stages": [{"ranks": [3], "layers": [0, 4]}],
        },
    ]
    plan_path = tmp_path / "plan.json"
    save_plan(build_plan(cluster, model_from_dict(MODEL, "model"), 4, pipes), str(plan_path))
    metrics = tmp_path / "metrics.jsonl"
    job = generate(
        tmp_path,
        plan_path,
        "hexi-e2e",
        entry=(),
        args=[*BASE_FLAGS, "--hetero-metrics-path", metrics],
    )
    assert f"HEXI_ENTRY_WORDS=({Path(sys.executable).parent / 'hexi-train'})" in job.read_text()
    out = submit(slurm_cluster, tmp_path, job, "hexi-e2e")
    assert "-> plan node rtx4090-0, torchrun node rank 0, 2 process(es)" in out
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3], out
    # The same training on one CPU process: the job's losses must be the same numbers.
    one = [
        {"micro_batch_size": 4, "num_microbatches": 1, "stages": [{"ranks": [0], "layers": [0, 4]}]}
    ]
    ref_path = tmp_path / "one-rank.json"
    save_plan(
        build_plan(
            load_cluster_dict(cluster_dict([("a100", 1, 1)])),
            model_from_dict(MODEL, "model"),
            4,
            one,
        ),
        str(ref_path),
    )
    ref = run_distributed(train, 1, ref_path, timeout=240)[0]
    for row, loss in zip(rows, ref["losses"]):
        assert abs(row["lm_loss"] - loss) <= 1e-5 * abs(loss), (rows, ref["losses"])
