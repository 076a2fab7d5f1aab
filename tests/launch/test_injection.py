"""Hostile names, paths and values in hexi-launch's generated scripts: nothing they carry runs.

Each hostile string would run `touch PWNED` if it reached the shell unquoted. The generated
printout, per-node scripts and sbatch script are run with stand-in `srun`, `scontrol`, `python`
and `torchrun` that record their arguments, so the tests check both that no marker file appears
and that every value arrives intact, as one argument. Plans with names a cluster file may not
carry are built valid, then renamed in memory: the launcher must be safe on its own. Node names
outside the planner's rule are refused (one line, nothing written); host names, paths, options
and training arguments are carried, quoted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from launch.hexi_launch_helpers import hexi_launch, make_plan
from megatron_hexi.launch import cli

MARK = "PWNED"
# node names the planner's rule allows (letters, digits, '.', '_', '-') that a shell, an option
# parser or a file system could still misread
NAMES = ["-rf", "--help", ".", "..", "a.b_c-d", "0"]
# node names outside the rule: refused by every command
BAD_NAMES = [
    f"r$(touch {MARK})",
    f"r;touch {MARK}",
    f"r`touch {MARK}`",
    f"r'\"$(touch {MARK})\"'",
    f"r}}$(touch {MARK})",
    f"r\\$(touch {MARK})",
    f"r]=0)$(touch {MARK})",
    f"r$(touch${{IFS}}{MARK})",
    f"r\ntouch {MARK}",
    "a\tb",
    "a b",
    "../../x",
    "../x",
    "a/b",
    "ABSOLUTE",
    "n\x00ul",
    "",
    "ümlaut",
]
NEWLINE_HOST = f"h\ntouch {MARK}"
HOST = f"h;touch {MARK}"
PY = f"py $(touch {MARK});`touch {MARK}`"  # --python: a stand-in of this name is on PATH
ENTRY = f"train $(touch {MARK}).py"
IMAGE = f"img;touch {MARK}"
ARGS = [
    "--x",
    f"$(touch {MARK})",
    f"a;touch {MARK}",
    f"`touch {MARK}`",
    "it's",
    "new\nline",
    "",
    "${HOME}",
    "*",
]
SB_VALUE = f"v$(touch${{IFS}}{MARK});`touch${{IFS}}{MARK}`"  # for #SBATCH lines: no whitespace

RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["STUB_OUT"], "a") as f:
    f.write(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                        "plan_node": os.environ.get("HEXI_PLAN_NODE"),
                        "master": os.environ.get("MASTER_ADDR")}}) + "\\n")
"""
SRUN = f"""#!{sys.executable}
# stand-in srun: record argv, then run the command after the options once per "id:host"
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["STUB_OUT"], "a") as f:
    f.write(json.dumps({{"prog": "srun", "argv": args}}) + "\\n")
while args and args[0].startswith("-"):
    args.pop(0)
for pair in os.environ["STUB_NODES"].split():
    nid, host = pair.split(":")
    env = {{**os.environ, "SLURM_NODEID": nid, "SLURMD_NODENAME": host}}
    rc = subprocess.run(args, env=env).returncode
    if rc:
        sys.exit(rc)
"""
SCONTROL = """#!/bin/bash
tr ',' '\\n' <<<"$3"
"""


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory (where `touch PWNED` would land) and stand-ins on PATH."""
    wd = tmp_path / "work"
    wd.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in [
        ("python", RECORDER),
        ("torchrun", RECORDER),
        (PY, RECORDER),
        ("srun", SRUN),
        ("scontrol", SCONTROL),
    ]:
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    monkeypatch.chdir(wd)
    return wd, bindir


def run_script(tmp_path, work, script, env_extra=None, ok=True):
    """bash SCRIPT with the stand-ins first on PATH; returns the recorded calls."""
    wd, bindir = work
    out = tmp_path / "calls.jsonl"
    if out.exists():
        out.unlink()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM", "MASTER_", "HEXI_")) and k != "PYTHON"
    }
    env.update(
        PATH=f"{bindir}:{env['PATH']}", STUB_OUT=str(out), SLURM_JOB_ID="7", **(env_extra or {})
    )
    r = subprocess.run(
        ["bash", str(script)], env=env, cwd=wd, capture_output=True, text=True, timeout=60
    )
    assert_untouched(tmp_path)
    if ok:
        assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return calls, r


def assert_untouched(tmp_path):
    found = [p for p in tmp_path.rglob("*") if p.name == MARK]
    assert not found, f"a hostile string ran: {found}"


def hostile_plan(tmp_path, names, hosts=None, partitions=None, gpus=None):
    """A valid plan, one GPU per node, saved under a hostile path; then its nodes, hosts and
    partitions renamed in memory (a cluster file may refuse these names)."""
    d = tmp_path / f"d $(touch {MARK})"
    d.mkdir()
    path = d / f"p$(touch {MARK});`touch {MARK}`.json"
    gpus = gpus or ["a100"] * len(names)
    plan = make_plan(path, [(f"{g}_{i}", 1, 1) for i, g in enumerate(gpus)])
    renamed = {}
    groups = []
    for i, g in enumerate(plan.cluster.groups):
        renamed[f"{g.name}-0"] = names[i]
        groups.append(
            dataclasses.replace(
                g,
                name=names[i],
                count=None,
                hostnames=(hosts[i],) if hosts else (),
                partition=partitions[i] if partitions else None,
            )
        )
    plan.cluster.groups = groups
    plan.ranks = [dataclasses.replace(r, node=renamed[r.node]) for r in plan.ranks]
    return path, plan


def launch(monkeypatch, capsys, plan_path, plan, *args):
    """hexi-launch in this process, reading `plan` for `plan_path`: (exit code, stdout, stderr)."""
    import planner.plan

    def load(p):
        assert p == str(plan_path)
        return plan

    monkeypatch.setattr(planner.plan, "load_plan", load)
    rc = cli.main([*map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(rc, err, *needles):
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hexi-launch: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], err


# the default entry for a --python without a folder (PY): `hexi-train` from the node's PATH
DEFAULT_ENTRY = ("--no-python", "hexi-train")


def torch_argv(nnodes, node_rank, addr, plan_path, entry=(ENTRY,), args=ARGS):
    return [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        "1",
        "--master-addr",
        addr,
        "--master-port",
        "29500",
        *entry,
        "--hetero-plan-path",
        str(plan_path),
        *args,
    ]


# ---- hexi-launch torchrun: the printout ----


def test_torchrun_printout(tmp_path, work, monkeypatch, capsys):
    names = NAMES
    hosts = [HOST] + [f"h{i}$(touch {MARK})" for i in range(1, len(names) - 1)] + [NEWLINE_HOST]
    path, plan = hostile_plan(tmp_path, names, hosts)
    rc, out, err = launch(
        monkeypatch,
        capsys,
        path,
        plan,
        "torchrun",
        path,
        "--python",
        PY,
        "--entry",
        ENTRY,
        "--",
        *ARGS,
    )
    assert rc == 0, err
    script = tmp_path / "printout.sh"
    script.write_text(out)
    calls, _ = run_script(tmp_path, work, script)
    assert [c["plan_node"] for c in calls] == names
    for i, c in enumerate(calls):
        assert c["prog"] == PY
        assert c["argv"] == torch_argv(len(names), i, HOST, path)
    # a line break in a host name does not end the comment line that names the node
    assert sum(ln.startswith("# on plan node ") for ln in out.splitlines()) == len(names)
    assert "# on plan node 0 (host h\\ntouch PWNED): 1 process(es)\n" in out


# ---- hexi-launch torchrun -o DIR ----


@pytest.mark.parametrize("with_host", [True, False])
def test_torchrun_node_scripts(tmp_path, work, monkeypatch, capsys, with_host):
    hosts = [HOST] + [f"h{i}" for i in range(1, len(NAMES))] if with_host else None
    path, plan = hostile_plan(tmp_path, NAMES, hosts)
    d = tmp_path / f"out $(touch {MARK})"
    rc, out, err = launch(
        monkeypatch,
        capsys,
        path,
        plan,
        "torchrun",
        path,
        "--python",
        PY,
        "--entry",
        ENTRY,
        "-o",
        d,
        "--",
        *ARGS,
    )
    assert rc == 0, err
    scripts = [d / f"{n}.sh" for n in NAMES]
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in scripts)
    for i, (name, script) in enumerate(zip(NAMES, scripts)):
        if not with_host:  # no address known: the script stops with a clear message
            calls, r = run_script(tmp_path, work, script, ok=False)
            assert r.returncode != 0 and calls == []
            assert "MASTER_ADDR" in r.stderr and NAMES[0] in r.stderr, r.stderr
            env = {"MASTER_ADDR": HOST}
        else:
            env = {}
        calls, _ = run_script(tmp_path, work, script, env, ok=True)
        assert len(calls) == 1
        assert calls[0]["prog"] == PY and calls[0]["plan_node"] == name
        assert calls[0]["argv"] == torch_argv(len(NAMES), i, HOST, path)


def test_torchrun_output_stays_in_its_folder(tmp_path, work, monkeypatch, capsys):
    """Names the rule allows make files directly inside -o DIR, '.' and '..' too."""
    path, plan = hostile_plan(tmp_path, NAMES)
    d = tmp_path / "a" / "b" / "nodes"
    rc, out, err = launch(monkeypatch, capsys, path, plan, "torchrun", path, "-o", d)
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.rglob("*.sh")) == sorted(f"{n}.sh" for n in NAMES)
    assert sorted(p.name for p in d.iterdir()) == sorted(f"{n}.sh" for n in NAMES)


# ---- node names outside the planner's rule: every command refuses them ----


@pytest.mark.parametrize("cmd", ["printout", "scripts", "sbatch"])
@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_node_names_refused(tmp_path, work, monkeypatch, capsys, cmd, bad):
    """One line naming the node, nothing on stdout, nothing written (not even the -o folder)."""
    if bad == "ABSOLUTE":  # a node name that is an absolute path
        bad = str(tmp_path / "abs")
    path, plan = hostile_plan(tmp_path, ["ok", bad], gpus=["a100", "rtx4090"])
    args = {
        "printout": ["torchrun", path],
        "scripts": ["torchrun", path, "-o", tmp_path / "a" / "nodes"],
        "sbatch": ["slurm", path, "--partition", "p", "-o", tmp_path / "job.sbatch"],
    }[cmd]
    before = sorted(tmp_path.rglob("*"))
    rc, out, err = launch(monkeypatch, capsys, path, plan, *args)
    one_line_error(rc, err, "plan node", repr(bad))
    assert out == ""
    assert sorted(tmp_path.rglob("*")) == before
    assert_untouched(tmp_path)


# ---- hexi-launch slurm ----


def test_sbatch_script(tmp_path, work, monkeypatch, capsys):
    """A heterogeneous job (two GPU types) with hostile node names, partitions and options."""
    gpus = ["rtx4090", "rtx4090", "a100", "a100", "a100", "a100"]
    parts = [SB_VALUE + "-4090"] * 2 + [SB_VALUE + "-a100"] * 4
    path, plan = hostile_plan(tmp_path, NAMES, partitions=parts, gpus=gpus)
    job = tmp_path / "job.sbatch"
    rc, out, err = launch(
        monkeypatch,
        capsys,
        path,
        plan,
        "slurm",
        path,
        "--python",
        PY,
        "--entry",
        ENTRY,
        "--account",
        SB_VALUE,
        "--time",
        SB_VALUE,
        "--job-name",
        SB_VALUE,
        "--container-image",
        IMAGE,
        "--gres-type",
        f"A100-SXM-80GB={SB_VALUE}",
        "-o",
        job,
        "--",
        *ARGS,
    )
    assert rc == 0, err
    text = job.read_text()
    directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    for line in (
        f"--partition={SB_VALUE}-4090",
        f"--partition={SB_VALUE}-a100",
        f"--account={SB_VALUE}",
        f"--time={SB_VALUE}",
        f"--job-name={SB_VALUE}",
        f"--gres=gpu:{SB_VALUE}:1",
    ):
        assert f"#SBATCH {line}" in directives
    hosts = ["n0", "n1", "n2", "n3", "n4", "n5"]
    calls, r = run_script(
        tmp_path,
        work,
        job,
        {
            "SLURM_HET_SIZE": "2",
            "SLURM_JOB_NODELIST_HET_GROUP_0": "n0,n1",
            "SLURM_JOB_NODELIST_HET_GROUP_1": "n2,n3,n4,n5",
            "STUB_NODES": " ".join(f"{i}:{h}" for i, h in enumerate(hosts)),
        },
    )
    srun = [c for c in calls if c["prog"] == "srun"]
    assert len(srun) == 1 and f"--container-image={IMAGE}" in srun[0]["argv"], srun
    runs = [c for c in calls if c["prog"] != "srun"]
    assert [c["plan_node"] for c in runs] == NAMES, r.stdout
    for i, c in enumerate(runs):
        assert c["prog"] == PY
        assert c["argv"] == torch_argv(len(NAMES), i, "n0", path)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--partition", "a100\n#SBATCH --wrap=x"),
        ("--partition", "A100-SXM-80GB=a b"),
        ("--partition", "A100-SXM-80GB=a100\n#SBATCH --wrap=x"),
        ("--account", "myhetjob"),
        ("--account", "acct\ntouch PWNED"),
        ("--time", "1:00\r"),
        ("--job-name", "my job"),
        ("--job-name", "j'q"),
        ("--log", "out\n%j"),
        ("--log", "a#b"),
        ("--gres-type", "a100=x\\y"),
        ("--gres-type", "RTX-4090=a b"),  # a GPU type the plan does not use: still checked
        ("--partition", "a b=x"),  # a key no GPU type or node group name can match
    ],
)
def test_sbatch_refuses_unsafe_directive_values(tmp_path, flag, value):
    """#SBATCH lines are not shell: a value that could end the line or be split is refused."""
    plan_path = tmp_path / "plan.json"
    make_plan(plan_path, [("a100", 1, 2)])
    job = tmp_path / "job.sbatch"
    r = hexi_launch("slurm", plan_path, flag, value, "-o", job, cwd=tmp_path)
    one_line_error(r.returncode, r.stderr, flag)
    assert r.stdout == "" and not job.exists()
    assert_untouched(tmp_path)


@pytest.mark.parametrize("partition", [["x", "y"], {"a": 1}, 3, "a\nb", "a b"])
def test_sbatch_partition_must_be_one_name(tmp_path, work, monkeypatch, capsys, partition):
    """A node group's partition that is not one name: one clear line naming the field."""
    path, plan = hostile_plan(tmp_path, ["ok"], partitions=[partition])
    job = tmp_path / "job.sbatch"
    rc, out, err = launch(monkeypatch, capsys, path, plan, "slurm", path, "-o", job)
    one_line_error(rc, err, "partition", "node group ok")
    assert out == "" and not job.exists()


@pytest.mark.parametrize("partition", [["x", "y"], {"a": 1}, 3, "a\nb", "a b"])
def test_cluster_partition_must_be_one_name(tmp_path, partition):
    """`partition:` of a node group in the cluster file, through the command line."""
    plan_path = tmp_path / "plan.json"
    make_plan(plan_path, [("a100", 1, 2)])
    data = json.loads(plan_path.read_text())
    data["cluster"]["nodes"][0]["partition"] = partition
    plan_path.write_text(json.dumps(data))
    job = tmp_path / "job.sbatch"
    r = hexi_launch("slurm", plan_path, "-o", job, cwd=tmp_path)
    one_line_error(r.returncode, r.stderr, "partition")
    assert r.stdout == "" and not job.exists()


def test_hostile_plan_path_end_to_end(tmp_path, work):
    """A plan file under a hostile path, through the real command line: every output runs."""
    wd, _ = work
    d = tmp_path / f"d $(touch {MARK})"
    d.mkdir()
    path = d / f"p$(touch {MARK});`touch {MARK}`\n.json"
    make_plan(path, [("a100", 1, 2)])
    r = hexi_launch("torchrun", path, "--python", PY, "--", *ARGS, cwd=wd)
    assert r.returncode == 0, r.stderr
    printout = tmp_path / "printout.sh"
    printout.write_text(r.stdout)
    calls, _ = run_script(tmp_path, work, printout, {"MASTER_ADDR": "m"})
    assert [c["argv"] for c in calls] == [
        torch_argv(2, i, "m", path, DEFAULT_ENTRY) for i in range(2)
    ]
    nodes = tmp_path / "nodes"
    r = hexi_launch("torchrun", path, "--python", PY, "-o", nodes, "--", *ARGS, cwd=wd)
    assert r.returncode == 0, r.stderr
    for i in range(2):
        calls, _ = run_script(tmp_path, work, nodes / f"a100-{i}.sh", {"MASTER_ADDR": "m"})
        assert [c["argv"] for c in calls] == [torch_argv(2, i, "m", path, DEFAULT_ENTRY)]
    job = tmp_path / "job.sbatch"
    r = hexi_launch("slurm", path, "--python", PY, "-o", job, "--", *ARGS, cwd=wd)
    assert r.returncode == 0, r.stderr
    calls, _ = run_script(
        tmp_path, work, job, {"SLURM_JOB_NODELIST": "n0,n1", "STUB_NODES": "0:n0 1:n1"}
    )
    assert [c["argv"] for c in calls if c["prog"] == PY] == [
        torch_argv(2, i, "n0", path, DEFAULT_ENTRY) for i in range(2)
    ]
