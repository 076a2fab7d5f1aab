"""Search candidates: a laid-out partition, and its micro-batches shared out over its pipelines.

Its own module because hexi, the exhaustive strategy and the neighbour moves all make, rank and
rebalance the same candidates (planner/search.py, planner/search_baselines.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from planner.search_pipeline import Context, MachineChunk, PipelineDraft, draft_to_stages
from planner.sync_model import StageLayout

if TYPE_CHECKING:
    from planner.models import ModelSpec
    from planner.simulator import Estimate

FINALISTS = 6  # candidates scored exactly by the simulator per knob


def allocate(drafts: Sequence[PipelineDraft], total: int) -> list[int] | None:
    """Micro-batch counts (>= 1 each, summing to `total`) that equalise the pipelines' finish.

    Water-filling on each pipeline's linear time fixed + m * rate (exact for the 1F1B periodic
    regime); refined afterwards on exact schedule times by `rebalance`.
    """
    K = len(drafts)
    if total < K:
        return None
    inv = sum(1 / d.rate for d in drafts)
    T = (total + sum(d.fixed / d.rate for d in drafts)) / inv
    ms = [max(1, int((T - d.fixed) / d.rate)) for d in drafts]
    excess = sum(ms) - total
    if excess > 0:  # take from the latest finishers (ties: lowest index), heap: O(K log K)
        heap = [(-(d.fixed + d.rate * m), i) for i, (d, m) in enumerate(zip(drafts, ms)) if m > 1]
        heapq.heapify(heap)
        while excess > 0:
            _, i = heapq.heappop(heap)
            ms[i] -= 1
            excess -= 1
            if ms[i] > 1:
                heapq.heappush(heap, (-(drafts[i].fixed + drafts[i].rate * ms[i]), i))
    elif excess < 0:  # give to the earliest finishers after one more
        heap = [(d.fixed + d.rate * (m + 1), i) for i, (d, m) in enumerate(zip(drafts, ms))]
        heapq.heapify(heap)
        while excess < 0:
            _, i = heapq.heappop(heap)
            ms[i] += 1
            excess += 1
            heapq.heappush(heap, (drafts[i].fixed + drafts[i].rate * (ms[i] + 1), i))
    return ms


def rebalance(
    drafts: Sequence[PipelineDraft], ms: Sequence[int], max_moves: int | None = None
) -> tuple[list[int], float]:
    """Move single micro-batches from the slowest pipeline (exact 1F1B time) while it helps."""
    cache: dict[tuple[int, int], float] = {}

    def t(i: int, m: int) -> float:
        key = (id(drafts[i]), m)
        if key not in cache:
            cache[key] = drafts[i].time(m)
        return cache[key]

    ms = list(ms)
    K = len(ms)
    times = [t(i, m) for i, m in enumerate(ms)]
    nxt = [t(i, m + 1) for i, m in enumerate(ms)]
    for _ in range(max_moves or 2 * K + 4):
        slow = max(range(K), key=times.__getitem__)
        if ms[slow] <= 1 or K < 2:
            break
        dst = min((i for i in range(K) if i != slow), key=nxt.__getitem__)
        others = max((times[i] for i in range(K) if i != slow and i != dst), default=0.0)
        new_max = max(others, t(slow, ms[slow] - 1), nxt[dst])
        if new_max >= times[slow] - 1e-12:
            break
        ms[slow] -= 1
        ms[dst] += 1
        for i in (slow, dst):
            times[i], nxt[i] = t(i, ms[i]), t(i, ms[i] + 1)
    return ms, max(times)


@dataclass(eq=False)
class Candidate:
    """A laid-out partition with its micro-batch counts, and what the search learns of it."""

    drafts: list[PipelineDraft]  # PipelineDraft per pipeline
    ms: list[int]  # micro-batches per pipeline
    mbs: int
    recompute: bool
    pipe_time: float  # slowest pipeline by the drafts' linear fits
    ctx: Context  # the context, partition and pipeline cache it came from,
    parts: list[list[MachineChunk]]  # so that it can be refined and polished
    cache: dict[tuple[Any, ...], Solution | None]
    sync: float | None = None  # exposed gradient sync seconds (planner.searcher.Searcher.proxy)
    estimate: Estimate | None = None  # the simulator's Estimate (planner.searcher.Searcher.score)

    def layouts(self, model: ModelSpec) -> list[list[StageLayout]]:
        out = []
        for d in self.drafts:
            stages, first = [], 0
            for s in d.stages:
                stages.append(
                    StageLayout(
                        s.ranks,
                        (first, first + s.layers),
                        tuple(s.shards["query_groups"]),
                        tuple(s.shards["ffn"]),
                        tuple(s.shards["vocab"]),
                    )
                )
                first += s.layers
            out.append(stages)
        return out

    def pipelines(self, model: ModelSpec) -> list[dict[str, Any]]:
        order = sorted(range(len(self.drafts)), key=lambda i: min(self.drafts[i].stages[0].ranks))
        return [
            {
                "micro_batch_size": self.mbs,
                "num_microbatches": self.ms[i],
                "stages": draft_to_stages(self.drafts[i], model.num_layers),
            }
            for i in order
        ]


class Solution(NamedTuple):
    """A part's best pipeline, by chunk kinds: re-mapped onto any part of the same kinds."""

    chunk_keys: tuple[tuple[str, int], ...]  # chunk kinds in stage order
    ks: tuple[int, ...]  # stages each chunk hosts
