"""Whether a plan fits its devices' memory, by the planner's own estimate (the simulator's per-rank
peak against each device's capacity), said in one line. `hexi-plan validate` refuses a plan that
does not fit; the runtime compares the same estimate with the memory the devices really have
(megatron_hexi.memory_fit)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.plan import Plan
    from planner.simulator import Estimate


def estimate_of(plan: Plan) -> Estimate:
    """The simulator's estimate of a validated plan (per-rank peak memory, capacity, terms)."""
    from planner.simulator import simulate

    return simulate(plan)


def memory_problems(plan: Plan, where: str, estimate: Estimate | None = None) -> list[str]:
    """One line naming the rank furthest over its device's capacity (and how many more are
    over), or none when every rank fits."""
    est = estimate or estimate_of(plan)
    over = [
        (need - cap, r, need, cap)
        for r, (need, cap) in enumerate(zip(est.peak_memory_gb, est.memory_capacity_gb))
        if need > cap
    ]
    if not over:
        return []
    _, r, need, cap = max(over, key=lambda x: (x[0], -x[1]))  # the lowest rank of a tie
    rank = plan.ranks[r]
    terms = est.memory_terms_gb[r]
    largest = max(terms, key=lambda k: terms[k])
    more = f"; {len(over) - 1} more rank(s) do not fit either" if len(over) > 1 else ""
    return [
        f"{where}: does not fit memory: rank {r} ({rank.gpu} on node {rank.node}) needs "
        f"{need:.2f} GB by the planner's estimate (hexi-plan simulate; largest term: {largest} "
        f"{terms[largest]:.2f} GB), its device holds {cap:.2f} GB{more}"
    ]


__all__ = ["estimate_of", "memory_problems"]
