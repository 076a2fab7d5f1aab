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

Gradient buffers are fp32 (GRAD_BYTES_PER_PARAM) and are reduced as fp32. The collectives run
one after another, in one global order, after the last backward of the iteration (the runtime does
not overlap them yet), each at the pace of the slowest link in its rank set.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

from planner.costmodel import (
    BF16_BYTES,
    GRAD_BYTES_PER_PARAM,
    ring_allgather_time,
    ring_allreduce_time,
    ring_reduce_scatter_time,
)
from planner.layout import unit_params, unit_tensors, weighted_split

if TYPE_CHECKING:
    from planner.costmodel import Topology
    from planner.models import ModelSpec


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
# whether a collective sums it).
AddSegment: TypeAlias = Callable[[tuple[int, ...], int, int, int, bool], None]

# axes of layout.UnitTensors / UnitParams
_QUERY_GROUP, _FFN_COLUMN, _LAYER_REPLICATED, _VOCAB_ROW, _FINAL_NORM = range(5)


def _add_axis(
    add: AddSegment,
    holders: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    axis: int,
    count: int,
) -> None:
    """Atomic segments of one parameter axis; holders = [(sizes, ranks)] one per holding stage.

    Calls add(rank set, axis, units in the segment, count, True) per segment. Holders with
    identical boundaries are grouped so that the work is segments x pipelines once per distinct
    layout.
    """
    by_bounds: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for sizes, ranks in holders:
        by_bounds.setdefault(sizes, []).append(ranks)
    if len(by_bounds) == 1:  # every holder cut alike: one set per shard
        ((sizes, rank_lists),) = by_bounds.items()
        for i, n in enumerate(sizes):
            add(tuple(sorted(map(itemgetter(i), rank_lists))), axis, n, count, True)
        return
    groups = [(_bounds(sizes), rank_lists) for sizes, rank_lists in by_bounds.items()]
    cuts = sorted({c for b, _ in groups for c in b})
    for x, y in zip(cuts, cuts[1:]):
        members: list[int] = []
        for b, rank_lists in groups:
            i = bisect_right(b, x) - 1
            members.extend(map(itemgetter(i), rank_lists))
        add(tuple(sorted(members)), axis, y - x, count, True)


def _replicated(
    add: AddSegment, stages: Sequence[StageLayout], axis: int, count: int, together: bool
) -> None:
    """TP-replicated tensors (norms, row-parallel biases) held by `stages`, one per pipeline.
    Reduced together (planner.layout.reduced_together), every TP rank of them joins one set
    (one contributes per stage); otherwise each rank keeps its copy to itself (its own set,
    with no collective)."""
    if together:
        add(tuple(sorted(r for st in stages for r in st.ranks)), axis, 1, count, True)
    else:
        for st in stages:
            for r in st.ranks:
                add((r,), axis, 1, count, False)


def _sweep(
    model: ModelSpec, pipelines: Layout, distributed_optimizer: bool, add: AddSegment
) -> None:
    """Every atomic segment of a layout, as planner.layout's gradient_segments cuts them and
    the runtime buckets them: add(rank set, axis of layout.UnitTensors, units, count, whether a
    collective sums it) once per run of `count` identical segments (layers with the same
    holders)."""
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
        _add_axis(add, [(st.query_groups, st.ranks) for st in holding], _QUERY_GROUP, n)
        _add_axis(add, [(st.ffn, st.ranks) for st in holding], _FFN_COLUMN, n)
        _replicated(add, holding, _LAYER_REPLICATED, n, together(holding))
    firsts = [pipe[0] for pipe in pipelines]
    lasts = [pipe[-1] for pipe in pipelines]
    if model.untie_embeddings_and_output_weights:
        _add_axis(add, [(st.vocab, st.ranks) for st in firsts], _VOCAB_ROW, 1)
        _add_axis(add, [(st.vocab, st.ranks) for st in lasts], _VOCAB_ROW, 1)
    else:
        holders = [(st.vocab, st.ranks) for st in firsts]
        holders += [(st.vocab, st.ranks) for pipe, st in zip(pipelines, lasts) if len(pipe) > 1]
        _add_axis(add, holders, _VOCAB_ROW, 1)
    _replicated(add, lasts, _FINAL_NORM, 1, together(lasts))


def rank_sets(
    model: ModelSpec, pipelines: Layout, distributed_optimizer: bool = False
) -> dict[tuple[int, ...], int]:
    """{sorted rank tuple: elements} of every coalesced gradient collective.

    `pipelines` is a list of lists of StageLayout (stage order). A fast mirror of
    planner.layout's gradient_segments and reduced_together, which the runtime's buckets follow
    (pinned by tests/planner/test_gradsync_layout.py): a segment joins a collective over its
    holders when several stages contribute to it, or, with the distributed optimizer, when
    several ranks hold it. Sets of one rank are included (they cost nothing); TP-replicated
    parameters that need no collective are left out. Sizes per unit: layout.unit_params.
    """
    unit = unit_params(model)
    sets: dict[tuple[int, ...], int] = {}

    def add(key: tuple[int, ...], axis: int, n: int, count: int, collective: bool) -> None:
        if collective:
            sets[key] = sets.get(key, 0) + n * count * unit[axis]

    _sweep(model, pipelines, distributed_optimizer, add)
    return sets


def optimizer_elements(
    model: ModelSpec, pipelines: Layout, weight_of: Callable[[int], float]
) -> dict[int, int]:
    """{rank: elements of fp32 master + Adam state it owns} under the distributed optimizer.

    A fast mirror of planner.layout.optimizer_elements for a layout (pinned by
    tests/planner/test_gradsync_layout.py): the same segments, each tensor's rows cut among
    the segment's holders by layout.weighted_split with weights `weight_of(rank)`.
    """
    tensors = unit_tensors(model)
    # rank set -> {(axis, units): segments}
    runs: dict[tuple[int, ...], dict[tuple[int, int], int]] = {}

    def add(key: tuple[int, ...], axis: int, n: int, count: int, collective: bool) -> None:
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
    bw, lat = topo.slowest(ranks)
    if distributed_optimizer:
        return ring_reduce_scatter_time(
            n_elems * GRAD_BYTES_PER_PARAM, n, bw, lat
        ) + ring_allgather_time(n_elems * BF16_BYTES, n, bw, lat)
    return ring_allreduce_time(n_elems * GRAD_BYTES_PER_PARAM, n, bw, lat)


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
