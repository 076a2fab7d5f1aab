"""Unit tests of hexi-launch's generators (no Slurm, no torch in the generator)."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import free_port
from launch.hexi_launch_helpers import (
    FAKE_TRAIN,
    REPO,
    STUB_SCONTROL,
    hexi_launch,
    make_plan,
    run_with_stub_slurm,
)
from megatron_hexi.launch import slurm as slurm_gen
from megatron_hexi.launch.common import default_gres_type, plan_nodes

PARTS = ["--partition", "A100-SXM-80GB=a100", "--partition", "RTX-4090=rtx4090"]
NASTY = ["--data-path", "my data/a b", "--name", "it's $HOME `x` \"q\"", "--empty", ""]


@pytest.fixture
def het_plan(tmp_path):
    """rtx4090 group FIRST (1 node x 2), then a100 (2 nodes x 2); 5 ranks: a100-1 runs only 1."""
    path = tmp_path / "het.json"
    return path, make_plan(path, [("rtx4090", 2, 1), ("a100", 2, 2)], world=5)


@pytest.fixture
def plain_plan(tmp_path):
    path = tmp_path / "plain.json"
    return path, make_plan(path, [("a100", 2, 2)])


def sbatch_lines(text):
    return [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]


def components_of(text):
    """The #SBATCH lines of each component, in order (split at `#SBATCH hetjob`)."""
    comps = [[]]
    for line in sbatch_lines(text):
        if line == "#SBATCH hetjob":
            comps.append([])
        else:
            comps[-1].append(line)
    return comps


def gres_of(comp):
    (line,) = [ln for ln in comp if ln.startswith("#SBATCH --gres=")]
    return line.removeprefix("#SBATCH --gres=")


@pytest.mark.parametrize(
    "gpu,gres",
    [
        ("A100-SXM-80GB", "a100"),
        ("RTX-4090", "rtx4090"),
        ("H100-SXM", "h100"),
        ("A100-PCIE-40GB", "a100"),
        ("RTX-3080-Ti", "rtx3080ti"),
        ("V100-SXM2", "v100"),
        ("L40S", "l40s"),
        ("T4", "t4"),
        ("CPU", None),
    ],
)
def test_default_gres_type(gpu, gres):
    assert default_gres_type(gpu) == gres


def test_plan_nodes_in_plan_order(het_plan):
    _, plan = het_plan
    nodes = plan_nodes(plan)
    assert [(n.name, n.nproc, n.node_rank, n.first_rank) for n in nodes] == [
        ("rtx4090-0", 2, 0, 0),
        ("a100-0", 2, 1, 2),
        ("a100-1", 1, 2, 4),
    ]


def test_plain_job(plain_plan, tmp_path):
    path, _ = plain_plan
    out = tmp_path / "job.sbatch"
    r = hexi_launch(
        "slurm", path, "--partition", "a100", "--time", "1:00:00", "--account", "proj", "-o", out
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert os.stat(out).st_mode & stat.S_IXUSR
    assert "hetjob" not in text and "--het-group" not in text
    assert sbatch_lines(text) == [
        "#SBATCH --job-name=hexi-plain",
        "#SBATCH --output=hexi-%j.out",
        "#SBATCH --partition=a100",
        "#SBATCH --account=proj",
        "#SBATCH --time=1:00:00",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gres=gpu:a100:2",
        "#SBATCH --cpus-per-task=4",
    ]
    assert "\nsrun --kill-on-bad-exit=1 \\\n" in text
    assert "declare -A HEXI_NPROC=([a100-0]=2 [a100-1]=2)" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def test_homogeneous_plan_without_partition_uses_default_partition(plain_plan):
    path, _ = plain_plan
    r = hexi_launch("slurm", path)
    assert r.returncode == 0, r.stderr
    assert not any("--partition" in ln for ln in sbatch_lines(r.stdout))


def test_het_job(het_plan):
    path, _ = het_plan
    r = hexi_launch(
        "slurm", path, *PARTS, "--gres-type", "RTX-4090=geforce_rtx_4090", "--cpus-per-gpu", "3"
    )
    assert r.returncode == 0, r.stderr
    text = r.stdout
    comp0, comp1, comp2 = components_of(text)
    # component 0 is the group of rank 0 (rtx4090, listed first in the plan), not Slurm's order
    assert "#SBATCH --partition=rtx4090" in comp0 and "#SBATCH --nodes=1" in comp0
    assert "#SBATCH --gres=gpu:geforce_rtx_4090:2" in comp0
    assert "#SBATCH --cpus-per-task=6" in comp0
    # a100-0 runs 2 ranks, a100-1 one: a component each, each asking for what its node uses
    assert "#SBATCH --partition=a100" in comp1 and "#SBATCH --nodes=1" in comp1
    assert "#SBATCH --gres=gpu:a100:2" in comp1 and "#SBATCH --cpus-per-task=6" in comp1
    assert "#SBATCH --partition=a100" in comp2 and "#SBATCH --nodes=1" in comp2
    assert "#SBATCH --gres=gpu:a100:1" in comp2 and "#SBATCH --cpus-per-task=3" in comp2
    assert all("--ntasks-per-node=1" in "\n".join(c) for c in (comp0, comp1, comp2))
    assert "srun --het-group=0-$((SLURM_HET_SIZE - 1)) --kill-on-bad-exit=1" in text
    assert text.count("\nsrun ") == 1
    assert "    rtx4090-0   # component 0" in text
    assert "    a100-0   # component 1" in text and "    a100-1   # component 2" in text
    assert "declare -A HEXI_NODE_RANK=([rtx4090-0]=0 [a100-0]=1 [a100-1]=2)" in text
    assert "declare -A HEXI_NPROC=([rtx4090-0]=2 [a100-0]=2 [a100-1]=1)" in text
    assert "export HEXI_NNODES=3" in text
    for default in (
        "\nMASTER_PORT=${MASTER_PORT:-29500}\n",
        "\nHEXI_TIMEOUT_S=${HEXI_TIMEOUT_S:-0} ",
        "\nPYTHON=${PYTHON:-",
    ):
        assert default in text
    assert "timeout -k 10 \"$HEXI_TIMEOUT_S\" \"$PYTHON\" -m torch.distributed.run" in text
    assert "--hetero-plan-path \"$HEXI_PLAN\"" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_partition_from_cluster_spec(tmp_path):
    path = tmp_path / "p.json"
    make_plan(
        path,
        [("a100", 2, 1, {"partition": "gpu-a100"}), ("rtx4090", 1, 1, {"partition": "gpu-4090"})],
    )
    r = hexi_launch("slurm", path)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --partition=gpu-a100" in r.stdout and "#SBATCH --partition=gpu-4090" in r.stdout
    # an option wins over the spec
    r = hexi_launch("slurm", path, "--partition", "rtx4090=other")
    assert "#SBATCH --partition=other" in r.stdout and "gpu-4090" not in r.stdout


def test_groups_of_one_gpu_type_and_count_share_a_component(tmp_path):
    """Two node groups with the same GPU type and GPUs per node: one component of 2 nodes."""
    path = tmp_path / "p.json"
    make_plan(path, [("a100", 2, 1), ("a100_b", 2, 1)])
    r = hexi_launch("slurm", path, "--partition", "a100")
    assert r.returncode == 0, r.stderr
    assert "hetjob" not in r.stdout and "#SBATCH --nodes=2" in r.stdout
    assert "#SBATCH --gres=gpu:a100:2" in r.stdout
    assert "declare -A HEXI_NPROC=([a100-0]=2 [a100_b-0]=2)" in r.stdout


@pytest.mark.parametrize(
    "groups,want",
    [
        # the README's planning example has RTX 4090 machines of 8 and of 4 GPUs
        (
            [("rtx4090", 8, 1), ("rtx4090_small", 4, 1)],
            [("gpu:rtx4090:8", ["rtx4090-0"]), ("gpu:rtx4090:4", ["rtx4090_small-0"])],
        ),
        # one group's nodes, sorted by their count: 1-GPU nodes around a 2-GPU node
        (
            [("a100", 1, 1), ("a100_big", 2, 1), ("a100_c", 1, 1)],
            [("gpu:a100:1", ["a100-0", "a100_c-0"]), ("gpu:a100:2", ["a100_big-0"])],
        ),
    ],
)
def test_same_gpu_type_different_gpus_per_node(tmp_path, groups, want):
    """Nodes of one GPU type and partition with different GPU counts: a component per count, and
    every node's --gres asks for exactly the GPUs its plan ranks use (never another node's
    count, which a smaller machine could not give)."""
    path = tmp_path / "p.json"
    plan = make_plan(path, groups)
    job = tmp_path / "job.sbatch"
    r = hexi_launch("slurm", path, "--partition", "gpu", "-o", job)
    assert r.returncode == 0, r.stderr
    text = job.read_text()
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    ranks_on = {}  # plan node -> its plan ranks, counted from the plan itself
    for entry in plan.ranks:
        ranks_on[entry.node] = ranks_on.get(entry.node, 0) + 1
    comps = components_of(text)
    assert [gres_of(c) for c in comps] == [g for g, _ in want]
    for i, (comp, (gres, nodes)) in enumerate(zip(comps, want)):
        assert f"#SBATCH --nodes={len(nodes)}" in comp
        assert all(ranks_on[n] == int(gres.rsplit(":", 1)[1]) for n in nodes)
        assert f"    {shlex.quote(' '.join(nodes))}   # component {i}" in text
    # the stand-in Slurm gives each component its nodes; each runs its plan node's processes
    env = {"SLURM_HET_SIZE": str(len(want))}
    hosts = []
    for i, (_, nodes) in enumerate(want):
        env[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"] = ",".join(f"h-{n}" for n in nodes)
        hosts += [f"h-{n}" for n in nodes]
    env["STUB_NODES"] = " ".join(f"{i}:{h}" for i, h in enumerate(hosts))
    calls, _ = run_with_stub_slurm(tmp_path, job, env)
    assert {n: int(_flag(c["argv"], "--nproc-per-node")) for n, c in calls.items()} == ranks_on


def test_component_nodes_must_be_separate_machines(tmp_path):
    """Slurm may place two components of one GPU type on one machine; the script refuses to run
    two plan nodes there (the plan's bandwidths assume separate machines)."""
    path = tmp_path / "p.json"
    make_plan(path, [("a100", 2, 1), ("a100_b", 1, 1)])
    job = tmp_path / "job.sbatch"
    assert hexi_launch("slurm", path, "--partition", "a100", "-o", job).returncode == 0
    calls, r = run_with_stub_slurm(
        tmp_path,
        job,
        {
            "SLURM_HET_SIZE": "2",
            "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
            "SLURM_JOB_NODELIST_HET_GROUP_1": "n1",
            "STUB_NODES": "0:n1 1:n1",
        },
        ok=False,
    )
    assert r.returncode == 1 and calls == {}
    assert "hexi: Slurm gave node n1 to components 0 and 1" in r.stderr
    assert "--exclusive" in r.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "no Slurm partition for GPU type(s) RTX-4090, A100-SXM-80GB"),
        (["--partition", "A100-SXM-80GB=a100"], "no Slurm partition for GPU type(s) RTX-4090:"),
        (
            ["--partition", "rtx4090"] + ["--gres-type", "oops"],
            "--gres-type 'oops': expected GPU=VALUE",
        ),
    ],
)
def test_bad_input_exit_2_one_line(het_plan, args, needle):
    path, _ = het_plan
    r = hexi_launch("slurm", path, *args)
    assert r.returncode == 2, r.stdout
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr and r.stderr.startswith("hexi-launch: error: ")


def test_bad_plan_exit_2(tmp_path):
    r = hexi_launch("slurm", tmp_path / "missing.json")
    assert r.returncode == 2 and "cannot read plan" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = hexi_launch("torchrun", bad)
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_check_partitions():
    class Comp:
        def __init__(self, part, gres, gpus, n):
            self.partition, self.gres_type, self.gpus = part, gres, gpus
            self.nodes, self.groups = [None] * n, [part]

    def fake_sinfo(args, **kw):
        part = args[args.index("-p") + 1]
        out = {
            "a100": "a100-1 gpu:a100:2(S:0)\na100-2 gpu:a100:2\n",
            "rtx4090": "rtx4090-1 gpu:rtx4090:2\n",
        }[part]
        return subprocess.CompletedProcess(args, 0, out, "")

    slurm_gen.check_partitions(
        [Comp("a100", "a100", 2, 2), Comp("rtx4090", "rtx4090", 2, 1)], run=fake_sinfo
    )
    with pytest.raises(slurm_gen.LaunchError) as e:
        slurm_gen.check_partitions(
            [Comp("a100", "a100", 2, 3), Comp("rtx4090", "rtx4090", 4, 1)], run=fake_sinfo
        )
    assert e.value.problems == [
        "node group a100 needs 3 node(s) with gpu:a100:2; partition a100 has 2 (a100-1, a100-2)",
        "node group rtx4090 needs 1 node(s) with gpu:rtx4090:4; partition rtx4090 has 0",
    ]


def test_check_partitions_components_need_separate_machines():
    """Two components on one partition and GPU type cannot count the same machine twice."""

    class Comp:
        def __init__(self, gpus, n, group):
            self.partition, self.gres_type, self.gpus = "a100", "a100", gpus
            self.nodes, self.groups = [None] * n, [group]

    def fake_sinfo(args, **kw):
        return subprocess.CompletedProcess(args, 0, "a100-1 gpu:a100:2\na100-2 gpu:a100:2\n", "")

    slurm_gen.check_partitions([Comp(1, 1, "small"), Comp(2, 1, "big")], run=fake_sinfo)
    with pytest.raises(slurm_gen.LaunchError) as e:
        slurm_gen.check_partitions([Comp(1, 2, "small"), Comp(2, 1, "big")], run=fake_sinfo)
    assert e.value.problems == [
        "node group small needs 2 node(s) with gpu:a100:1; partition a100 has 2 (a100-1, "
        "a100-2), 1 of them for the larger component(s) before it"
    ]


def test_generator_does_not_import_torch(het_plan, tmp_path):
    path, _ = het_plan
    code = textwrap.dedent(f"""
        import sys, contextlib, io
        from megatron_hexi.launch.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["slurm", {str(path)!r}, "--partition", "a100", "--partition",
                         "RTX-4090=rtx4090"]) == 0
            assert main(["torchrun", {str(path)!r}]) == 0
        assert "torch" not in sys.modules, "launch imported torch"
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---- the sbatch script's node mapping, run with stand-ins for srun / scontrol / python ----


def _flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("node_ids", ["in_order", "shuffled"])
def test_sbatch_mapping_with_stub_slurm(het_plan, tmp_path, node_ids):
    path, plan = het_plan
    job = tmp_path / "job.sbatch"
    r = hexi_launch("slurm", path, *PARTS, "--entry", "train.py", "-o", job, "--", *NASTY)
    assert r.returncode == 0, r.stderr
    # Slurm sorts nodes by name within a component; component 0 is rtx4090 here.
    nodes = "0:rtx4090-1 1:a100-1 2:a100-2"
    if node_ids == "shuffled":  # step numbering that disagrees with the node lists
        nodes = "0:a100-2 1:rtx4090-1 2:a100-1"
    calls, r = run_with_stub_slurm(
        tmp_path,
        job,
        {
            "SLURM_HET_SIZE": "3",
            "SLURM_JOB_NODELIST_HET_GROUP_0": "rtx4090-1",
            "SLURM_JOB_NODELIST_HET_GROUP_1": "a100-1",
            "SLURM_JOB_NODELIST_HET_GROUP_2": "a100-2",
            "STUB_NODES": nodes,
        },
    )
    log = r.stdout
    assert set(calls) == {"rtx4090-0", "a100-0", "a100-1"}, log
    want = {"rtx4090-0": ("0", "2"), "a100-0": ("1", "2"), "a100-1": ("2", "1")}
    for node, (node_rank, nproc) in want.items():
        argv = calls[node]["argv"]
        assert argv[:2] == ["-m", "torch.distributed.run"]
        assert _flag(argv, "--node-rank") == node_rank and _flag(argv, "--nproc-per-node") == nproc
        assert _flag(argv, "--nnodes") == "3"
        assert (
            _flag(argv, "--master-addr") == "rtx4090-1" and _flag(argv, "--master-port") == "29500"
        )
        tail = argv[argv.index("train.py") :]
        assert tail == ["train.py", "--hetero-plan-path", str(path.resolve()), *NASTY]


def test_sbatch_plain_mapping_and_env_overrides(plain_plan, tmp_path):
    path, _ = plain_plan
    job = tmp_path / "job.sbatch"
    assert hexi_launch("slurm", path, "-o", job, "--entry-module", "my.mod").returncode == 0
    calls, _ = run_with_stub_slurm(
        tmp_path,
        job,
        {
            "SLURM_JOB_NODELIST": "n7,n8",
            "STUB_NODES": "0:n7 1:n8",
            "MASTER_PORT": "31000",
            "HEXI_TIMEOUT_S": "50",
        },
    )
    assert _flag(calls["a100-1"]["argv"], "--master-port") == "31000"
    assert _flag(calls["a100-1"]["argv"], "--node-rank") == "1"
    assert calls["a100-0"]["argv"][-4:-2] == ["-m", "my.mod"]


def test_sbatch_wrong_node_count_fails(plain_plan, tmp_path):
    path, _ = plain_plan
    job = tmp_path / "job.sbatch"
    assert hexi_launch("slurm", path, "-o", job).returncode == 0
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(STUB_SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "SLURM_JOB_NODELIST": "n7",
        "SLURM_JOB_ID": "1",
        "PATH": f"{bindir}:{os.environ['PATH']}",
    }
    r = subprocess.run(["bash", str(job)], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 1
    assert "component 0 got 1 node(s) (n7), the plan needs 2" in r.stderr


# ---- what every node runs, and what -o says ----


def test_default_entry_is_the_installed_hexi_train(plain_plan, tmp_path):
    """Without --entry, every node runs setup.py's console script hexi-train by absolute path,
    from beside the nodes' python (this interpreter by default): nothing depends on the folder
    a job starts in."""
    path, _ = plain_plan
    train = str(Path(sys.executable).parent / "hexi-train")
    assert os.access(train, os.X_OK), "hexi-train is not installed beside this python"
    job = tmp_path / "job.sbatch"
    assert hexi_launch("slurm", path, "-o", job, cwd=tmp_path).returncode == 0
    calls, _ = run_with_stub_slurm(
        tmp_path, job, {"SLURM_JOB_NODELIST": "n0,n1", "STUB_NODES": "0:n0 1:n1"}
    )
    for c in calls.values():
        argv = c["argv"]
        assert argv[argv.index("--master-port") + 2 :][:2] == [train, "--hetero-plan-path"]
    r = hexi_launch("torchrun", path, cwd=tmp_path)
    cmds = [ln for ln in r.stdout.splitlines() if not ln.startswith("#")]
    assert len(cmds) == 2 and all(f" {train} --hetero-plan-path " in c for c in cmds), r.stdout
    # an interpreter on the nodes only: its hexi-train, by the same folder
    r = hexi_launch("torchrun", path, "--python", "/opt/env/bin/python")
    assert r.stdout.count(" /opt/env/bin/hexi-train --hetero-plan-path ") == 2, r.stdout
    # a bare name (also a container's default `python`): hexi-train from the node's PATH
    r = hexi_launch("torchrun", path, "--python", "python3")
    assert r.stdout.count(" --no-python hexi-train --hetero-plan-path ") == 2, r.stdout
    r = hexi_launch("slurm", path, "--container-image", "img")
    assert "\nHEXI_ENTRY_WORDS=(--no-python hexi-train)\n" in r.stdout
    # a script given by a relative path that exists here: made absolute
    (tmp_path / "train.py").write_text("")
    r = hexi_launch("torchrun", path, "--entry", "train.py", cwd=tmp_path)
    assert r.stdout.count(f" {tmp_path / 'train.py'} --hetero-plan-path ") == 2, r.stdout


def test_default_entry_missing_is_one_line(plain_plan, tmp_path):
    """A python here without hexi-train beside it: one line saying what to do, nothing written."""
    path, _ = plain_plan
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    job = tmp_path / "job.sbatch"
    r = hexi_launch("slurm", path, "--python", python, "-o", job)
    assert r.returncode == 2 and r.stdout == "" and not job.exists()
    assert r.stderr == (
        f"hexi-launch: error: no hexi-train beside {python}: install megatron-hexi for that "
        "python (pip install -e .), or name the training script with --entry\n"
    )
    assert hexi_launch("slurm", path, "--python", python, "--entry", "t.py").returncode == 0


def test_output_says_what_it_wrote(het_plan, tmp_path):
    """`-o` prints what it wrote and what to do with it (stdout; no script goes there then)."""
    path, _ = het_plan
    job = tmp_path / "job.sbatch"
    r = hexi_launch("slurm", path, *PARTS, "-o", job)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines() == [
        f"wrote {job}: heterogeneous job, 3 components",
        "  component 0: partition rtx4090, 1 node(s) with gpu:rtx4090:2 each: plan node(s) "
        "rtx4090-0",
        "  component 1: partition a100, 1 node(s) with gpu:a100:2 each: plan node(s) a100-0",
        "  component 2: partition a100, 1 node(s) with gpu:a100:1 each: plan node(s) a100-1",
        f"submit with: sbatch {job}",
    ]
    d = tmp_path / "nodes"
    r = hexi_launch("torchrun", path, "-o", d)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines() == [
        f"wrote 3 node script(s) to {d}; run each on its machine, in any order:",
        f"  bash {d}/rtx4090-0.sh  # plan node rtx4090-0: torchrun node rank 0, 2 process(es), "
        "plan ranks 0..1",
        f"  bash {d}/a100-0.sh     # plan node a100-0: torchrun node rank 1, 2 process(es), "
        "plan ranks 2..3",
        f"  bash {d}/a100-1.sh     # plan node a100-1: torchrun node rank 2, 1 process(es), "
        "plan ranks 4..4",
        "set MASTER_ADDR to the address of plan node rtx4090-0 on every machine first (the "
        "plan's cluster names no host for it; or give --master-addr)",
    ]
    assert sorted(p.name for p in d.iterdir()) == ["a100-0.sh", "a100-1.sh", "rtx4090-0.sh"]
    r = hexi_launch("torchrun", path, "-o", d, "--master-addr", "10.0.0.1")
    assert "MASTER_ADDR" not in r.stdout and r.stdout.startswith("wrote 3 node script(s)")


# ---- hexi-launch torchrun ----


def test_torchrun_commands(het_plan):
    path, _ = het_plan
    r = hexi_launch("torchrun", path, "--master-port", "29999", "--", "--lr", "1e-4", "a b")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    cmds = [ln for ln in lines if not ln.startswith("#")]
    assert len(cmds) == 3
    assert cmds[0].startswith("HEXI_PLAN_NODE=rtx4090-0 ")
    assert "--nnodes 3 --node-rank 0 --nproc-per-node 2" in cmds[0]
    assert cmds[2].startswith("HEXI_PLAN_NODE=a100-1 ")
    assert "--node-rank 2 --nproc-per-node 1" in cmds[2]
    assert all('--master-addr "$MASTER_ADDR" --master-port 29999' in c for c in cmds)
    assert all(c.endswith(f"--hetero-plan-path {path.resolve()} --lr 1e-4 'a b'") for c in cmds)


def test_torchrun_master_addr_from_hostnames(tmp_path):
    path = tmp_path / "p.json"
    make_plan(path, [("a100", 1, 2, {"hostnames": ["gpu-a", "gpu-b"]})])
    r = hexi_launch("torchrun", path)
    assert "--master-addr gpu-a " in r.stdout and "# on plan node a100-1 (host gpu-b)" in r.stdout


def test_torchrun_scripts_run_locally(het_plan, tmp_path):
    """The per-node scripts, all started on this machine: every plan rank once, on its node."""
    path, plan = het_plan
    d = tmp_path / "nodes"
    r = hexi_launch(
        "torchrun",
        path,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--timeout-s",
        "90",
        "--entry",
        FAKE_TRAIN,
        "-o",
        d,
        "--",
        "--out",
        tmp_path / "res.json",
        "--x",
        "a b",
    )
    assert r.returncode == 0, r.stderr
    scripts = sorted(d.glob("*.sh"))
    assert [s.name for s in scripts] == ["a100-0.sh", "a100-1.sh", "rtx4090-0.sh"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            ["bash", str(s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for s in scripts
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    from launch.hexi_launch_helpers import check_fake_result

    res = check_fake_result(tmp_path / "res.json", plan)
    assert all(
        x["how"] == "HEXI_PLAN_NODE" and x["extra_args"] == ["--x", "a b"] for x in res["ranks"]
    )


def test_example_template_runs_with_stub_slurm(tmp_path):
    """examples/slurm/hetero-template.sbatch: valid bash, same node mapping as the generator."""
    template = REPO / "examples" / "slurm" / "hetero-template.sbatch"
    assert subprocess.run(["bash", "-n", str(template)]).returncode == 0
    calls, _ = run_with_stub_slurm(
        tmp_path,
        template,
        {
            "SLURM_HET_SIZE": "2",
            "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu-a1,gpu-a2",
            "SLURM_JOB_NODELIST_HET_GROUP_1": "g4090",
            "STUB_NODES": "0:gpu-a1 1:gpu-a2 2:g4090",
            "HEXI_PLAN": "/p/plan.json",
        },
    )
    assert {
        n: (_flag(c["argv"], "--node-rank"), _flag(c["argv"], "--nproc-per-node"))
        for n, c in calls.items()
    } == {"a100-0": ("0", "2"), "a100-1": ("1", "2"), "rtx4090-0": ("2", "2")}
    assert all(_flag(c["argv"], "--master-addr") == "gpu-a1" for c in calls.values())
    argv = calls["a100-0"]["argv"]
    # the default entry: the hexi-train installed beside $PYTHON (the stub torchrun's python)
    entry = argv.index("--no-python")
    assert argv[entry + 1].endswith("/hexi-train") and os.path.isabs(argv[entry + 1]), argv
    assert argv[entry + 2 :] == [
        "--hetero-plan-path",
        "/p/plan.json",
        "--train-iters",
        "100",
        "--lr",
        "1e-4",
        "--mock-data",
    ]


# ---- numeric flags: bounded, refused in one line naming the flag, nothing written ----


@pytest.mark.parametrize(
    "cmd,flag,value",
    [
        ("slurm", "--timeout-s", "-4"),
        ("torchrun", "--timeout-s", "-1"),
        ("slurm", "--master-port", "999999"),
        ("torchrun", "--master-port", "65536"),
        ("torchrun", "--master-port", "0"),
        ("slurm", "--master-port", "-1"),
        ("slurm", "--cpus-per-gpu", "-3"),
        ("slurm", "--cpus-per-gpu", "100000"),
        ("torchrun", "--timeout-s", "1e3"),
        ("slurm", "--master-port", "http"),
        ("slurm", "--timeout-s", "9" * 40),
    ],
)
@pytest.mark.parametrize("joined", [True, False])
def test_bad_numeric_flag_one_line(plain_plan, tmp_path, cmd, flag, value, joined):
    """`--flag=-4` and `--flag -4` alike: exit 2, one line naming the flag, no usage text."""
    path, _ = plain_plan
    out = tmp_path / "out"
    args = [f"{flag}={value}"] if joined else [flag, value]
    r = hexi_launch(cmd, path, *args, "-o", out)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hexi-launch: error: "), r.stderr
    assert flag in lines[0] and "usage:" not in r.stderr, r.stderr
    assert r.stdout == "" and not out.exists()


@pytest.mark.parametrize("args", [["--bogus"], ["slurm"], ["nosuch", "x"], []])
def test_bad_flag_one_line(plain_plan, args):
    """Unknown flags, missing arguments and subcommands: one line too, not argparse's usage."""
    path, _ = plain_plan
    r = hexi_launch(*[a if a != "x" else path for a in args])
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hexi-launch"), r.stderr
    assert "error: " in lines[0] and "usage:" not in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("args", [["--help"], ["slurm", "--help"], ["torchrun", "-h"]])
def test_help_still_works(args):
    r = hexi_launch(*args)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("usage: hexi-launch")


def test_numeric_flags_at_their_bounds(plain_plan):
    """The edges are accepted: port 1 and 65535, no time limit (0), no --cpus-per-task (0)."""
    path, _ = plain_plan
    r = hexi_launch(
        "slurm", path, "--master-port", "65535", "--timeout-s", "0", "--cpus-per-gpu", "0"
    )
    assert r.returncode == 0, r.stderr
    assert "\nMASTER_PORT=${MASTER_PORT:-65535}\n" in r.stdout
    assert "\nHEXI_TIMEOUT_S=${HEXI_TIMEOUT_S:-0} " in r.stdout
    assert "--cpus-per-task" not in r.stdout
    r = hexi_launch("torchrun", path, "--master-port", "1", "--timeout-s", "1")
    assert r.returncode == 0, r.stderr
    assert "timeout -k 10 1 " in r.stdout and "--master-port 1 " in r.stdout
