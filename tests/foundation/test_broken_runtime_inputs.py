"""The runtime's broken inputs: every case is one clear line (exit 2), printed once, or correct
behaviour, and nothing a run did not write is replaced, moved back or removed.

The corpus (runtime_cases.py) runs through the real entry in forked, memory- and CPU-capped
children of one runner process; its categories are counted (the audit's: one line, correct,
traceback, hang, out of memory, data lost, read outside, silently wrong). Three two-rank launches
check what needs several processes: problems found on different ranks printed once, the advice
after a rank is killed before any checkpoint, and SIGINT.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from foundation import runtime_cases as rc
from megatron_hexi.checkpoint_files import SAVE_MARKER, TRACKER, CheckpointError
from megatron_hexi.memory_fit import DeviceMemory, fit_problems
from megatron_hexi.run_paths import MetricsFile
from planner.errors import SpecError
from planner.plan import load_plan
from planner.simulator import simulate

MAX_CPU_SECONDS = 30.0  # per case, the child's own CPU time (a loaded machine must not fail it)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runtime-corpus")
    rows, counts = rc.collect(tmp)
    return tmp, rows, counts


def test_every_case_is_one_line_or_correct(corpus):
    tmp, rows, counts = corpus
    wrong = [
        (case.id, category, got["exit"], got["stderr"][-600:])
        for case, got, category in rows
        if category not in ("one line", "correct")
    ]
    assert not wrong, wrong
    setup = sum(1 for case, _, _ in rows if case.refuse is None)
    assert counts == {
        **dict.fromkeys(rc.CATEGORIES, 0),
        "correct": setup,
        "one line": len(rows) - setup,
    }
    assert len(rows) - setup >= 28
    for case, got, _ in rows:
        assert got["cpu_seconds"] < MAX_CPU_SECONDS, (case.id, got["cpu_seconds"])
        assert "\x1b" not in got["stderr"] and "Traceback" not in got["stderr"], case.id


def test_a_run_beside_a_users_files_leaves_them_alone(corpus):
    """The folder also holds notes and a TensorBoard folder: a fresh run and its resumption
    use it, touch neither, and mark their iteration folders as theirs."""
    tmp, _, _ = corpus
    own = tmp / "own"
    assert (own / "notes.txt").read_text() == "a user's notes\n"
    assert sorted(os.listdir(own)) == ["iter_0000001", "iter_0000002", TRACKER, "notes.txt", "tb"]
    assert (own / TRACKER).read_text() == "2"
    assert (own / "iter_0000002" / SAVE_MARKER).is_file()


def _line(rows, case_id):
    (got,) = [g for c, g, _ in rows if c.id == case_id]
    (line,) = rc.error_lines(got["stderr"])
    return line


def test_names_are_escaped_and_cut(corpus):
    """HEXI_PLAN_NODE with a newline, an ANSI escape and 512 characters: one line, escaped, and
    cut where the runtime names it (the planner's own message after it repeats it escaped)."""
    _, rows, _ = corpus
    line = _line(rows, "node name with a newline, an ANSI escape, 512 characters")
    assert "'evil\\nnode\\x1b[31m" in line and "... (518 characters)'" in line, line
    assert len(line) < 300, line
    line = _line(rows, "start-up planning: node name with control characters")
    assert "on nodes evil\\nnode\\x1b[31m" in line and "... (518 characters) (1): " in line, line


def test_memory_refusal_names_rank_and_numbers(corpus):
    tmp, rows, _ = corpus
    need = simulate(load_plan(tmp / "huge-micro-batch.json")).memory_terms_gb[0]
    line = _line(rows, "memory: micro-batch 1,048,576 on a CPU host")
    assert "memory: plan rank 0 on host " in line and "launch rank 0" in line, line
    # the estimate without the framework reserve (a CPU process holds its libraries already)
    assert f"need {sum(v for k, v in need.items() if k != 'reserve'):.2f} GB" in line, line
    assert "GB (MemAvailable)" in line or "GB (cgroup limit minus usage)" in line, line


def test_hexi_plan_validate_refuses_what_cannot_fit(corpus, hexi_plan):
    tmp, _, _ = corpus
    path = tmp / "huge-micro-batch.json"
    est = simulate(load_plan(path))
    code, out, err = hexi_plan("validate", path)
    assert code == 2 and out == "", (code, out, err)
    assert err.splitlines() == [
        f"hexi-plan: error: {path}: does not fit memory: rank 0 (CPU on node cpu) needs "
        f"{est.peak_memory_gb[0]:.2f} GB by the planner's estimate (hexi-plan simulate; largest "
        f"term: activations {est.memory_terms_gb[0]['activations']:.2f} GB), its device holds "
        f"{est.memory_capacity_gb[0]:.2f} GB"
    ]


def test_memory_fit_sums_the_ranks_that_share_memory(tmp_path):
    """CPU ranks on one host share its memory; GPU ranks each have their device's."""
    plan = load_plan(rc.write_plan(tmp_path / "two.json", world=2))
    est = simulate(plan)
    need = [(est.peak_memory_gb[r] - est.memory_terms_gb[r]["reserve"]) * 1e9 for r in range(2)]
    cap = int(max(need) * 1.5)  # either rank fits alone, the two together do not

    def on(hosts, device="cpu", capacity=cap):
        return [
            DeviceMemory(r, r, h, device, capacity, "MemAvailable") for r, h in enumerate(hosts)
        ]

    (line,) = fit_problems(plan, on(["a", "a"]))
    assert line.startswith("memory: plan ranks 0, 1 on host a (CPU processes, launch ranks 0, 1)")
    assert f"need {sum(need) / 1e9:.2f} GB" in line and f"has {cap / 1e9:.2f} GB" in line, line
    assert fit_problems(plan, on(["a", "b"])) == []
    # a GPU counts the framework reserve: a device of the CPU ranks' need is too small
    gpus = [DeviceMemory(r, r, "a", f"cuda:{r}", cap, "total memory") for r in range(2)]
    assert [p.split(" need")[0] for p in fit_problems(plan, gpus)] == [
        "memory: plan rank 0 on host a cuda:0 (launch rank 0)",
        "memory: plan rank 1 on host a cuda:1 (launch rank 1)",
    ]
    big = [DeviceMemory(r, r, "a", f"cuda:{r}", 10**12, "total memory") for r in range(2)]
    assert fit_problems(plan, big) == []


def test_a_full_disk_is_one_line():
    """ENOSPC while writing the metrics file (os.devnull's sibling /dev/full always answers so)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    metrics = MetricsFile("/dev/full", append=True)
    with pytest.raises(SpecError) as info:
        metrics.write_line(json.dumps({"iteration": 1}))
    metrics.close()
    assert info.value.problems == [
        "--hetero-metrics-path /dev/full: cannot write a line (No space left on device)"
    ]


def test_a_save_never_replaces_or_removes_what_it_did_not_write(tmp_path):
    """The save's own guards, under the start-up check: a foreign iteration folder is not
    replaced, a user's temporary folder not removed, a foreign pointer not moved back."""
    from megatron_hexi.checkpoint import behind_foreign_pointer, commit_directory
    from megatron_hexi.checkpoint_files import is_own, mark_own

    save = tmp_path / "ckpt"
    (save / "iter_0000002").mkdir(parents=True)
    (save / "iter_0000002" / "model.pt").write_text("foreign")
    tmp = save / ".iter_0000002.tmp"
    tmp.mkdir()
    mark_own(str(tmp))
    with pytest.raises(CheckpointError, match="not written by this project's saves; not replaced"):
        commit_directory(str(save), str(tmp), 2)
    assert (save / "iter_0000002" / "model.pt").read_text() == "foreign"
    (save / TRACKER).write_text("7")
    assert "names iteration 7, whose folder is not this project's" in behind_foreign_pointer(
        str(save), 3
    )
    assert behind_foreign_pointer(str(save), 8) is None
    user = save / ".iter_0000005.tmp"
    user.mkdir()
    assert not is_own(str(user)) and is_own(str(tmp))


def test_advice_names_only_a_checkpoint_that_loads(tmp_path):
    from megatron_hexi import interrupt
    from megatron_hexi.distributed import resume_advice

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / TRACKER).write_text("3")  # a pointer, but no checkpoint behind it
    assert resume_advice(str(empty)) == (
        f"last complete checkpoint: none in {empty}; rerun the same command to start over"
    )
    assert interrupt.line(str(empty)) == (
        f"pretrain_gpt.py: interrupted (SIGINT); no checkpoint that loads in {empty}"
    )
    assert (
        interrupt.line(None)
        == "pretrain_gpt.py: interrupted (SIGINT); nothing was saved (no --save)"
    )


# ----------------------------------------------------------------------- two-rank launches

TWO = ["--mock-data", "--lr", "1e-3", "--lr-decay-style", "constant"]


def test_problems_of_every_rank_are_printed_once(tmp_path):
    """Rank 0 checks --save's content and the metrics path, the last rank the wandb folder: the
    three problems reach every rank, every rank exits 2, and rank 0 alone prints them. Nothing
    of the foreign checkpoint moves and the FIFO does not block."""
    plan = rc.write_plan(tmp_path / "plan.json", world=2)
    foreign = tmp_path / "foreign"
    (foreign / "iter_0000002").mkdir(parents=True)
    (foreign / "iter_0000002" / "model_optim_rng.pt").write_bytes(b"weights")
    (foreign / TRACKER).write_text("7")
    before = rc.snapshot(foreign)
    os.mkfifo(tmp_path / "fifo")
    read_only = tmp_path / "wandb-ro"
    if not rc.make_read_only(read_only):
        pytest.skip("cannot make a folder unwritable for this process here")
    try:
        launch = rc.Launch(
            [
                "--hetero-plan-path",
                plan,
                *TWO,
                "--train-iters",
                "1",
                "--save",
                foreign,
                "--hetero-metrics-path",
                tmp_path / "fifo",
                "--wandb-project",
                "corpus",
                "--wandb-save-dir",
                read_only,
            ],
            2,
            tmp_path,
            env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        )
        (code0, _, err0), (code1, _, err1) = launch.finish(timeout=300)
    finally:
        rc.undo_read_only(read_only)
    assert (code0, code1) == (2, 2), (err0, err1)
    assert err1 == "", err1
    lines = err0.splitlines()
    assert len(lines) == 3 and all(line.startswith(rc.ERROR) for line in lines), err0
    assert "iter_0000002, latest_checkpointed_iteration.txt (naming iter_0000007)" in lines[0]
    assert (
        lines[1]
        == f"{rc.ERROR}--hetero-metrics-path {tmp_path / 'fifo'}: is a FIFO, not a regular file"
    )
    assert lines[2].startswith(f"{rc.ERROR}--wandb-save-dir {read_only}: cannot write there")
    assert rc.snapshot(foreign) == before


def test_a_rank_killed_before_any_checkpoint_gets_no_load_advice(tmp_path):
    plan = rc.write_plan(tmp_path / "plan.json", world=2)
    save = tmp_path / "ckpt"
    launch = rc.Launch(
        [
            "--hetero-plan-path",
            plan,
            *TWO,
            "--train-iters",
            "100000",
            "--save",
            save,
            "--save-interval",
            "100000",
            "--distributed-timeout-minutes",
            "1",
        ],
        2,
        tmp_path,
    )
    launch.wait_for(0, "start-up done", timeout=300)
    launch.procs[1].send_signal(signal.SIGKILL)
    (code0, _, err0), _ = launch.finish(timeout=180)
    assert code0 == 1, err0
    assert "Traceback" not in err0, err0
    assert err0.splitlines()[-1] == (
        f"{rc.ERROR}last complete checkpoint: none in {save}; rerun the same command to start over"
    ), err0
    assert "--load" not in err0, err0


def test_sigint_is_one_line_naming_the_checkpoint_that_loads(tmp_path):
    """torchrun and srun pass Ctrl-C to every worker: every rank leaves with 130, rank 0 says
    so in one line naming the last checkpoint, which loads."""
    from megatron_hexi.checkpoint import Checkpoint

    plan = rc.write_plan(tmp_path / "plan.json", world=2)
    save = tmp_path / "ckpt"
    launch = rc.Launch(
        [
            "--hetero-plan-path",
            plan,
            *TWO,
            "--train-iters",
            "100000",
            "--save",
            save,
            "--save-interval",
            "2",
        ],
        2,
        tmp_path,
    )
    launch.wait_for(0, "successfully saved checkpoint from iteration", timeout=300)
    for p in launch.procs:
        p.send_signal(signal.SIGINT)
    (code0, _, err0), (code1, _, err1) = launch.finish(timeout=180)
    assert (code0, code1) == (130, 130), (err0, err1)
    assert err1 == "", err1
    step = int((save / TRACKER).read_text())
    assert err0.splitlines() == [
        f"pretrain_gpt.py: interrupted (SIGINT); last checkpoint that loads: iteration {step} in "
        f"{save} (rerun with --load {save} to resume)"
    ], err0
    Checkpoint(str(save)).close()
