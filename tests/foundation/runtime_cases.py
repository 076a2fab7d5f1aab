"""The runtime's broken-input corpus: output paths, checkpoint folders that hold what a run did
not write, pointers and plan folders that lead outside, names with control characters, plans that
cannot fit memory. Shared by the tests (test_broken_runtime_inputs.py) and by anyone who wants the
counts per category on another tree (run `collect` with that tree first on PYTHONPATH).

Each case is one `pretrain_gpt.py` command line, run through the real entry
(`megatron_hexi.training.main`) in a forked, memory- and CPU-capped child of one runner process
(runtime_corpus_runner.py). `classify` puts each result in one category of the audit: a clear
one-line error, correct behaviour, a traceback, a hang, out of memory, data lost, a read outside
the given folder, or a silently wrong result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.cluster import load_cluster_dict
from planner.models import load_model
from planner.plan import build_plan, save_plan

HERE = Path(__file__).parent
REPO = HERE.parent.parent
ERROR = "pretrain_gpt.py: error: "
SECRET = "SECRET-FIRST-LINE-OF-ANOTHER-FILE"
HANG_EXIT = -14  # SIGALRM: the runner's wall-clock limit ended a blocked child
RUN = ["--mock-data", "--lr", "1e-3", "--lr-decay-style", "constant", "--train-iters", "1"]
RUN += ["--attention-dropout", "0", "--hidden-dropout", "0"]
CATEGORIES = (
    "one line",
    "correct",
    "traceback",
    "hang",
    "out of memory",
    "data lost",
    "read outside",
    "silently wrong",
    "other",
)


@dataclass
class Case:
    """`refuse`: what the one error line must say (None: the run must succeed). `keep`: trees a
    case must leave as they were; `secret`: text that must never be printed."""

    id: str
    argv: list[object]
    refuse: str | None
    env: dict[str, str] = field(default_factory=dict)
    keep: list[Path] = field(default_factory=list)
    secret: str | None = None


def cpu_cluster(world: int) -> dict[str, object]:
    return {
        "name": f"cpu-{world}",
        "nodes": [
            {
                "name": "cpu",
                "gpu": "CPU",
                "gpus_per_node": world,
                "intra_node": "host",
                "nic": "10 Gbit/s",
            }
        ],
    }


def write_plan(path: Path, world: int = 1, micro_batch: int = 8) -> Path:
    """A plan of the tiny model: `world` single-stage pipelines of `micro_batch` samples each."""
    pipelines = [
        {
            "micro_batch_size": micro_batch,
            "num_microbatches": 1,
            "stages": [{"ranks": [r], "layers": [0, 4]}],
        }
        for r in range(world)
    ]
    plan = build_plan(
        load_cluster_dict(cpu_cluster(world)), load_model("tiny"), micro_batch * world, pipelines
    )
    save_plan(plan, path)
    return path


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: kind and content digest} of a tree (or a file), links not followed."""
    if root.is_file() and not root.is_symlink():
        return {"": hashlib.sha256(root.read_bytes()).hexdigest()}
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "special"
    return out


def make_read_only(path: Path) -> bool:
    """Make the folder `path` unwritable for this process: mode 0555, and, for root (whom modes
    do not stop), the immutable attribute. True if a write there now fails."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    try:
        (path / ".probe").write_text("")
    except OSError:
        return True
    (path / ".probe").unlink()
    return False


def undo_read_only(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
    path.chmod(0o755)


def _loop(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(path.name + "-b", path)
    os.symlink(path.name, path.parent / (path.name + "-b"))
    return path


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def setup_cases(tmp: Path) -> list[Case]:
    """Phase 1: correct runs that leave a checkpoint of this project in tmp/own (beside a user's
    files) for the refusals of phase 2 to point at."""
    own = tmp / "own"
    (own / "tb").mkdir(parents=True)
    (own / "notes.txt").write_text("a user's notes\n")
    plan = write_plan(tmp / "plan.json")
    return [
        Case(
            "save: a fresh run beside a user's files",
            ["--hetero-plan-path", plan, *RUN, "--train-iters", "2", "--exit-interval", "1"]
            + ["--save", own],
            None,
        ),
        Case(
            "save: resume the folder's own run",
            ["--hetero-plan-path", plan, *RUN, "--train-iters", "2", "--load", own, "--save", own],
            None,
        ),
    ]


def refusal_cases(tmp: Path) -> list[Case]:
    """Phase 2: one clear line each, nothing of the given folders touched."""
    plan = tmp / "plan.json"
    base = ["--hetero-plan-path", plan, *RUN]
    cases = []
    copies = iter(range(1000))

    def own() -> Path:
        """A copy of phase 1's checkpoint folder, one per case (so that a case that changed it
        shows up as that case's loss alone)."""
        copy = tmp / f"own-{next(copies)}"
        shutil.copytree(tmp / "own", copy, symlinks=True)
        return copy

    foreign = tmp / "foreign"  # a Megatron-LM checkpoint: iteration folder and pointer 7
    (foreign / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
    (foreign / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"weights")
    (foreign / "latest_checkpointed_iteration.txt").write_text("7")
    cases.append(
        Case(
            "save: a foreign checkpoint",
            [*base, "--save", foreign],
            "not written by this project's saves",
            keep=[foreign],
        )
    )
    user_tmp = tmp / "user-tmp"
    (user_tmp / ".iter_0000001.tmp").mkdir(parents=True)
    (user_tmp / ".iter_0000001.tmp" / "keep.txt").write_text("mine\n")
    cases.append(
        Case(
            "save: a user's .iter_0000001.tmp",
            [*base, "--save", user_tmp],
            ".iter_0000001.tmp",
            keep=[user_tmp],
        )
    )
    d = own()
    cases.append(
        Case(
            "save: a fresh run over its own earlier run",
            [*base, "--save", d],
            "would replace its later iterations",
            keep=[d],
        )
    )
    d = own()
    cases.append(
        Case(
            "save: --finetune into the folder it loads",
            [*base, "--load", d, "--save", d, "--finetune"],
            "--finetune would save over the run it starts from",
            keep=[d],
        )
    )

    secret = tmp / "system-file"
    secret.write_text(SECRET + "\n")
    for flag in ("--load", "--save"):
        linked = tmp / f"linked-pointer{flag}"
        linked.mkdir()
        os.symlink(secret, linked / "latest_checkpointed_iteration.txt")
        cases.append(
            Case(
                f"{flag[2:]}: a pointer that is a symbolic link",
                [*base, flag, linked],
                "is a symbolic link",
                keep=[linked, secret],
                secret=SECRET,
            )
        )

    cluster = tmp / "cluster.yaml"
    cluster.write_text(json.dumps(cpu_cluster(1)))
    outside, linked_plans = tmp / "outside", tmp / "linked-plans"
    outside.mkdir()
    linked_plans.mkdir()
    os.symlink(outside, linked_plans / "plans")
    startup = ["--hetero-cluster", cluster, "--hetero-model", "tiny", "--global-batch-size", "8"]
    cases.append(
        Case(
            "save: plans/ is a symbolic link out of the folder",
            [*startup, *RUN, "--save", linked_plans],
            "plans (a symbolic link)",
            env={"HEXI_PLAN_NODE": "cpu"},
            keep=[outside, linked_plans],
        )
    )

    deep = tmp / "deep"
    (deep / "iter_0000001").mkdir(parents=True)
    (deep / "latest_checkpointed_iteration.txt").write_text("1")
    (deep / "iter_0000001" / "checkpoint.json").write_text("[" * 100_000 + "]" * 100_000)
    cases.append(
        Case("load: deeply nested checkpoint.json", [*base, "--load", deep], "nested too deeply")
    )

    paths = tmp / "paths"
    paths.mkdir()
    (paths / "a-file").write_text("")
    (paths / "a-dir").mkdir()
    flags = {
        "metrics": ("--hetero-metrics-path", []),
        "tensorboard": ("--tensorboard-dir", []),
        "wandb": ("--wandb-save-dir", ["--wandb-project", "corpus"]),
    }
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for what, (flag, extra) in flags.items():
        env = wandb_env if what == "wandb" else {}
        inside = own()
        bad = {
            "a FIFO": (_fifo(paths / f"{what}-fifo"), "is a FIFO"),
            "a symbolic link loop": (_loop(paths / f"{what}-loop"), "a symbolic link loop"),
            "inside a checkpoint's iteration folder": (
                inside / "iter_0000002" / f"{what}-out",
                "lies among a checkpoint's own files",
            ),
        }
        if what == "metrics":
            bad["the plan file"] = (plan, "an input of this run")
            bad["a folder"] = (paths / "a-dir", "is a folder, not a regular file")
            bad["a device"] = (Path(os.devnull), "is a device")
            bad["in a read-only folder"] = (paths / "ro-metrics" / "m.jsonl", "cannot write there")
        else:
            bad["a file"] = (paths / "a-file", "is a regular file, not a folder")
            bad["read-only"] = (paths / f"ro-{what}", "cannot write there")
        for name, (path, say) in bad.items():
            d = inside if "iteration folder" in name else own()
            cases.append(
                Case(
                    f"{flag} {name}",
                    [*base, flag, path, *extra, "--train-iters", "2", "--save", d, "--load", d],
                    say,
                    env=env,
                    keep=[d, plan, paths / "a-file"],
                )
            )

    long_name = "evil\nnode\x1b[31m" + "x" * 500
    cases.append(
        Case(
            "node name with a newline, an ANSI escape, 512 characters",
            base,
            "which is not a node",
            env={"HEXI_PLAN_NODE": long_name},
        )
    )
    cases.append(
        Case(
            "start-up planning: node name with control characters",
            [*startup, *RUN],
            "",
            env={"HEXI_PLAN_NODE": long_name},
        )
    )

    huge = write_plan(tmp / "huge-micro-batch.json", micro_batch=1_048_576)
    cases.append(
        Case(
            "memory: micro-batch 1,048,576 on a CPU host",
            ["--hetero-plan-path", huge, *RUN],
            "the plan cannot fit",
        )
    )
    return cases


def read_only_paths(tmp: Path) -> list[Path]:
    """The folders refusal_cases wants unwritable (made so by the caller, undone after)."""
    return [
        tmp / "paths" / "ro-metrics",
        tmp / "paths" / "ro-tensorboard",
        tmp / "paths" / "ro-wandb",
    ]


def run_corpus(cases: list[Case], tmp: Path, name: str, pythonpath: Path = REPO) -> dict[str, dict]:
    """Run `cases` in one runner process (the runtime on `pythonpath`); results by case id."""
    spec = tmp / f"{name}.json"
    spec.write_text(
        json.dumps([{"id": c.id, "argv": [str(a) for a in c.argv], "env": c.env} for c in cases])
    )
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        # the repository, and tests/ for the runner's helpers (`foundation.entry_corpus_runner`)
        "PYTHONPATH": os.pathsep.join(
            [str(pythonpath), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "HEXI_PLAN_NODE"):
        env.pop(key, None)
    out = tmp / f"{name}-results.json"
    # forked from the harness's forkserver when the runtime is this checkout's (its imports
    # are done there), else a fresh interpreter
    if Path(pythonpath).resolve() == REPO.resolve():
        from harness import run_script_with_environ

        code, _, err = run_script_with_environ(
            [HERE / "runtime_corpus_runner.py", spec, out], env, timeout=3600, cwd=tmp
        )
    else:
        r = subprocess.run(
            [sys.executable, str(HERE / "runtime_corpus_runner.py"), str(spec), str(out)],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        code, err = r.returncode, r.stderr
    assert code == 0, err[-3000:]
    return json.loads(out.read_text())


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(ERROR)]


def classify(case: Case, got: dict, kept: bool) -> str:
    """The audit's category of one result (`kept`: the case's trees are as they were)."""
    printed = got["stdout"] + got["stderr"]
    if got["exit"] == HANG_EXIT:
        return "hang"
    if "MemoryError" in printed or "bad_alloc" in printed or got["exit"] == -9:
        return "out of memory"
    if not kept:
        return "data lost"
    if case.secret and case.secret in printed:
        return "read outside"
    if "Traceback" in got["stderr"]:
        return "traceback"
    if case.refuse is None:
        return "correct" if got["exit"] == 0 else "other"
    if got["exit"] == 0:
        return "silently wrong"
    lines = error_lines(got["stderr"])
    if (
        got["exit"] == 2
        and len(lines) == 1
        and case.refuse in lines[0]
        and len(got["stderr"].splitlines()) == 1
    ):
        return "one line"
    return "other"


def collect(
    tmp: Path, pythonpath: Path = REPO
) -> tuple[list[tuple[Case, dict, str]], dict[str, int]]:
    """Both phases on `pythonpath`'s runtime: [(case, result, category)] and the counts."""
    rows = []
    first = setup_cases(tmp)
    results = run_corpus(first, tmp, "setup", pythonpath)
    for c in first:
        rows.append((c, results[c.id], classify(c, results[c.id], True)))
    cases = refusal_cases(tmp)
    unwritable = read_only_paths(tmp)
    try:
        for p in unwritable:
            make_read_only(p)
        before = {c.id: [snapshot(k) for k in c.keep] for c in cases}
        results = run_corpus(cases, tmp, "refusals", pythonpath)
    finally:
        for p in unwritable:
            undo_read_only(p)
    for c in cases:
        got = results[c.id]
        kept = [snapshot(k) for k in c.keep] == before[c.id]
        rows.append((c, got, classify(c, got, kept)))
    counts = {k: 0 for k in CATEGORIES}
    for _, _, category in rows:
        counts[category] += 1
    return rows, counts


# ----------------------------------------------------------------------- multi-process launches


class Launch:
    """`pretrain_gpt.py ARGS` as `world` plain processes with torchrun's environment (as
    harness.run_ranks, which waits for the end), forked from the harness's forkserver (they
    start in milliseconds): each rank's output goes to files read as they grow, so a test can
    act at a point of the run (`wait_for`), then signal ranks (`procs[i].send_signal`)."""

    def __init__(
        self, args: list[object], world: int, cwd: Path, env: dict[str, str] | None = None
    ):
        import tempfile

        from harness import CPU_ONLY_ENV, free_port, start_script

        port = str(free_port())
        self._folder = tempfile.TemporaryDirectory(prefix="hexi-launch-")
        self.procs: list[Any] = []
        self.files: list[tuple[Path, Path]] = []
        for rank in range(world):
            e = {
                **os.environ,
                **CPU_ONLY_ENV,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": "1",
                **(env or {}),
            }
            e.pop("HEXI_PLAN_NODE", None)
            out, err = (Path(self._folder.name) / f"{rank}.{s}" for s in ("out", "err"))
            self.files.append((out, err))
            self.procs.append(start_script([REPO / "pretrain_gpt.py", *args], e, cwd, out, err))

    def _read(self, path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, rank: int, text: str, timeout: float) -> None:
        """Until `rank`'s stdout holds `text` (AssertionError after `timeout` s or if the rank
        ended without it)."""
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self._read(self.files[rank][0]):
                return
            if self.procs[rank].poll() is not None:
                if text in self._read(self.files[rank][0]):
                    return
                break
            time.sleep(0.1)
        self.kill()
        raise AssertionError(
            f"rank {rank} never printed {text!r}: {self._read(self.files[rank][0])[-2000:]}"
        )

    def finish(self, timeout: float) -> list[tuple[int, str, str]]:
        """[(exit code, stdout, stderr)] per rank, once every rank has ended (AssertionError,
        every rank killed, past `timeout` s). A rank that exits with SIGABRT fails the test (the
        harness's rule for every launch)."""
        from harness import check_no_abort

        try:
            for rank, p in enumerate(self.procs):
                if p.wait(timeout) is None:
                    raise AssertionError(f"rank {rank} still running after {timeout} s")
            codes = [p.poll() for p in self.procs]
            check_no_abort(codes, "pretrain_gpt.py")
            return [
                (code, self._read(out), self._read(err))
                for code, (out, err) in zip(codes, self.files)
            ]
        finally:
            self.kill()
            self._folder.cleanup()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
