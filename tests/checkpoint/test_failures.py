"""A rank killed mid-step or mid-save: the others exit with a clear error within the collective
timeout, and rerunning the same command resumes from the last complete checkpoint, continuing
the loss curve exactly.

Every run is the same command (`--load D --hetero-load-if-exists --save D`, one metrics file that
resumed runs append to). Run 1 is killed from outside (SIGKILL to rank 1) once the metrics show a
checkpoint was completed; run 2 resumes, and rank 1 kills itself in the middle of the next save
(kill_in_save.py wraps the rank-file writer in its processes: the window is milliseconds long);
run 3 (under torchrun) resumes from the checkpoint before the broken save and finishes.
Iterations computed twice must agree bit for bit, and every iteration 1..N must be in the
metrics.
"""

import json
import os
import re
import signal
import time

import pytest

from checkpoint.launching import TWO_STAGES, launch, wait_all
from conftest import REPO
from harness import _kill_tree, run_script, run_torchrun
from megatron_hexi.checkpoint import TRACKER, Checkpoint
from planner.layout import canonical_shards
from planner.models import load_model
from runtime.plans import REFERENCE, write_plan

TRAIN_ITERS, INTERVAL, TIMEOUT_MIN = 14, 3, 0.5


def command(tmp_path, plan):
    d = tmp_path / "ckpt"
    return [
        "--hetero-plan-path",
        str(plan),
        "--mock-data",
        "--train-iters",
        str(TRAIN_ITERS),
        "--lr",
        "1e-3",
        "--lr-decay-style",
        "cosine",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--adam-eps",
        "1e-4",
        "--seed",
        "7",
        "--save",
        str(d),
        "--save-interval",
        str(INTERVAL),
        "--load",
        str(d),
        "--hetero-load-if-exists",
        "--hetero-metrics-path",
        str(tmp_path / "metrics.jsonl"),
        "--distributed-timeout-minutes",
        str(TIMEOUT_MIN),
        "--log-interval",
        "1",
    ]


def metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_killed_rank_and_killed_save_resume_exactly(tmp_path):
    plan = write_plan(tmp_path, "two_stages", "tiny", 2, TWO_STAGES)
    argv = command(tmp_path, plan)
    ckpt = tmp_path / "ckpt"
    procs = []
    try:
        # Run 1: SIGKILL rank 1 from outside once iteration 2 x INTERVAL + 1 is logged.
        procs = launch(tmp_path, "run1", argv, 2)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if any(m["iteration"] > 2 * INTERVAL for m in metrics(tmp_path)):
                break
            time.sleep(0.02)
        assert all(p.poll() is None for p in procs), "run 1 ended before the kill"
        os.kill(procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        codes = wait_all(procs, killed_at + TIMEOUT_MIN * 60 + 15)
        exited_after = time.monotonic() - killed_at
        err0 = (tmp_path / "run1.0.err").read_text()
        assert codes[0] not in (None, 0), f"rank 0 did not exit after its peer died:\n{err0}"
        assert exited_after < TIMEOUT_MIN * 60, exited_after
        assert "a collective failed" in err0, err0
        k1 = int((ckpt / TRACKER).read_text())
        assert k1 >= 2 * INTERVAL and k1 < TRAIN_ITERS - INTERVAL
        assert re.search(
            rf"last complete checkpoint: iteration {k1} in .*rerun the same command "
            rf"with --load",
            err0,
        ), err0
        run1 = [m["iteration"] for m in metrics(tmp_path)]
        print(
            f"run 1: rank 1 killed after iteration {run1[-1]}; rank 0 exited (code {codes[0]}) "
            f"{exited_after:.1f} s later; last checkpoint {k1}"
        )

        # Run 2: the same command resumes from k1; rank 1 dies inside the save of k1 + INTERVAL.
        k2 = k1 + INTERVAL
        kill = [str(REPO / "tests" / "checkpoint" / "kill_in_save.py"), f"{k2}:1"]
        procs = launch(tmp_path, "run2", argv, 2, script=kill)
        codes = wait_all(procs, time.monotonic() + 240)
        err0 = (tmp_path / "run2.0.err").read_text()
        out0 = (tmp_path / "run2.0.out").read_text()
        assert f"loaded checkpoint from {ckpt}/iter_{k1:07d} at iteration {k1}" in out0, out0
        assert codes[1] == -signal.SIGKILL and codes[0] not in (None, 0), (codes, err0)
        assert "checkpoint save of iteration" in err0 or "a collective failed" in err0, err0
        assert (ckpt / TRACKER).read_text() == str(k1), "a broken save moved the pointer"
        assert not (ckpt / f"iter_{k2:07d}").exists()
        # The previous checkpoint is intact: every tensor of it reads.
        with Checkpoint(str(ckpt)) as previous:
            assert previous.iteration == k1
            for s in canonical_shards(load_model("tiny")):
                for kind in ("param", "exp_avg", "exp_avg_sq"):
                    previous.read_full(s.name, s.shape, s.dim, kind)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p.pid, group=True)

    # Run 3: the same command under torchrun finishes the run from k1.
    code, out, err = run_torchrun([REPO / "pretrain_gpt.py", *argv], 2, timeout=300)
    assert code == 0, err[-3000:]
    assert f"at iteration {k1} in" in out
    assert (ckpt / TRACKER).read_text() == str(TRAIN_ITERS)
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")], os.listdir(ckpt)

    # Every iteration is in the (appended) metrics; iterations computed twice agree exactly.
    seen = {}
    for m in metrics(tmp_path):
        seen.setdefault(m["iteration"], set()).add((m["lm_loss"], m["grad_norm"]))
    assert sorted(seen) == list(range(1, TRAIN_ITERS + 1))
    repeated = [i for i in seen if i > k1 and i <= run1[-1] or k1 < i <= k2]
    assert all(len(v) == 1 for v in seen.values()), {i: v for i, v in seen.items() if len(v) > 1}
    print(f"iterations computed twice, identical: {sorted(set(repeated))}")

    # A checkpoint loaded with another model is one clear error naming the fields (one process,
    # no launcher: what is checked is the rank's own error and exit code).
    other = write_plan(tmp_path, "gqa", "tiny-gqa", 1, REFERENCE)
    code, out, err = run_script(
        [
            REPO / "pretrain_gpt.py",
            "--hetero-plan-path",
            other,
            "--mock-data",
            "--train-iters",
            "1",
            "--lr",
            "1e-3",
            "--load",
            ckpt,
        ],
        timeout=120,
    )
    assert code == 2, err[-3000:]
    assert re.search(
        r"pretrain_gpt.py: error: .*holds a different model \(ffn_hidden_size: "
        r"checkpoint 256, this run 192; num_attention_heads",
        err,
    ), err[-3000:]


def test_hung_rank_fails_the_others_within_the_timeout(tmp_path):
    """A rank that stops answering (SIGSTOP: no connection is closed) fails its peers when the
    collective timeout (--distributed-timeout-minutes, fractions allowed) runs out. 6 s: a
    step's collectives of the tiny model take milliseconds, a thousand times less."""
    timeout_min = 0.1
    plan = write_plan(tmp_path, "two_stages", "tiny", 2, TWO_STAGES)
    argv = [
        "--hetero-plan-path",
        str(plan),
        "--mock-data",
        "--train-iters",
        "500",
        "--lr",
        "1e-3",
        "--hetero-metrics-path",
        str(tmp_path / "metrics.jsonl"),
        "--log-interval",
        "100",
        "--distributed-timeout-minutes",
        str(timeout_min),
    ]
    procs = launch(tmp_path, "hang", argv, 2)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(
            m["iteration"] >= 2 for m in metrics(tmp_path)
        ):
            assert all(p.poll() is None for p in procs), "a rank ended early"
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = wait_all(procs[:1], stopped + timeout_min * 60 + 30)[0]
        after = time.monotonic() - stopped
        err = (tmp_path / "hang.0.err").read_text()
        print(
            f"rank 1 stopped; rank 0 exited (code {code}) {after:.1f} s later "
            f"(timeout {timeout_min * 60:g} s)"
        )
        assert code not in (None, 0), err
        assert timeout_min * 60 * 0.8 < after < timeout_min * 60 + 15, after
        assert "a collective failed" in err and "imed out" in err, err
    finally:
        for p in procs:
            _kill_tree(p.pid, group=True)


@pytest.mark.parametrize(
    "gloo_error, timed_out",
    [
        (
            "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
            "12000ms for recv operation to complete",
            True,
        ),
        ("Application timeout caused pair closure", True),
        (
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
            "[127.0.0.1]:29500",
            False,
        ),
    ],
)
def test_collective_failure_names_its_cause(gloo_error, timed_out):
    """gloo reports a hung peer in two wordings (a wait's timeout, or the pair's read timeout
    when the rank was blocked reading from it, depending on where the hang met it); both are
    the collective timeout, and a closed connection is not."""
    from megatron_hexi.config import OptimizerConfig, RunConfig, TrainingConfig
    from megatron_hexi.distributed import failure_lines

    config = RunConfig(TrainingConfig(train_iters=1), OptimizerConfig(lr=1e-3))
    lines, collective = failure_lines(RuntimeError(gloo_error), config)
    assert collective
    assert lines[1].endswith(
        "a collective failed: "
        + (
            "it timed out: another rank hung or stopped answering"
            if timed_out
            else "another rank died, hung or lost its connection"
        )
        + " (collective timeout --distributed-timeout-minutes 10)"
    ), lines
