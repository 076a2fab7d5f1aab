"""How pretrain_gpt.py's flags are read: argparse that collects every bad value instead of stopping
at the first, help that shows every default, and the checks a flag needs on its own (numeric
ranges, the --split syntax). megatron_hexi.flags defines the flags.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

from planner.errors import SpecError


def finite_float(text: str) -> float:
    """argparse type: a float that is finite (`nan`, `inf` and `1e999` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse that reads the whole command line: a bad value (not a choice, not a number) is
    noted in `problems` and the parse goes on, so that every problem of a command line is in one
    message (megatron_hexi.arguments); what argparse cannot go on from is a SpecError."""

    problems: list[str]
    bad: set[str]  # the dests of the flags whose value was bad (left None)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.problems, self.bad = [], set()
        return super().parse_known_args(args, namespace)

    def _get_value(self, action: argparse.Action, arg_string: str) -> object:
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as e:
            self.problems.append(str(e))
            self.bad.add(action.dest)
            return None

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if value is None:  # a value _get_value could not read: already noted
            return
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            self.problems.append(str(e))
            self.bad.add(action.dest)

    def error(self, message: str) -> NoReturn:
        raise SpecError([*self.problems, message])


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it (or the flag is
    refused: it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or text.startswith("refused:"):
            return text
        if action.nargs == 0:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class Range(NamedTuple):
    """Allowed values of a numeric flag: [low, high], either end open or absent."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def describe(self) -> str:
        low = f"{'>' if self.low_open else '>='} {self.low}"
        if self.high is None:
            return low
        return f"{low} and {'<' if self.high_open else '<='} {self.high}"

    def holds(self, value: float) -> bool:
        above = value > self.low or (value == self.low and not self.low_open)
        below = (
            self.high is None or value < self.high or (value == self.high and not self.high_open)
        )
        return above and below


RANGES = {
    "lr": Range(0),
    "min_lr": Range(0),
    "lr_warmup_init": Range(0),
    "weight_decay": Range(0),
    "clip_grad": Range(0),
    "adam_beta1": Range(0, 1, high_open=True),
    "adam_beta2": Range(0, 1, high_open=True),
    "adam_eps": Range(0, low_open=True),
    "attention_dropout": Range(0, 1),
    "hidden_dropout": Range(0, 1),
    "norm_epsilon": Range(0, low_open=True),
    "distributed_timeout_minutes": Range(0, low_open=True),
    "train_iters": Range(1),
    "log_interval": Range(1),
    "lr_decay_iters": Range(1),
    "lr_warmup_iters": Range(0),
    "seed": Range(0, 2**32 - 1),
    "micro_batch_size": Range(1),
    "global_batch_size": Range(1),
    "save_interval": Range(1),
    "exit_interval": Range(1),
    "tensorboard_log_interval": Range(1),
    "ckpt_step": Range(0),
    "eval_interval": Range(1),
    "eval_iters": Range(0),
    "ddp_bucket_size": Range(1),
    "init_method_std": Range(0, low_open=True),
    "max_position_embeddings": Range(1),
    "make_vocab_size_divisible_by": Range(1),
    "recompute_num_layers": Range(1),
    "manual_gc_interval": Range(0),
    "exit_duration_in_mins": Range(0, low_open=True),
    "lr_warmup_fraction": Range(0, 1),
    "train_samples": Range(1),
    "lr_decay_samples": Range(1),
    "lr_warmup_samples": Range(0),
}


def range_problems(args: argparse.Namespace) -> list[str]:
    """One line per numeric flag that is given outside its range."""
    return [
        f"--{flag.replace('_', '-')} must be {r.describe()}, got {getattr(args, flag)}"
        for flag, r in RANGES.items()
        if getattr(args, flag, None) is not None and not r.holds(getattr(args, flag))
    ]


SPLIT = re.compile(r"^\s*[0-9.eE+]+(\s*[,/]\s*[0-9.eE+]+){0,2}\s*$")


def check_split(text: str) -> None:
    """--split in Megatron's syntax: up to three non-negative weights (train, valid, test),
    separated by ',' or '/', with a positive sum."""
    parts = re.split(r"\s*[,/]\s*", text.strip()) if SPLIT.match(text) else []
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if not weights or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise SpecError(
            f"--split {text!r}: give up to three non-negative weights with a "
            f"positive sum, as '969,30,1' or '98/2/0'"
        )
