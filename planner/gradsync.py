"""Weighted data-parallel gradient sync across pipelines whose layouts differ.

The runtime cuts every parameter into the atomic segments of all pipelines' shard boundaries and
all-reduces each segment over the ranks that hold it (one per pipeline); segments with the same
rank set are coalesced into one all-reduce. This module derives those rank sets and their sizes
from a layout, and times them:

- attention weights (QKV and output projection) are cut by query groups, the MLP (fc1 gate/up and
  fc2) by FFN columns, the embedding and output layer by vocabulary rows;
- norms are replicated on every TP rank of a stage: all those ranks join (one contributes), so the
  rank set is the union of the holding stages' TP groups; with one pipeline they need no sync;
- a tied embedding is one parameter held by the first and the last stage of every pipeline.

Gradient buffers are fp32 (GRAD_BYTES_PER_PARAM) and are reduced as fp32. The collectives run
one after another, in one global order, after the last backward of the iteration (the runtime does
not overlap them yet), each at the pace of the slowest link in its rank set.
"""
from bisect import bisect_right
from operator import itemgetter
from typing import NamedTuple

from planner.costmodel import (BF16_BYTES, GRAD_BYTES_PER_PARAM, ring_allgather_time,
                               ring_allreduce_time, ring_reduce_scatter_time)


class StageLayout(NamedTuple):
    """One stage as the cost model sees it: TP ranks, [first, last) layers and per-rank shards.
    (A named tuple: the search builds hundreds of thousands of them on large clusters.)"""
    ranks: tuple
    layers: tuple
    query_groups: tuple
    ffn: tuple
    vocab: tuple          # per-rank vocabulary rows (even split if the stage holds no vocab)


def _bounds(sizes):
    out, acc = [0], 0
    for x in sizes:
        acc += x
        out.append(acc)
    return out


def _add_axis(sets, holders, unit):
    """Atomic segments of one parameter axis; holders = [(sizes, ranks)] one per holding stage.

    Adds `unit` x segment length elements to sets[rank set]. Holders with identical boundaries
    are grouped so that the work is segments x pipelines once per distinct layout.
    """
    if unit == 0:
        return
    by_bounds = {}
    for sizes, ranks in holders:
        by_bounds.setdefault(sizes, []).append(ranks)
    if len(by_bounds) == 1:             # every holder cut alike: one set per shard
        (sizes, rank_lists), = by_bounds.items()
        for i, n in enumerate(sizes):
            key = tuple(sorted(map(itemgetter(i), rank_lists)))
            sets[key] = sets.get(key, 0) + n * unit
        return
    groups = [(_bounds(sizes), rank_lists) for sizes, rank_lists in by_bounds.items()]
    cuts = sorted({c for b, _ in groups for c in b})
    for x, y in zip(cuts, cuts[1:]):
        members = []
        for b, rank_lists in groups:
            i = bisect_right(b, x) - 1
            members.extend(map(itemgetter(i), rank_lists))
        key = tuple(sorted(members))
        sets[key] = sets.get(key, 0) + (y - x) * unit


def _replicated(sets, stages, elems, together):
    """A TP-replicated parameter (norm, row-parallel bias) held by `stages`, one per pipeline:
    every TP rank of them joins (one contributes per stage), as planner.layout cuts it."""
    if elems and together:
        key = tuple(sorted(r for st in stages for r in st.ranks))
        sets[key] = sets.get(key, 0) + elems


def rank_sets(model, pipelines, distributed_optimizer=False):
    """{sorted rank tuple: elements} of every coalesced gradient collective.

    `pipelines` is a list of lists of StageLayout (stage order). Mirrors planner.layout's
    gradient_segments and the runtime's buckets (megatron_hexi.grad_sync.reduced_together): a
    segment joins a collective over its holders when several stages contribute to it, or, with
    the distributed optimizer, when several ranks hold it. Sets of one rank are included (they
    cost nothing but the distributed optimizer shards over them too); TP-replicated parameters
    that need no collective are left out.
    """
    m = model
    h, d, hpg = m.hidden_size, m.head_dim, m.heads_per_group
    bias = bool(m.add_bias_linear)
    norm = h * (2 if m.normalization == "LayerNorm" else 1)      # weight (+ bias) per norm
    fc1 = 2 if m.swiglu else 1
    per_group = (hpg * d + 2 * d) * (h + bias) + hpg * d * h     # QKV (+ bias) + projection
    per_ffn = fc1 * (h + bias) + h                                # fc1 (+ bias) + fc2
    per_layer_replicated = 2 * norm + (2 * h if bias else 0)     # norms (+ proj, fc2 biases)
    sets = {}
    K = len(pipelines)

    def together(stages):
        return K > 1 or (distributed_optimizer and sum(len(st.ranks) for st in stages) > 1)

    cuts = sorted({x for pipe in pipelines for st in pipe for x in st.layers})
    pos = [0] * K
    for lo, hi in zip(cuts, cuts[1:]):
        n = hi - lo
        holding = []
        for pi, pipe in enumerate(pipelines):     # stages in layer order: walk a pointer
            j = pos[pi]
            while pipe[j].layers[1] <= lo:
                j += 1
            pos[pi] = j
            holding.append(pipe[j])
        _add_axis(sets, [(st.query_groups, st.ranks) for st in holding], n * per_group)
        _add_axis(sets, [(st.ffn, st.ranks) for st in holding], n * per_ffn)
        _replicated(sets, holding, n * per_layer_replicated, together(holding))
    firsts = [pipe[0] for pipe in pipelines]
    lasts = [pipe[-1] for pipe in pipelines]
    if m.untie_embeddings_and_output_weights:
        _add_axis(sets, [(st.vocab, st.ranks) for st in firsts], h)
        _add_axis(sets, [(st.vocab, st.ranks) for st in lasts], h)
    else:
        holders = [(st.vocab, st.ranks) for st in firsts]
        holders += [(st.vocab, st.ranks) for pipe, st in zip(pipelines, lasts) if len(pipe) > 1]
        _add_axis(sets, holders, h)
    _replicated(sets, lasts, norm, together(lasts))
    return sets


def allreduce_time(n_elems, ranks, topo, distributed_optimizer):
    """One coalesced segment all-reduce of fp32 grads, on the slowest link of its rank set.

    With the distributed optimizer it is a reduce-scatter of fp32 grads, then (after the step) an
    all-gather of the updated bf16 weights.
    """
    n = len(ranks)
    if n <= 1:
        return 0.0
    bw, lat = topo.slowest(ranks)
    if distributed_optimizer:
        return (ring_reduce_scatter_time(n_elems * GRAD_BYTES_PER_PARAM, n, bw, lat)
                + ring_allgather_time(n_elems * BF16_BYTES, n, bw, lat))
    return ring_allreduce_time(n_elems * GRAD_BYTES_PER_PARAM, n, bw, lat)


def sync_time(sets, topo, distributed_optimizer=False):
    """(total seconds, the costliest (seconds, rank set)) of the serial gradient collectives."""
    total, worst = 0.0, (0.0, ())
    for ranks, elems in sets.items():
        t = allreduce_time(elems, ranks, topo, distributed_optimizer)
        total += t
        if t > worst[0]:
            worst = (t, ranks)
    return total, worst


def optimizer_shares(sets, weights=None):
    """{rank: elements of fp32 master + Adam state it owns} under the distributed optimizer.

    Each segment's state is sharded over its rank set, evenly or (with `weights`, e.g. free
    memory per rank) in proportion to the weights.
    """
    owned = {}
    for ranks, elems in sets.items():
        if weights is None:
            share = elems / len(ranks)
            for r in ranks:
                owned[r] = owned.get(r, 0.0) + share
        else:
            tot = sum(max(weights[r], 0.0) for r in ranks)
            for r in ranks:
                w = max(weights[r], 0.0) / tot if tot > 0 else 1.0 / len(ranks)
                owned[r] = owned.get(r, 0.0) + elems * w
    return owned
