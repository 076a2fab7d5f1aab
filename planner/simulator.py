"""Simulator: score any valid plan with the cost model and say what limits it.

iteration time = the slowest pipeline's 1F1B time (each stage's own forward/backward, boundary
transfers and all-gathers) + the exposed part of the weighted gradient sync across pipelines + the
optimizer step (the slowest rank). The gradient sync is serial after the last backward (all of it
exposed), or, with the plan's training.overlap_grad_reduce / overlap_param_gather, overlapped with
the backward and the next forward as planner.sync_model describes (`overlapped_sync_time`); the
stages' last-backward end times come from the same 1F1B simulation. MFU = model FLOPs without
recompute / (iteration time x the sum of the used GPUs' catalog peaks). Memory is checked per rank
against the device's capacity.

CPU contention (profiled CPU nodes only): processes that share a node slow each other only while
they compute. The pipelines are evaluated once at the node's full contention; each rank then
gets the contention of 1 + the share of the step its node's other processes compute (their
stages' forward + backward time over the iteration), and the pipelines are evaluated again. An
overlapped sync hides only what a free core can run there (planner/cpu_sharing.py).

Distributed optimizer: each rank holds the fp32 master and Adam state of the elements
planner.layout.optimizer_elements gives it (the runtime's own split; counted here by its fast
mirror planner.sync_model.fast_optimizer_elements).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeAlias

from planner.attention import PLAN_DEFAULT_BACKEND
from planner.costmodel import stage_cost
from planner.cpu_sharing import busy_shares, cores_taken, overlap_paid, shared_node_slowdowns
from planner.devices import Device, optimizer_step_time
from planner.estimate import Estimate, StageReport
from planner.flops import model_flops_per_sample
from planner.host import EAGER_LOCAL, LayerImpl, layer_impl
from planner.island_estimate import simulate_islands
from planner.layout import optimizer_weight
from planner.measured_costs import step_overhead
from planner.memory import (
    OPTIMIZER_BYTES_PER_PARAM,
    WEIGHT_BYTES_PER_PARAM,
    MemoryUse,
    RankShape,
    rank_memory,
    sequence_split,
)
from planner.outer_sync import OUTER_BYTES_PER_PARAM
from planner.schedule import last_backward_ends, pipeline_time
from planner.sync_model import (
    BUCKET_ELEMENTS,
    Layout,
    StageLayout,
    collectives,
    fast_optimizer_elements,
    overlapped_sync_time,
    rank_sets,
    stage_timings,
    sync_time,
)
from planner.topology import Topology, boundary_times

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec
    from planner.models import ModelSpec
    from planner.plan import Plan

# The 1F1B schedule's inputs: per stage forward and backward seconds, per boundary transfer
# seconds forward and back (planner.schedule.pipeline_time's arguments, without m).
ScheduleInputs: TypeAlias = tuple[
    tuple[float, ...], tuple[float, ...], tuple[float, ...], tuple[float, ...]
]
# One pipeline's evaluation: (1F1B seconds, per stage (fwd, bwd, compute, tp_comm, p2p_in), per
# rank MemoryUse without optimizer state, the schedule's inputs).
PipelineEval: TypeAlias = tuple[float, list[tuple[float, ...]], list[MemoryUse], ScheduleInputs]


class SimulationCache:
    """Memo of one search (or any run of many simulations of one model on one topology):
    identical pipelines are evaluated once, and a layout's optimizer shares are cut once."""

    MAX_ENTRIES = 20_000  # per memo: cleared beyond, so that memory stays bounded

    def __init__(self) -> None:
        self.pipelines: dict[tuple[Any, ...], PipelineEval] = {}
        # per pipeline (same keys): its stages' last-backward end times (overlapped sync only)
        self.ends: dict[tuple[Any, ...], tuple[float, ...]] = {}
        self.optimizer: dict[tuple[Any, ...], dict[int, int]] = {}


def layouts_of(plan: Plan) -> list[list[StageLayout]]:
    """Plan -> list (pipelines) of lists (stages) of StageLayout, shards resolved."""
    out = []
    for pipe in plan.pipelines:
        out.append(
            [
                StageLayout(
                    tuple(s.ranks),
                    tuple(s.layers),
                    tuple(plan.shard_sizes(s, "query_groups")),
                    tuple(plan.shard_sizes(s, "ffn")),
                    tuple(plan.shard_sizes(s, "vocab")),
                )
                for s in pipe.stages
            ]
        )
    return out


def simulate(
    plan: Plan,
    topo: Topology | None = None,
    cache: SimulationCache | None = None,
    bucket_elements: int = BUCKET_ELEMENTS,
) -> Estimate:
    """Estimate of a validated Plan; `bucket_elements`: the runtime's --ddp-bucket-size (its
    default is BUCKET_ELEMENTS), which bounds the overlapped buckets. A plan with islands or
    outer steps: planner.island_estimate."""
    if plan.islands or plan.training.outer is not None:
        topo = topo or Topology(plan.cluster)
        return simulate_islands(
            plan,
            topo,
            lambda pipes: _simulate_pipelines(plan, pipes, topo, cache, bucket_elements, True),
        )
    return _simulate_pipelines(plan, range(len(plan.pipelines)), topo, cache, bucket_elements)


def _simulate_pipelines(
    plan: Plan,
    pipes: Sequence[int],
    topo: Topology | None,
    cache: SimulationCache | None,
    bucket_elements: int,
    outer_state: bool = False,
) -> Estimate:
    """Estimate of the pipelines `pipes` of `plan` synchronised every step among themselves."""
    layouts = layouts_of(plan)
    return simulate_layout(
        plan.model,
        plan.cluster,
        [layouts[p] for p in pipes],
        [(plan.pipelines[p].micro_batch_size, plan.pipelines[p].num_microbatches) for p in pipes],
        plan.training.recompute,
        plan.training.use_distributed_optimizer,
        plan.training.optimizer_shard,
        topo,
        cache,
        plan.training.overlap_grad_reduce,
        plan.training.overlap_param_gather,
        bucket_elements,
        plan.training.attention_backend,
        plan.training.sequence_parallel,
        plan_layer_impl(plan),
        outer_state,
    )


def plan_layer_impl(plan: Plan) -> LayerImpl:
    """How the plan's layers run, for their host time (planner.host)."""
    t = plan.training
    return layer_impl(t.transformer_impl, t.cuda_graph_impl, t.cuda_graph_scope)


def _gpu_label(topo: Topology, ranks: Sequence[int]) -> str:
    nodes = sorted({topo.node_of[r] for r in ranks})
    dev = topo.devices[nodes[0]].name
    where = ",".join(topo.nodes[n].name for n in nodes[:3]) + ("..." if len(nodes) > 3 else "")
    return f"{len(ranks)}x{dev}@{where}"


def simulate_layout(
    model: ModelSpec,
    cluster: ClusterSpec,
    layouts: Layout,
    batches: Sequence[tuple[int, int]],
    recompute: bool,
    distributed_optimizer: bool = False,
    optimizer_shard: str = "even",
    topo: Topology | None = None,
    cache: SimulationCache | None = None,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    bucket_elements: int = BUCKET_ELEMENTS,
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    sequence_parallel: bool = False,
    layer_impl: LayerImpl = EAGER_LOCAL,
    outer_state: bool = False,
) -> Estimate:
    """Estimate of a layout: `layouts` as from layouts_of, `batches` [(mbs, num_microbatches)].

    `cache`: a SimulationCache shared by the calls of one search (None: a fresh one).
    `overlap_grad_reduce`, `overlap_param_gather`, `attention_backend`, `sequence_parallel`: the
    plan's training settings of those names (the parameter gather counts only with the
    distributed optimizer; sequence parallelism acts in stages of TP degree > 1). `layer_impl`:
    how the layers run (planner.host: the host time of a layer pass). `outer_state`: every rank
    also keeps fp32 outer parameters and momentum for its optimizer elements (islands)."""
    m = model
    topo = topo or Topology(cluster)
    cache = cache if cache is not None else SimulationCache()
    overlapped = overlap_grad_reduce or (overlap_param_gather and distributed_optimizer)
    ptimes, reports, ranks_all, mems_all, scheds, ends = _pipelines(
        m,
        topo,
        layouts,
        batches,
        recompute,
        cache,
        None,
        overlapped,
        attention_backend,
        sequence_parallel,
        layer_impl,
    )
    if overlapped:
        colls = collectives(m, layouts, distributed_optimizer)
        # on CPU nodes whose cores are all busy, the hidden part of the sync is paid for anyway
        paid = (
            overlap_paid(topo, busy_shares(m, topo, layouts, reports, batches, max(ptimes)))
            if cores_taken(topo, ranks_all)
            else 0.0
        )

        def overlapped_sync() -> tuple[float, float, tuple[float, tuple[int, ...]]]:
            timing = stage_timings(layouts, ends, [x[0] for x in scheds], [x[1] for x in scheds])
            got = overlapped_sync_time(
                colls,
                topo,
                distributed_optimizer,
                timing,
                max(ptimes),
                overlap_grad_reduce,
                overlap_param_gather,
                bucket_elements,
            )
            exposed = got.exposed + paid * (got.serial - got.exposed)
            return exposed, got.serial, got.worst

        sync, serial, worst_sync = overlapped_sync()
    else:
        sync, worst_sync = sync_time(
            rank_sets(m, layouts, distributed_optimizer), topo, distributed_optimizer
        )
        serial = sync
    slow = shared_node_slowdowns(
        topo, busy_shares(m, topo, layouts, reports, batches, max(ptimes) + sync)
    )
    if slow:
        ptimes, reports, ranks_all, mems_all, scheds, ends = _pipelines(
            m,
            topo,
            layouts,
            batches,
            recompute,
            cache,
            slow,
            overlapped,
            attention_backend,
            sequence_parallel,
            layer_impl,
        )
        if overlapped:
            sync, serial, worst_sync = overlapped_sync()
    nonopt = dict(zip(ranks_all, mems_all))  # rank -> MemoryUse without optimizer state
    node_of, devices = topo.node_of, topo.devices

    owned = None  # rank -> optimizer-state elements it owns
    if distributed_optimizer:
        owned = _optimizer_elements(m, topo, layouts, optimizer_shard, cache)
    opt_time, peak, cap, terms = 0.0, [], [], []
    fits, worst_mem, used_peak = True, None, 0.0
    # ranks with the same memory, optimizer share and machine kind are computed once (and share
    # their memory_terms_gb dict)
    seen: dict[tuple[Any, ...], tuple[float, float, dict[str, float], float, float]] = {}
    node_sig = [topo.node_sig(n) for n in range(len(topo.nodes))]
    for r in sorted(nonopt):
        base, n = nonopt[r], node_of[r]
        key = (id(base), None if owned is None else owned[r], node_sig[n])
        got = seen.get(key)
        if got is None:
            dev = devices[n]
            # elements whose fp32 master and Adam state this rank keeps and steps
            state = base.weights / WEIGHT_BYTES_PER_PARAM if owned is None else owned[r]
            opt = state * OPTIMIZER_BYTES_PER_PARAM
            total = base.total + opt
            step = optimizer_step_time(state, dev.mem_bw) + step_overhead(dev)
            t = {k: v / 1e9 for k, v in base.terms().items()}
            t["optimizer"] = opt / 1e9
            if outer_state:
                t["outer"] = state * OUTER_BYTES_PER_PARAM / 1e9
                total += state * OUTER_BYTES_PER_PARAM
            got = seen[key] = (total, step, t, dev.memory_bytes, dev.peak_flops)
        total, step, t, capacity, pk = got
        if step > opt_time:
            opt_time = step
        used_peak += pk
        peak.append(total / 1e9)
        cap.append(capacity / 1e9)
        terms.append(t)
        over = total - capacity
        if over > 0:
            fits = False
            if worst_mem is None or over > worst_mem[0]:
                worst_mem = (over, r, t)

    iteration = max(ptimes) + sync + opt_time
    samples = sum(mbs * nmb for mbs, nmb in batches)
    tokens = samples * m.seq_length
    mfu = samples * model_flops_per_sample(m) / (iteration * used_peak)
    bottleneck = _bottleneck(
        topo,
        reports,
        ptimes,
        batches,
        sync,
        worst_sync,
        opt_time,
        iteration,
        worst_mem,
        serial if overlapped else None,
    )
    return Estimate(
        iteration,
        tokens / iteration,
        mfu,
        peak,
        cap,
        terms,
        ptimes,
        sync,
        opt_time,
        bottleneck,
        fits,
        reports,
        serial,
        overlapped,
    )


def _optimizer_elements(
    m: ModelSpec, topo: Topology, layouts: Layout, optimizer_shard: str, cache: SimulationCache
) -> dict[int, int]:
    """{rank: elements of optimizer state it owns}, weighted (optimizer_shard "memory") by the
    catalog GPU of each rank's node, as the plan names it."""
    key = (optimizer_shard, tuple(tuple(pipe) for pipe in layouts))
    got = cache.optimizer.get(key)
    if got is None:
        if len(cache.optimizer) > cache.MAX_ENTRIES:
            cache.optimizer.clear()
        nodes, node_of = topo.nodes, topo.node_of
        got = cache.optimizer[key] = fast_optimizer_elements(
            m, layouts, lambda r: optimizer_weight(nodes[node_of[r]].gpu, optimizer_shard)
        )
    return got


def _pipelines(
    m: ModelSpec,
    topo: Topology,
    layouts: Layout,
    batches: Sequence[tuple[int, int]],
    recompute: bool,
    sim_cache: SimulationCache,
    slow: Mapping[int, float] | None = None,
    with_ends: bool = False,
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    sequence_parallel: bool = False,
    layer_impl: LayerImpl = EAGER_LOCAL,
) -> tuple[
    list[float],
    list[StageReport],
    list[int],
    list[MemoryUse],
    list[ScheduleInputs],
    list[tuple[float, ...]],
]:
    """(1F1B time per pipeline, StageReports, ranks in stage order, their MemoryUse, schedule
    inputs per pipeline, and with `with_ends` per pipeline its stages' last-backward end times);
    `slow`: {rank: compute slowdown} replacing the node's full contention for those ranks."""
    cache, ends_cache = sim_cache.pipelines, sim_cache.ends
    if len(cache) > sim_cache.MAX_ENTRIES:
        cache.clear()
        ends_cache.clear()
    ends: list[tuple[float, ...]] = []
    ptimes: list[float] = []
    reports: list[StageReport] = []
    ranks_all: list[int] = []
    mems_all: list[MemoryUse] = []
    scheds: list[ScheduleInputs] = []
    for pi, (stages, (mbs, nmb)) in enumerate(zip(layouts, batches)):
        ranks = [r for st in stages for r in st.ranks]
        mine = tuple(slow.get(r) for r in ranks) if slow else ()
        # identical pipelines (same machine kinds, layers and shards) are evaluated once
        key = (
            topo.sig(*[st.ranks for st in stages]),
            tuple((st.layers, st.query_groups, st.ffn, st.vocab) for st in stages),
            mbs,
            nmb,
            recompute,
            mine,
            attention_backend,
            sequence_parallel,
            layer_impl,
        )
        got = cache.get(key)
        if got is None:
            got = cache[key] = _pipeline_eval(
                m, topo, stages, mbs, nmb, recompute, slow, attention_backend, sequence_parallel,
                layer_impl,
            )  # fmt: skip
        ptime, stage_rows, mems, sched = got
        ptimes.append(ptime)
        scheds.append(sched)
        if with_ends:
            e = ends_cache.get(key)
            if e is None:
                e = ends_cache[key] = last_backward_ends(*sched, nmb)
            ends.append(e)
        for k, (st, row) in enumerate(zip(stages, stage_rows)):
            reports.append(StageReport(pi, k, st.ranks, *row))
            ranks_all.extend(st.ranks)
        mems_all.extend(mems)
    return ptimes, reports, ranks_all, mems_all, scheds, ends


def _device(topo: Topology, rank: int, slow: Mapping[int, float] | None) -> Device:
    """The rank's Device, with its own contention when `slow` gives one."""
    dev = topo.device_of(rank)
    s = slow.get(rank) if slow else None
    if s is None:
        return dev
    assert dev.profile is not None  # `slow` names ranks of profiled nodes only
    return replace(dev, profile=type(dev.profile)(dev.profile.profile, s))


def _pipeline_eval(
    m: ModelSpec,
    topo: Topology,
    stages: Sequence[StageLayout],
    mbs: int,
    nmb: int,
    recompute: bool,
    slow: Mapping[int, float] | None = None,
    attention_backend: str = PLAN_DEFAULT_BACKEND,
    sequence_parallel: bool = False,
    layer_impl: LayerImpl = EAGER_LOCAL,
) -> PipelineEval:
    """(1F1B seconds, per stage (fwd, bwd, compute, tp_comm, p2p_in), per rank MemoryUse
    without optimizer state, the schedule's inputs) of one pipeline. Under
    `sequence_parallel` a stage of TP degree t > 1 keeps its activations cut over its t ranks
    (memory.sequence_split) and does not all-gather what it receives."""
    p = len(stages)
    fwd, bwd, xf, xb, rows, mems = [], [], [], [], [], []
    for k, st in enumerate(stages):
        devs = [_device(topo, r, slow) for r in st.ranks]
        first, last = st.layers[0] == 0, st.layers[1] == m.num_layers
        link = topo.slowest(st.ranks)
        c = stage_cost(
            m,
            mbs,
            devs,
            {"query_groups": st.query_groups, "ffn": st.ffn, "vocab": st.vocab},
            st.layers[1] - st.layers[0],
            first,
            last,
            link,
            recompute,
            attention_backend,
            layer_impl,
        )
        fwd.append(c.fwd)
        bwd.append(c.bwd)
        rows.append([c.fwd, c.bwd, c.compute, c.tp_comm, 0.0, c.host_wait])
        seen = {}
        split = sequence_split(len(st.ranks), sequence_parallel)
        for i in range(len(st.ranks)):
            shape = RankShape(
                mbs, st.query_groups[i], st.ffn[i], st.vocab[i], first, last, k, p, nmb,
                recompute, optimizer_fraction=0.0, attention_backend=attention_backend,
                sequence_split=split,
            )  # fmt: skip
            if shape not in seen:
                seen[shape] = rank_memory(m, shape, st.layers[1] - st.layers[0])
            mems.append(seen[shape])
    for k in range(p - 1):
        (tf, gf), (tb, gb) = boundary_times(
            m, mbs, stages[k].ranks, stages[k + 1].ranks, topo, sequence_parallel
        )
        xf.append(tf)
        xb.append(tb)
        fwd[k + 1] += gf
        bwd[k] += gb
        rows[k + 1][0] += gf
        rows[k][1] += gb
        rows[k + 1][4] = tf + gf + tb + gb
    sched = (tuple(fwd), tuple(bwd), tuple(xf), tuple(xb))
    return pipeline_time(fwd, bwd, xf, xb, nmb), [tuple(r) for r in rows], mems, sched


def _bottleneck(
    topo: Topology,
    reports: Sequence[StageReport],
    ptimes: Sequence[float],
    batches: Sequence[tuple[int, int]],
    sync: float,
    worst_sync: tuple[float, tuple[int, ...]],
    opt_time: float,
    iteration: float,
    worst_mem: tuple[float, int, dict[str, float]] | None,
    serial: float | None = None,
) -> str:
    """One line naming what limits the plan, led by its kind (memory-bound, communication-bound,
    host-bound or compute-bound): memory, a stage (and why), or a link. `serial`: the
    collectives' serial seconds when the sync is overlapped (`sync` is then its exposed part),
    None when it is serial."""
    if worst_mem is not None:
        over, r, t = worst_mem
        term = max((k for k in t if k != "reserve"), key=lambda k: t[k])
        return (
            f"memory-bound: rank {r} ({topo.device_of(r).name}) needs {sum(t.values()):.2f} GB, "
            f"{over / 1e9:.2f} GB over capacity (largest term: {term} {t[term]:.2f} GB)"
        )
    slow = max(range(len(ptimes)), key=lambda i: ptimes[i])
    if sync > 0.5 * (iteration - opt_time) or sync >= ptimes[slow]:
        _, ranks = worst_sync
        bw, _ = topo.slowest(ranks)
        if serial is None:
            return (
                f"communication-bound: gradient sync {sync:.3g} s of {iteration:.3g} s; "
                f"largest all-reduce over {len(ranks)} ranks ({_gpu_label(topo, ranks)}) at "
                f"{bw / 1e9:.3g} GB/s"
            )
        return (
            f"communication-bound: gradient sync {sync:.3g} s exposed of {iteration:.3g} s "
            f"({serial:.3g} s of collectives, overlapped); last to finish: the collective over "
            f"{len(ranks)} ranks ({_gpu_label(topo, ranks)}) at {bw / 1e9:.3g} GB/s"
        )
    stages = [r for r in reports if r.pipeline == slow]
    st = max(stages, key=lambda r: r.fwd + r.bwd)
    per = st.fwd + st.bwd
    parts = {
        "compute": st.compute - st.host_wait,
        "host dispatch": st.host_wait,
        "TP all-reduce": st.tp_comm,
        "stage-boundary p2p": st.p2p_in,
    }
    why = max(parts, key=parts.__getitem__)
    kind = {"compute": "compute-bound", "host dispatch": "host-bound"}.get(
        why, "communication-bound"
    )
    return (
        f"{kind}: pipeline {slow} stage {st.stage} ({_gpu_label(topo, st.ranks)}): "
        f"{per * 1e3:.3g} ms per micro-batch, mostly {why} ({parts[why] / per:.0%}); pipeline "
        f"{ptimes[slow]:.3g} s of iteration {iteration:.3g} s"
    )
