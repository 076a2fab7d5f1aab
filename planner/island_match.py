"""Which saved island each island of a plan continues from, when a checkpoint is loaded.

An island's identity is its site (planner.sites): the site(s) of the nodes its pipelines run on,
which stay the same however the start-up planner lays the island out. A checkpoint records each
saved island's site (`island_sites`); a plan of other islands, say after an elastic restart lost
a whole site, continues each of its islands from the saved island of the same site:

- a one-island checkpoint starts every island (as before islands had identities);
- sites known on both sides (every island on named sites, no two islands on the same sites):
  each island continues from the saved island of its sites. An island on a site the checkpoint
  has no island of (a site that joins, or comes back) joins (None) where the checkpoint holds the
  outer state and the plan takes outer steps: it starts from the outer parameters (what every
  island lands on at the outer steps); otherwise, or with no island continuing, it is an error
  naming the site and the checkpoint's sites;
- otherwise (a cluster without sites, a checkpoint written before islands had identities):
  islands continue by index, which needs as many islands as the checkpoint has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.errors import SpecError

if TYPE_CHECKING:
    from planner.plan import Plan


def island_sites(plan: Plan) -> list[str | None]:
    """Each island's identity: its nodes' sites, sorted and joined by '+' (one site for islands
    planned by site); None for an island with a node on no named site."""
    site_of = {n.name: n.site for n in plan.cluster.nodes}
    out: list[str | None] = []
    for pipes in plan.island_pipelines():
        sites = {site_of[plan.ranks[r].node] for p in pipes for r in plan.pipelines[p].ranks}
        out.append(None if None in sites else "+".join(sorted(s for s in sites if s)))
    return out


def _named(sites: Sequence[str | None] | None, count: int) -> bool:
    """Whether `sites` identify `count` islands: one name each, no two alike."""
    return (
        sites is not None and len(sites) == count and None not in sites and len(set(sites)) == count
    )


def source_islands(
    saved_count: int,
    saved_sites: Sequence[str | None] | None,
    sites: Sequence[str | None],
    joinable: bool = False,
) -> list[int | None]:
    """The saved island each of the plan's islands (`sites`, island_sites' order) continues
    from, None for one that joins from the outer parameters (`joinable`: the checkpoint holds
    them and the plan takes outer steps); SpecError, one line, otherwise (module docstring)."""
    if saved_count == 1:
        return [0 for _ in sites]
    if _named(saved_sites, saved_count) and _named(sites, len(sites)):
        assert saved_sites is not None  # _named
        missing = [s for s in sites if s not in saved_sites]
        if missing and (not joinable or len(missing) == len(sites)):
            why = (
                "no island continues"
                if joinable
                else "a site joins only from the outer state of a plan with outer steps"
            )
            raise SpecError(
                f"saved with islands on sites {', '.join(map(str, saved_sites))}; this plan's "
                f"island on site {missing[0]} has no saved island to continue from ({why})"
            )
        return [list(saved_sites).index(s) if s in saved_sites else None for s in sites]
    if saved_count == len(sites):
        return [i for i, _ in enumerate(sites)]
    raise SpecError(
        f"saved with {saved_count} islands, this plan has {len(sites)}, and the islands are not "
        f"identified by site on both sides: each island's weights continue only in an island of "
        f"its own (a one-island checkpoint starts every island)"
    )


__all__ = ["island_sites", "source_islands"]
