"""The typed run configuration: a Trainer built from a Plan and a RunConfig in code trains exactly
as pretrain_gpt.py does with the same flags, and the flags map onto the RunConfig completely.

The mapping test reads which flags `run_config` looks at: every flag the parser defines is either
read (and changing it changes the config) or listed in NOT_IN_RUN_CONFIG (and never read), and
every RunConfig field is set by some flag. The defaults of the dataclasses are the flags'.
"""

import argparse
import dataclasses
import json
import math

from harness import run_distributed, run_ranks
from megatron_hexi.arguments import NOT_IN_RUN_CONFIG, build_parser, parse_args, run_config
from megatron_hexi.config import (
    DataConfig,
    DropoutConfig,
    LRScheduleConfig,
    OptimizerConfig,
    RunConfig,
    TrainingConfig,
)
from planner.models import load_model
from planner.plan import build_plan, save_plan
from runtime.plans import GLOBAL_BATCH, cpu_cluster

ITERS = 3
# Not the defaults, so that a setting lost on the way would show: warm-up then cosine decay,
# clipping that bites, dropout (RNG streams), another seed.
FLAGS = [
    "--mock-data",
    "--train-iters",
    str(ITERS),
    "--lr",
    "2e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "1",
    "--lr-warmup-init",
    "1e-4",
    "--weight-decay",
    "0.05",
    "--adam-beta2",
    "0.95",
    "--adam-eps",
    "1e-6",
    "--clip-grad",
    "0.5",
    "--attention-dropout",
    "0.05",
    "--hidden-dropout",
    "0.05",
    "--seed",
    "77",
]
CONFIG = RunConfig(
    training=TrainingConfig(train_iters=ITERS, seed=77),
    optimizer=OptimizerConfig(
        lr=2e-3, min_lr=1e-4, weight_decay=0.05, adam_beta2=0.95, adam_eps=1e-6, clip_grad=0.5
    ),
    lr_schedule=LRScheduleConfig(lr_decay_style="cosine", lr_warmup_iters=1, lr_warmup_init=1e-4),
    dropout=DropoutConfig(attention_dropout=0.05, hidden_dropout=0.05),
    data=DataConfig(mock_data=True),
)
REQUIRED = ["--hetero-plan-path", "p.json", "--train-iters", "3", "--lr", "1e-3"]


def _plan():
    """Two stages of one pipeline (a stage boundary, first and last stage apart)."""
    return build_plan(
        cpu_cluster(2),
        load_model("tiny"),
        GLOBAL_BATCH,
        [
            {
                "micro_batch_size": 2,
                "num_microbatches": 4,
                "stages": [{"ranks": [0], "layers": [0, 2]}, {"ranks": [1], "layers": [2, 4]}],
            }
        ],
    )


def _train_from_code(plan, config):
    """A Trainer from the Plan and the RunConfig, no flags: per step (loss, grad norm, lr)."""
    from megatron_hexi.training import Trainer, init_distributed

    trainer = Trainer(plan, config, init_distributed(plan, config))
    steps = [trainer.train_step(it) for it in range(config.training.train_iters)]
    return [(m["lm_loss"], m["grad_norm"], m["lr"]) for m in steps]


def test_trainer_from_code_equals_pretrain_gpt(tmp_path, repo_root):
    assert run_config(parse_args(["--hetero-plan-path", "p.json", *FLAGS])) == CONFIG
    plan = _plan()
    save_plan(plan, tmp_path / "plan.json")
    metrics = tmp_path / "metrics.jsonl"
    runs = run_ranks(
        [
            repo_root / "pretrain_gpt.py",
            "--hetero-plan-path",
            tmp_path / "plan.json",
            *FLAGS,
            "--hetero-metrics-path",
            metrics,
        ],
        2,
        cwd=repo_root,
    )
    for code, _, err in runs:
        assert code == 0, err
    by_flags = [
        (m["lm_loss"], m["grad_norm"], m["lr"])
        for m in map(json.loads, metrics.read_text().splitlines())
    ]
    from_code = run_distributed(
        _train_from_code, 2, plan, CONFIG, timeout=240, env={"OMP_NUM_THREADS": "1"}
    )[0]
    assert from_code == by_flags  # exactly: the same computation
    assert len(from_code) == ITERS and all(math.isfinite(x) for s in from_code for x in s)
    losses = [s[0] for s in from_code]
    assert losses[-1] < losses[0], losses  # it trains
    assert abs(from_code[0][2] - 2e-3) < 1e-12 and from_code[-1][2] < 1e-3  # warm-up, decay


def _flat(config):
    """{"group.field": value} of a RunConfig."""
    return {
        f"{g.name}.{f.name}": getattr(getattr(config, g.name), f.name)
        for g in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, g.name))
    }


class _Reads(argparse.Namespace):
    """A Namespace that records which attributes are read."""

    def __init__(self, args):
        super().__init__(**vars(args))
        object.__setattr__(self, "read", set())

    def __getattribute__(self, name):
        if not name.startswith("_") and name != "read" and name in vars(self):
            object.__getattribute__(self, "read").add(name)
        return object.__getattribute__(self, name)


# samples instead of iterations, under a plan's global batch of 8
SAMPLE_FLAGS = {
    "train_samples": ["--train-samples", "16"],
    "lr_decay_samples": ["--train-samples", "24", "--lr-decay-samples", "16"],
    "lr_warmup_samples": ["--train-samples", "24", "--lr-warmup-samples", "8"],
}


def _variant(dest, action):
    """(argv, the plan's global batch) with `dest` at a value other than its default."""
    if dest in SAMPLE_FLAGS:
        at = BASE.index("--train-iters")
        return BASE[:at] + BASE[at + 2 :] + SAMPLE_FLAGS[dest], 8
    if dest == "manual_gc_interval":
        return BASE + ["--manual-gc", "--manual-gc-interval", "7"], None
    return BASE + _other_value(action), None


def _other_value(action):
    """argv for `action` giving a value other than its default (and valid with BASE)."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # store_true / store_false
        return [flag]
    if action.choices:
        return [flag, next(c for c in action.choices if c not in (action.default, *BASE))]
    if action.dest == "split":
        return [flag, "1,0,0"]
    if action.dest == "loss_scale":  # a constant scale needs 16-bit parameters
        return [flag, "8", "--fp16"]
    if action.dest == "loss_scale_window":  # whole steps
        return [flag, "7"]
    if action.nargs == "+":
        return [flag, "other"]
    if action.type is int:
        return [flag, "7"]
    if action.type is not None:  # finite_float
        return [flag, "0.25"]
    return [flag, "other"]


# Every flag can be given on top of this (a --save and a --load for the flags that need them).
BASE = [
    "--hetero-plan-path",
    "p.json",
    "--train-iters",
    "3",
    "--lr",
    "1e-3",
    "--data-path",
    "corpus",
    "--tokenizer-type",
    "HuggingFaceTokenizer",
    "--tokenizer-model",
    "tok",
    "--save",
    "s",
    "--load",
    "l",
]


def test_every_flag_maps_onto_the_run_config():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert NOT_IN_RUN_CONFIG <= actions.keys(), NOT_IN_RUN_CONFIG - actions.keys()
    # run_config reads exactly the flags that are not excluded
    reads = _Reads(parse_args(BASE))
    run_config(reads)
    assert reads.read == actions.keys() - NOT_IN_RUN_CONFIG, (
        f"not read: {sorted(actions.keys() - NOT_IN_RUN_CONFIG - reads.read)}; read but "
        f"excluded: {sorted(reads.read & NOT_IN_RUN_CONFIG)}"
    )
    # each of them reaches the config, and together they set every field
    base = _flat(run_config(parse_args(BASE)))
    reached = set()
    for dest in sorted(reads.read):
        argv, global_batch = _variant(dest, actions[dest])
        changed = _flat(run_config(parse_args(argv), global_batch))
        fields = {k for k in base if changed[k] != base[k]}
        assert fields, f"--{dest.replace('_', '-')} does not change the RunConfig"
        reached |= fields
    assert reached == base.keys(), sorted(base.keys() - reached)


def test_defaults_are_the_flag_defaults():
    assert run_config(parse_args(REQUIRED + ["--mock-data"])) == RunConfig(
        training=TrainingConfig(train_iters=3),
        optimizer=OptimizerConfig(lr=1e-3),
        data=DataConfig(mock_data=True),
    )
    config = run_config(
        parse_args(
            REQUIRED
            + [
                "--data-path",
                "a",
                "b",
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                "t",
            ]
        )
    )
    assert config.data.data_path == ("a", "b")  # a tuple: the config is hashable
    assert hash(config) == hash(
        run_config(
            parse_args(
                REQUIRED
                + [
                    "--data-path",
                    "a",
                    "b",
                    "--tokenizer-type",
                    "HuggingFaceTokenizer",
                    "--tokenizer-model",
                    "t",
                ]
            )
        )
    )
