"""--save / --load: exact resume under the same plan, resharding to another plan, clear errors.

One straight run of plan A (two pipelines, a TP=2 stage with uneven shards; the `straight` fixture
of conftest.py) saves at iterations 2 and 4. Resuming from iteration 2 under plan A must repeat
iterations 3-4 exactly (1e-6; in practice bit for bit); resuming under plan B (three ranks, other
stage boundaries, other TP and uneven shards, and the distributed optimizer) must match within
1e-5, parameters and Adam state included, and plan B's own checkpoint must hold the same tensors
as plan A's.
"""

import json
import os
import shutil

import pytest
import torch

from checkpoint.conftest import ITERS
from checkpoint.workers import max_relative_difference, train
from harness import run_distributed
from megatron_hexi.checkpoint import TRACKER, Checkpoint, CheckpointError, read_full_model
from planner.layout import canonical_shards
from planner.models import load_model
from runtime.plans import PLANS, write_plan

PLAN_B = [
    {
        "micro_batch_size": 4,
        "num_microbatches": 2,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 2],
                "shards": {"query_groups": [1, 3], "ffn": [100, 156], "vocab": [28, 100]},
            },
            {"ranks": [2], "layers": [2, 4]},
        ],
    }
]


def _events(result, kind):
    return [e for e in result["events"] if kind in e]


def test_resume_same_plan_is_exact(straight, tmp_path):
    d, plan, ref = straight
    world = PLANS["two_pipelines_uneven_tp2"][1]
    res = run_distributed(
        train, world, plan, [*ITERS, "--load", str(d / "ckpt"), "--ckpt-step", "2"], timeout=300
    )[0]
    assert res["iterations"] == [3, 4]
    loss = max(max_relative_difference(a, b) for a, b in zip(res["losses"], ref["losses"][2:]))
    norm = max(
        max_relative_difference(a, b) for a, b in zip(res["grad_norms"], ref["grad_norms"][2:])
    )
    param = max(max_relative_difference(res["params"][k], ref["params"][k]) for k in ref["params"])
    save = _events(ref, "save_iteration")
    load = _events(res, "load_iteration")
    print(
        f"resume, same plan: max relative difference loss {loss:.2e}, grad norm {norm:.2e}, "
        f"parameters {param:.2e}; plan A save {save[0]['seconds']:.3f} s "
        f"{save[0]['bytes'] / 1e6:.2f} MB, load {load[0]['seconds']:.3f} s"
    )
    assert loss < 1e-6 and norm < 1e-6 and param < 1e-6


def test_resume_under_another_plan(straight, tmp_path):
    d, _, ref = straight
    plan_b = write_plan(tmp_path, "plan_b", "tiny", 3, PLAN_B, use_distributed_optimizer=True)
    res = run_distributed(
        train,
        3,
        plan_b,
        [*ITERS, "--load", str(d / "ckpt"), "--ckpt-step", "2", "--save", str(tmp_path / "ckpt_b")],
        timeout=300,
    )[0]
    assert res["iterations"] == [3, 4]
    loss = max(max_relative_difference(a, b) for a, b in zip(res["losses"], ref["losses"][2:]))
    param = max(max_relative_difference(res["params"][k], ref["params"][k]) for k in ref["params"])
    # Adam's moments went through the reshard too: compare both final checkpoints tensor by tensor.
    a, b = Checkpoint(str(d / "ckpt")), Checkpoint(str(tmp_path / "ckpt_b"))
    assert a.iteration == b.iteration == 4
    assert_written_once(b.meta)
    moments = 0.0
    for s in canonical_shards(load_model("tiny")):
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            moments = max(
                moments,
                max_relative_difference(
                    b.read_full(s.name, s.shape, s.dim, kind),
                    a.read_full(s.name, s.shape, s.dim, kind),
                ),
            )
    save = _events(res, "save_iteration")
    load = _events(res, "load_iteration")
    print(
        f"resume, plan B: max relative difference loss {loss:.2e}, parameters {param:.2e}, "
        f"saved tensors (params, Adam moments) {moments:.2e}; plan B save "
        f"{save[0]['seconds']:.3f} s {save[0]['bytes'] / 1e6:.2f} MB, "
        f"load {load[0]['seconds']:.3f} s"
    )
    assert loss < 1e-5 and param < 1e-5 and moments < 1e-5


def test_checkpoint_layout_and_tensorboard(straight):
    d, plan, ref = straight
    ckpt = d / "ckpt"
    assert (ckpt / TRACKER).read_text() == "4"
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", TRACKER]
    meta = json.loads((ckpt / "iter_0000004" / "checkpoint.json").read_text())
    assert meta["iteration"] == 4 and meta["consumed_samples"] == 32 and meta["adam_step"] == 4
    assert meta["scheduler"]["num_steps"] == 4 and sorted(meta["rng"]) == ["0", "1", "2", "3"]
    assert_written_once(meta)
    # The last checkpoint holds the straight run's final parameters.
    _, _, tensors = read_full_model(str(ckpt))
    assert all(torch.equal(tensors[k], ref["params"][k]) for k in ref["params"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in (
        "lm loss",
        "learning-rate",
        "grad-norm",
        "tokens-per-second",
        "mfu",
        "pipeline-step-time/pipeline-0",
        "pipeline-step-time/pipeline-1",
        "peak-memory-gb/rank-3",
    ):
        assert tag in tags, tag
    assert [round(e.value, 5) for e in acc.Scalars("lm loss")] == [
        round(x, 5) for x in ref["losses"]
    ]


def assert_written_once(meta):
    """Every element of every tensor is in exactly one file, whatever the replication."""
    covered = {}
    for rows in meta["files"].values():
        for row in rows:
            covered.setdefault((row["kind"], row["name"]), []).append(
                (row["start"], row["start"] + row["length"])
            )
    shards = canonical_shards(load_model("tiny"))
    assert set(covered) == {(k, s.name) for s in shards for k in ("param", "exp_avg", "exp_avg_sq")}
    for s in shards:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            pos = 0
            for lo, hi in sorted(covered[(k, s.name)]):
                assert lo == pos, (k, s.name, lo, pos)
                pos = hi
            assert pos == s.shape[s.dim], (k, s.name)


def _broken_copy(straight, tmp_path):
    d = straight[0]
    dst = tmp_path / "ckpt"
    shutil.copytree(d / "ckpt", dst)
    return dst


def _read_everything(path, step=None):
    with Checkpoint(str(path), step) as ckpt:
        for s in canonical_shards(load_model("tiny")):
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                ckpt.read_full(s.name, s.shape, s.dim, kind)


def test_missing_and_corrupt_checkpoints_are_clear_errors(straight, tmp_path):
    ckpt = _broken_copy(straight, tmp_path)
    _read_everything(ckpt)  # the intact copy reads
    with pytest.raises(CheckpointError, match="no such directory"):
        Checkpoint(str(tmp_path / "nowhere"))
    (ckpt / TRACKER).write_text("6")
    with pytest.raises(CheckpointError, match="iter_0000006: missing"):
        Checkpoint(str(ckpt))
    (ckpt / TRACKER).write_text("four")
    with pytest.raises(CheckpointError, match=f"{TRACKER}: corrupt"):
        Checkpoint(str(ckpt))
    (ckpt / TRACKER).unlink()
    with pytest.raises(CheckpointError, match=f"{TRACKER}: missing"):
        Checkpoint(str(ckpt))
    (ckpt / "iter_0000004" / "rank_00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="iter_0000004/rank_00002.safetensors: missing"):
        _read_everything(ckpt, 4)
    path = ckpt / "iter_0000002" / "rank_00001.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        CheckpointError, match="iter_0000002/rank_00001.safetensors: corrupt or truncated"
    ):
        _read_everything(ckpt, 2)
    (ckpt / "iter_0000002" / "checkpoint.json").write_text("{")
    with pytest.raises(CheckpointError, match="iter_0000002/checkpoint.json: corrupt"):
        Checkpoint(str(ckpt), 2)


def test_incompatible_model_names_the_fields(straight):
    ckpt = Checkpoint(str(straight[0] / "ckpt"))
    ckpt.check_model(load_model("tiny"))
    with pytest.raises(
        CheckpointError,
        match=r"different model \(ffn_hidden_size: checkpoint 256, "
        r"this run 192; num_attention_heads: checkpoint 4, "
        r"this run 8; vocab_size: checkpoint 128, this run 120\)",
    ):
        ckpt.check_model(load_model("tiny-gqa"))


def test_flag_errors_and_missing_tensorboard(monkeypatch):
    from megatron_hexi.arguments import parse_args
    from megatron_hexi.tensorboard_log import check_available
    from planner.errors import SpecError

    base = ["--hetero-plan-path", "p.json", "--mock-data", "--train-iters", "2", "--lr", "1e-3"]
    for flags, message in (
        (["--save-interval", "2"], "--save-interval needs --save DIR"),
        (["--ckpt-step", "2"], "--ckpt-step needs --load DIR"),
        (["--finetune"], "--finetune needs --load DIR"),
        (["--save", "d", "--save-interval", "0"], "--save-interval must be"),
        (["--distributed-timeout-minutes", "0"], "must be > 0"),
    ):
        with pytest.raises(SpecError, match=message):
            parse_args(base + flags)
    args = parse_args(
        base + ["--distributed-timeout-minutes", "0.25", "--load", "d", "--hetero-load-if-exists"]
    )
    assert args.distributed_timeout_minutes == 0.25
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)
    with pytest.raises(SpecError, match="--tensorboard-dir needs the tensorboard package"):
        check_available()


def test_interrupted_commits_leave_a_loadable_checkpoint(tmp_path):
    """The states a killed save can leave (one process, no training): a half-written temporary
    directory; a renamed directory whose pointer was not updated yet; a re-save of the same
    iteration killed between its two renames. Each time the pointer's checkpoint loads."""
    from megatron_hexi import checkpoint as ck

    model = load_model("tiny")
    gen = torch.Generator().manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=gen) for s in canonical_shards(model)}
    d = tmp_path / "ckpt"
    ck.save_params_only(str(d), model, tensors, iteration=3)
    # Killed while writing iteration 6: a temporary directory with half a file.
    tmp6 = d / ".iter_0000006.tmp"
    tmp6.mkdir()
    (tmp6 / "rank_00000.safetensors").write_bytes(b"\0" * 100)
    # Killed after renaming iteration 9 into place, before the pointer moved.
    src = d / ".iter_0000009.tmp"
    shutil.copytree(d / "iter_0000003", src)
    ck.commit_directory(str(d), str(src), 9)
    assert (d / TRACKER).read_text() == "3"
    _, _, back = read_full_model(str(d))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    # A re-save of iteration 3 killed between moving the old copy aside and renaming the new one.
    os.replace(d / "iter_0000003", d / ".iter_0000003.tmp.old")
    assert Checkpoint(str(d)).iteration == 3
    _, _, back = read_full_model(str(d))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
