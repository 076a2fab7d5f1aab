"""Plans for the machines that are actually there: an elastic run re-plans at every start.

A cluster file lists every machine a job may use; at a given start only some of them run
processes. `present_cluster` is the file's cluster cut down to those nodes, each with as many
GPUs as it runs processes; `PlanningOptions` are the search options a start takes from its
flags; `smallest_fitting_nodes` is how few nodes an elastic job may shrink to (its MIN).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from planner.attention import PLAN_DEFAULT_BACKEND
from planner.cli_args import with_seq_length
from planner.cluster import ClusterSpec, LinkOverride, NodeGroup
from planner.cuda_graphs import PLAN_DEFAULT_GRAPH_IMPL
from planner.errors import ClusterError, SpecError
from planner.models import ModelSpec
from planner.plan import Plan
from planner.search import search_plan
from planner.sites import SiteLinks
from planner.transformer_impl import PLAN_DEFAULT_IMPL


@dataclass(frozen=True)
class PlanningOptions:
    """What `hexi-plan plan` takes besides the cluster and the model (its flag names)."""

    global_batch_size: int
    micro_batch_size: int | None = None  # None: searched
    seq_length: int | None = None  # None: the model's
    recompute: str = "auto"  # auto | on | off
    use_distributed_optimizer: bool = False
    strategy: str = "hexi"
    seed: int = 0
    # the runtime's --overlap-grad-reduce / --overlap-param-gather (the plan records them)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # the runtime's --attention-backend (planner.attention's names; the plan records it)
    attention_backend: str = PLAN_DEFAULT_BACKEND
    # the runtime's --sequence-parallel (the plan records it): on, as `hexi-plan plan`
    sequence_parallel: bool = True
    # the runtime's --transformer-impl (planner.transformer_impl's names; the plan records it)
    transformer_impl: str = PLAN_DEFAULT_IMPL
    # the runtime's --cuda-graph-impl / --cuda-graph-scope (planner.cuda_graphs; the plan
    # records them)
    cuda_graph_impl: str = PLAN_DEFAULT_GRAPH_IMPL
    cuda_graph_scope: tuple[str, ...] = ()
    # lay out for ranks that also keep the islands' outer state (planner.search_islands)
    outer_state: bool = False


def plan_for(
    cluster: ClusterSpec, model: ModelSpec, options: PlanningOptions, progress: bool = False
) -> Plan:
    """The searched plan; SpecError (naming what is missing) when nothing fits. With CUDA graphs
    the search plans without recompute (graphs cannot capture it: planner.cuda_graphs), and the
    plan records and costs the graphs."""
    graphs = options.cuda_graph_impl != PLAN_DEFAULT_GRAPH_IMPL
    if graphs and options.recompute == "on":
        raise SpecError(
            f"--recompute on: --cuda-graph-impl {options.cuda_graph_impl} cannot capture full "
            "activation recompute"
        )
    if graphs and options.overlap_param_gather:
        raise SpecError(
            f"--overlap-param-gather: --cuda-graph-impl {options.cuda_graph_impl} cannot run "
            "the overlapped parameter gather's forward pre-hooks"
        )
    return search_plan(
        cluster,
        with_seq_length(model, options.seq_length),
        options.global_batch_size,
        strategy=options.strategy,
        micro_batch_size=options.micro_batch_size,
        recompute="off" if graphs else options.recompute,
        seed=options.seed,
        use_distributed_optimizer=options.use_distributed_optimizer,
        progress=progress,
        overlap_grad_reduce=options.overlap_grad_reduce,
        overlap_param_gather=options.overlap_param_gather,
        attention_backend=options.attention_backend,
        sequence_parallel=options.sequence_parallel,
        transformer_impl=options.transformer_impl,
        cuda_graph_impl=options.cuda_graph_impl,
        cuda_graph_scope=options.cuda_graph_scope,
        outer_state=options.outer_state,
    )


def present_cluster(cluster: ClusterSpec, processes: Mapping[str, int]) -> ClusterSpec:
    """The nodes of `cluster` named in `processes` (node -> process count), in the file's order,
    each with that many GPUs. Every link between two kept nodes is what the file says it is:
    each kept node becomes a group of its own, so a link the file gives between groups is
    written out per pair of kept nodes. The sites of the kept nodes keep their links (the
    islands' planner reads them), those of sites with no node left are dropped."""
    known = {n.name: n for n in cluster.nodes}
    problems = [
        f"node {name!r} runs processes but is not a node of cluster {cluster.name!r} "
        f"(its nodes: {', '.join(known)})"
        for name in processes
        if name not in known
    ]
    for name, count in processes.items():
        node = known.get(name)
        if node is not None and count > node.gpus_per_node:
            problems.append(
                f"node {name!r} runs {count} processes but has {node.gpus_per_node} GPU(s) in "
                f"cluster {cluster.name!r}"
            )
    if problems:
        raise ClusterError(problems)
    group_of = {g.name: g for g in cluster.groups}
    kept = [n for n in cluster.nodes if processes.get(n.name, 0) > 0]
    groups = [
        replace(
            group_of[n.group],
            name=n.name,
            gpus_per_node=processes[n.name],
            count=None,
            hostnames=(n.hostname,) if n.hostname else (),
        )
        for n in kept
    ]
    cut = ClusterSpec(
        cluster.name, groups, [], cluster.description, _present_sites(cluster.sites, groups)
    )
    links = []
    for i, a in enumerate(kept):
        for b in kept[i + 1 :]:
            want = cluster.link(a.name, b.name)
            if cut.link(a.name, b.name) != want:
                links.append(LinkOverride((a.name, b.name), want[0], want[1]))
    cut.links.extend(links)
    return cut


def _present_sites(sites: SiteLinks | None, groups: list[NodeGroup]) -> SiteLinks | None:
    """The cluster's `sites` section cut down to the sites that still have a node."""
    if sites is None:
        return None
    kept = {g.site for g in groups}
    order = tuple(pair for pair in sites.order if set(pair) <= kept)
    pairs = {k: v for k, v in sites.pairs.items() if k <= kept}
    return SiteLinks(pairs, sites.default, order)


def _memory_order(cluster: ClusterSpec) -> list[str]:
    """Node names, least total GPU memory first (cluster order among equals)."""
    from planner.catalog import get_gpu

    nodes = cluster.nodes
    return [n.name for n in sorted(nodes, key=lambda n: n.gpus_per_node * get_gpu(n.gpu).memory_gb)]


@dataclass(frozen=True)
class SmallestFit:
    """The fewest nodes an elastic job can train on, the nodes that showed it and their plan,
    and the whole cluster's plan (searched first: without it, nothing fits)."""

    count: int
    nodes: tuple[str, ...]
    plan: Plan
    whole: Plan


def smallest_fitting_nodes(
    cluster: ClusterSpec, model: ModelSpec, options: PlanningOptions
) -> SmallestFit:
    """The smallest k such that the k nodes with the least GPU memory have a plan, and that plan.
    Any k nodes of the file then hold at least as much memory per node, so k is a safe MIN for
    `torchrun --nnodes MIN:MAX` (fitting grows with nodes, so the k is found by bisection).
    SpecError, naming what is missing, when even the whole cluster has no plan."""
    order = _memory_order(cluster)
    by_name = {n.name: n for n in cluster.nodes}

    def attempt(k: int) -> Plan | None:
        chosen = set(order[:k])
        present = {n.name: by_name[n.name].gpus_per_node for n in cluster.nodes if n.name in chosen}
        try:
            return plan_for(present_cluster(cluster, present), model, options)
        except SpecError:
            return None

    full = plan_for(cluster, model, options)  # raises the planner's own message if nothing fits
    low, high, best = 1, len(order), full
    while low < high:
        mid = (low + high) // 2
        found = attempt(mid)
        if found is None:
            low = mid + 1
        else:
            high, best = mid, found
    return SmallestFit(high, tuple(order[:high]), best, full)


__all__ = [
    "PlanningOptions",
    "plan_for",
    "present_cluster",
    "smallest_fitting_nodes",
    "SmallestFit",
]
