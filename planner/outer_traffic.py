"""Who exchanges which canonical range at an outer step, and the bytes each rank sends for it.

The outer step (planner.islands) averages every canonical range over the islands. The ranges are
the plan's atomic gradient segments over all ranks (planner.layout.gradient_segments): cut at
every holder's boundaries in every island, so each range is one contiguous slice of one local
parameter on each of its holders, whatever TP shards each island uses. For each range, one
holder per island exchanges it across islands (its representative: the holder in the island's
lowest-numbered pipeline, the lowest rank there), then hands the result to the island's other
holders. The runtime (megatron_hexi.outer_step) and the planner's byte prediction both read
`outer_ranges`, so they agree by construction on who sends what.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from planner.islands import fragment_layers, outer_bytes_sent
from planner.layout import canonical_shards, gradient_segments, segment_numel

if TYPE_CHECKING:
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
    representatives per island."""
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


def outer_bytes_per_rank(plan: Plan) -> list[int]:
    """Bytes each rank sends across islands per `interval` inner steps (every fragment's outer
    step once): the sum over the ranges it represents of planner.islands.outer_bytes_sent."""
    sent = [0] * plan.world_size
    if plan.training.outer is None:
        return sent
    k, compression = len(plan.island_pipelines()), plan.training.outer.compression
    for r in outer_ranges(plan):
        for rep in r.representatives:
            sent[rep] += outer_bytes_sent(r.numel, k, compression)
    return sent
