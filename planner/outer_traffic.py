"""Who exchanges which canonical range at an outer step, and the bytes each rank sends for it.

The outer step (planner.islands) averages every canonical range over the islands. The ranges are
the plan's atomic gradient segments over all ranks (planner.layout.gradient_segments): cut at
every holder's boundaries in every island, so each range is one contiguous slice of one local
parameter on each of its holders, whatever TP shards each island uses. For each range, one
holder per island exchanges it across islands (its representative: the holder in the island's
lowest-numbered pipeline, the lowest rank there), then hands the result to the island's other
holders. Under the distributed optimizer the ranges are cut further, where any island's fp32
master parts end, and each island's representative of a range is the owner of its master part
(the optimizer's all-gather is the hand-off). The runtime (megatron_hexi.outer_step), its byte
metric and the simulator (planner.outer_sync, through `outer_bytes_by_fragment`) all read
`outer_ranges`, so they agree by construction on who sends what and how many bytes.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from planner.islands import fragment_layers, outer_bytes_sent
from planner.layout import (
    canonical_shards,
    gradient_segments,
    island_ranks,
    optimizer_split,
    optimizer_weight,
    segment_numel,
)

if TYPE_CHECKING:
    from planner.islands import OuterSettings
    from planner.layout import Segment
    from planner.plan import Plan


class OuterRange(NamedTuple):
    """A canonical range as the outer step moves it."""

    segment: Segment
    numel: int
    fragment: int  # the fragment whose outer step carries it
    holders: tuple[tuple[int, ...], ...]  # per island: the ranks that hold it, sorted
    representatives: tuple[int, ...]  # per island: the holder that exchanges it


def layer_of(name: str) -> int | None:
    """Global layer of a canonical parameter name; None outside the decoder layers."""
    parts = name.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return None


def fragment_of(name: str, num_layers: int, fragments: int) -> int:
    """The fragment of a canonical parameter: its layer's; the embedding goes with fragment 0,
    the final norm and the output layer with the last (planner.islands)."""
    layer = layer_of(name)
    if layer is None:
        return 0 if name.startswith("embedding.") else fragments - 1
    for f, (first, last) in enumerate(fragment_layers(num_layers, fragments)):
        if first <= layer < last:
            return f
    raise ValueError(f"{name}: layer {layer} is outside the model's {num_layers} layers")


def outer_ranges(plan: Plan) -> list[OuterRange]:
    """Every canonical range in the plan's global segment order, with its fragment, holders and
    representatives per island. Under the distributed optimizer the ranges are also cut where
    any island's fp32 master parts end (`_sharded`), and each is represented by its master's
    owner in each island."""
    if plan.training.use_distributed_optimizer:
        return _sharded(plan)
    fragments = plan.training.outer.fragments if plan.training.outer is not None else 1
    shapes = {sh.name: sh.shape for sh in canonical_shards(plan.model)}
    islands = plan.island_pipelines()
    out = []
    for seg in gradient_segments(plan):
        held = set(seg.ranks)
        holders, reps = [], []
        for pipes in islands:
            mine = tuple(sorted(r for p in pipes for r in plan.pipelines[p].ranks if r in held))
            if not mine:
                raise ValueError(f"{seg.name}: island of pipelines {list(pipes)} does not hold it")
            first = next(
                min(r for r in plan.pipelines[p].ranks if r in held)
                for p in sorted(pipes)
                if held & set(plan.pipelines[p].ranks)
            )
            holders.append(mine)
            reps.append(first)
        out.append(
            OuterRange(
                seg,
                segment_numel(shapes[seg.name], seg),
                fragment_of(seg.name, plan.model.num_layers, fragments),
                tuple(holders),
                tuple(reps),
            )
        )
    return out


def _sharded(plan: Plan) -> list[OuterRange]:
    """Outer ranges under the distributed optimizer: each island's segments are cut among their
    holders by optimizer_split (as megatron_hexi.distributed_optimizer cuts its master parts,
    one bucket per rank set); every range lies in one part per island, whose owner exchanges it
    and writes the result into its master (the optimizer's all-gather hands it on)."""
    fragments = plan.training.outer.fragments if plan.training.outer is not None else 1
    shapes = {sh.name: sh.shape for sh in canonical_shards(plan.model)}
    mode = plan.training.optimizer_shard
    parts: dict[str, list[tuple[int, int, int, int]]] = {}  # name -> (start, end, island, rank)
    for island, ranks in enumerate(island_ranks(plan)):
        for seg in gradient_segments(plan, ranks):
            rows = optimizer_split(seg, lambda r: optimizer_weight(plan.ranks[r].gpu, mode))
            start = seg.start
            for rank, n in zip(seg.ranks, rows):
                if n:
                    parts.setdefault(seg.name, []).append((start, start + n, island, rank))
                start += n
    k = len(plan.island_pipelines())
    out = []
    for seg in gradient_segments(plan):
        mine = [p for p in parts[seg.name] if p[0] < seg.end and seg.start < p[1]]
        cuts = sorted({seg.start, seg.end} | {c for p in mine for c in p[:2]})
        for a, b in zip(cuts, cuts[1:]):
            if not seg.start <= a < b <= seg.end:
                continue
            owners = [-1] * k
            for start, end, island, rank in mine:
                if start <= a and b <= end:
                    owners[island] = rank
            if -1 in owners:
                raise ValueError(f"{seg.name} [{a}, {b}): an island holds no master part of it")
            piece = replace(seg, start=a, end=b)
            out.append(
                OuterRange(
                    piece,
                    segment_numel(shapes[seg.name], piece),
                    fragment_of(seg.name, plan.model.num_layers, fragments),
                    tuple((r,) for r in owners),
                    tuple(owners),
                )
            )
    return out


def outer_bytes_by_fragment(plan: Plan) -> list[list[int]]:
    """Bytes each rank sends across islands for each fragment's outer step ([rank][fragment]):
    the sum over the ranges it represents of planner.islands.outer_bytes_sent (one call per
    range, as the runtime counts them). Kept per plan content but H, which the bytes do not
    depend on: the search tries many H on one plan (planner.search_islands.outer_interval)."""
    outer = plan.training.outer
    if outer is None:
        return [[] for _ in range(plan.world_size)]
    key = _content_key(plan, outer)
    if key not in _BYTES:
        if len(_BYTES) >= _CACHED_PLANS:
            _BYTES.clear()
        sent = [[0] * outer.fragments for _ in range(plan.world_size)]
        k = len(plan.island_pipelines())
        for r in outer_ranges(plan):
            b = outer_bytes_sent(r.numel, k, outer.compression)
            for rep in r.representatives:
                sent[rep][r.fragment] += b
        _BYTES[key] = sent
    return [list(row) for row in _BYTES[key]]


_CACHED_PLANS = 64
_BYTES: dict[Hashable, list[list[int]]] = {}


def _content_key(plan: Plan, outer: OuterSettings) -> Hashable:
    """What outer_ranges and the byte counts read of a plan (all but H); the function that
    counts bytes is part of it, so replacing it (the tests' broken formula) is not hidden."""
    pipes = tuple(
        (p.micro_batch_size, p.num_microbatches)
        + tuple((s.ranks, s.layers, tuple(sorted(s.shards.items()))) for s in p.stages)
        for p in plan.pipelines
    )
    training = replace(plan.training, outer=replace(outer, interval=1))
    return (outer_bytes_sent, plan.model, training, pipes, tuple(plan.ranks), plan.islands)


def outer_bytes_per_rank(plan: Plan) -> list[int]:
    """Bytes each rank sends across islands per `interval` inner steps (every fragment's outer
    step once)."""
    return [sum(row) for row in outer_bytes_by_fragment(plan)]
