"""`hexi-plan`: validate, build by hand, show (and, with the search, plan and simulate) plans.

Every user error is printed to stderr as one line per problem, with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from planner.cli_args import (
    MFU_NOTE,
    PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER,
    ArgumentParser,
    Register,
    add_attention_backend_flag,
    add_cuda_graph_flags,
    add_sequence_parallel_flag,
    add_transformer_impl_flag,
    bounded_int,
    cuda_graph_settings,
    percent,
    resolve_transformer_impl,
    with_examples,
    with_seq_length,
)
from planner.cli_islands import (
    add_outer_flags,
    describe_islands,
    describe_outer_estimate,
    manual_islands,
)
from planner.cluster import load_cluster
from planner.cuda_graphs import describe as describe_graphs
from planner.errors import SpecError
from planner.inputs import read_json
from planner.limits import MAX_BATCH, MAX_REPORTED_PROBLEMS, MAX_SEQ_LENGTH
from planner.models import load_model
from planner.plan import build_plan, load_plan, save_plan
from planner.search import runs_on_gpus

if TYPE_CHECKING:
    from planner.plan import Plan


def cmd_validate(args: argparse.Namespace) -> None:
    from planner.memory_fit import memory_problems

    plan = load_plan(args.plan)
    problems = memory_problems(plan, str(args.plan))
    if problems:
        raise SpecError(problems)
    print(
        f"{args.plan}: valid plan, {plan.world_size} ranks, {len(plan.pipelines)} pipelines, "
        f"global batch {plan.global_batch_size}; {training_settings(plan)}"
        + "".join(f"; {line}" for line in describe_islands(plan))
    )


def cmd_manual(args: argparse.Namespace) -> None:
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise SpecError(PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER)
    impl, scope = cuda_graph_settings(args)
    cluster = load_cluster(args.cluster)
    model = with_seq_length(load_model(args.model), args.seq_length)
    pipelines = read_json(args.pipelines, "pipelines file")
    if isinstance(pipelines, dict) and "pipelines" in pipelines:
        pipelines = pipelines["pipelines"]
    count = len(pipelines) if isinstance(pipelines, list) else 0
    islands, outer = manual_islands(args, count, model.num_layers)
    plan = build_plan(
        cluster,
        model,
        args.global_batch_size,
        pipelines,
        recompute=args.recompute,
        use_distributed_optimizer=args.use_distributed_optimizer,
        optimizer_shard=args.optimizer_shard,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        attention_backend=args.attention_backend,
        sequence_parallel=args.sequence_parallel,
        transformer_impl=resolve_transformer_impl(args, runs_on_gpus(cluster)),
        cuda_graph_impl=impl,
        cuda_graph_scope=scope,
        islands=islands,
        outer=outer,
    )
    save_plan(plan, args.output)
    print(f"wrote {args.output}: {plan.world_size} ranks, {len(plan.pipelines)} pipelines")


def _describe_gpus(plan: Plan, ranks: Iterable[int]) -> str:
    """'2xA100-SXM-80GB@a100' style summary of the GPUs behind some ranks."""
    counts: dict[tuple[str, str], int] = {}
    for r in ranks:
        key = (plan.ranks[r].gpu, plan.ranks[r].node)
        counts[key] = counts.get(key, 0) + 1
    return ",".join(f"{n}x{g}@{node}" for (g, node), n in counts.items())


def _sizes(sizes: object) -> str:
    """[4, 4, 4] -> '3x4'; uneven lists are printed whole."""
    if not isinstance(sizes, list):
        return str(sizes)
    return f"{len(sizes)}x{sizes[0]}" if len(set(sizes)) == 1 and len(sizes) > 1 else str(sizes)


def training_settings(plan: Plan) -> str:
    """The plan's runtime settings in one line: recompute, optimizer, overlap, attention,
    sequence parallelism, transformer implementation, and CUDA graphs where the plan has them."""
    t = plan.training
    optimizer = (
        f"distributed ({t.optimizer_shard} shards)" if t.use_distributed_optimizer else "plain"
    )
    on = {True: "on", False: "off"}
    graphs = (
        f", cuda-graphs {describe_graphs(t.cuda_graph_impl, t.cuda_graph_scope)}"
        if t.cuda_graph_impl != "none"
        else ""
    )
    return (
        f"recompute {on[t.recompute]}, optimizer {optimizer}, overlap-grad-reduce "
        f"{on[t.overlap_grad_reduce]}, overlap-param-gather {on[t.overlap_param_gather]}, "
        f"attention {t.attention_backend}, sequence-parallel {on[t.sequence_parallel]}, "
        f"transformer-impl {t.transformer_impl}" + graphs
    )


def format_plan_table(plan: Plan) -> str:
    """A text table: per pipeline, its stages with ranks, GPU types, layers, shards, batches."""
    lines = [
        f"plan for cluster {plan.cluster.name!r}: {plan.world_size} ranks, model "
        f"{plan.model.name or 'custom'} ({plan.model.num_layers} layers, hidden "
        f"{plan.model.hidden_size}), global batch {plan.global_batch_size}"
        f"{', recompute' if plan.training.recompute else ''}",
        f"training: {training_settings(plan)}",
        *describe_islands(plan),
    ]
    header = (
        f"  {'stage':<6}{'ranks':<16}{'gpus':<34}{'layers':<10}{'query_groups':<16}"
        f"{'ffn':<18}{'vocab':<16}"
    )
    for p, pipe in enumerate(plan.pipelines):
        start, end = plan.sample_range(p)
        lines.append(
            f"pipeline {p}: {len(pipe.stages)} stages, micro_batch_size "
            f"{pipe.micro_batch_size} x {pipe.num_microbatches} micro-batches = samples "
            f"[{start}, {end})"
        )
        lines.append(header)
        for s, stage in enumerate(pipe.stages):
            gpus = _describe_gpus(plan, stage.ranks)
            holds_vocab = stage.layers[0] == 0 or stage.layers[1] == plan.model.num_layers
            vocab = _sizes(plan.shard_sizes(stage, "vocab")) if holds_vocab else "-"
            ranks = (
                str(list(stage.ranks))
                if len(stage.ranks) <= 3
                else f"[{stage.ranks[0]}..{stage.ranks[-1]}]"
            )
            lines.append(
                f"  {s:<6}{ranks:<16}{gpus:<34}"
                f"{'[%d,%d)' % stage.layers:<10}"
                f"{_sizes(plan.shard_sizes(stage, 'query_groups')):<16}"
                f"{_sizes(plan.shard_sizes(stage, 'ffn')):<18}{vocab:<16}"
            )
    if plan.estimate:
        e = plan.estimate
        lines.append(
            f"estimate: iteration {e.get('iteration_time_s', 0):.4g} s, "
            f"{e.get('tokens_per_s', 0):.4g} tokens/s, MFU {percent(e.get('mfu', 0))}, "
            f"bottleneck: {e.get('bottleneck', '?')}"
        )
        if outer_line := describe_outer_estimate(e):
            lines.append(f"islands: {outer_line}")
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> None:
    plan = load_plan(args.plan)
    print(format_plan_table(plan))
    if getattr(args, "png", None):
        from planner.picture import draw_plan

        draw_plan(plan, args.png)
        print(f"wrote {args.png}")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="hexi-plan",
        description="Plan heterogeneous training.",
        **with_examples(
            "hexi-plan plan --cluster examples/clusters/mini-hetero.yaml --model tiny "
            "--global-batch-size 8 -o plan.json",
            "hexi-plan show plan.json",
            "hexi-plan simulate plan.json",
            note=f"Paths are relative to a megatron-hexi checkout. {MFU_NOTE}",
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "validate",
        help="check a plan against every rule of the plan format",
        **with_examples("hexi-plan validate examples/plans/hetero-4rank.json"),
    )
    p.add_argument("plan")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "manual",
        help="build a plan from hand-written pipelines",
        **with_examples(
            "hexi-plan manual --cluster examples/clusters/mini-hetero.yaml --model tiny "
            "--global-batch-size 8 --pipelines examples/pipelines/hetero-4rank.json -o plan.json"
        ),
    )
    p.add_argument("--cluster", required=True, help="cluster YAML")
    p.add_argument("--model", required=True, help="catalog model name or model YAML")
    p.add_argument("--global-batch-size", type=bounded_int(1, MAX_BATCH), required=True)
    p.add_argument(
        "--seq-length",
        type=bounded_int(1, MAX_SEQ_LENGTH),
        default=None,
        help="override the model's seq_length",
    )
    p.add_argument("--pipelines", required=True, help="JSON file with the plan's `pipelines` array")
    p.add_argument("--recompute", action="store_true", help="full activation recompute")
    p.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard fp32 master weights and Adam state over each segment's ranks",
    )
    p.add_argument(
        "--optimizer-shard",
        choices=["even", "memory"],
        default="even",
        help="with --use-distributed-optimizer: cut state evenly or by GPU memory",
    )
    p.add_argument(
        "--overlap-grad-reduce",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="gradient collectives start as soon as the last backward has produced their "
        "gradients (the runtime's flag of that name)",
    )
    p.add_argument(
        "--overlap-param-gather",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --use-distributed-optimizer: parameter all-gathers hidden behind the next "
        "forward (the runtime's flag of that name)",
    )
    add_attention_backend_flag(p)
    add_sequence_parallel_flag(p, default=False)
    add_transformer_impl_flag(p)
    add_cuda_graph_flags(p)
    p.add_argument(
        "--islands",
        default=None,
        help="JSON file: a list of pipeline-index lists, one per island (pipelines that sync "
        "every step; islands meet every --outer-interval steps); default: one island",
    )
    add_outer_flags(p, "inner steps between outer steps (H); needed with --islands")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_manual)

    p = sub.add_parser(
        "show",
        help="print a plan as a table (and draw it with --png)",
        **with_examples(
            "hexi-plan show examples/plans/hetero-4rank.json --png plan.png", note=MFU_NOTE
        ),
    )
    p.add_argument("plan")
    p.add_argument("--png", default=None, help="also draw the plan to this PNG file")
    p.set_defaults(func=cmd_show)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands() -> list[Register]:
    """Subcommands contributed by the search and the simulator, when present (the search
    needs pymetis; validate, manual and show do not)."""
    out: list[Register] = []
    try:
        from planner.search_cli import register_commands

        out.append(register_commands)
    except ImportError:
        pass
    return out


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def error_lines(problems: Sequence[object]) -> list[str]:
    """The stderr lines for a SpecError: one per problem, control characters escaped (so one
    problem is always one line), at most MAX_REPORTED_PROBLEMS and then a count of the rest."""

    def escape(line: str) -> str:
        return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], line)

    lines = [f"hexi-plan: error: {escape(str(p))}" for p in problems[:MAX_REPORTED_PROBLEMS]]
    if len(problems) > MAX_REPORTED_PROBLEMS:
        lines.append(
            f"hexi-plan: error: ... and {len(problems) - MAX_REPORTED_PROBLEMS:,} more problems"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.func(args)
    except SpecError as e:
        for line in error_lines(e.problems):
            print(line, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hexi-plan: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
