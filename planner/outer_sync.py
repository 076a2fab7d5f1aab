"""The outer sync of islands, as the simulator costs it: bytes per fragment, seconds, overlap.

planner.outer_traffic fixes what crosses islands: which rank of each island represents each
canonical range, and the bytes it sends for it (`outer_bytes_by_fragment`, the runtime's metric
too). This module turns that into time:

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

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from planner.islands import fragment_offset
from planner.layout import island_ranks
from planner.outer_traffic import outer_bytes_by_fragment

if TYPE_CHECKING:
    from planner.plan import Plan
    from planner.topology import Topology

# fp32 outer parameters (theta_outer) and fp32 outer momentum, per element a rank keeps
OUTER_BYTES_PER_PARAM = 8


class OuterSync(NamedTuple):
    """What the outer sync costs one plan."""

    time_per_step: float  # exposed seconds, amortised over the H inner steps
    bytes_per_step: float  # bytes crossing sites, amortised over the H inner steps
    fragment_times: tuple[float, ...]  # seconds of each fragment's exchange (unoverlapped)
    fragment_bytes: tuple[int, ...]  # bytes all islands send for each fragment


def outer_sync(plan: Plan, topo: Topology, windows: Sequence[float]) -> OuterSync:
    """The outer sync of `plan` (with training.outer); `windows`: per island the seconds an
    exchange can hide in (its 1F1B time plus its slack behind the slowest island)."""
    outer = plan.training.outer
    assert outer is not None
    islands = plan.island_pipelines()
    k, frags = len(islands), outer.fragments
    if k <= 1:
        return OuterSync(0.0, 0.0, (0.0,) * frags, (0,) * frags)
    sent_by = outer_bytes_by_fragment(plan)
    reps = [{r: sent_by[r] for r in ranks if any(sent_by[r])} for ranks in island_ranks(plan)]
    site = [topo.nodes[topo.node_of[min(plan.pipelines[min(p)].ranks)]].site for p in islands]
    rep_nodes = [sorted({topo.node_of[r] for r in rr}) for rr in reps]
    hops = 2 * (k - 1) if outer.compression == "none" else k - 1
    times, sent, crossing = [], [], 0
    for f in range(frags):
        worst, total = 0.0, 0
        site_load: dict[tuple[str | None, str | None], int] = {}
        nic_load: dict[int, int] = {}
        for i, rr in enumerate(reps):
            island_bytes = 0
            for r, by_fragment in rr.items():
                b = by_fragment[f]
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
