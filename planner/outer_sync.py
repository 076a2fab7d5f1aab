"""The outer sync of islands, as the simulator costs it: bytes per fragment, seconds, overlap.

planner.islands fixes what crosses islands: each island's representatives (the ranks of its
lowest-numbered pipeline) send their canonical ranges of the fragment, `outer_bytes_sent` bytes
per buffer (one buffer per rank and fragment). This module turns that into time:

- a rank's exchange runs over its link to the other islands' representatives (topology: the
  slower of NIC and site link), with 2 (k - 1) latency hops for the fp32 ring and k - 1 for the
  compressed all-gather;
- a machine's NIC carries all its representatives' bytes;
- the islands form a ring in island order; a site link carries, in each direction, the bytes of
  every island whose next island stands on the other site (a shared capacity, planner.sites);
- a fragment's time is the largest of these bounds plus the latency hops.

Overlap (the schedule of planner.islands): with F = 1 the exchange blocks after every H-th step,
fully exposed. With F > 1 fragment f's exchange runs during the next inner step's forward and
backward; only what exceeds that window is exposed. Island i's window is its pipelines' 1F1B
time plus its slack behind the slowest island; fragments that sync after the same step share it.
The outer update itself (a few fp32 vector operations per element) is neglected.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from planner.islands import fragment_layers, fragment_offset, outer_bytes_sent
from planner.layout import param_shards

if TYPE_CHECKING:
    from planner.plan import Plan
    from planner.topology import Topology

# fp32 outer parameters (theta_outer) and fp32 outer momentum, per element a rank keeps
OUTER_BYTES_PER_PARAM = 8
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class OuterSync(NamedTuple):
    """What the outer sync costs one plan."""

    time_per_step: float  # exposed seconds, amortised over the H inner steps
    bytes_per_step: float  # bytes crossing sites, amortised over the H inner steps
    fragment_times: tuple[float, ...]  # seconds of each fragment's exchange (unoverlapped)
    fragment_bytes: tuple[int, ...]  # bytes all islands send for each fragment


def _fragment_of(name: str, num_layers: int, bounds: Sequence[tuple[int, int]]) -> int:
    """Fragment of a canonical parameter: its layer's; embedding first, final norm/output last."""
    m = _LAYER.match(name)
    if m is None:
        return 0 if name.startswith("embedding.") else len(bounds) - 1
    layer = int(m.group(1))
    return next(f for f, (lo, hi) in enumerate(bounds) if lo <= layer < hi)


def representative_elements(plan: Plan, pipeline: int, fragments: int) -> dict[int, list[int]]:
    """{rank: elements per fragment} of one pipeline's ranks, each canonical range counted once
    (the lowest rank holding it: TP replicas and a tied embedding's second copy send nothing)."""
    bounds = fragment_layers(plan.model.num_layers, fragments)
    taken: dict[str, list[tuple[int, int]]] = {}
    out: dict[int, list[int]] = {}
    for rank in sorted(plan.pipelines[pipeline].ranks):
        counts = out.setdefault(rank, [0] * fragments)
        for sh in param_shards(plan.model, plan.rank_view(rank)):
            row = 1
            for i, n in enumerate(sh.shape):
                if i != sh.dim:
                    row *= n
            have = taken.setdefault(sh.name, [])
            f = _fragment_of(sh.name, plan.model.num_layers, bounds)
            for p in sh.pieces:
                lo, hi = p.global_start, p.global_start + p.length
                new = hi - lo - sum(max(0, min(hi, b) - max(lo, a)) for a, b in have)
                have.append((lo, hi))
                counts[f] += new * row
    return out


def outer_sync(plan: Plan, topo: Topology, windows: Sequence[float]) -> OuterSync:
    """The outer sync of `plan` (with training.outer); `windows`: per island the seconds an
    exchange can hide in (its 1F1B time plus its slack behind the slowest island)."""
    outer = plan.training.outer
    assert outer is not None
    islands = plan.island_pipelines()
    k, frags = len(islands), outer.fragments
    if k <= 1:
        return OuterSync(0.0, 0.0, (0.0,) * frags, (0,) * frags)
    reps = [representative_elements(plan, min(pipes), frags) for pipes in islands]
    site = [topo.nodes[topo.node_of[min(r)]].site for r in reps]
    rep_nodes = [sorted({topo.node_of[r] for r in rr}) for rr in reps]
    hops = 2 * (k - 1) if outer.compression == "none" else k - 1
    times, sent, crossing = [], [], 0
    for f in range(frags):
        worst, total = 0.0, 0
        site_load: dict[tuple[str | None, str | None], int] = {}
        nic_load: dict[int, int] = {}
        for i, rr in enumerate(reps):
            island_bytes = 0
            for r, counts in rr.items():
                b = outer_bytes_sent(counts[f], k, outer.compression)
                if b == 0:
                    continue
                n = topo.node_of[r]
                bw, lat = min(
                    topo.node_link(n, m) for j in range(k) if j != i for m in rep_nodes[j]
                )
                worst = max(worst, b / bw + hops * lat)
                nic_load[n] = nic_load.get(n, 0) + b
                island_bytes += b
            total += island_bytes
            nxt = site[(i + 1) % k]
            if nxt != site[i]:
                site_load[(site[i], nxt)] = site_load.get((site[i], nxt), 0) + island_bytes
                crossing += island_bytes
        for n, b in nic_load.items():
            worst = max(worst, b / topo.nic[n])
        for (a, b_site), b in site_load.items():
            link = topo.cluster.site_link(a, b_site)
            if link is not None:
                worst = max(worst, b / link.bandwidth + hops * link.latency)
        times.append(worst)
        sent.append(total)
    if frags == 1:
        exposed = times[0]
    else:
        by_step: dict[int, float] = {}
        for f in range(frags):
            o = fragment_offset(f, frags, outer.interval)
            by_step[o] = by_step.get(o, 0.0) + times[f]
        exposed = sum(max(0.0, t - min(windows)) for t in by_step.values())
    h = outer.interval
    return OuterSync(exposed / h, crossing / h, tuple(times), tuple(sent))
