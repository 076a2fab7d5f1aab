"""`hexi-plan plan` (search) and `hexi-plan simulate` (score a plan), registered into the CLI."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from planner.cli_args import (
    MFU_NOTE,
    PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER,
    Subparsers,
    add_attention_backend_flag,
    add_cuda_graph_flags,
    add_sequence_parallel_flag,
    add_transformer_impl_flag,
    bounded_int,
    cuda_graph_settings,
    percent,
    resolve_transformer_impl,
    with_examples,
)
from planner.cli_islands import add_island_flags, describe_outer_estimate, island_request
from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.limits import MAX_BATCH, MAX_SEED, MAX_SEQ_LENGTH
from planner.measured_costs import cost_sources
from planner.membership import PlanningOptions, smallest_fitting_nodes
from planner.models import load_model
from planner.plan import load_plan, save_plan
from planner.search import STRATEGIES, overlap_by_default, runs_on_gpus
from planner.search_islands import plan_islands
from planner.simulator import simulate
from planner.topology import Topology

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec
    from planner.plan import Plan
    from planner.simulator import Estimate


def format_estimate(plan: Plan, est: Estimate) -> str:
    """Human-readable report of a simulated plan."""
    sync = f"gradient sync {est.grad_sync_time_s:.4g} s"
    if est.overlapped:
        sync += f" exposed of {est.grad_sync_serial_s:.4g} s overlapped"
    parts = (
        f"slowest pipeline {max(est.pipeline_time_s):.4g} s + {sync} + "
        f"optimizer step {est.optimizer_step_time_s:.4g} s"
    )
    if est.inner_step_time_s is not None:  # the slowest island's parts, then the outer sync
        parts = f"slowest island: {parts}; + outer sync {est.outer_sync_time_s:.4g} s per step"
    lines = [
        f"iteration time   {est.iteration_time_s:.4g} s  ({parts})",
        f"throughput       {est.tokens_per_s:.4g} tokens/s",
        f"MFU              {percent(est.mfu)}  (model FLOPs without recompute / sum of used peaks)",
        "pipelines        " + ", ".join(f"{t:.4g} s" for t in est.pipeline_time_s),
    ]
    if outer_line := describe_outer_estimate(est.to_dict()):
        lines.append(f"islands          {outer_line}")
    lines.append("memory per rank  (GB used / capacity)")
    for r, (used, cap) in enumerate(zip(est.peak_memory_gb, est.memory_capacity_gb)):
        flag = "  OVER" if used > cap else ""
        lines.append(f"  rank {r:<5} {plan.ranks[r].gpu:<16} {used:7.2f} / {cap:6.1f}{flag}")
    lines.append(f"bottleneck       {est.bottleneck}")
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> None:
    plan = load_plan(args.plan)
    est = simulate(plan)
    sources = cost_sources(Topology(plan.cluster), plan.model)
    if args.json:
        print(json.dumps({**est.to_dict(), "cost_source": sources}, indent=1))
    else:
        print(format_estimate(plan, est))
        for group, line in sources.items():
            print(f"cost source      {group}: {line}")


def planning_options(args: argparse.Namespace, cluster: ClusterSpec) -> PlanningOptions:
    """The search options of `plan` and `min-nodes` (add_planning_flags). The overlap flags,
    when not given, follow `overlap_by_default(cluster)`; the parameter gather's only with
    --use-distributed-optimizer, and not with CUDA graphs (they cannot run its hooks)."""
    impl, scope = cuda_graph_settings(args)
    dist_opt = args.use_distributed_optimizer
    if args.overlap_param_gather and not dist_opt:
        raise SpecError(PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER)
    overlap_grad, overlap_gather = args.overlap_grad_reduce, args.overlap_param_gather
    if overlap_grad is None or overlap_gather is None:
        auto = overlap_by_default(cluster)
        if overlap_grad is None:
            overlap_grad = auto
        if overlap_gather is None:
            overlap_gather = auto and dist_opt and impl == "none"
    return PlanningOptions(
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        recompute=args.recompute,
        use_distributed_optimizer=dist_opt,
        strategy=args.strategy,
        seed=args.seed,
        overlap_grad_reduce=overlap_grad,
        overlap_param_gather=overlap_gather,
        attention_backend=args.attention_backend,
        sequence_parallel=args.sequence_parallel,
        transformer_impl=resolve_transformer_impl(args, runs_on_gpus(cluster)),
        cuda_graph_impl=impl,
        cuda_graph_scope=scope,
    )


def cmd_plan(args: argparse.Namespace) -> None:
    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    request = island_request(args, model.num_layers)
    plan = plan_islands(cluster, model, planning_options(args, cluster), request, progress=True)
    save_plan(plan, args.output)
    e = plan.estimate
    assert e is not None  # search_plan fills it
    print(
        f"wrote {args.output}: {plan.world_size} ranks, {len(plan.pipelines)} pipelines, "
        f"{e['iteration_time_s']:.4g} s/iteration, {e['tokens_per_s']:.4g} tokens/s, "
        f"MFU {percent(e['mfu'])}; bottleneck: {e['bottleneck']}"
    )


def cmd_min_nodes(args: argparse.Namespace) -> None:
    cluster = load_cluster(args.cluster)
    fit = smallest_fitting_nodes(cluster, load_model(args.model), planning_options(args, cluster))
    print(
        f"{fit.count} of {len(cluster.nodes)} nodes: the model fits on the {fit.count} "
        f"node(s) with the least GPU memory ({', '.join(fit.nodes)}), so on any {fit.count}; "
        f"an elastic job can use --nnodes {fit.count}:{len(cluster.nodes)}"
    )


def add_planning_flags(p: argparse.ArgumentParser) -> None:
    """The cluster, the model and the search options (PlanningOptions)."""
    p.add_argument("--cluster", required=True, help="cluster YAML")
    p.add_argument("--model", required=True, help="catalog model name or model YAML")
    p.add_argument("--global-batch-size", type=bounded_int(1, MAX_BATCH), required=True)
    p.add_argument(
        "--micro-batch-size",
        type=bounded_int(1, MAX_BATCH),
        default=None,
        help="fix the micro-batch size (default: searched)",
    )
    p.add_argument(
        "--seq-length",
        type=bounded_int(1, MAX_SEQ_LENGTH),
        default=None,
        help="override the model's seq_length",
    )
    p.add_argument("--strategy", choices=STRATEGIES, default="hexi")
    p.add_argument("--seed", type=bounded_int(0, MAX_SEED), default=0)
    p.add_argument("--recompute", choices=("auto", "on", "off"), default="auto")
    p.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard fp32 master weights and Adam state over each segment's ranks",
    )
    p.add_argument(
        "--overlap-grad-reduce",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan for gradient collectives that start as soon as the last backward has "
        "produced their gradients (default: on, off where nodes use a CPU profile)",
    )
    p.add_argument(
        "--overlap-param-gather",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --use-distributed-optimizer: plan for parameter all-gathers hidden behind "
        "the next forward (default: on with the distributed optimizer, off where nodes use a "
        "CPU profile)",
    )
    add_attention_backend_flag(p)
    add_sequence_parallel_flag(p, default=True)
    add_transformer_impl_flag(p)
    add_cuda_graph_flags(p)


def register_commands(sub: Subparsers) -> None:
    p = sub.add_parser(
        "plan",
        help="search the fastest plan that fits (writes PLAN.json)",
        **with_examples(
            "hexi-plan plan --cluster examples/clusters/paper-hetero-a.yaml --model llama2-7b "
            "--global-batch-size 64 -o plan.json",
            "hexi-plan plan --cluster examples/clusters/mini-hetero.yaml --model tiny "
            "--global-batch-size 8 --strategy uniform -o uniform.json",
            note=MFU_NOTE,
        ),
    )
    add_planning_flags(p)
    add_island_flags(p)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "min-nodes",
        help="the fewest nodes of a cluster the model fits on (an elastic job's MIN)",
        **with_examples(
            "hexi-plan min-nodes --cluster examples/clusters/paper-hetero-a.yaml "
            "--model llama2-7b --global-batch-size 64",
        ),
    )
    add_planning_flags(p)
    p.set_defaults(func=cmd_min_nodes)

    p = sub.add_parser(
        "simulate",
        help="score a plan with the cost model",
        **with_examples(
            "hexi-plan simulate examples/plans/hetero-4rank.json",
            "hexi-plan simulate examples/plans/hetero-4rank.json --json",
            note=MFU_NOTE,
        ),
    )
    p.add_argument("plan")
    p.add_argument("--json", action="store_true", help="print the estimate object only")
    p.set_defaults(func=cmd_simulate)


__all__ = ["register_commands", "format_estimate", "add_planning_flags", "planning_options"]
