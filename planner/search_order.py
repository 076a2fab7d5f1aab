"""Phase 2 of the search, the choice: which order of its chunks a pipeline takes and how many
stages each chunk hosts.

Its own module because the choice (beam orders, coordinate descent over stage counts, whole
machine orders) only scores layouts that planner/search_pipeline.py builds: it never touches
layers, memory or times itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from planner.search_pipeline import (
    Context,
    MachineChunk,
    OrderKey,
    PipelineDraft,
    build_pipeline,
    chunk_stage_options,
    layout_template,
    order_key,
)

# Pipelines of at most this many chunks also get a per-chunk pass over stage counts.
PER_CHUNK_REFINE_MAX_CHUNKS = 16

# Beam width of the stage-ordering search (HexiScale's tau). Stated choice: 4 partial orders.
TOP_TAU = 4

# Pipelines on few machines also try every order of whole machines (up to this many distinct
# orders), re-tuning stage counts on the best BLOCK_ORDERS_REFINED of them.
BLOCK_ORDERS_MAX = 120
BLOCK_ORDERS_REFINED = 2


class _Choice:
    """A scored (order, stage counts) pair; the draft is re-mapped only for the winner."""

    __slots__ = ("chunks", "ks")

    def __init__(self, chunks: Iterable[MachineChunk], ks: Iterable[int]):
        self.chunks, self.ks = tuple(chunks), tuple(ks)


class _Scored(NamedTuple):
    """What the search compares: phase 2's objective of a choice (lower is better)."""

    obj: float
    choice: _Choice


def _score(
    ctx: Context,
    order: Sequence[MachineChunk],
    ks: tuple[int, ...],
    m_est: int,
    okey: OrderKey | None = None,
) -> _Scored | None:
    """_Scored or None: what the search compares, without building the draft. `okey`: the
    order's `order_key`, for callers that score many stage counts of one order."""
    tpl = layout_template(ctx, order, ks, m_est, okey)
    return None if tpl is None else _Scored(tpl.obj, _Choice(order, ks))


def order_chunks(
    ctx: Context, chunks: Sequence[MachineChunk], tau: int = TOP_TAU
) -> list[list[MachineChunk]]:
    """Top-tau greedy orders of the chunks: keep the tau partial orders with the smallest sum of
    boundary transfer times, extend each by every unused chunk, repeat; returns the final orders.

    Interchangeable chunks (same key) are tried once per step.
    """
    beam: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    n = len(chunks)
    for _ in range(n):
        nxt: dict[tuple[tuple[str, int], ...], tuple[tuple[int, ...], float]] = {}
        for path, score in beam:
            used = set(path)
            seen = set()
            for i, ch in enumerate(chunks):
                if i in used or ch.key in seen:
                    continue
                seen.add(ch.key)
                s = score + (ctx.link_cost(chunks[path[-1]], ch) if path else 0.0)
                new = path + (i,)
                sig = tuple(chunks[j].key for j in new)
                if sig not in nxt or s < nxt[sig][1]:
                    nxt[sig] = (new, s)
        beam = sorted(nxt.values(), key=lambda x: (x[1], [chunks[j].key for j in x[0]]))[:tau]
    return [[chunks[i] for i in path] for path, _ in beam]


def best_pipeline(
    ctx: Context,
    chunks: Sequence[MachineChunk],
    m_est: int,
    exhaustive: bool = False,
    polish: bool = False,
    tune_orders: bool = False,
) -> PipelineDraft | None:
    """The best PipelineDraft for these chunks (None if nothing fits), fitted for the schedule.

    Heuristic: candidate orders = top-tau orders, their reverses, and chunks by memory (largest
    first: early stages hold more micro-batches); stage counts chosen per GPU type by coordinate
    descent (for the best top-tau order and the memory order; the others take the counts
    chosen so far, or with `tune_orders` are tuned too). Polish (the search's finalists): also
    every order of whole machines, when few (`_block_orders`). The search polishes its
    finalists with and without `tune_orders` and keeps what the simulator scores best: the
    cheap objective that picks a pipeline's layout does not always agree with it.
    Exhaustive: every distinct order x every per-chunk stage count.
    """
    if exhaustive:
        orders, seen = [], set()
        for perm in itertools.permutations(range(len(chunks))):
            sig = tuple(chunks[i].key for i in perm)
            if sig not in seen:
                seen.add(sig)
                orders.append([chunks[i] for i in perm])
    else:
        orders = order_chunks(ctx, chunks)
        orders += [list(reversed(o)) for o in orders]
        orders.append(
            sorted(
                chunks,
                key=lambda ch: (
                    -ctx.topo.device_of(ch.ranks[0]).memory_bytes,
                    -ctx.topo.device_of(ch.ranks[0]).flops,
                    ch.node,
                ),
            )
        )
    uniq, seen = [], set()
    for o in orders:
        sig = tuple(ch.key for ch in o)
        if sig not in seen:
            seen.add(sig)
            uniq.append(o)
    best = None
    for n_order, order in enumerate(uniq):
        opts = [
            chunk_stage_options(len(ch.ranks), ctx.model, ctx.sequence_parallel) for ch in order
        ]
        if exhaustive:
            for ks in itertools.product(*opts):
                got = _score(ctx, order, ks, m_est)
                if got is not None and (best is None or got.obj < best.obj):
                    best = got
            continue
        if tune_orders and best is not None:
            # every order gets its own stage counts, starting also from the counts chosen so
            # far: scored only with another order's counts, an order was undervalued (at
            # 10 Gbit/s the search missed a layout it found at 25 Gbit/s that is better at 10
            # too: tests/planner/test_search_consistency.py)
            chosen = {ch.key: k for ch, k in zip(best.choice.chunks, best.choice.ks)}
            got = _coordinate_descent(ctx, order, opts, m_est, chosen)
        elif n_order == 0 or n_order == len(uniq) - 1:  # best top-tau order, memory order
            got = _coordinate_descent(ctx, order, opts, m_est)
        elif best is not None:  # other orders: the chosen stage counts
            sel = {ch.key: k for ch, k in zip(best.choice.chunks, best.choice.ks)}
            got = _score(ctx, order, tuple(sel[ch.key] for ch in order), m_est)
        else:
            got = _coordinate_descent(ctx, order, opts, m_est)
        if got is not None and (best is None or got.obj < best.obj):
            best = got
    if polish and not exhaustive and best is not None:
        best = _block_orders(ctx, chunks, m_est, best, seen)
    if best is None:
        return None
    draft = build_pipeline(ctx, best.choice.chunks, best.choice.ks, m_est)
    assert draft is not None  # its template was scored above
    return draft.fit(ctx.fits)


def _block_orders(
    ctx: Context,
    chunks: Sequence[MachineChunk],
    m_est: int,
    best: _Scored,
    tried: set[tuple[tuple[str, int], ...]],
) -> _Scored:
    """Every order of whole machines (a machine's chunks kept together), when there are at most
    BLOCK_ORDERS_MAX distinct ones: each scored with the chosen stage counts per chunk kind, the
    BLOCK_ORDERS_REFINED best then re-tuned by coordinate descent."""
    by_node: dict[int, list[MachineChunk]] = {}
    for ch in sorted(chunks, key=lambda ch: ch.ranks):
        by_node.setdefault(ch.node, []).append(ch)
    blocks = list(by_node.values())
    if len(blocks) < 2:
        return best
    kinds = [tuple(ch.key for ch in b) for b in blocks]
    count, n = 1, len(blocks)
    for i in range(2, n + 1):
        count *= i
        if count > 40 * BLOCK_ORDERS_MAX:
            return best
    perms, seen = [], set()
    for perm in itertools.permutations(range(n)):
        sig = tuple(kinds[i] for i in perm)
        if sig in seen:
            continue
        seen.add(sig)
        perms.append([ch for i in perm for ch in blocks[i]])
        if len(perms) > BLOCK_ORDERS_MAX:
            return best
    # each order scored with the stage counts chosen so far and with the fewest stages per chunk
    sels = [
        {ch.key: k for ch, k in zip(best.choice.chunks, best.choice.ks)},
        {
            ch.key: chunk_stage_options(len(ch.ranks), ctx.model, ctx.sequence_parallel)[0]
            for ch in chunks
        },
    ]
    scored = []
    for i, order in enumerate(perms):
        if tuple(ch.key for ch in order) in tried:
            continue
        objs = [
            got.obj
            for got in (
                _score(ctx, order, tuple(sel[ch.key] for ch in order), m_est) for sel in sels
            )
            if got is not None
        ]
        if objs:
            scored.append((min(objs), i, order))
    scored.sort(key=lambda x: (x[0], x[1]))
    for _, _, order in scored[:BLOCK_ORDERS_REFINED]:
        opts = [
            chunk_stage_options(len(ch.ranks), ctx.model, ctx.sequence_parallel) for ch in order
        ]
        got = _coordinate_descent(ctx, order, opts, m_est)
        if got is not None and got.obj < best.obj:
            best = got
    return best


def _coordinate_descent(
    ctx: Context,
    order: Sequence[MachineChunk],
    opts: Sequence[Sequence[int]],
    m_est: int,
    chosen: Mapping[tuple[str, int], int] | None = None,
) -> _Scored | None:
    """Choose one stage count per chunk key (GPU type) by coordinate descent from two starts, and
    from `chosen` (counts per key found for another order) when given."""
    keys = sorted({ch.key for ch in order})
    choices = {k: opts[[ch.key for ch in order].index(k)] for k in keys}
    best = None
    L = ctx.model.num_layers
    starts = [{k: choices[k][0] for k in keys}]
    # start 2: as many stages as memory may need, without exceeding the layers
    most = {k: choices[k][-1] for k in keys}
    if sum(most[ch.key] for ch in order) > L:
        most = {
            k: max(
                [x for x in choices[k] if x * sum(1 for ch in order if ch.key == k) <= L]
                or [choices[k][0]]
            )
            for k in keys
        }
    starts.append(most)
    if chosen is not None:
        starts.append({k: chosen[k] for k in keys})
    cache: dict[tuple[int, ...], _Scored | None] = {}
    okey = order_key(order)
    order_keys = okey[0]

    def score(sel: Mapping[tuple[str, int], int]) -> _Scored | None:
        ks = tuple(map(sel.__getitem__, order_keys))
        if ks not in cache:
            cache[ks] = _score(ctx, order, ks, m_est, okey)
        return cache[ks]

    for sel in starts:
        cur = score(sel)
        for _ in range(3):
            improved = False
            for k in keys:
                for x in choices[k]:
                    if x == sel[k]:
                        continue
                    trial = {**sel, k: x}
                    got = score(trial)
                    if got is not None and (cur is None or got.obj < cur.obj - 1e-12):
                        sel, cur, improved = trial, got, True
            if not improved:
                break
        if cur is not None and len(order) <= PER_CHUNK_REFINE_MAX_CHUNKS:
            # then per chunk: machines of one type may host different stage counts
            ks = list(cur.choice.ks)
            for i in [j for _ in range(2) for j in reversed(range(len(order)))]:
                for x in opts[i]:
                    if x == ks[i]:
                        continue
                    cand = tuple(ks[:i] + [x] + ks[i + 1 :])
                    if cand not in cache:
                        cache[cand] = _score(ctx, order, cand, m_est, okey)
                    got = cache[cand]
                    if got is not None and got.obj < cur.obj - 1e-12:
                        cur, ks = got, list(cand)
            # and swaps: which machine of a type hosts more stages (a two-coordinate move)
            for i in range(len(order)):
                for j in range(i + 1, len(order)):
                    if order[i].key != order[j].key or ks[i] == ks[j]:
                        continue
                    swapped = list(ks)
                    swapped[i], swapped[j] = ks[j], ks[i]
                    cand = tuple(swapped)
                    if cand not in cache:
                        cache[cand] = _score(ctx, order, cand, m_est, okey)
                    got = cache[cand]
                    if got is not None and got.obj < cur.obj - 1e-12:
                        cur, ks = got, list(cand)
        if cur is not None and (best is None or cur.obj < best.obj):
            best = cur
    return best
