"""Processes that share a profiled CPU node: how busy each is, and what that costs the others.

A CPU profile (hexi-profile on a CPU) measures the slowdown of its node's processes computing at
once (`contention`). Two consequences are modelled here, both from the share of the step each
process computes (`busy_shares`):
- contention only while the others compute: a rank gets the contention of 1 + the busy share of
  its node's other processes (`shared_node_slowdowns`; planner/simulator.py evaluates the
  pipelines again with it). A TP rank with a smaller shard than its stage's largest computes for
  that fraction of the stage's time and waits in the all-reduces for the rest.
- an overlapped gradient sync hides only what a free core can run: gloo reduces and copies on
  the CPU, so where the node's other processes keep every core busy, the sync hidden behind the
  backward takes the backward's cores (`overlap_paid`). Measured on the 2-core VM (fidelity
  bench): two data-parallel ranks stepped as slow with the sync overlapped as without it, or
  slower (292 against 286 ms, 269 against 262), while a long pipeline beside a short one did
  gain from it (431 against 440 ms).

GPU profiles and catalog devices are untouched: their collectives do not take compute from the
kernels in this way. Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.estimate import StageReport
    from planner.models import ModelSpec
    from planner.sync_model import Layout
    from planner.topology import Topology


def busy_shares(
    m: ModelSpec,
    topo: Topology,
    layouts: Layout,
    reports: Sequence[StageReport],
    batches: Sequence[tuple[int, int]],
    period: float,
) -> dict[int, float]:
    """{rank: the share of `period` it computes}: its stage's forward + backward times its
    micro-batches, scaled by its shard against the stage's largest (on profiled devices)."""
    busy: dict[int, float] = {}
    g, f = m.num_query_groups, m.ffn_hidden_size
    for rep in reports:
        share = min((rep.fwd + rep.bwd) * batches[rep.pipeline][1] / period, 1.0)
        st = layouts[rep.pipeline][rep.stage]
        pd = topo.device_of(rep.ranks[0]).profile
        work = [
            1.0 if pd is None else pd.profile.share(q / g, x / f)
            for q, x in zip(st.query_groups, st.ffn)
        ]
        for r, w in zip(rep.ranks, work):
            busy[r] = share * w / max(work)
    return busy


def _by_node(topo: Topology, ranks: Iterable[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in ranks:
        out.setdefault(topo.node_of[r], []).append(r)
    return out


def shared_node_slowdowns(topo: Topology, busy: Mapping[int, float]) -> dict[int, float]:
    """{rank: slowdown} on profiled CPU nodes where the node's other processes compute for only
    part of the step; {} when no rank is affected."""
    out = {}
    for n, ranks in _by_node(topo, busy).items():
        pd = topo.devices[n].profile
        if pd is None or pd.slowdown <= 1.0 or len(ranks) < 2:
            continue
        total = sum(busy[r] for r in ranks)
        for r in ranks:
            s = pd.profile.contention(1.0 + total - busy[r])
            if s < pd.slowdown:
                out[r] = s
    return out


def cores_taken(topo: Topology, ranks: Iterable[int]) -> bool:
    """Whether every node of these ranks is a profiled CPU node whose processes fill its cores
    (no core to spare for the collectives): where `overlap_paid` applies."""
    for n in _by_node(topo, ranks):
        pd = topo.devices[n].profile
        if pd is None or not pd.profile.is_cpu:
            return False
        if topo.nodes[n].gpus_per_node < pd.profile.process_slots:
            return False
    return True


def overlap_paid(topo: Topology, busy: Mapping[int, float]) -> float:
    """The share of an overlapped gradient sync's hidden part that the step pays anyway, on
    nodes where `cores_taken` holds: how busy the busiest rank's neighbours keep the cores it
    does not use (the largest over the nodes)."""
    paid = 0.0
    for n, ranks in _by_node(topo, busy).items():
        prof = topo.devices[n].profile
        assert prof is not None  # cores_taken: profiled CPU nodes only
        others = prof.profile.process_slots - 1
        shares = sorted((busy[r] for r in ranks), reverse=True)
        paid = max(paid, min(sum(shares[1:]) / max(others, 1), 1.0))
    return paid


__all__ = ["busy_shares", "cores_taken", "overlap_paid", "shared_node_slowdowns"]
