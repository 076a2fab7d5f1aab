"""Weighted data-parallel gradient sync across pipelines whose layouts differ.

The runtime cuts every parameter into the atomic segments of all pipelines' shard boundaries and
all-reduces each segment over the ranks that hold it (one per pipeline); segments with the same
rank set are coalesced into one all-reduce. This module derives those rank sets and their sizes
from a layout (and, with the distributed optimizer, each rank's share of their state), and times
them:

- attention weights (QKV and output projection) are cut by query groups, the MLP (fc1 gate/up and
  fc2) by FFN columns, the embedding and output layer by vocabulary rows;
- norms are replicated on every TP rank of a stage: all those ranks join (one contributes), so the
  rank set is the union of the holding stages' TP groups; with one pipeline they need no sync;
- a tied embedding is one parameter held by the first and the last stage of every pipeline.

Gradient buffers are fp32 (GRAD_BYTES_PER_PARAM) and are reduced as fp32. Each collective runs at
the pace of the slowest link in its rank set.

Serial (the default): the collectives run one after another, in one global order, after the last
backward of the iteration; all of their time is exposed (`sync_time`).

Overlapped (`overlapped_sync_time`, the runtime's --overlap-grad-reduce and
--overlap-param-gather):
- as the runtime does, each rank set's elements are cut into buckets of BUCKET_ELEMENTS (or the
  runtime's --ddp-bucket-size), taken last layer first and cut inside layers (`buckets`); each
  bucket is a collective of its own, with its own latency, and may start when the backward of
  its lowest layer has ended on every holder (the embedding counts as layer 0, the output layer
  and final norm as the last layer).
  A stage's last backward (micro-batch m - 1) ends at the time the 1F1B schedule gives
  (planner.schedule.last_backward_ends: the last stage first, stage 0 last), and it produces its
  layers' gradients last layer first, at an even pace per layer (`StageTiming.ready`);
- resources: a collective over ranks of several machines occupies the NIC of every machine it
  touches, one inside a machine that machine's intra-node link (`Topology.resources`). Buckets
  on a shared resource queue behind each other in the order they become ready (the runtime
  issues them in backward production order; that a rank also issues its buckets strictly in
  that order is not modelled); buckets on disjoint resources run at the same time, each at its
  own full speed; the backward's compute and its p2p and TP traffic are not slowed by them;
- only what finishes after the last pipeline's compute is exposed;
- the distributed optimizer's all-gather of updated parameters (--overlap-param-gather) starts
  after the optimizer step, in forward order, on the same resources, and is hidden behind the
  next step's first forward on its holders: up to one forward of their stage; the largest
  excess over that is exposed. Without it the all-gathers stay serial after the step.
With neither flag the overlapped model is not used: `sync_time` gives the serial sum, exactly as
plans without the overlap settings were always costed.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from planner.layout import unit_params, unit_tensors
from planner.memory import BF16_BYTES, GRAD_BYTES_PER_PARAM
from planner.splits import weighted_split
from planner.topology import ring_allgather_time, ring_allreduce_time, ring_reduce_scatter_time

if TYPE_CHECKING:
    from planner.models import ModelSpec
    from planner.topology import Topology


class StageLayout(NamedTuple):
    """One stage as the cost model sees it: TP ranks, [first, last) layers and per-rank shards.
    (A named tuple: the search builds hundreds of thousands of them on large clusters.)"""

    ranks: tuple[int, ...]
    layers: tuple[int, ...]  # [first, last)
    query_groups: tuple[int, ...]
    ffn: tuple[int, ...]
    vocab: tuple[int, ...]  # per-rank vocabulary rows (even split if the stage holds no vocab)


def _bounds(sizes: Sequence[int]) -> list[int]:
    out, acc = [0], 0
    for x in sizes:
        acc += x
        out.append(acc)
    return out


# A layout: per pipeline, its stages in order.
Layout: TypeAlias = Sequence[Sequence[StageLayout]]
# _sweep's callback: add(rank set, axis of layout.UnitTensors, units in the segment, count,
# whether a collective sums it, first layer of the segments: 0 for the embedding, num_layers for
# the output layer and the final norm).
AddSegment: TypeAlias = Callable[[tuple[int, ...], int, int, int, bool, int], None]

# Elements per overlapped gradient bucket: Megatron-LM's floor for --ddp-bucket-size, and the
# runtime's default bound (megatron_hexi.grad_sync reads it from here).
BUCKET_ELEMENTS = 40_000_000

# axes of layout.UnitTensors / UnitParams
_QUERY_GROUP, _FFN_COLUMN, _LAYER_REPLICATED, _VOCAB_ROW, _FINAL_NORM, _POSITION_TABLE = range(6)


def _add_axis(
    add: AddSegment,
    holders: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    axis: int,
    count: int,
    layer: int,
) -> None:
    """Atomic segments of one parameter axis; holders = [(sizes, ranks)] one per holding stage.

    Calls add(rank set, axis, units in the segment, count, True, layer) per segment. Holders with
    identical boundaries are grouped so that the work is segments x pipelines once per distinct
    layout.
    """
    by_bounds: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for sizes, ranks in holders:
        by_bounds.setdefault(sizes, []).append(ranks)
    if len(by_bounds) == 1:  # every holder cut alike: one set per shard
        ((sizes, rank_lists),) = by_bounds.items()
        for i, n in enumerate(sizes):
            add(tuple(sorted(map(itemgetter(i), rank_lists))), axis, n, count, True, layer)
        return
    groups = [(_bounds(sizes), rank_lists) for sizes, rank_lists in by_bounds.items()]
    cuts = sorted({c for b, _ in groups for c in b})
    for x, y in zip(cuts, cuts[1:]):
        members: list[int] = []
        for b, rank_lists in groups:
            i = bisect_right(b, x) - 1
            members.extend(map(itemgetter(i), rank_lists))
        add(tuple(sorted(members)), axis, y - x, count, True, layer)


def _replicated(
    add: AddSegment,
    stages: Sequence[StageLayout],
    axis: int,
    count: int,
    together: bool,
    layer: int,
) -> None:
    """TP-replicated tensors (norms, row-parallel biases) held by `stages`, one per pipeline.
    Reduced together (planner.layout.reduced_together), every TP rank of them joins one set
    (one contributes per stage); otherwise each rank keeps its copy to itself (its own set,
    with no collective)."""
    if together:
        add(tuple(sorted(r for st in stages for r in st.ranks)), axis, 1, count, True, layer)
    else:
        for st in stages:
            for r in st.ranks:
                add((r,), axis, 1, count, False, layer)


def _sweep(
    model: ModelSpec, pipelines: Layout, distributed_optimizer: bool, add: AddSegment
) -> None:
    """Every atomic segment of a layout, as planner.layout's gradient_segments cuts them and
    the runtime buckets them: add(rank set, axis of layout.UnitTensors, units, count, whether a
    collective sums it, first layer) once per run of `count` identical segments (layers with the
    same holders)."""
    K = len(pipelines)

    def together(stages: Sequence[StageLayout]) -> bool:
        return K > 1 or (distributed_optimizer and sum(len(st.ranks) for st in stages) > 1)

    cuts = sorted({x for pipe in pipelines for st in pipe for x in st.layers})
    pos = [0] * K
    for lo, hi in zip(cuts, cuts[1:]):
        n = hi - lo
        holding = []
        for pi, pipe in enumerate(pipelines):  # stages in layer order: walk a pointer
            j = pos[pi]
            while pipe[j].layers[1] <= lo:
                j += 1
            pos[pi] = j
            holding.append(pipe[j])
        _add_axis(add, [(st.query_groups, st.ranks) for st in holding], _QUERY_GROUP, n, lo)
        _add_axis(add, [(st.ffn, st.ranks) for st in holding], _FFN_COLUMN, n, lo)
        _replicated(add, holding, _LAYER_REPLICATED, n, together(holding), lo)
    firsts = [pipe[0] for pipe in pipelines]
    lasts = [pipe[-1] for pipe in pipelines]
    L = model.num_layers
    if model.untie_embeddings_and_output_weights:
        _add_axis(add, [(st.vocab, st.ranks) for st in firsts], _VOCAB_ROW, 1, 0)
        _add_axis(add, [(st.vocab, st.ranks) for st in lasts], _VOCAB_ROW, 1, L)
    else:
        holders = [(st.vocab, st.ranks) for st in firsts]
        holders += [(st.vocab, st.ranks) for pipe, st in zip(pipelines, lasts) if len(pipe) > 1]
        _add_axis(add, holders, _VOCAB_ROW, 1, 0)
    _replicated(add, lasts, _FINAL_NORM, 1, together(lasts), L)
    if model.position_rows:
        _replicated(add, firsts, _POSITION_TABLE, 1, together(firsts), 0)


def rank_sets(
    model: ModelSpec, pipelines: Layout, distributed_optimizer: bool = False
) -> dict[tuple[int, ...], int]:
    """{sorted rank tuple: elements} of every coalesced gradient collective.

    `pipelines` is a list of lists of StageLayout (stage order). A fast mirror of
    planner.layout's gradient_segments and reduced_together, which the runtime's buckets follow
    (pinned by tests/planner/test_sync_model_layout.py): a segment joins a collective over its
    holders when several stages contribute to it, or, with the distributed optimizer, when
    several ranks hold it. Sets of one rank are included (they cost nothing); TP-replicated
    parameters that need no collective are left out. Sizes per unit: layout.unit_params.
    """
    unit = unit_params(model)
    sets: dict[tuple[int, ...], int] = {}

    def add(
        key: tuple[int, ...], axis: int, n: int, count: int, collective: bool, layer: int
    ) -> None:
        if collective:
            sets[key] = sets.get(key, 0) + n * count * unit[axis]

    _sweep(model, pipelines, distributed_optimizer, add)
    return sets


def fast_optimizer_elements(
    model: ModelSpec, pipelines: Layout, weight_of: Callable[[int], float]
) -> dict[int, int]:
    """{rank: elements of fp32 master + Adam state it owns} under the distributed optimizer.

    A fast mirror of planner.layout.optimizer_elements for a layout (pinned by
    tests/planner/test_sync_model_layout.py): the same segments, each tensor's rows cut among
    the segment's holders by splits.weighted_split with weights `weight_of(rank)`.
    """
    tensors = unit_tensors(model)
    # rank set -> {(axis, units): segments}
    runs: dict[tuple[int, ...], dict[tuple[int, int], int]] = {}

    def add(
        key: tuple[int, ...], axis: int, n: int, count: int, collective: bool, layer: int
    ) -> None:
        got = runs.setdefault(key, {})
        got[axis, n] = got.get((axis, n), 0) + count

    _sweep(model, pipelines, True, add)
    owned: dict[int, int] = {}
    splits: dict[tuple[int, tuple[float, ...]], list[int]] = {}  # many sets share a split
    for ranks, sizes in runs.items():
        weights = tuple(weight_of(r) for r in ranks)
        for (axis, n), count in sizes.items():
            for cut in tensors[axis]:
                key = (n * cut.rows, weights)
                parts = splits.get(key)
                if parts is None:
                    parts = splits[key] = weighted_split(n * cut.rows, list(weights))
                for r, rows in zip(ranks, parts):
                    owned[r] = owned.get(r, 0) + rows * cut.inner * count
    return owned


def bucket_seconds(
    elems: float, n: int, link: tuple[float, float], distributed_optimizer: bool
) -> tuple[float, float]:
    """(reduce, gather) seconds of one bucket's collectives over n ranks on `link` (bandwidth,
    latency): an fp32 all-reduce, or with the distributed optimizer an fp32 reduce-scatter and,
    after the step, a bf16 all-gather."""
    bw, lat = link
    if distributed_optimizer:
        return (
            ring_reduce_scatter_time(elems * GRAD_BYTES_PER_PARAM, n, bw, lat),
            ring_allgather_time(elems * BF16_BYTES, n, bw, lat),
        )
    return ring_allreduce_time(elems * GRAD_BYTES_PER_PARAM, n, bw, lat), 0.0


def allreduce_time(
    n_elems: float, ranks: Sequence[int], topo: Topology, distributed_optimizer: bool
) -> float:
    """One coalesced segment all-reduce of fp32 grads, on the slowest link of its rank set.

    With the distributed optimizer it is a reduce-scatter of fp32 grads, then (after the step) an
    all-gather of the updated bf16 weights.
    """
    n = len(ranks)
    if n <= 1:
        return 0.0
    return sum(bucket_seconds(n_elems, n, topo.slowest(ranks), distributed_optimizer))


def sync_time(
    sets: Mapping[tuple[int, ...], float], topo: Topology, distributed_optimizer: bool = False
) -> tuple[float, tuple[float, tuple[int, ...]]]:
    """(total seconds, the costliest (seconds, rank set)) of the serial gradient collectives."""
    total = 0.0
    worst: tuple[float, tuple[int, ...]] = (0.0, ())
    for ranks, elems in sets.items():
        t = allreduce_time(elems, ranks, topo, distributed_optimizer)
        total += t
        if t > worst[0]:
            worst = (t, ranks)
    return total, worst


def collectives(
    model: ModelSpec, pipelines: Layout, distributed_optimizer: bool = False
) -> dict[tuple[int, ...], dict[int, int]]:
    """{sorted rank tuple: {layer: elements}} of every coalesced gradient collective: the sets of
    `rank_sets` (their elements summed over layers are its sizes), each cut by the layer that
    produces the elements (0 for the embedding, num_layers for the output layer and the final
    norm)."""
    unit = unit_params(model)
    sets: dict[tuple[int, ...], dict[int, int]] = {}

    def add(
        key: tuple[int, ...], axis: int, n: int, count: int, collective: bool, layer: int
    ) -> None:
        if collective:
            got = sets.get(key)
            if got is None:
                got = sets[key] = {}
            per = n * unit[axis]
            for x in range(layer, layer + count):
                got[x] = got.get(x, 0) + per

    _sweep(model, pipelines, distributed_optimizer, add)
    return sets


def buckets(
    layers: Mapping[int, int], bound: int = BUCKET_ELEMENTS
) -> list[tuple[int, int, int, int]]:
    """A rank set's overlapped buckets, cut as the runtime cuts them
    (megatron_hexi.grad_sync._bounded_buckets): the set's elements in backward production order
    (last layer first), in buckets of `bound` elements, a bucket closing wherever it is full,
    inside a layer or not; the last one holds the rest. Grouped by the layer each bucket closes
    in (the lowest layer it holds: it is ready when that layer's gradients are), in production
    order: (layer, buckets, elements per bucket, elements of the last one). A bucket's
    collective has its own latency, so many small buckets cost more than one large one."""
    out: list[tuple[int, int, int, int]] = []
    total = sum(layers.values())
    done = 0  # elements taken so far
    for layer in sorted(layers, reverse=True):
        after = done + layers[layer]
        full = after // bound - done // bound  # buckets that fill up inside this layer
        if after == total and after % bound:  # the rest closes with the set's last layer
            out.append((layer, full + 1, bound, after % bound))
        elif full:
            out.append((layer, full, bound, bound))
        done = after
    return out


class StageTiming(NamedTuple):
    """A stage in the step's schedule, as the overlapped sync sees it (seconds from the step's
    start)."""

    grads_done: float  # end of the stage's last backward: all its gradients are produced
    bwd: float  # one micro-batch's backward on the stage
    fwd: float  # one micro-batch's forward on the stage
    first: int  # layers [first, last)
    last: int

    def ready(self, layer: int) -> float:
        """When the stage has produced the gradients of `layer`: the last backward runs from
        `grads_done - bwd`, last layer first, at an even pace per layer (layers outside the
        stage count as its nearest one)."""
        a = self.first
        done = min(max(layer, a), self.last - 1) - a
        return self.grads_done - self.bwd * done / (self.last - a)


class Timings(NamedTuple):
    """Every rank's StageTiming: `stages[stage_of[rank]]` (stage numbers, so that the ranks of
    a collective are grouped by stage cheaply)."""

    stage_of: Sequence[int]
    stages: Sequence[StageTiming]

    @classmethod
    def of(cls, by_rank: Mapping[int, StageTiming]) -> Timings:
        """From {rank: StageTiming} (any ranks a collective needs)."""
        stages = list(dict.fromkeys(by_rank.values()))
        number = {t: i for i, t in enumerate(stages)}
        stage_of = [-1] * (max(by_rank, default=-1) + 1)
        for r, t in by_rank.items():
            stage_of[r] = number[t]
        return cls(stage_of, stages)


def stage_timings(
    pipelines: Layout,
    ends: Sequence[Sequence[float]],
    fwd: Sequence[Sequence[float]],
    bwd: Sequence[Sequence[float]],
) -> Timings:
    """Every rank's StageTiming, from per pipeline and stage: last-backward end times
    (planner.schedule.last_backward_ends), forward and backward seconds per micro-batch. Equal
    timings (identical pipelines) share a number, so a collective over many identical pipelines
    looks at one."""
    stage_of = [-1] * (1 + max(max(st.ranks) for pipe in pipelines for st in pipe))
    number: dict[StageTiming, int] = {}
    seen: dict[tuple[Any, ...], list[int]] = {}  # identical pipelines are numbered once
    for pipe, e, f, b in zip(pipelines, ends, fwd, bwd):
        key = (tuple(e), tuple(f), tuple(b), tuple(st.layers for st in pipe))
        ks = seen.get(key)
        if ks is None:
            ks = seen[key] = [
                number.setdefault(StageTiming(ek, bk, fk, st.layers[0], st.layers[1]), len(number))
                for st, ek, fk, bk in zip(pipe, e, f, b)
            ]
        for st, k in zip(pipe, ks):
            lo, hi = min(st.ranks), max(st.ranks)
            if hi - lo + 1 == len(st.ranks):  # consecutive ranks (distinct): one slice
                stage_of[lo : hi + 1] = [k] * len(st.ranks)
            else:
                for r in st.ranks:
                    stage_of[r] = k
    return Timings(stage_of, list(number))


class SyncTimes(NamedTuple):
    exposed: float  # seconds the gradient sync adds to the iteration
    serial: float  # seconds of all its collectives (overlapped: every bucket's) one after another
    worst: tuple[float, tuple[int, ...]]  # (seconds, rank set) of the collective that limits it


def overlapped_sync_time(
    sets: Mapping[tuple[int, ...], Mapping[int, int]],
    topo: Topology,
    distributed_optimizer: bool,
    timing: Timings,
    compute_end: float,
    overlap_grad_reduce: bool,
    overlap_param_gather: bool,
    bucket_elements: int = BUCKET_ELEMENTS,
) -> SyncTimes:
    """Exposed seconds of the gradient collectives (`collectives`) under the overlap model of
    the module docstring; `timing`: every rank's StageTiming, `compute_end`: when the last
    pipeline ends its compute (the slowest pipeline's 1F1B time)."""
    stage_of, stages = timing.stage_of, timing.stages
    serial = 0.0
    worst: tuple[float, tuple[int, ...]] = (0.0, ())
    # (ready, -layer, ranks, resources, reduce seconds, gather seconds, hidden window, layer)
    rows: list[tuple[float, int, tuple[int, ...], tuple[int, ...], float, float, float, int]] = []
    for ranks, layers in sets.items():
        n = len(ranks)
        if n <= 1:
            continue
        link = topo.slowest(ranks)
        holders = [stages[k] for k in set(map(stage_of.__getitem__, ranks))]
        window = min(t.fwd for t in holders)
        res = topo.resources(ranks)
        spent = 0.0  # the set's collectives, one after another
        # each bucket is a collective of its own, as the runtime issues them; without
        # overlap_grad_reduce the runtime keeps one bucket per rank set
        bound = bucket_elements if overlap_grad_reduce else max(sum(layers.values()), 1)
        for layer, count, e, last in buckets(layers, bound):
            full = bucket_seconds(e, n, link, distributed_optimizer)
            tail = full if last == e else bucket_seconds(last, n, link, distributed_optimizer)
            r, g = ((count - 1) * f + t for f, t in zip(full, tail))
            spent += r + g
            ready = max(t.ready(layer) for t in holders)
            rows.append((ready, -layer, ranks, res, r, g, window, layer))
        serial += spent
        if spent > worst[0]:
            worst = (spent, ranks)

    if overlap_grad_reduce:
        free = [0.0] * (2 * len(topo.nodes))  # per resource: when it is free
        end = compute_end
        for ready, _, ranks, res, red, _, _, _ in sorted(rows):
            busy = max(map(free.__getitem__, res))
            fin = (ready if ready > busy else busy) + red
            for x in res:
                free[x] = fin
            if fin > end:
                end, worst = fin, (red, ranks)
        exposed = end - compute_end
    else:
        exposed = sum(row[4] for row in rows)
    if distributed_optimizer and overlap_param_gather:
        free = [0.0] * (2 * len(topo.nodes))
        excess = 0.0
        for _, _, ranks, res, _, gat, window, _ in sorted(rows, key=lambda x: (x[7], x[2])):
            fin = max(map(free.__getitem__, res)) + gat
            for x in res:
                free[x] = fin
            if fin - window > excess:
                excess = fin - window
                if excess > exposed:
                    worst = (gat, ranks)
        exposed += excess
    else:
        exposed += sum(row[5] for row in rows)
    return SyncTimes(exposed, serial, worst)
