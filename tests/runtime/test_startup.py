"""Start-up from a plan: bad flags, bad plans, world-size and node mismatches are one clear error
(exit code 2, no traceback, no hang), and processes map to plan ranks whatever their launch order.
"""

import json

import pytest

import harness
from megatron_hexi.rank_mapping import Identity, LaunchError, resolve_ranks
from planner.plan import load_plan
from runtime.entry import REPO_FLAGS, run_entry


@pytest.fixture(scope="module")
def plan_path(repo_root):
    return repo_root / "examples/plans/hetero-4rank.json"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--context-parallel-size", "2"], "--context-parallel-size is refused: context paral"),
        (["--sequence-parallel"], "--sequence-parallel contradicts the plan (sequence_parallel"),
        (["--use-distributed-optimizer"], "--use-distributed-optimizer contradicts the plan"),
        (["--hidden-size", "128"], "--hidden-size 128 contradicts the plan's model hidden_size 64"),
        (
            ["--global-batch-size", "16"],
            "--global-batch-size 16 contradicts the plan's global_batch_size 8",
        ),
        (
            ["--micro-batch-size", "1"],
            "--micro-batch-size 1 contradicts the plan's micro-batch sizes [1, 2]",
        ),
        (["--tensor-model-parallel-size", "2"], "contradicts the plan's TP degrees [1, 2]"),
    ],
)
def test_flag_errors(repo_root, plan_path, flags, message):
    code, err = run_entry(repo_root, "--hetero-plan-path", plan_path, *REPO_FLAGS, *flags)
    assert code == 2, err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr", "nan"], "argument --lr: must be a finite number, got 'nan'"),
        (["--lr", "-1"], "--lr must be >= 0, got -1.0"),
        (["--lr", "1e999"], "argument --lr: must be a finite number, got '1e999'"),
        (["--clip-grad", "-1"], "--clip-grad must be >= 0, got -1.0"),
        (
            ["--distributed-timeout-minutes", "nan"],
            "argument --distributed-timeout-minutes: must be a finite number",
        ),
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0"),
        (["--attention-dropout", "2"], "--attention-dropout must be >= 0 and <= 1, got 2.0"),
        (["--adam-beta2", "1"], "--adam-beta2 must be >= 0 and < 1, got 1.0"),
        (["--norm-epsilon", "inf"], "argument --norm-epsilon: must be a finite number"),
        (["--seed", "-1"], "--seed must be >= 0 and <= 4294967295, got -1"),
        (["--split", "abc"], "--split 'abc': give up to three non-negative weights"),
        (["--split", "1,nan,0"], "--split '1,nan,0': give up to three non-negative weights"),
        (["--hidden-size", "x"], "argument --hidden-size: invalid int value: 'x'"),
        (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1, got 0"),
    ],
)
def test_bad_flag_values(flags, message):
    """Parsed in this process: every flag value outside its range is one SpecError line."""
    from megatron_hexi.arguments import parse_args
    from planner.errors import SpecError

    with pytest.raises(SpecError) as e:
        parse_args(["--hetero-plan-path", "p.json", *REPO_FLAGS, *flags])
    assert e.value.problems == [e.value.problems[0]] and message in e.value.problems[0], (
        e.value.problems
    )


@pytest.mark.parametrize("field", ["overlap_grad_reduce", "overlap_param_gather"])
def test_overlap_flags_follow_the_plan(plan_path, field):
    """--overlap-grad-reduce / --overlap-param-gather are the plan's to decide: given against a
    plan without them, one clear error; against a plan with them, accepted."""
    import dataclasses

    from megatron_hexi.arguments import check_against_plan, parse_args
    from planner.errors import SpecError

    flag = "--" + field.replace("_", "-")
    args = parse_args(["--hetero-plan-path", str(plan_path), *REPO_FLAGS, flag])
    plan = load_plan(plan_path)
    with pytest.raises(SpecError) as e:
        check_against_plan(args, plan)
    assert e.value.problems == [
        f"{flag} contradicts the plan ({field}: false); re-plan with hexi-plan ... {flag}"
    ]
    training = dataclasses.replace(plan.training, use_distributed_optimizer=True, **{field: True})
    check_against_plan(args, dataclasses.replace(plan, training=training))


@pytest.mark.parametrize(
    "flags, plan_backend, message",
    [
        (
            ["--attention-backend", "flash"],
            "unfused",
            "--attention-backend flash contradicts the plan (attention_backend: unfused); "
            "re-plan with hexi-plan ... --attention-backend flash",
        ),
        (
            ["--use-flash-attn"],
            "unfused",
            "--attention-backend flash contradicts the plan (attention_backend: unfused)",
        ),
        (["--use-flash-attn"], "auto", None),  # the same fused module runs (planner.attention)
        (
            ["--use-flash-attn", "--attention-backend", "unfused"],
            "flash",
            "--use-flash-attn contradicts --attention-backend unfused",
        ),
        (["--attention-backend", "auto"], "auto", None),
        (["--use-flash-attn"], "flash", None),
        ([], "unfused", None),
    ],
)
def test_attention_backend_follows_the_plan(plan_path, flags, plan_backend, message):
    """--attention-backend (and --use-flash-attn, Megatron-LM's alias of flash) must name the
    plan's training.attention_backend; --use-flash-attn also runs under an `auto` plan."""
    import dataclasses

    from megatron_hexi.arguments import check_against_plan, parse_args
    from planner.errors import SpecError

    args = parse_args(["--hetero-plan-path", str(plan_path), *REPO_FLAGS, *flags])
    plan = load_plan(plan_path)
    plan = dataclasses.replace(
        plan, training=dataclasses.replace(plan.training, attention_backend=plan_backend)
    )
    if message is None:
        check_against_plan(args, plan)
        return
    with pytest.raises(SpecError) as e:
        check_against_plan(args, plan)
    assert len(e.value.problems) == 1 and message in e.value.problems[0], e.value.problems


def test_bad_flag_value_is_one_line(repo_root, plan_path):
    code, err = run_entry(repo_root, "--hetero-plan-path", plan_path, *REPO_FLAGS, "--lr", "nan")
    assert code == 2 and err == (
        "pretrain_gpt.py: error: argument --lr: must be a finite number, got 'nan'\n"
    ), err


def test_plan_errors(repo_root, tmp_path):
    code, err = run_entry(repo_root, "--hetero-plan-path", tmp_path / "missing.json", *REPO_FLAGS)
    assert code == 2 and "missing.json: cannot read plan" in err and "Traceback" not in err, err
    bad = json.loads((repo_root / "examples/plans/hetero-4rank.json").read_text())
    bad["pipelines"][0]["stages"][0]["shards"]["ffn"] = [200, 50]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    code, err = run_entry(repo_root, "--hetero-plan-path", tmp_path / "bad.json", *REPO_FLAGS)
    assert code == 2, err
    assert "pipelines[0].stages[0].shards.ffn: sums to 250, model ffn_hidden_size is 256" in err
    latin1 = (
        (repo_root / "examples/plans/hetero-4rank.json")
        .read_bytes()
        .replace(b'"mini-hetero"', b'"mini-h\xe9t\xe9ro"')
    )
    (tmp_path / "latin1.json").write_bytes(latin1)
    code, err = run_entry(repo_root, "--hetero-plan-path", tmp_path / "latin1.json", *REPO_FLAGS)
    assert code == 2 and len(err.splitlines()) == 1 and "UTF-8" in err, err


def run_ranks(repo_root, world, args, env=None):
    """pretrain_gpt.py on `world` ranks as plain processes: [(exit code, stderr)] per rank."""
    return [
        (code, err)
        for code, _, err in harness.run_ranks(
            [repo_root / "pretrain_gpt.py", *args], world, env=env, cwd=repo_root
        )
    ]


def test_world_size_mismatch_fails_on_every_rank(repo_root, plan_path):
    results = run_ranks(repo_root, 2, ["--hetero-plan-path", plan_path, *REPO_FLAGS])
    for code, err in results:
        assert code == 2, err
        assert "world size 2 does not match the plan's 4 ranks" in err and "Traceback" not in err


def test_unknown_plan_node_fails_on_every_rank(repo_root, plan_path):
    results = run_ranks(
        repo_root,
        4,
        ["--hetero-plan-path", plan_path, *REPO_FLAGS],
        env={"HEXI_PLAN_NODE": "h100-7"},
    )
    for code, err in results:
        assert code == 2, err
        assert "says node 'h100-7', which is not a node of cluster 'mini-hetero'" in err, err
        assert "Traceback" not in err, err


def _ids(*entries):
    return [Identity(i, node, "host", lr, dev) for i, (node, lr, dev) in enumerate(entries)]


def test_rank_mapping(plan_path):
    plan = load_plan(plan_path)  # ranks: a100:0, a100:1, rtx4090:0, rtx3090:0
    # Launch order differs from plan order: mapping follows (node, local rank).
    ids = _ids(("rtx3090", 0, "cpu"), ("a100", 1, "cpu"), ("rtx4090", 0, "cpu"), ("a100", 0, "cpu"))
    assert resolve_ranks(plan, ids, check_devices=False) == {0: 3, 1: 1, 2: 2, 3: 0}
    # No node names at all: launch order.
    assert resolve_ranks(plan, _ids(*[("", i, "cpu") for i in range(4)]), False) == {
        0: 0,
        1: 1,
        2: 2,
        3: 3,
    }
    # Device types are checked when running on GPUs.
    ids = _ids(
        ("a100", 0, "NVIDIA A100-SXM4-80GB"),
        ("a100", 1, "NVIDIA A100-SXM4-80GB"),
        ("rtx4090", 0, "NVIDIA GeForce RTX 3090"),
        ("rtx3090", 0, "NVIDIA GeForce RTX 3090"),
    )
    with pytest.raises(LaunchError, match="plan rank 2 .* expects RTX-4090, but the device is"):
        resolve_ranks(plan, ids, check_devices=True)
    with pytest.raises(LaunchError, match="has local rank 1, but the plan uses no such GPU"):
        resolve_ranks(
            plan,
            _ids(
                ("a100", 0, "cpu"), ("a100", 1, "cpu"), ("rtx4090", 1, "cpu"), ("rtx3090", 0, "cpu")
            ),
            False,
        )
    with pytest.raises(LaunchError, match="could not be placed"):
        resolve_ranks(
            plan,
            _ids(("a100", 0, "cpu"), ("", 1, "cpu"), ("rtx4090", 0, "cpu"), ("rtx3090", 0, "cpu")),
            False,
        )
