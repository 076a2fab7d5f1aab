"""Gradient-sync volume per rank and step, against the lower bound, for a plan.

    python tools/bench/sync_volume.py [PLAN.json ...]

The runtime all-reduces every atomic segment over all ranks that hold it (planner.layout), fp32.
The lower bound sums each element once across the pipelines that hold it: a rank's share is the
elements it contributes (not TP replicas of norms) that another pipeline also holds. The numbers
come from the plan alone, with the same layout the runtime uses.
"""

import sys
from pathlib import Path

from planner.layout import canonical_shards, gradient_segments, segment_numel
from planner.plan import load_plan

BYTES_PER_ELEMENT = 4  # gradients are reduced in fp32


def sync_volume(plan):
    """{rank: (bytes all-reduced, lower-bound bytes)} per step."""
    shapes = {s.name: s.shape for s in canonical_shards(plan.model)}
    pipeline_of = {r: plan.rank_view(r).pipeline for r in range(plan.world_size)}
    out = {r: [0, 0] for r in range(plan.world_size)}
    for seg in gradient_segments(plan):
        numel = segment_numel(shapes[seg.name], seg)
        pipelines = {pipeline_of[r] for r in seg.ranks}
        for r in seg.ranks:
            if seg.needs_reduce:
                out[r][0] += numel * BYTES_PER_ELEMENT
            if len(pipelines) > 1 and r in seg.contributors:
                out[r][1] += numel * BYTES_PER_ELEMENT
    return out


def main(paths):
    root = Path(__file__).resolve().parents[2]
    paths = paths or [root / "examples/plans/hetero-4rank.json"]
    for path in paths:
        plan = load_plan(path)
        vol = sync_volume(plan)
        total, bound = sum(v[0] for v in vol.values()), sum(v[1] for v in vol.values())
        print(f"{Path(path).name}: {plan.world_size} ranks, {len(plan.pipelines)} pipelines")
        print(f"  {'rank':>4} {'all-reduced bytes':>18} {'lower bound':>12} {'ratio':>6}")
        for r, (b, lb) in vol.items():
            ratio = f"{b / lb:.3f}" if lb else "-"
            print(f"  {r:>4} {b:>18,} {lb:>12,} {ratio:>6}")
        print(
            f"  total {total:,} bytes vs lower bound {bound:,}: ratio "
            f"{total / bound if bound else float('nan'):.3f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
