"""What the `hexi-plan` front ends share: the argument parser, its argument types and the
subcommand table (planner.cli builds the parser, planner.search_cli adds its subcommands).

A leaf under both, so that neither imports the other to reach these.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn, TypeAlias

from planner.errors import SpecError
from planner.limits import MAX_NUMBER_CHARS
from planner.models import ModelSpec, model_from_dict


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one SpecError line (exit 2) instead of usage text."""

    def error(self, message: str) -> NoReturn:
        raise SpecError(f"{message} (see {self.prog} --help)")


# `hexi-plan`'s subcommands, and a function that adds some to them (planner.search_cli's).
Subparsers: TypeAlias = "argparse._SubParsersAction[ArgumentParser]"
Register: TypeAlias = Callable[[Subparsers], None]


def bounded_int(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi], refused in one line naming the flag otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= MAX_NUMBER_CHARS else None
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            kind = "a positive integer" if lo == 1 else f"an integer >= {lo}"
            raise argparse.ArgumentTypeError(f"must be {kind} up to {hi:,}, got {text[:40]!r}")
        return value

    parse.__name__ = "integer"
    return parse


def with_seq_length(
    model: ModelSpec, seq_length: int | None, flag: str = "--seq-length"
) -> ModelSpec:
    """The model with another seq_length, validated like any model field."""
    if seq_length is None:
        return model
    return model_from_dict({**model.to_dict(), "seq_length": seq_length}, flag)
