"""The search's two reference strategies beside hexi: `uniform` and `exhaustive`.

Their own module because each is a whole search of its own over the Searcher's inputs and caches
(planner/search.py): `uniform`, what a user gets without this project (Megatron-style TP x PP x DP
over all GPUs), and `exhaustive`, the yardstick for hexi's heuristics on small clusters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from planner.errors import SpecError
from planner.search_candidates import FINALISTS, Candidate, Solution
from planner.search_partition import make_chunks
from planner.search_pipeline import MachineChunk, chunk_stage_options
from planner.splits import even_split
from planner.sync_model import StageLayout

if TYPE_CHECKING:
    from planner.searcher import Searcher

_T = TypeVar("_T")

EXHAUSTIVE_MAX_CHUNKS = 8
EXHAUSTIVE_MAX_LAYOUTS = 50_000  # pipeline layouts exhaustive may evaluate


class UniformLayout(NamedTuple):
    """The best uniform layout found: its sort key, plan pipelines and recompute."""

    key: tuple[bool, float]  # (does not fit, iteration seconds)
    pipelines: list[dict[str, Any]]
    recompute: bool


def uniform(searcher: Searcher) -> UniformLayout | None:
    """Best fitting Megatron-style layout: TP t, PP p, DP d with t*p*d = all GPUs."""
    N, L, m = searcher.topo.cluster.num_gpus, searcher.model.num_layers, searcher.model
    best = None
    for t in divisors(N):
        if t > m.num_query_groups:
            continue
        if searcher.sequence_parallel and t > 1 and m.seq_length % t:
            continue  # the plan's rule: the sequence is cut evenly over the TP ranks
        shards = (
            tuple(even_split(m.num_query_groups, t)),
            tuple(even_split(m.ffn_hidden_size, t)),
            tuple(even_split(m.vocab_size, t)),
        )
        for p in divisors(N // t):
            d = N // (t * p)
            if p > L or searcher.gbs % d:
                continue
            per = searcher.gbs // d
            for rc in searcher.rc_list:
                for mbs in searcher.mbs_list:
                    if per % mbs:
                        continue
                    layers = even_split(L, p)
                    pipes: list[dict[str, Any]] = []
                    for dp in range(d):
                        stages, first = [], 0
                        for pp in range(p):
                            base = t * (dp + d * pp)
                            stages.append(
                                {
                                    "ranks": list(range(base, base + t)),
                                    "layers": [first, first + layers[pp]],
                                }
                            )
                            first += layers[pp]
                        pipes.append(
                            {
                                "micro_batch_size": mbs,
                                "num_microbatches": per // mbs,
                                "stages": stages,
                            }
                        )
                    lay = [
                        [
                            StageLayout(tuple(s["ranks"]), tuple(s["layers"]), *shards)
                            for s in pp_["stages"]
                        ]
                        for pp_ in pipes
                    ]
                    e = searcher.simulate(lay, [(mbs, per // mbs)] * d, rc)
                    key = (not e.fits_memory, e.iteration_time_s)
                    if best is None or key < best.key:
                        best = UniformLayout(key, pipes, rc)
            searcher.progress(f"uniform: TP {t} x PP {p} x DP {d}")
    return best


def exhaustive(searcher: Searcher) -> Candidate | None:
    """Every partition of the machine groups, every order and per-group stage count of
    hexi's search space (`Searcher.evaluate` with exhaustive pipelines); the best by the
    simulator."""
    levels = []
    for c in searcher.chunk_levels():
        chunks = make_chunks(searcher.topo, c, searcher.by_name)
        if len(chunks) <= EXHAUSTIVE_MAX_CHUNKS:
            levels.append(chunks)
    levels = [ch for ch in levels if exhaustive_size(searcher, ch) <= EXHAUSTIVE_MAX_LAYOUTS]
    if not levels:
        n = len(make_chunks(searcher.topo, 1, searcher.by_name))
        raise SpecError(
            f"--strategy exhaustive: cluster {searcher.cluster.name!r} ({n} machines, "
            f"{searcher.topo.cluster.num_gpus} GPUs) is too large to enumerate "
            f"(limit {EXHAUSTIVE_MAX_CHUNKS} chunks / {EXHAUSTIVE_MAX_LAYOUTS} "
            f"pipeline layouts); use --strategy hexi"
        )
    best = None
    for rc in searcher.rc_list:
        for mbs in searcher.mbs_list:
            cands = []
            for chunks in levels:
                caches: dict[int, dict[tuple[Any, ...], Solution | None]] = {}
                seen = set()
                for parts in set_partitions(chunks):
                    K = len(parts)
                    sig = tuple(sorted(tuple(sorted(ch.key for ch in p)) for p in parts))
                    if sig in seen and not searcher.by_name:
                        continue  # same machines' kinds per pipeline: same plan cost
                    seen.add(sig)
                    if K > searcher.gbs // mbs:
                        continue
                    ctx = searcher.context(mbs, rc, K)
                    cache = caches.setdefault(id(ctx), {})
                    cand = searcher.evaluate(ctx, parts, mbs, True, cache)
                    if cand is not None:
                        cands.append(cand)
                searcher.progress(f"exhaustive: {len(cands)} candidates")
            cands.sort(key=searcher.proxy)
            for cand in cands[:FINALISTS]:
                if best is None or searcher.score(cand) < searcher.score(best):
                    best = cand
    return best


def exhaustive_size(searcher: Searcher, chunks: Sequence[MachineChunk]) -> int:
    """Distinct pipeline layouts exhaustive evaluates: every sub-multiset of chunks (by kind),
    each distinct order and every per-chunk stage count."""
    kinds: dict[tuple[Any, ...], list[MachineChunk]] = {}
    for ch in chunks:
        kinds.setdefault(ch.key if not searcher.by_name else ch.ranks, []).append(ch)
    groups = [
        (
            len(v),
            len(chunk_stage_options(len(v[0].ranks), searcher.model, searcher.sequence_parallel)),
        )
        for v in kinds.values()
    ]
    total = 0
    for counts in itertools.product(*[range(c + 1) for c, _ in groups]):
        k = sum(counts)
        if k == 0:
            continue
        perms = math.factorial(k)
        for c in counts:
            perms //= math.factorial(c)
        opts = 1
        for c, (_, o) in zip(counts, groups):
            opts *= o**c
        total += perms * opts
    return total


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def set_partitions(items: Sequence[_T]) -> Iterator[list[list[_T]]]:
    """Every partition of a list into non-empty blocks (restricted growth strings)."""
    n = len(items)
    if n == 0:
        return
    a = [0] * n

    def rec(i: int, k: int) -> Iterator[list[list[_T]]]:
        if i == n:
            blocks: list[list[_T]] = [[] for _ in range(k)]
            for x, b in zip(items, a):
                blocks[b].append(x)
            yield blocks
            return
        for b in range(k + 1):
            a[i] = b
            yield from rec(i + 1, max(k, b + 1))

    yield from rec(0, 0)
