"""The search: from a cluster, a model and a global batch to the fastest plan that fits.

Strategies (all scored by the same simulator):
- `hexi`: two-phase hierarchical partitioning. Every machine is cut into equal chunks of its GPUs
  (`MachineChunk`: GPUs of one machine that go to one pipeline; a whole machine is one chunk);
  the number of pipelines K and the coarsening level (chunks per machine) are searched; phase 1
  (search_partition) splits the chunks into K pipelines and refines; phase 2 (search_order,
  search_pipeline) lays out each pipeline; micro-batches go to pipelines in proportion to their
  speed so that they finish together (search_candidates).
- `uniform` (search_baselines): the best Megatron-style TP x PP x DP over all GPUs (even layers,
  even batch, even shards, Megatron's rank order): what a user gets without this project.
- `exhaustive` (search_baselines): every partition of the chunks, every chunk order and every
  per-chunk stage count of hexi's search space; refused above a size limit.
The outer loop covers micro-batch size and recompute. Deterministic for a seed.

With overlap_grad_reduce / overlap_param_gather the candidates are ranked and scored with the
overlapped gradient sync (planner.sync_model's overlap model) and the plan records both settings;
likewise every candidate is costed (time and memory) with the given attention backend, which the
plan records. With sequence parallelism every stage of TP degree t > 1 keeps its activations
outside attention and MLP cut over its t ranks (memory.layer_activation_bytes) and needs no
all-gather of received activations; only TP degrees that divide seq_length are laid out, so
every plan validates, and the plan records the setting.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from planner.attention import PLAN_DEFAULT_BACKEND
from planner.cuda_graphs import PLAN_DEFAULT_GRAPH_IMPL
from planner.errors import SpecError
from planner.host import layer_impl
from planner.plan import build_plan
from planner.search_baselines import exhaustive, uniform
from planner.searcher import Searcher
from planner.simulator import simulate
from planner.topology import Topology
from planner.transformer_impl import PLAN_DEFAULT_IMPL, TRANSFORMER_IMPLS

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec
    from planner.models import ModelSpec
    from planner.plan import Plan

STRATEGIES = ("hexi", "uniform", "exhaustive")


def run_strategy(searcher: Searcher, strategy: str) -> Plan:
    """The plan `strategy` finds with this search's inputs and caches: hexi keeps the uniform
    layout as a seed, so it never returns a worse plan; SpecError (one line) if none fits."""
    if strategy not in STRATEGIES:
        raise SpecError(f"--strategy: must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    uni = uniform(searcher) if strategy in ("uniform", "hexi") else None
    fitting_uni = uni if uni is not None and not uni.key[0] else None
    cand = {"hexi": searcher.hexi, "exhaustive": lambda: exhaustive(searcher)}.get(
        strategy, lambda: None
    )()
    if (
        cand is not None
        and not searcher.score(cand)[0]
        and (fitting_uni is None or searcher.score(cand)[1] <= fitting_uni.key[1])
    ):
        pipelines, recompute = cand.pipelines(searcher.model), cand.recompute
    elif fitting_uni is not None:
        # hexi keeps the uniform layout as one of its seeds: it never does worse
        pipelines, recompute = fitting_uni.pipelines, fitting_uni.recompute
    else:
        raise SpecError(searcher.explain_infeasible(strategy))
    plan = build_plan(
        searcher.cluster,
        searcher.model,
        searcher.gbs,
        pipelines,
        recompute=recompute,
        use_distributed_optimizer=searcher.dist_opt,
        overlap_grad_reduce=searcher.overlap_grad_reduce,
        overlap_param_gather=searcher.overlap_param_gather,
        attention_backend=searcher.attention_backend,
        sequence_parallel=searcher.sequence_parallel,
        transformer_impl=searcher.layer_impl.transformer_impl,
        cuda_graph_impl=searcher.cuda_graph_impl,
        cuda_graph_scope=searcher.cuda_graph_scope,
    )
    est = simulate(plan, searcher.topo, searcher.simulations)
    if not est.fits_memory:  # the search scores with the same model: a bug if reached
        raise SpecError(f"internal: the {strategy} plan does not fit: {est.bottleneck}")
    plan.estimate = est.to_dict()
    plan.estimate["strategy"] = strategy
    return plan


def runs_on_gpus(cluster: ClusterSpec) -> bool:
    """Whether every node of `cluster` is a GPU: none is the catalog's CPU row or has a CPU
    profile (such runs exercise the code path with gloo)."""
    for d in Topology(cluster).devices:
        if d.name == "CPU" or (d.profile is not None and d.profile.profile.is_cpu):
            return False
    return True


def overlap_by_default(cluster: ClusterSpec) -> bool:
    """Whether `hexi-plan plan` overlaps the gradient sync when no flag says: on clusters of real
    GPUs (runs_on_gpus); off where a node is a CPU, whose runs keep the serial sync unless
    asked."""
    return runs_on_gpus(cluster)


def search_plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    global_batch_size: int,
    strategy: str = "hexi",
    micro_batch_size: int | None = None,
    recompute: str = "auto",
    seed: int = 0,
    use_distributed_optimizer: bool = False,
    progress: bool = False,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    sequence_parallel: bool = False,
    transformer_impl: str = PLAN_DEFAULT_IMPL,
    cuda_graph_impl: str = PLAN_DEFAULT_GRAPH_IMPL,
    cuda_graph_scope: tuple[str, ...] = (),
    outer_state: bool = False,
) -> Plan:
    """The best plan under `strategy`, validated and with `estimate` filled; SpecError if none.

    `overlap_grad_reduce`, `overlap_param_gather`, `attention_backend`, `sequence_parallel`: the
    runtime settings the plan is made for (written into its `training`, every candidate costed
    with them; with `sequence_parallel` only TP degrees dividing seq_length are laid out); the
    caller picks them (`overlap_by_default`, planner.attention.CLI_DEFAULT_BACKEND and sequence
    parallelism on are the CLI's defaults). `transformer_impl`: the layer spec the plan records
    and costs (the host time of a layer pass, planner.host); `cuda_graph_impl` and
    `cuda_graph_scope` the CUDA graphs it records and costs (planner.cuda_graphs).
    `outer_state`: lay out for ranks that also keep the outer state of islands (the plan of
    one island, planner.search_islands)."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise SpecError(
            f"--transformer-impl: must be one of {', '.join(TRANSFORMER_IMPLS)}, "
            f"got {transformer_impl!r}"
        )
    s = Searcher(
        cluster,
        model,
        global_batch_size,
        micro_batch_size,
        recompute,
        seed,
        use_distributed_optimizer,
        progress,
        overlap_grad_reduce,
        overlap_param_gather,
        attention_backend,
        sequence_parallel,
        layer_impl(transformer_impl, cuda_graph_impl, cuda_graph_scope),
        cuda_graph_impl,
        cuda_graph_scope,
    )
    s.outer_state = outer_state
    # The search allocates millions of small tuples and no reference cycles to speak of: the
    # cyclic collector's generation scans would cost up to a fifth of the time on large clusters.
    enabled = gc.isenabled()
    gc.disable()
    try:
        plan = run_strategy(s, strategy)
    finally:
        if enabled:
            gc.enable()
    return plan


__all__ = [
    "search_plan",
    "overlap_by_default",
    "runs_on_gpus",
    "run_strategy",
    "STRATEGIES",
]
