"""Phase 1 of the search: split the GPUs into K pipelines of balanced compute.

The GPU graph (node weights: sustained FLOP/s and memory; edge weights: bandwidth) is coarsened
with machines as super-nodes, because GPUs of one machine share the fast links; a machine may
also be cut into equal chunks ("units") when there are more pipelines than machines. METIS
(pymetis, two balance constraints: compute and memory) partitions the unit graph into K parts,
keeping fast links inside parts; a longest-processing-time greedy split and a machine-striped
split (pipeline j takes chunk j of every machine, so gradient all-reduces stay inside machines)
are the other seeds. `refine` then moves and swaps units between pipelines while the cost model
says the plan gets faster.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pymetis

from planner.layout import even_split
from planner.search_pipeline import Unit

if TYPE_CHECKING:
    from planner.topology import Topology

# What `refine` asks of a partition: (seconds, pipeline indices slowest first, anything else the
# caller keeps), or None if it has no feasible layout.
Evaluation = tuple[float, list[int], Any]

# Above this many units the METIS graph keeps only each unit's nearest neighbours (by bandwidth
# and cluster order) instead of all pairs, so that building it stays near-linear.
DENSE_GRAPH_MAX_UNITS = 256
SPARSE_NEIGHBOURS = 16


def make_units(topo: Topology, chunks: int, by_name: bool) -> list[Unit]:
    """Units at one coarsening level: every machine cut into min(chunks, its GPUs) equal chunks."""
    units, start = [], 0
    for i, node in enumerate(topo.nodes):
        n = node.gpus_per_node
        sizes = even_split(n, min(chunks, n))
        off = start
        for sz in sizes:
            key = (node.name if by_name else node.group, sz)
            units.append(Unit(i, tuple(range(off, off + sz)), key))
            off += sz
        start += n
    return units


def _weights(topo: Topology, u: Unit) -> tuple[int, int]:
    dev = topo.devices[u.node]
    return (
        max(1, round(dev.flops * len(u.ranks) / 1e12)),
        max(1, round(dev.memory_bytes * len(u.ranks) / 1e9)),
    )


def metis_partition(
    topo: Topology, units: Sequence[Unit], K: int, seed: int
) -> list[list[Unit]] | None:
    """K parts with pymetis (compute + memory balanced, bandwidth kept inside); None if unusable."""
    n = len(units)
    if K == 1:
        return [list(units)]
    if K >= n:
        return [[u] for u in units] if K == n else None
    adj: list[list[int]] = [[] for _ in range(n)]
    wts: list[list[int]] = [[] for _ in range(n)]
    dense = n <= DENSE_GRAPH_MAX_UNITS
    for i in range(n):
        js = range(i + 1, n) if dense else range(i + 1, min(n, i + 1 + SPARSE_NEIGHBOURS))
        for j in js:
            bw, _ = topo.node_link(units[i].node, units[j].node)
            w = max(1, round(bw / 1e8))
            adj[i].append(j)
            adj[j].append(i)
            wts[i].append(w)
            wts[j].append(w)
    xadj: list[int] = [0]
    adjncy: list[int] = []
    ew: list[int] = []
    for i in range(n):
        adjncy.extend(adj[i])
        ew.extend(wts[i])
        xadj.append(len(adjncy))
    vw = [x for u in units for x in _weights(topo, u)]
    saved = os.dup(2)  # METIS prints its complaints about degenerate graphs to fd 2
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            _, parts = pymetis.part_graph(
                K,
                adjacency=pymetis.CSRAdjacency(xadj, adjncy),
                vweights=vw,
                eweights=ew,
                options=pymetis.Options(seed=seed),
            )
    except Exception:  # METIS refuses some tiny or degenerate graphs; other seeds remain
        return None
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    out: list[list[Unit]] = [[] for _ in range(K)]
    for u, p in zip(units, parts):
        out[p].append(u)
    return out if all(out) else None


def greedy_partition(topo: Topology, units: Sequence[Unit], K: int) -> list[list[Unit]] | None:
    """Longest-processing-time split: biggest unit first, to the part with the least compute."""
    if K > len(units):
        return None
    w = {u: _weights(topo, u)[0] for u in units}
    order = sorted(units, key=lambda u: (-w[u], u.node, u.ranks))
    parts: list[list[Unit]] = [[] for _ in range(K)]
    heap = [(0, i) for i in range(K)]  # (load, part): least loaded, lowest index first
    for u in order:
        load, j = heapq.heappop(heap)
        parts[j].append(u)
        heapq.heappush(heap, (load + w[u], j))
    return [sorted(p, key=lambda u: u.ranks) for p in parts]


def striped_partition(units: Sequence[Unit], K: int) -> list[list[Unit]] | None:
    """Pipeline j takes the j-th chunk of every machine (needs every machine cut into K chunks)."""
    by_node: dict[int, list[Unit]] = {}
    for u in units:
        by_node.setdefault(u.node, []).append(u)
    if any(len(v) != K for v in by_node.values()):
        return None
    return [[v[j] for v in by_node.values()] for j in range(K)]


def refine(
    parts: list[list[Unit]],
    evaluate: Callable[[list[list[Unit]]], Evaluation | None],
    max_rounds: int = 4,
    max_trials: int = 64,
) -> tuple[list[list[Unit]], Evaluation | None]:
    """Move or swap units between pipelines while `evaluate(parts)` (seconds) decreases.

    Trials per round: each unit of the slowest-per-compute pipeline moved to, or swapped with a
    unit of another type in, the fastest ones. Deterministic.
    """
    best = evaluate(parts)
    if best is None or len(parts) < 2:
        return parts, best
    for _ in range(max_rounds):
        improved = False
        ranked = best[1]  # pipeline indices, slowest first
        src = ranked[0]
        trials = 0
        for dst in reversed(ranked[1:]):
            for i, u in enumerate(parts[src]):
                cands: list[tuple[str, int, int | None]] = []
                if len(parts[src]) > 1:
                    cands.append(("move", i, None))
                for j, v in enumerate(parts[dst]):
                    if v.key != u.key:
                        cands.append(("swap", i, j))
                for _kind, i2, j2 in cands:
                    if trials >= max_trials:
                        break
                    trials += 1
                    trial = [list(p) for p in parts]
                    moved = trial[src].pop(i2)
                    if j2 is not None:  # a swap
                        trial[src].append(trial[dst].pop(j2))
                    trial[dst].append(moved)
                    got = evaluate(trial)
                    if got is not None and got[0] < best[0] * (1 - 1e-4):
                        parts, best, improved = trial, got, True
                        break
                if improved or trials >= max_trials:
                    break
            if improved or trials >= max_trials:
                break
        if not improved:
            break
    return parts, best
