"""`hexi-launch torchrun --elastic` and `hexi-plan min-nodes`: the commands an elastic job runs,
the MIN they use, and one clear error for each way the inputs cannot work. (The commands are run
for real, agents killed and added, in tests/runtime/test_elastic.py.)"""

from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

CLUSTER = REPO / "examples" / "clusters" / "paper-hetero-a.yaml"
RESUME = ["--save", "ck", "--load", "ck", "--hetero-load-if-exists"]
TRAINING = ["--mock-data", "--train-iters", "10", "--lr", "1e-4", "--global-batch-size", "64"]


def hexi_launch(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_hexi.launch.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_torchrun_elastic_commands(hexi_plan):
    code, out, err = hexi_plan(
        "min-nodes", "--cluster", CLUSTER, "--model", "llama2-7b", "--global-batch-size", "64"
    )
    assert code == 0, err
    assert out.startswith("2 of 4 nodes: the model fits on the 2 node(s) with the least GPU "), out

    r = hexi_launch(
        "torchrun", "--elastic", CLUSTER, "--model", "llama2-7b", "--master-addr", "10.0.0.1",
        "--max-restarts", "5", "--", *TRAINING, *RESUME,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "elastic job, MIN 2: the model fits on the 2 node(s)" in r.stderr
    lines = r.stdout.splitlines()
    commands = [shlex.split(line) for line in lines if not line.startswith("#")]
    nodes = ["a100", "rtx4090x8", "rtx4090x4", "rtx3090"]
    assert [c[0] for c in commands] == [f"HEXI_PLAN_NODE={n}" for n in nodes]
    for words, gpus in zip(commands, (8, 8, 4, 8)):
        assert words[1] == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        run = words[words.index("torch.distributed.run") + 1 :]
        flags = dict(zip(run[:14:2], run[1:14:2]))
        assert flags == {
            "--nnodes": "2:4",
            "--nproc-per-node": str(gpus),
            "--rdzv-backend": "c10d",
            "--rdzv-endpoint": "10.0.0.1:29500",
            "--rdzv-id": "hexi",
            "--max-restarts": "5",
            run[12]: run[13],  # the entry (hexi-train) and its first flag follow
        }
        tail = run[run.index("--hetero-cluster") :]
        assert tail == [
            "--hetero-cluster", str(CLUSTER), "--hetero-model", "llama2-7b", *TRAINING,
            *RESUME, "--exit-signal-handler",
        ]  # fmt: skip


def test_elastic_scripts_and_given_min(tmp_path):
    r = hexi_launch(
        "torchrun", "--elastic", CLUSTER, "--model", "llama2-7b", "--min-nodes", "3",
        "-o", tmp_path / "nodes", "--", *TRAINING, *RESUME, "--exit-signal-handler",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "MIN 3: given (--min-nodes)" in r.stderr
    script = (tmp_path / "nodes" / "rtx4090x4.sh").read_text()
    assert "--nnodes 3:4 --nproc-per-node 4" in script
    assert script.count("--exit-signal-handler") == 1  # given once, not added again
    # run for real with a stand-in python that prints what it was given
    fake = tmp_path / "python"
    fake.write_text(
        '#!/bin/bash\necho "node=$HEXI_PLAN_NODE store=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE $*"\n'
    )
    fake.chmod(0o755)
    text = script.replace(sys.executable, str(fake))
    (tmp_path / "run.sh").write_text(text)
    r = subprocess.run(["bash", tmp_path / "run.sh", "--seed", "7"], capture_output=True, text=True)
    assert r.returncode == 2 and "set MASTER_ADDR" in r.stderr  # no --master-addr, none set
    r = subprocess.run(
        ["bash", tmp_path / "run.sh", "--seed", "7"],
        capture_output=True,
        text=True,
        env={"MASTER_ADDR": "10.1.1.1", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("node=rtx4090x4 store=1 -m torch.distributed.run --nnodes 3:4 ")
    assert "--rdzv-endpoint 10.1.1.1:29500 " in r.stdout
    assert r.stdout.rstrip().endswith("--exit-signal-handler --seed 7")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--elastic", CLUSTER, "--", *TRAINING, *RESUME], "--elastic needs --model"),
        (
            ["--elastic", CLUSTER, "--model", "llama2-7b", "--", *TRAINING],
            "an elastic job resumes from its own checkpoints after every restart: give --save "
            "DIR --load DIR (the same DIR) --hetero-load-if-exists",
        ),
        (
            [
                "--elastic",
                CLUSTER,
                "--model",
                "llama2-7b",
                "--min-nodes",
                "5",
                "--",
                *TRAINING,
                *RESUME,
            ],
            "--min-nodes 5: must be 1..4 (the cluster's nodes)",
        ),  # fmt: skip
        (
            [
                "--elastic",
                CLUSTER,
                "--model",
                "llama2-7b",
                "--",
                "--mock-data",
                "--train-iters",
                "10",
                "--lr",
                "1e-4",
                *RESUME,
            ],
            "--hetero-cluster needs --global-batch-size",
        ),  # fmt: skip
        (
            ["--elastic", CLUSTER, "--model", "llama2-70b", "--", *TRAINING, *RESUME],
            "no plan fits: llama2-70b",
        ),
        (["--model", "llama2-7b", "plan.json"], "--model goes with --elastic"),
    ],
)
def test_elastic_errors_are_one_line(args, message):
    r = hexi_launch("torchrun", *args)
    assert r.returncode == 2, r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("hexi-launch: error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_elastic_launch_does_not_import_torch():
    """The whole elastic path (arguments, the smallest fitting nodes, the commands) without
    torch: the tiny model, whose searches take a fraction of a second, takes the same path."""
    code = textwrap.dedent(f"""
        import sys, contextlib, io
        from megatron_hexi.launch.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main(["torchrun", "--elastic", {str(CLUSTER)!r}, "--model", "tiny",
                         "--", *{TRAINING + RESUME!r}]) == 0
        assert "torch" not in sys.modules, "launch imported torch"
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
