"""Phase 1 of the search: split the GPUs into K pipelines of balanced compute.

The GPU graph (node weights: sustained FLOP/s and memory; edge weights: bandwidth) is coarsened
with machines as super-nodes, because GPUs of one machine share the fast links; a machine may
also be cut into equal chunks when there are more pipelines than machines. METIS
(pymetis, two balance constraints: compute and memory) partitions the chunk graph into K parts,
keeping fast links inside parts; a longest-processing-time greedy split and a machine-striped
split (pipeline j takes chunk j of every machine, so gradient all-reduces stay inside machines)
are the other seeds. `refine` then moves and swaps chunks between pipelines while the cost model
says the plan gets faster.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pymetis

from planner.search_pipeline import MachineChunk
from planner.splits import even_split

if TYPE_CHECKING:
    from planner.topology import Topology

# What `refine` asks of a partition: (seconds, pipeline indices slowest first, anything else the
# caller keeps), or None if it has no feasible layout.
Evaluation = tuple[float, list[int], Any]

# Above this many chunks the METIS graph keeps only each chunk's nearest neighbours (by bandwidth
# and cluster order) instead of all pairs, so that building it stays near-linear.
DENSE_GRAPH_MAX_UNITS = 256
SPARSE_NEIGHBOURS = 16


def make_chunks(topo: Topology, per_machine: int, by_name: bool) -> list[MachineChunk]:
    """The chunks at one coarsening level: every machine cut into min(per_machine, its GPUs)
    equal chunks."""
    chunks, start = [], 0
    for i, node in enumerate(topo.nodes):
        n = node.gpus_per_node
        sizes = even_split(n, min(per_machine, n))
        off = start
        for sz in sizes:
            key = (node.name if by_name else node.group, sz)
            chunks.append(MachineChunk(i, tuple(range(off, off + sz)), key))
            off += sz
        start += n
    return chunks


def _weights(topo: Topology, ch: MachineChunk) -> tuple[int, int]:
    dev = topo.devices[ch.node]
    return (
        max(1, round(dev.flops * len(ch.ranks) / 1e12)),
        max(1, round(dev.memory_bytes * len(ch.ranks) / 1e9)),
    )


def metis_partition(
    topo: Topology, chunks: Sequence[MachineChunk], K: int, seed: int
) -> list[list[MachineChunk]] | None:
    """K parts with pymetis (compute + memory balanced, bandwidth kept inside); None if unusable."""
    n = len(chunks)
    if K == 1:
        return [list(chunks)]
    if K >= n:
        return [[ch] for ch in chunks] if K == n else None
    adj: list[list[int]] = [[] for _ in range(n)]
    wts: list[list[int]] = [[] for _ in range(n)]
    dense = n <= DENSE_GRAPH_MAX_UNITS
    for i in range(n):
        js = range(i + 1, n) if dense else range(i + 1, min(n, i + 1 + SPARSE_NEIGHBOURS))
        for j in js:
            bw, _ = topo.node_link(chunks[i].node, chunks[j].node)
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
    vw = [x for ch in chunks for x in _weights(topo, ch)]
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
    out: list[list[MachineChunk]] = [[] for _ in range(K)]
    for ch, p in zip(chunks, parts):
        out[p].append(ch)
    return out if all(out) else None


def greedy_partition(
    topo: Topology, chunks: Sequence[MachineChunk], K: int
) -> list[list[MachineChunk]] | None:
    """Longest-processing-time split: biggest chunk first, to the part with the least compute."""
    if K > len(chunks):
        return None
    w = {ch: _weights(topo, ch)[0] for ch in chunks}
    order = sorted(chunks, key=lambda ch: (-w[ch], ch.node, ch.ranks))
    parts: list[list[MachineChunk]] = [[] for _ in range(K)]
    heap = [(0, i) for i in range(K)]  # (load, part): least loaded, lowest index first
    for ch in order:
        load, j = heapq.heappop(heap)
        parts[j].append(ch)
        heapq.heappush(heap, (load + w[ch], j))
    return [sorted(p, key=lambda ch: ch.ranks) for p in parts]


def striped_partition(chunks: Sequence[MachineChunk], K: int) -> list[list[MachineChunk]] | None:
    """Pipeline j takes the j-th chunk of every machine (needs every machine cut into K chunks)."""
    by_node: dict[int, list[MachineChunk]] = {}
    for ch in chunks:
        by_node.setdefault(ch.node, []).append(ch)
    if any(len(v) != K for v in by_node.values()):
        return None
    return [[v[j] for v in by_node.values()] for j in range(K)]


def refine(
    parts: list[list[MachineChunk]],
    evaluate: Callable[[list[list[MachineChunk]]], Evaluation | None],
    max_rounds: int = 4,
    max_trials: int = 64,
) -> tuple[list[list[MachineChunk]], Evaluation | None]:
    """Move or swap chunks between pipelines while `evaluate(parts)` (seconds) decreases.

    Trials per round: each chunk of the slowest-per-compute pipeline moved to, or swapped with a
    chunk of another type in, the fastest ones. Deterministic.
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
            for i, ch in enumerate(parts[src]):
                cands: list[tuple[str, int, int | None]] = []
                if len(parts[src]) > 1:
                    cands.append(("move", i, None))
                for j, v in enumerate(parts[dst]):
                    if v.key != ch.key:
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
