"""`hexi-plan plan --islands sites|auto`: one island per site, each planned by the usual search.

Sites joined by slow links (planner.sites) train as islands (planner.islands). `sites` plans each
site's GPUs with the existing search and joins the plans:
- the global batch is split over the islands so that their inner steps take the same time:
  start in proportion to each site's peak FLOPS, re-split in proportion to each island's
  predicted samples per second (a few rounds, keeping the best), then move single units from
  the slowest island to the fastest while that shortens the slowest step; units are samples,
  or multiples of the micro-batch size where one is given;
- the islands must agree on the plan-wide settings: if their searches chose differently whether
  to recompute, every island is planned again with recompute on; if the joined plan does not fit
  with the outer state (fp32 outer parameters and momentum), the islands are planned again with
  the distributed optimizer, which shards that state too;
- H (training.outer.interval) is the smallest interval whose exposed outer sync is at most
  `max_comm_share` of the iteration (0 with fragments that hide it), unless given; it never
  exceeds `max_interval` (DEFAULT_MAX_INTERVAL: the longest interval measured to train as well
  as synchronous training), even where the outer sync then takes more of the step.
`auto` also plans synchronously across all sites and keeps islands only where the site links
cost the synchronous plan more than `max_comm_share` of its step (`site_link_share`: against the
same plan, and the plan searched, with site links as fast as the NICs) and islands are faster.
The choice and its reason lead the estimate's bottleneck text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from planner.catalog import get_gpu
from planner.cluster import ClusterSpec
from planner.errors import SpecError
from planner.islands import MAX_OUTER_INTERVAL, OuterSettings
from planner.membership import PlanningOptions, plan_for
from planner.plan import build_plan
from planner.simulator import simulate
from planner.splits import weighted_split

if TYPE_CHECKING:
    from planner.models import ModelSpec
    from planner.plan import Plan

ISLAND_MODES = ("off", "sites", "auto")
# The largest H the planner chooses by itself (--outer-max-interval). Sourced: DiLoCo (Douillard
# et al., 2023) matched synchronous training's validation perplexity on C4 with 8 workers and 500
# inner steps between outer steps, and communicating less often (1,000 and 2,000 steps) cost
# perplexity; this project's own runs (docs/benchmarks.md, "Islands against synchronous
# training") reach only H 64 on a 1.6 M-parameter model. Longer intervals stay available by
# giving --outer-interval.
DEFAULT_MAX_INTERVAL = 500
BALANCE_ROUNDS = 3  # proportional splits of the batch (each plans every site once)
BALANCE_MOVES = 4  # then single-unit moves from the slowest island to the fastest, at most


@dataclass(frozen=True)
class IslandRequest:
    """What `plan --islands` asks beyond the usual options."""

    mode: str = "off"
    max_comm_share: float = 0.10
    outer: dict[str, Any] | None = None  # the --outer-* fields given (interval may be absent)
    max_interval: int = DEFAULT_MAX_INTERVAL  # the largest H chosen when none is given


def site_clusters(cluster: ClusterSpec) -> list[tuple[str, ClusterSpec]]:
    """(site, the cluster of that site's node groups and the links among them) per site."""
    sites = list(dict.fromkeys(g.site for g in cluster.groups))
    if len(sites) < 2 or sites[0] is None:
        raise SpecError(
            f"--islands: cluster {cluster.name!r} has one site; name each node group's `site` "
            f"(and give the links between sites) to plan islands"
        )
    out = []
    for site in sites:
        groups = [g for g in cluster.groups if g.site == site]
        names = {g.name for g in groups} | {
            f"{g.name}-{i}" if g.count is not None else g.name
            for g in groups
            for i in range(g.count or 1)
        }
        links = [lk for lk in cluster.links if set(lk.between) <= names]
        out.append((str(site), ClusterSpec(f"{cluster.name}-{site}", groups, links)))
    return out


def _join(cluster: ClusterSpec, model: ModelSpec, plans: list[Plan], outer: OuterSettings) -> Plan:
    """One plan of the islands' plans: pipelines in island order, ranks renumbered to the
    whole cluster's order."""
    slot = {(n, lr): i for i, (n, lr, _) in enumerate(cluster.gpu_slots())}
    pipelines: list[dict[str, Any]] = []
    islands = []
    for p in plans:
        first = len(pipelines)
        for pipe in p.pipelines:
            d = pipe.to_dict()
            for st in d["stages"]:
                st["ranks"] = [slot[(p.ranks[r].node, p.ranks[r].local_rank)] for r in st["ranks"]]
            pipelines.append(d)
        islands.append(tuple(range(first, len(pipelines))))
    t = plans[0].training
    return build_plan(
        cluster,
        model,
        sum(p.global_batch_size for p in plans),
        pipelines,
        recompute=t.recompute,
        use_distributed_optimizer=t.use_distributed_optimizer,
        overlap_grad_reduce=t.overlap_grad_reduce,
        overlap_param_gather=t.overlap_param_gather,
        attention_backend=t.attention_backend,
        sequence_parallel=t.sequence_parallel,
        transformer_impl=t.transformer_impl,
        cuda_graph_impl=t.cuda_graph_impl,
        cuda_graph_scope=t.cuda_graph_scope,
        islands=islands,
        outer=outer,
    )


def _split(total: int, weights: list[float], unit: int) -> list[int]:
    """`total` samples in whole `unit`s in proportion to `weights`, at least one unit each."""
    units = total // unit
    if units < len(weights):
        raise SpecError(
            f"--global-batch-size: {total} samples cannot give each of {len(weights)} islands "
            f"at least {unit} (the micro-batch size)"
        )
    parts = weighted_split(units, weights)
    for i, n in enumerate(parts):
        if n == 0:
            parts[i] = 1
            parts[parts.index(max(parts))] -= 1
    return [n * unit for n in parts]


def _site_plans(
    sites: list[tuple[str, ClusterSpec]],
    model: ModelSpec,
    options: PlanningOptions,
    batches: list[int],
) -> list[Plan]:
    return [
        plan_for(c, model, replace(options, global_batch_size=b, outer_state=True), False)
        for (_, c), b in zip(sites, batches)
    ]


def balanced_island_plans(
    cluster: ClusterSpec, model: ModelSpec, options: PlanningOptions
) -> list[Plan]:
    """Each site's plan, with the global batch split so that their steps take equal time:
    proportional re-splits first, then single-unit moves from the slowest island to the
    fastest while they shorten the slowest step (search times are not smooth in the batch)."""
    sites = site_clusters(cluster)
    unit = options.micro_batch_size or 1
    peak = [sum(get_gpu(n.gpu).peak_flops * n.gpus_per_node for n in c.nodes) for _, c in sites]
    seen: dict[tuple[int, ...], list[Plan]] = {}

    def plans_for(batches: list[int]) -> list[Plan]:
        nonlocal options
        key = tuple(batches)
        if key not in seen:
            plans = _site_plans(sites, model, options, batches)
            if len({p.training.recompute for p in plans}) > 1 and options.recompute == "auto":
                options = replace(options, recompute="on")  # one plan-wide setting
                seen.clear()
                plans = _site_plans(sites, model, options, batches)
            seen[key] = plans
        return seen[key]

    def times(batches: list[int]) -> list[float]:
        return [p.estimate["iteration_time_s"] if p.estimate else 0.0 for p in plans_for(batches)]

    batches = _split(options.global_batch_size, peak, unit)
    best = batches
    for _ in range(BALANCE_ROUNDS):
        t = times(batches)
        if max(t) < max(times(best)):
            best = batches
        batches = _split(options.global_batch_size, [b / x for b, x in zip(batches, t)], unit)
        if tuple(batches) in seen:
            break
    for _ in range(BALANCE_MOVES):
        t = times(best)
        slow, fast = t.index(max(t)), t.index(min(t))
        if slow == fast or best[slow] <= unit:
            break
        moved = list(best)
        moved[slow] -= unit
        moved[fast] += unit
        if max(times(moved)) >= max(t):
            break
        best = moved
    return plans_for(best)


def outer_interval(plan: Plan, share: float, max_interval: int = MAX_OUTER_INTERVAL) -> int:
    """The smallest H whose exposed outer sync is at most `share` of the iteration, or
    `max_interval` where none up to it is."""
    outer = plan.training.outer
    assert outer is not None

    def ok(h: int) -> bool:
        plan.training = replace(plan.training, outer=replace(outer, interval=h))
        est = simulate(plan)
        return est.outer_sync_time_s is not None and (
            est.outer_sync_time_s <= share * est.iteration_time_s
        )

    hi = 1
    while not ok(hi):
        if hi >= max_interval:
            return max_interval
        hi = min(2 * hi, max_interval)
    lo = hi // 2 + 1 if hi > 1 else 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def site_link_share(
    plan: Plan, model: ModelSpec | None = None, options: PlanningOptions | None = None
) -> float:
    """The share of a synchronous plan's step that the site links cost: 1 - (its time with
    links between sites as fast as the machines' own) / its time. With `model` and `options`,
    also against the plan searched for the cluster without site links, since the search lays
    out around slow links (fewer pipelines across them), which the first measure misses; the
    larger share counts."""
    t = simulate(plan).iteration_time_s
    c = plan.cluster  # the same machines on one site
    free = replace(c, groups=[replace(g, site=None) for g in c.groups], sites=None)
    best = simulate(replace(plan, cluster=free)).iteration_time_s
    if model is not None and options is not None:
        searched = plan_for(free, model, options).estimate
        assert searched is not None
        best = min(best, searched["iteration_time_s"])
    return max(0.0, 1.0 - best / t)


def islands_plan(
    cluster: ClusterSpec,
    model: ModelSpec,
    options: PlanningOptions,
    request: IslandRequest,
    site_plans: list[Plan] | None = None,
) -> tuple[Plan, str]:
    """The islands' plan with its estimate, and the reason text for its bottleneck.
    `site_plans`: balanced_island_plans' result for these options, when already made (the
    sites' plans do not depend on the links between sites)."""
    fields = dict(request.outer or {})
    given_h = "interval" in fields
    settings = OuterSettings(**{"interval": 1, **fields})
    plans = site_plans or balanced_island_plans(cluster, model, options)
    plan = _join(cluster, model, plans, settings)
    if not simulate(plan).fits_memory and not options.use_distributed_optimizer:
        # the outer state does not fit: the distributed optimizer shards it with Adam's
        plans = balanced_island_plans(
            cluster, model, replace(options, use_distributed_optimizer=True)
        )
        plan = _join(cluster, model, plans, settings)
    est = simulate(plan)
    if not est.fits_memory:
        raise SpecError(
            f"--islands {request.mode}: the islands' plan does not fit with the outer state: "
            f"{est.bottleneck}"
        )
    h = (
        settings.interval
        if given_h
        else outer_interval(plan, request.max_comm_share, request.max_interval)
    )
    plan.training = replace(plan.training, outer=replace(settings, interval=h))
    est = simulate(plan)
    plan.estimate = est.to_dict()
    plan.estimate["strategy"] = options.strategy
    share = (est.outer_sync_time_s or 0.0) / est.iteration_time_s
    reason = (
        f"islands by site (batch {'/'.join(str(p.global_batch_size) for p in plans)}, H={h}: "
        f"outer sync {share:.1%} of the step"
        + ("" if given_h else _limit_text(share, request))
        + ")"
    )
    return plan, reason


def _limit_text(share: float, request: IslandRequest) -> str:
    """What bounded the chosen H: the comm share, or the interval cap where the share is not
    met within it."""
    if share <= request.max_comm_share:
        return f", at most {request.max_comm_share:.0%}"
    return (
        f", above {request.max_comm_share:.0%}: H is capped at --outer-max-interval "
        f"{request.max_interval}"
    )


def plan_islands(
    cluster: ClusterSpec,
    model: ModelSpec,
    options: PlanningOptions,
    request: IslandRequest,
    progress: bool = False,
) -> Plan:
    """The plan `--islands` asks for (module docstring), validated, with its estimate."""
    if request.mode not in ISLAND_MODES:
        raise SpecError(f"--islands: must be one of {', '.join(ISLAND_MODES)}")
    if request.mode == "off":
        return plan_for(cluster, model, options, progress)
    if request.mode == "sites":
        plan, reason = islands_plan(cluster, model, options, request)
    else:
        sync = plan_for(cluster, model, options, progress)
        assert sync.estimate is not None
        cap = request.max_comm_share
        sites = len({g.site for g in cluster.groups})
        share = site_link_share(sync, model, options) if sites > 1 else 0.0
        why = f"{share:.1%} of the synchronous step goes to the site links"
        if share <= cap:
            sync.estimate["bottleneck"] = (
                f"synchronous (auto: {why}, at most {cap:.0%}): {sync.estimate['bottleneck']}"
            )
            return sync
        plan, reason = islands_plan(cluster, model, options, request)
        assert plan.estimate is not None
        if plan.estimate["tokens_per_s"] <= sync.estimate["tokens_per_s"]:
            sync.estimate["bottleneck"] = (
                f"synchronous (auto: {why}, above {cap:.0%}, but islands would give "
                f"{plan.estimate['tokens_per_s']:.4g} tokens/s, not more): "
                f"{sync.estimate['bottleneck']}"
            )
            return sync
        reason += (
            f"; auto: {why}, above {cap:.0%} (synchronous: "
            f"{sync.estimate['tokens_per_s']:.4g} tokens/s)"
        )
    assert plan.estimate is not None
    plan.estimate["bottleneck"] = f"{reason}: {plan.estimate['bottleneck']}"
    return plan
