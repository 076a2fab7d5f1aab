"""What a run reports, as a Megatron-LM user reads it: start-up phases, iteration lines averaged
over --log-interval with elapsed time and ETA, validation lines, the metrics JSONL, TensorBoard
and wandb (offline, read back from its run file) with the same scalars.

One pretrain_gpt.py launch (two ranks, two pipelines, forked with torchrun's environment)
checks all of it.
"""

import json
import re
import struct

import pytest

from harness import run_ranks
from planner.errors import SpecError
from planner.layout import rank_params, total_params
from planner.plan import load_plan
from runtime.plans import write_plan

TWO_PIPELINES = [
    {"micro_batch_size": 2, "num_microbatches": 3, "stages": [{"ranks": [0], "layers": [0, 4]}]},
    {"micro_batch_size": 2, "num_microbatches": 1, "stages": [{"ranks": [1], "layers": [0, 4]}]},
]


def wandb_records(path):
    """The protobuf Records of a wandb run file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log blocks of 32 KiB whose records have a 7-byte header (CRC, length, type: 1 full,
    2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(records):
    """{step: {name: value}} of the history records, and the run's config {key: value}."""
    history, config = {}, {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {
                (i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item
            }
            step = items.pop("_step")
            history.setdefault(step, {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")}
            )
        elif kind in ("run", "config"):
            updates = r.run.config.update if kind == "run" else r.config.update
            config.update({i.key: json.loads(i.value_json) for i in updates})
    return history, config


@pytest.fixture(scope="module")
def reported(tmp_path_factory, repo_root):
    d = tmp_path_factory.mktemp("report")
    plan = write_plan(d, "two", "tiny", 2, TWO_PIPELINES)
    ranks = run_ranks(
        [
            repo_root / "pretrain_gpt.py",
            "--hetero-plan-path",
            plan,
            "--mock-data",
            "--train-iters",
            "6",
            "--lr",
            "1e-3",
            "--log-interval",
            "3",
            "--log-throughput",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--hetero-metrics-path",
            d / "metrics.jsonl",
            "--tensorboard-dir",
            d / "tb",
            "--wandb-project",
            "hexi-test",
            "--wandb-exp-name",
            "report",
            "--wandb-save-dir",
            d / "wb",
        ],
        2,
        timeout=240,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"},
    )
    assert [code for code, _, _ in ranks] == [0, 0], [err[-3000:] for _, _, err in ranks]
    out = "".join(out for _, out, _ in ranks)  # what a launcher shows, rank by rank
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return d, load_plan(plan), out, rows


def test_start_up_and_iteration_lines(reported):
    d, plan, out, rows = reported
    phases = re.findall(
        r"^> (plan loaded|process groups built|model built|data ready|start-up "
        r"done)",
        out,
        re.M,
    )
    assert phases == [
        "plan loaded",
        "process groups built",
        "model built",
        "data ready",
        "start-up done",
    ], out
    per_rank = [rank_params(plan, r) for r in range(2)]
    assert f"parameters per rank {per_rank}, {total_params(plan.model):,} in the model" in out
    lines = [x for x in out.splitlines() if " iteration " in x and "consumed samples" in x]
    assert [int(re.search(r"iteration +(\d+)/", x)[1]) for x in lines] == [3, 6], lines
    for line, chunk in zip(lines, (rows[0:3], rows[3:6]), strict=True):
        mean_loss = sum(r["lm_loss"] for r in chunk) / 3
        assert f"lm loss: {mean_loss:.6E}" in line, (line, chunk)
        mean_ms = sum(r["step_time_s"] for r in chunk) / 3 * 1000
        assert f"elapsed time per iteration (ms): {mean_ms:.1f}" in line, line
        assert f"grad norm: {chunk[-1]['grad_norm']:.3f}" in line
        assert re.search(r"throughput per GPU \(TFLOP/s/GPU\): [0-9.]+ \|", line), line
        assert re.search(r"MFU: [0-9.]+% \| elapsed: \d+:\d\d:\d\d \| ETA: \d+:\d\d:\d\d \|$", line)
    assert "ETA: 0:00:00 |" in lines[-1]


def test_validation_lines_and_metrics(reported):
    d, plan, out, rows = reported
    found = re.findall(
        r"validation loss at (iteration \d+(?: on validation set)?) \| lm loss "
        r"value: (\S+) \| lm loss PPL: (\S+) \|",
        out,
    )
    assert [w for w, _, _ in found] == [
        "iteration 3",
        "iteration 6",
        "iteration 6 on validation set",
    ], out
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6, 6]
    assert [("eval_lm_loss" in r) for r in rows[:6]] == [False, False, True, False, False, True]
    assert rows[-1].keys() == {"iteration", "eval_lm_loss", "end"}
    evals = [rows[2]["eval_lm_loss"], rows[5]["eval_lm_loss"], rows[6]["eval_lm_loss"]]
    for (_, value, ppl), loss in zip(found, evals, strict=True):
        assert value == f"{loss:.6E}"
        assert float(ppl) == pytest.approx(2.718281828459045**loss, rel=1e-6)


def test_wandb_offline_has_the_tensorboard_scalars(reported):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, plan, out, rows = reported
    runs = list((d / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # one rank writes
    history, config = wandb_history(wandb_records(runs[0]))
    assert config["launch_rank"] == 1  # the last rank, as in Megatron-LM
    assert config["logging"]["wandb_exp_name"] == "report"
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    assert [history[i]["lm loss"] for i in range(1, 7)] == [r["lm_loss"] for r in rows[:6]]
    assert history[3]["lm loss validation"] == rows[2]["eval_lm_loss"]
    assert history[6]["lm loss validation"] == rows[6]["eval_lm_loss"]  # the last one written
    acc = EventAccumulator(str(d / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {k for step in history.values() for k in step}, tags ^ set(history[6])
    for tag in tags:
        tb = {e.step: e.value for e in acc.Scalars(tag)}
        wb = {s: v[tag] for s, v in history.items() if tag in v}
        assert tb.keys() == wb.keys(), tag
        assert all(tb[s] == pytest.approx(wb[s], rel=1e-6) for s in tb), tag  # TB stores fp32


def test_missing_wandb_is_a_clear_error(monkeypatch):
    from megatron_hexi import wandb_log

    monkeypatch.setitem(__import__("sys").modules, "wandb", None)
    with pytest.raises(
        SpecError,
        match=r"--wandb-project needs the wandb package .*"
        r"pip install 'megatron-hexi\[wandb\]'",
    ):
        wandb_log.check_available()


def test_evaluation_windows_follow_the_iteration():
    """Evaluation k every eval_interval reads window k - 1, the end of the run the next one; a
    checkpoint past --train-iters (--skip-train on it) reads the last window built."""
    from megatron_hexi.config import EvaluationConfig
    from megatron_hexi.run_datasets import eval_window

    ev = EvaluationConfig(eval_interval=3, eval_iters=2)
    assert [eval_window(i, 9, ev, end=False) for i in (3, 6, 9)] == [0, 1, 2]
    assert eval_window(9, 9, ev, end=True) == 3  # 9 // 3 + 1 = 4 windows are built
    assert eval_window(7, 9, ev, end=True) == 2  # a run stopped early (--exit-interval)
    assert eval_window(20, 9, ev, end=True) == 3
    assert eval_window(0, 9, ev, end=True) == 0  # --skip-train from scratch
    assert eval_window(5, 9, EvaluationConfig(eval_iters=2), end=True) == 0  # at the end only
