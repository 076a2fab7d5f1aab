"""The README's commands, pasted in order into a fresh shell, work.

Every ```bash block of README.md has a marker comment on the line before it, which says what this
test does with it:

    <!-- readme-test: run -->                  pasted, in README order, into one `bash -e` shell
    <!-- readme-test: syntax only: REASON -->  parsed with `bash -n` only, for the reason given

Run: the quick start (tools/quickstart.sh: set up .venv, plan, train 10 tiny iterations; then
`source .venv/bin/activate`), the hand-written plan (manual, validate, show), training (torchrun,
3 iterations of the tiny model on 4 CPU processes), planning (plan, simulate, show --png) and
launching (hexi-launch slurm and torchrun with -o).
Syntax only: `bash tools/test.sh` (it is the suite that runs this test), `pip install -e .` (it
installs into an environment of the reader's own), real data (needs the reader's corpus and
tokenizer) and `sbatch job.sbatch` (needs the plan's 8-GPU machines). The job script the README
generates is checked instead: `bash -n`, every component's `--gres` against the GPUs its plan
nodes use, and a run with stand-ins for srun and scontrol that must start each plan node's
processes; tests/slurm submits scripts of the same generator to a real Slurm on localhost.

The shell is fresh: an empty HOME, no virtual environment active and no `.venv/bin` on PATH, so
a step the README leaves out (`hexi-plan: command not found`) fails here. It runs in a scratch
folder that links to the checkout's tracked top-level entries and to its `.venv`: the README's
relative paths work, and what the commands write (plan.json, runs/, nodes/, ...) stays out of
the checkout. tools/setup_env.sh runs in the checkout first, so the quick start's own call of it
finds `.venv` up to date and changes nothing (about a minute in all, mostly process start-up).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from harness import free_port
from launch.hexi_launch_helpers import run_with_stub_slurm

REPO = Path(__file__).resolve().parents[2]

MARKER = re.compile(r"<!-- readme-test: (run|syntax only: (.+?)) -->")
SHELL_FENCE = re.compile(r"```(bash|sh|shell|console)\s*$")


def readme_blocks(text):
    """[(line number, 'run' or the syntax-only reason, block text)] of every shell block."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if SHELL_FENCE.match(lines[i]):
            start = i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = MARKER.fullmatch(prev.strip())
            assert m, (
                f"README.md line {start + 1}: a shell block without a marker; put "
                "`<!-- readme-test: run -->` (or `<!-- readme-test: syntax only: WHY -->`) "
                "on the line before it"
            )
            kind = "run" if m.group(1) == "run" else m.group(2)
            blocks.append((start + 1, kind, "\n".join(lines[start + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def scratch_checkout(dst):
    """A folder that looks like the checkout: links to its tracked top-level entries and .venv."""
    r = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    names = sorted({line.split("/", 1)[0] for line in r.stdout.splitlines() if line})
    assert "README.md" in names and "tools" in names, names
    dst.mkdir()
    for name in [*names, ".venv"]:
        (dst / name).symlink_to(REPO / name)
    return dst


def fresh_env(home):
    """The environment of a new login shell: nothing of a virtual environment or of this test
    run's Python on PATH, no project settings, an empty HOME."""
    hidden = {(REPO / ".venv" / "bin").resolve(), Path(sys.executable).parent.resolve()}
    if os.environ.get("VIRTUAL_ENV"):
        hidden.add((Path(os.environ["VIRTUAL_ENV"]) / "bin").resolve())
    path = [
        p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p).resolve() not in hidden
    ]
    drop = ("HEXI_", "SLURM", "MASTER_", "PET_", "PYTHON", "VIRTUAL_ENV", "CONDA")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(PATH=os.pathsep.join(path), HOME=str(home))
    for tool in ("hexi-plan", "hexi-launch", "torchrun"):
        found = shutil.which(tool, path=env["PATH"])
        assert found is None, f"{found} is on PATH outside .venv: the fresh shell cannot be fresh"
    # Free ports, so that a run elsewhere on this machine cannot collide: the quick start reads
    # MASTER_PORT, torchrun reads PET_MASTER_PORT for its --master-port default.
    env["MASTER_PORT"], env["PET_MASTER_PORT"] = str(free_port()), str(free_port())
    return env


def test_readme_commands_in_a_fresh_shell(tmp_path):
    blocks = readme_blocks((REPO / "README.md").read_text())
    run = [b for b in blocks if b[1] == "run"]
    assert len(run) >= 5 and any("quickstart.sh" in b[2] for b in run), blocks

    for line, why, text in blocks:
        if why != "run":
            r = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
            assert r.returncode == 0, f"README.md line {line} ({why}): {r.stderr}"

    setup = subprocess.run(
        ["bash", "tools/setup_env.sh"], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    assert setup.returncode == 0, setup.stdout + setup.stderr
    work = scratch_checkout(tmp_path / "checkout")
    home = tmp_path / "home"
    home.mkdir()
    script = "".join(f"echo '== README.md line {line}' >&2\n{text}" for line, _, text in run)
    (tmp_path / "readme.sh").write_text(script)
    r = subprocess.run(
        ["bash", "-e", str(tmp_path / "readme.sh")],
        cwd=work,
        env=fresh_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in order: the failing block's marker, its error
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, f"exit {r.returncode}; the last lines:\n{r.stdout[-6000:]}"
    for line, _, _ in run:
        assert f"== README.md line {line}" in r.stdout

    # the quick start's run and the README's own training: every iteration in the metrics
    rows = (work / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in rows] == list(range(1, 11))
    rows = [json.loads(x) for x in (work / "m.jsonl").read_text().splitlines()]
    # 4 iterations, validation at 2 and 4, and once more at the end on a line of its own
    assert [x["iteration"] for x in rows] == [1, 2, 3, 4, 4]
    assert ["eval_lm_loss" in x for x in rows] == [False, True, False, True, True]
    assert "validation loss at iteration 4 on validation set | lm loss value: " in r.stdout
    assert (work / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"MFU \d+(\.\d+)?%", r.stdout), "the planner prints MFU in percent"
    check_generated_launch_scripts(tmp_path, work, r.stdout)


def check_generated_launch_scripts(tmp_path, work, stdout):
    """The job script and node scripts the README writes for its planning example's plan."""
    plan = json.loads((work / "plan.json").read_text())
    ranks_on = {}
    for entry in plan["ranks"]:
        ranks_on[entry["node"]] = ranks_on.get(entry["node"], 0) + 1
    assert len(set(ranks_on.values())) > 1, "the example plan has nodes of different sizes"

    job = work / "job.sbatch"
    assert "wrote job.sbatch: heterogeneous job, " in stdout
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    text = job.read_text()
    # component i: its --gres line and its plan nodes (the HEXI_PLAN_NODES line it owns)
    gres = [int(m.group(1)) for m in re.finditer(r"^#SBATCH --gres=gpu:[\w.-]+:(\d+)$", text, re.M)]
    members = [
        shlex.split(m.group(1))[0].split()
        for m in re.finditer(r"^    (.+?)   # component \d+$", text, re.M)
    ]
    assert len(gres) == len(members) == text.count("#SBATCH hetjob") + 1, text
    assert sorted(n for m in members for n in m) == sorted(ranks_on)
    for count, nodes in zip(gres, members):
        assert all(ranks_on[n] == count for n in nodes), (count, nodes, ranks_on)
    # run it with stand-ins for Slurm: every plan node starts with its own process count
    env = {"SLURM_HET_SIZE": str(len(members))}
    hosts = []
    for i, nodes in enumerate(members):
        env[f"SLURM_JOB_NODELIST_HET_GROUP_{i}"] = ",".join(f"host-{n}" for n in nodes)
        hosts += [f"host-{n}" for n in nodes]
    env["STUB_NODES"] = " ".join(f"{i}:{h}" for i, h in enumerate(hosts))
    calls, _ = run_with_stub_slurm(tmp_path, job, env)
    started = {n: int(c["argv"][c["argv"].index("--nproc-per-node") + 1]) for n, c in calls.items()}
    assert started == ranks_on
    # the entry is the installed hexi-train, by absolute path
    train = os.path.realpath(REPO / ".venv" / "bin" / "hexi-train")
    for c in calls.values():
        entry = c["argv"][c["argv"].index("--hetero-plan-path") - 1]
        assert os.path.isabs(entry) and os.path.realpath(entry) == train, c["argv"]

    scripts = sorted((work / "nodes").glob("*.sh"))
    assert [s.stem for s in scripts] == sorted(ranks_on)
    assert f"wrote {len(scripts)} node script(s) to nodes; " in stdout
    for s in scripts:
        assert subprocess.run(["bash", "-n", str(s)]).returncode == 0
        assert f" --nproc-per-node {ranks_on[s.stem]} " in s.read_text()
