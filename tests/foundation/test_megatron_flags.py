"""Megatron-LM's pretraining flags in pretrain_gpt.py, checked without launching anything: every
refusal is one line naming the flag and what to use instead, every problem of a command line
comes in one message, the honoured flags reach the RunConfig as Megatron-LM computes them, the
plan-checked ones agree with the plan or say what it holds, every flag's help shows its default,
and docs/megatron-flags.md is the parser's own table.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_hexi.arguments import check_command_line, parse_args, run_config
from megatron_hexi.flag_docs import markdown, rows
from megatron_hexi.flags import build_parser
from megatron_hexi.plan_flags import padded_vocab
from megatron_hexi.refused_flags import REFUSED
from planner.errors import SpecError
from planner.models import load_model
from planner.plan import load_plan
from runtime.plans import REFERENCE, TWO_STAGES, write_plan

BASE = ["--mock-data", "--train-iters", "4", "--lr", "1e-3"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Plans of the tiny model (4 layers, 4 query groups, vocab 128, seq 32, gbs 8): one rank,
    two stages that recompute, and variants of the model."""
    d = tmp_path_factory.mktemp("plans")
    tiny = load_model("tiny")
    return {
        "one": write_plan(d, "one", "tiny", 1, REFERENCE, attention_backend="auto"),
        "recompute": write_plan(d, "recompute", "tiny", 2, TWO_STAGES, recompute=True),
        "mqa": write_plan(d, "mqa", dataclasses.replace(tiny, num_query_groups=1), 1, REFERENCE),
        "learned": write_plan(
            d,
            "learned",
            dataclasses.replace(
                tiny, position_embedding_type="learned_absolute", max_position_embeddings=64
            ),
            1,
            REFERENCE,
        ),
    }


def problems(argv):
    """The problems check_command_line reports for `argv` ([] if none)."""
    try:
        check_command_line([str(a) for a in argv])
    except SpecError as e:
        return [str(p) for p in e.problems]
    return []


def _values(r):
    return {0: [], 1: ["x"], 3: ["16", "16", "100"]}[r.nargs]


@pytest.mark.parametrize("refused", REFUSED, ids=[r.flag for r in REFUSED])
def test_each_refusal_is_one_line_saying_what_instead(refused):
    with pytest.raises(SpecError) as e:
        parse_args(["--hetero-plan-path", "p.json", *BASE, refused.flag, *_values(refused)])
    (line,) = e.value.problems
    assert line.startswith(f"{refused.flag} is refused: ") and "\n" not in line
    why, instead = line.split("; ", 1)  # why, then what to do instead
    assert len(why) > len(refused.flag) + 15 and len(instead) > 10, line


def test_every_problem_of_a_command_line_in_one_message(plans):
    """A bad choice (argparse's own error, which used to stop the parse), a bad number, an
    unknown flag, two refused flags, a range, a cross-flag problem and a contradiction with the
    plan file: all reported together, one line each."""
    found = problems(
        [
            "--hetero-plan-path",
            plans["one"],
            *BASE,
            "--lr-decay-style",
            "wavy",
            "--hidden-size",
            "x",
            "--made-up-flag",
            "--rampup-batch-size",
            "16",
            "16",
            "100",
            "--use-checkpoint-args",
            "--clip-grad",
            "-1",
            "--manual-gc-interval",
            "5",
            "--num-layers",
            "12",
        ]
    )
    expected = [
        "argument --lr-decay-style: invalid choice: 'wavy'",
        "argument --hidden-size: invalid int value: 'x'",
        "unsupported flag: --made-up-flag",
        "--rampup-batch-size is refused: a plan fixes the global batch size",
        "--use-checkpoint-args is refused: the plan fixes the model",
        "--clip-grad must be >= 0, got -1.0",
        "--manual-gc-interval needs --manual-gc",
        "--num-layers 12 contradicts the plan's model num_layers 4",
    ]
    assert len(found) == len(expected), found
    for line, start in zip(found, expected, strict=True):
        assert line.startswith(start), (line, start)


def test_every_flag_has_help_and_shows_its_default():
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = formatter._expand_help(action)
        refused = text.startswith("refused: ")  # no default: the flag is an error
        assert action.help and ("default" in text or refused), action.option_strings[0]


def test_docs_table_is_the_parsers():
    """docs/megatron-flags.md is flag_docs' output (regenerate: python -m
    megatron_hexi.flag_docs > docs/megatron-flags.md), so it lists exactly the parser's flags,
    the refused ones included, with the status the code gives them."""
    from conftest import REPO

    assert (REPO / "docs/megatron-flags.md").read_text() == markdown()
    table = {flag: state for _, flag, state, _ in rows()}
    parser_flags = {a.option_strings[0] for a in build_parser()._actions if a.option_strings} - {
        "-h"
    }
    assert set(table) == parser_flags
    assert {r.flag for r in REFUSED} <= {f for f, s in table.items() if s == "refused"}
    expected = {
        "--no-masked-softmax-fusion": "honoured",
        "--no-bias-dropout-fusion": "honoured",
        "--no-rope-fusion": "honoured",
        "--manual-gc": "honoured",
        "--manual-gc-interval": "honoured",
        "--exit-duration-in-mins": "honoured",
        "--lr-warmup-fraction": "honoured",
        "--train-samples": "honoured",
        "--lr-decay-samples": "honoured",
        "--lr-warmup-samples": "honoured",
        "--recompute-method": "honoured",
        "--make-vocab-size-divisible-by": "honoured",
        "--log-world-size-to-tensorboard": "honoured",
        "--exit-on-missing-checkpoint": "honoured",
        "--log-params-norm": "honoured",
        "--no-position-embedding": "checked against the plan",
        "--use-rotary-position-embeddings": "checked against the plan",
        "--log-num-zeros-in-grad": "refused",
        "--qk-layernorm": "refused",
        "--use-cpu-initialization": "accepted, no effect",
        "--no-create-attention-mask-in-dataloader": "accepted, no effect",
        "--use-rope-scaling": "checked against the plan",
        "--use-mcore-models": "accepted, no effect",
        "--calculate-per-token-loss": "accepted, no effect",
        "--timing-log-level": "accepted, no effect",
        "--log-timers-to-tensorboard": "accepted, no effect",
        "--log-validation-ppl-to-tensorboard": "accepted, no effect",
        "--log-memory-to-tensorboard": "accepted, no effect",
        "--hetero-load-if-exists": "accepted, no effect",
        "--init-method-std": "checked against the plan",
        "--group-query-attention": "checked against the plan",
        "--use-flash-attn": "checked against the plan",
        "--max-position-embeddings": "checked against the plan",
        "--rampup-batch-size": "refused",
        "--ckpt-format": "refused",
        "--use-checkpoint-args": "refused",
        "--recompute-activations": "refused",
    }
    assert {f: table[f] for f in expected} == expected


def _config(plan_path, *flags):
    return check_command_line(["--hetero-plan-path", str(plan_path), *map(str, flags)]).config


def test_samples_become_iterations_of_the_plans_global_batch(plans):
    """As Megatron-LM without ramp-up: iterations = samples / global batch (the plan's 8)."""
    c = _config(
        plans["one"],
        "--mock-data",
        "--lr",
        "1e-3",
        "--train-samples",
        "32",
        "--lr-decay-samples",
        "24",
        "--lr-warmup-samples",
        "8",
    )
    assert c.training.train_iters == 4
    assert (c.lr_schedule.lr_decay_iters, c.lr_schedule.lr_warmup_iters) == (3, 1)
    found = problems(
        ["--hetero-plan-path", plans["one"], "--mock-data", "--lr", "1e-3", "--train-samples", 30]
    )
    assert found == [
        "--train-samples 30 is not a multiple of the global batch size 8; give a multiple "
        "(iterations are whole global batches)"
    ]
    found = problems(
        ["--hetero-plan-path", plans["one"], *BASE, "--train-samples", 32, "--lr-decay-iters", 3]
    )
    assert found == ["give one of --train-iters and --train-samples, got both"]
    found = problems(["--hetero-plan-path", plans["one"], *BASE, "--lr-warmup-samples", 8])
    assert found == [
        "--lr-warmup-samples goes with --train-samples; with --train-iters use --lr-warmup-iters"
    ]


def test_honoured_flags_reach_the_run_config(plans):
    c = _config(
        plans["recompute"],
        *BASE,
        "--lr-warmup-fraction",
        "0.25",
        "--manual-gc",
        "--manual-gc-interval",
        "10",
        "--exit-duration-in-mins",
        "230",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "2",
        "--log-world-size-to-tensorboard",
        "--save",
        "s",
        "--load",
        "s",
        "--exit-on-missing-checkpoint",
    )
    assert c.lr_schedule.lr_warmup_fraction == 0.25 and c.lr_schedule.lr_warmup_iters == 0
    t = c.training
    assert (t.manual_gc, t.manual_gc_interval, t.exit_duration_in_mins) == (True, 10, 230.0)
    assert (t.recompute_method, t.recompute_num_layers) == ("block", 2)
    assert c.logging.log_world_size_to_tensorboard
    assert c.checkpoint.exit_on_missing_checkpoint
    # accepted with no effect: the same RunConfig as without them
    quiet = [
        "--use-mcore-models",
        "--timing-log-level",
        "2",
        "--log-timers-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--log-memory-to-tensorboard",
        "--hetero-load-if-exists",
        "--use-cpu-initialization",
        "--no-create-attention-mask-in-dataloader",
        "--tensorboard-queue-size",
        "10",
        "--load",
        "s",
    ]
    assert _config(plans["one"], *BASE, *quiet) == _config(plans["one"], *BASE, "--load", "s")
    assert problems(["--hetero-plan-path", plans["one"], *BASE, "--lr-warmup-fraction", 0.1,
                     "--lr-warmup-iters", 2]) == [
        "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both give the warm-up; "
        "keep one"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "plan, flags, message",
    [
        ("recompute", ["--recompute-method", "uniform", "--recompute-num-layers", "1"], None),
        ("recompute", ["--recompute-method", "block", "--recompute-num-layers", "2"], None),
        (
            "recompute",
            ["--recompute-method", "uniform", "--recompute-num-layers", "2"],
            "--recompute-method uniform --recompute-num-layers 2: the plan (recompute: true) "
            "holds one recomputed layer at a time, not 2; give --recompute-num-layers 1",
        ),
        (
            "recompute",
            ["--recompute-method", "block", "--recompute-num-layers", "1"],
            "--recompute-method block --recompute-num-layers 1: block leaves layers past the "
            "first 1 of a stage unrecomputed, but the plan (recompute: true) recomputes all (2 "
            "in its largest stage); give --recompute-num-layers 2 or --recompute-method uniform",
        ),
        (
            "one",
            ["--recompute-method", "uniform", "--recompute-num-layers", "1"],
            "--recompute-method uniform --recompute-num-layers 1 contradicts the plan "
            "(recompute: false); re-plan with hexi-plan ... --recompute, or drop the flag",
        ),
        (
            "recompute",
            ["--recompute-granularity", "selective"],
            "--recompute-granularity selective is not supported; use --recompute-granularity "
            "full with a plan that recomputes, or drop the flag",
        ),
        (
            "one",
            ["--recompute-activations"],
            "--recompute-activations (selective recompute) is not supported; use "
            "--recompute-granularity full, or plan with recompute",
        ),
        ("one", ["--group-query-attention", "--num-query-groups", "4"], None),
        (
            "one",
            ["--group-query-attention"],
            "--group-query-attention without --num-query-groups means 1 query group "
            "(Megatron-LM's default), but the plan's model has num_query_groups 4; add "
            "--num-query-groups 4",
        ),
        ("mqa", ["--group-query-attention"], None),
        ("one", ["--max-position-embeddings", "4096"], None),  # rope: no effect
        ("one", ["--no-position-embedding"], None),
        ("one", ["--use-rotary-position-embeddings"], None),
        (
            "learned",
            ["--use-rotary-position-embeddings"],
            "--use-rotary-position-embeddings contradicts the plan's model (learned_absolute "
            "positions)",
        ),
        ("one", ["--rotary-percent", "1.0", "--rope-scaling-factor", "8"], None),
        (
            "one",
            ["--rotary-percent", "0.5"],
            "--rotary-percent 0.5: the plan's model rotates the whole head (1.0); drop the flag",
        ),
        (
            "one",
            ["--use-rope-scaling"],
            "--use-rope-scaling contradicts the plan's model (rope_scaling: false)",
        ),
        (
            "one",
            ["--rope-scaling-factor", "32"],
            "--rope-scaling-factor 32.0 contradicts the plan's model rope_scaling_factor 8.0; "
            "drop the flag, or plan a model (YAML) with rope_scaling_factor: 32.0",
        ),
        (
            "learned",
            ["--no-position-embedding"],
            "--no-position-embedding contradicts the plan's model (learned_absolute positions)",
        ),
        (
            "one",
            ["--max-position-embeddings", "16"],
            "--max-position-embeddings 16 is below the sequence length 32; give at least 32",
        ),
        ("learned", ["--max-position-embeddings", "64"], None),
        (
            "learned",
            ["--max-position-embeddings", "4096"],
            "--max-position-embeddings 4096 contradicts the plan's model (learned_absolute "
            "positions, 64 rows)",
        ),
        (
            "one",
            ["--position-embedding-type", "learned_absolute"],
            "--position-embedding-type learned_absolute contradicts the plan's model (rope)",
        ),
        ("one", ["--init-method-std", "0.02"], None),
        (
            "one",
            ["--init-method-std", "0.006"],
            "--init-method-std 0.006 contradicts the plan's model init_method_std 0.02; drop "
            "the flag, or plan a model (YAML) with init_method_std: 0.006",
        ),
        ("one", ["--make-vocab-size-divisible-by", "128"], None),
        (
            "one",
            ["--make-vocab-size-divisible-by", "100"],
            "--make-vocab-size-divisible-by 100: the mock data's vocabulary (128 tokens) pads "
            "to 200 (a multiple of 100 x TP 1), but the plan's model vocab_size is 128; plan "
            "with vocab_size 200, or give a value that pads to 128",
        ),
        ("one", ["--use-flash-attn"], None),  # an `auto` plan: the same fused module
        ("one", ["--use-mcore-models", "--timing-log-level", "1"], None),
    ],
)
def test_flags_checked_against_the_plan(plans, plan, flags, message):
    found = problems(["--hetero-plan-path", plans[plan], *BASE, *flags])
    assert found == ([] if message is None else [message])


def test_padded_vocab_is_megatron_lms():
    """Up to a multiple of divisible-by x TP (several TP degrees: their least common multiple)."""
    assert padded_vocab(32000, 128, [1]) == 32000
    assert padded_vocab(50257, 128, [1]) == 50304
    assert padded_vocab(50257, 128, [2]) == 50432
    assert padded_vocab(50257, 128, [2, 3]) == 50688
    assert padded_vocab(120, 128, [1, 2]) == 256


def test_plan_and_run_config_agree_on_the_global_batch(plans):
    """run_config without a plan converts samples with --global-batch-size (planning at
    start-up needs it), and says what is missing without either."""
    args = parse_args(
        ["--hetero-plan-path", "p.json", "--mock-data", "--lr", "1", "--train-samples", "16"]
    )
    with pytest.raises(SpecError, match="--train-samples needs the global batch size"):
        run_config(args)
    assert run_config(args, 8).training.train_iters == 2
    assert load_plan(plans["one"]).global_batch_size == 8
    assert isinstance(args, argparse.Namespace)


def test_bf16_on_gpus_without_it_is_refused(plans, tmp_path):
    """V100 and T4 have no bf16 tensor cores (the catalog says so): a plan over a T4 refuses
    --bf16 and names --fp16; fp16 and fp32 run; a plan of GPUs with bf16 takes --bf16."""
    from planner.catalog import get_gpu
    from planner.cluster import load_cluster_dict
    from planner.plan import build_plan, save_plan

    assert [get_gpu(g).bf16 for g in ("V100-SXM2", "V100-PCIE", "T4", "A100-SXM-80GB")] == [
        False,
        False,
        False,
        True,
    ]
    node = {"name": "t4", "gpu": "T4", "gpus_per_node": 1, "intra_node": "host", "nic": "10 Gbit/s"}
    cluster = load_cluster_dict({"name": "t4", "nodes": [node]})
    path = tmp_path / "t4.json"
    save_plan(build_plan(cluster, load_model("tiny"), 8, REFERENCE), path)
    t4 = ["--hetero-plan-path", path, *BASE]
    assert problems([*t4, "--bf16"]) == [
        "--bf16: the plan's T4 have no bf16 tensor cores; train with --fp16 (loss scaling), or "
        "plan without them"
    ]
    assert problems([*t4, "--fp16"]) == problems(t4) == []
    assert problems(["--hetero-plan-path", plans["one"], *BASE, "--bf16"]) == []
