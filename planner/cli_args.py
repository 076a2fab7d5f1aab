"""What the `hexi-plan` front ends share: the argument parser, its argument types and the
subcommand table (planner.cli builds the parser, planner.search_cli adds its subcommands).

A leaf under both, so that neither imports the other to reach these.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from typing import Any, NoReturn, TypeAlias

from planner.attention import ATTENTION_BACKENDS, CLI_DEFAULT_BACKEND
from planner.cuda_graphs import CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES, PLAN_DEFAULT_GRAPH_IMPL
from planner.errors import SpecError
from planner.limits import MAX_NUMBER_CHARS
from planner.models import ModelSpec, model_from_dict
from planner.transformer_impl import TRANSFORMER_IMPLS, default_impl


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one SpecError line (exit 2) instead of usage text."""

    def error(self, message: str) -> NoReturn:
        raise SpecError(f"{message} (see {self.prog} --help)")


# `hexi-plan`'s subcommands, and a function that adds some to them (planner.search_cli's).
Subparsers: TypeAlias = "argparse._SubParsersAction[ArgumentParser]"
Register: TypeAlias = Callable[[Subparsers], None]


PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER = (
    "--overlap-param-gather: needs --use-distributed-optimizer (only the distributed optimizer "
    "all-gathers parameters)"
)

MFU_NOTE = "MFU is printed in percent, as Megatron prints it; JSON keeps the fraction (`mfu`)."


def percent(fraction: float) -> str:
    """An MFU (a fraction, as the plan's `estimate.mfu` stores it) as the percent people read
    everywhere else, Megatron's iteration lines and this runtime's included: 0.333 -> 33.3%."""
    return f"{100 * fraction:.3g}%"


def with_examples(*commands: str, note: str = "", width: int = 96) -> dict[str, Any]:
    """Keyword arguments for an argparse parser whose `--help` ends with runnable examples, so
    that help shows how a command is called and not only its flags. Each command is one line
    here, wrapped with shell continuations between options (a flag stays with its value); the
    raw formatter keeps the layout."""
    lines = [*textwrap.wrap(note, width), ""] if note else []
    lines.append("example:" if len(commands) == 1 else "examples:")
    for command in commands:
        units: list[str] = []
        for word in command.split(" "):
            if units and units[-1].startswith("-") and " " not in units[-1]:
                if not word.startswith("-"):
                    units[-1] += " " + word
                    continue
            units.append(word)
        cur = "  "
        for unit in units:
            if len(cur) + len(unit) + 2 > width and cur.strip():
                lines.append(cur.rstrip() + " \\")
                cur = "      "
            cur += unit + " "
        lines.append(cur.rstrip())
    return {"epilog": "\n".join(lines), "formatter_class": argparse.RawDescriptionHelpFormatter}


def add_attention_backend_flag(p: argparse.ArgumentParser) -> None:
    """--attention-backend of `plan`, `min-nodes` and `manual`: the runtime's flag of that name,
    which the plan records (`training.attention_backend`) and the cost model follows."""
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=CLI_DEFAULT_BACKEND,
        help="the attention the runtime will run: auto, flash and fused keep no s x s scores; "
        f"unfused and local (megatron-core's) keep them (default: {CLI_DEFAULT_BACKEND})",
    )


def add_sequence_parallel_flag(p: argparse.ArgumentParser, default: bool) -> None:
    """--sequence-parallel / --no-sequence-parallel: megatron-core's sequence parallelism in every
    stage of TP degree > 1, which the plan records (`training.sequence_parallel`) and the cost
    model follows. `plan` and `min-nodes` default to on (the search then lays out only TP
    degrees that divide seq_length); `manual` to off, as it takes the user's layout as given."""
    if default:
        why = (
            "default: on, the planner default: sequence parallelism wherever TP > 1; the search "
            "then uses only TP degrees that divide the sequence length"
        )
    else:
        why = (
            "default: off, as manual takes the layout as given and sequence parallelism adds a "
            "constraint on it: every TP degree > 1 must divide the sequence length"
        )
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="megatron-core's sequence parallelism in every stage with TP > 1, which cuts the "
        f"norm and dropout activations over the stage's TP ranks ({why})",
    )


def add_transformer_impl_flag(p: argparse.ArgumentParser) -> None:
    """--transformer-impl of `plan`, `min-nodes` and `manual`: the runtime's flag of that name,
    which the plan records (`training.transformer_impl`). Not given: planner.transformer_impl's
    default_impl for the cluster (resolve_transformer_impl)."""
    p.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default=None,
        help="the layer implementation the runtime will build: transformer_engine (needs CUDA "
        "and Transformer Engine where training runs) or local (megatron-core's torch layers); "
        "default: transformer_engine on a GPU cluster when Transformer Engine is installed "
        "here, else local",
    )


def resolve_transformer_impl(args: argparse.Namespace, gpu_cluster: bool) -> str:
    """The --transformer-impl given, else the default for a cluster (of GPUs or not)."""
    return args.transformer_impl or default_impl(gpu_cluster)


def add_cuda_graph_flags(p: argparse.ArgumentParser) -> None:
    """--cuda-graph-impl and --cuda-graph-scope of `plan`, `min-nodes` and `manual`: the runtime's
    flags of those names (megatron-core's meanings, planner.cuda_graphs), which the plan records
    (`training.cuda_graph_impl`, `training.cuda_graph_scope`)."""
    p.add_argument(
        "--cuda-graph-impl",
        choices=CUDA_GRAPH_IMPLS,
        default=PLAN_DEFAULT_GRAPH_IMPL,
        help="CUDA graphs the runtime will capture per layer: local (megatron-core's "
        "CudaGraphManager) or transformer_engine (TE's make_graphed_callables); CUDA only, "
        f"and not with recompute or an overlapped parameter gather (default: "
        f"{PLAN_DEFAULT_GRAPH_IMPL})",
    )
    p.add_argument(
        "--cuda-graph-scope",
        nargs="+",
        choices=CUDA_GRAPH_SCOPES,
        default=None,
        help="with --cuda-graph-impl: capture only these parts of each layer (default: the "
        "whole layer)",
    )


def cuda_graph_settings(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    """(impl, scope) from --cuda-graph-impl and --cuda-graph-scope; SpecError for a scope given
    without graphs, or given twice."""
    impl, scope = args.cuda_graph_impl, tuple(args.cuda_graph_scope or ())
    if scope and impl == "none":
        raise SpecError("--cuda-graph-scope: needs --cuda-graph-impl local or transformer_engine")
    if len(set(scope)) != len(scope):
        raise SpecError(f"--cuda-graph-scope: repeats a scope: {' '.join(scope)}")
    return impl, scope


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
