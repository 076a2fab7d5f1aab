"""Sites: where node groups stand, and the links between them (a cluster file's `sites`).

Machines in different buildings or regions talk over links much slower than their NICs. A node
group may name its `site`; a cluster whose groups name none is one unnamed site, as before. The
`sites` section gives the link between each pair of used sites, or one `default` for every pair:

    sites:
      default: {bandwidth: "1 Gbit/s", latency: "10 ms"}
      links:
        - {between: [east, west], bandwidth: "10 Gbit/s", latency: "4 ms"}

Two GPUs on different sites talk at the slower of their machines' link and the site link, with
the larger latency (ClusterSpec.link). The site link is also a capacity shared by every
transfer that crosses it at the same time: the outer sync of islands is bounded by it
(planner.outer_sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from planner.errors import SpecError
from planner.inputs import short
from planner.units import format_bandwidth, format_latency, parse_bandwidth, parse_latency

# Stated assumption, used when a site link gives no latency: one way over ~1,000 km of fibre
# (light in glass covers ~200 km per ms) plus routing, a regional wide-area link.
DEFAULT_SITE_LATENCY_S = 5e-3
_SECTION_KEYS = {"default", "links"}
_LINK_KEYS = {"between", "bandwidth", "latency"}


@dataclass(frozen=True)
class SiteLink:
    """The link between two sites: bandwidth (bytes/s) and one-way latency (s)."""

    bandwidth: float
    latency: float
    latency_given: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = {"bandwidth": format_bandwidth(self.bandwidth)}
        if self.latency_given:
            d["latency"] = format_latency(self.latency)
        return d


@dataclass(frozen=True)
class SiteLinks:
    """The cluster's `sites` section: links per unordered pair of sites, and a default."""

    pairs: dict[frozenset[Optional[str]], SiteLink] = field(default_factory=dict)
    default: Optional[SiteLink] = None
    order: tuple[tuple[str, str], ...] = ()  # pairs as written, for to_dict

    def between(self, a: Optional[str], b: Optional[str]) -> SiteLink:
        """The link between two different sites (validated: one exists for every used pair)."""
        got = self.pairs.get(frozenset((a, b)), self.default)
        if got is None:
            raise SpecError(f"sites: no link between sites {a!r} and {b!r}")
        return got

    def cap(self, a: Optional[str], b: Optional[str], bw: float, lat: float) -> tuple[float, float]:
        """(bandwidth, latency) of a machine link of `bw`, `lat` that crosses from a to b."""
        sl = self.between(a, b)
        return min(bw, sl.bandwidth), max(lat, sl.latency)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.default is not None:
            out["default"] = self.default.to_dict()
        if self.order:
            out["links"] = [
                {"between": list(pair), **self.pairs[frozenset(pair)].to_dict()}
                for pair in self.order
            ]
        return out


def site_names(groups: Sequence[tuple[str, Optional[str]]]) -> list[str]:
    """The named sites of (group name, site) pairs, in first-appearance order."""
    return list(dict.fromkeys(site for _, site in groups if site is not None))


def _link(raw: dict[str, Any], where: str, problems: list[str]) -> SiteLink | None:
    if "bandwidth" not in raw:
        problems.append(f"{where}.bandwidth: missing required field")
        return None
    try:
        bw = parse_bandwidth(raw["bandwidth"], f"{where}.bandwidth")
        if "latency" in raw:
            return SiteLink(bw, parse_latency(raw["latency"], f"{where}.latency"))
        return SiteLink(bw, DEFAULT_SITE_LATENCY_S, latency_given=False)
    except SpecError as e:
        problems.extend(e.problems)
        return None


def parse_sites(
    raw: object, groups: Sequence[tuple[str, Optional[str]]], problems: list[str]
) -> SiteLinks | None:
    """The `sites` section checked against the node groups' (name, site) in file order;
    problems appended one line each. None when no group names a site (one unnamed site)."""
    used = site_names(groups)
    if not used:
        if raw is not None:
            problems.append("sites: given, but no node group names its `site`")
        return None
    unnamed = [(i, name) for i, (name, site) in enumerate(groups) if site is None]
    if unnamed:
        i, name = unnamed[0]
        problems.append(
            f"nodes[{i}] ({name}).site: missing; once one node group names its site, every "
            f"group must (sites named: {', '.join(used)})"
        )
        return None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"sites: must be a mapping with `links` and/or `default`, got {short(raw)}")
        return None
    start = len(problems)
    for key in sorted(set(raw) - _SECTION_KEYS):
        problems.append(f"sites.{key}: unknown field (known: default, links)")
    default = None
    if "default" in raw:
        if not isinstance(raw["default"], dict):
            problems.append("sites.default: must be a mapping with bandwidth (and latency)")
        else:
            for key in sorted(set(raw["default"]) - {"bandwidth", "latency"}):
                problems.append(f"sites.default.{key}: unknown field (known: bandwidth, latency)")
            default = _link(raw["default"], "sites.default", problems)
    links = raw.get("links") or []
    if not isinstance(links, list):
        problems.append("sites.links: must be a list of {between, bandwidth, latency}")
        links = []
    pairs: dict[frozenset[Optional[str]], SiteLink] = {}
    order: list[tuple[str, str]] = []
    for j, item in enumerate(links):
        where = f"sites.links[{j}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: must be a mapping with between and bandwidth")
            continue
        for key in sorted(set(item) - _LINK_KEYS):
            problems.append(f"{where}.{key}: unknown field (known: between, bandwidth, latency)")
        between = item.get("between")
        if not isinstance(between, list) or len(between) != 2:
            problems.append(f"{where}.between: must be a list of two site names")
            continue
        unknown = [s for s in between if s not in used]
        if unknown:
            problems.append(
                f"{where}.between: {short(unknown[0])} is not the site of any node group "
                f"(sites: {', '.join(used)})"
            )
            continue
        if between[0] == between[1]:
            problems.append(f"{where}.between: a site link joins two different sites")
            continue
        key = frozenset(between)
        if key in pairs:
            problems.append(f"{where}.between: the link {between[0]}-{between[1]} is given twice")
            continue
        got = _link(item, where, problems)
        if got is not None:
            pairs[key] = got
            order.append((between[0], between[1]))
    if len(problems) > start:
        return None
    if default is None:
        for i, a in enumerate(used):
            for b in used[i + 1 :]:
                if frozenset((a, b)) not in pairs:
                    problems.append(
                        f"sites: no link between sites {a!r} and {b!r} (add one to "
                        f"sites.links, or give sites.default)"
                    )
                    return None
    return SiteLinks(pairs, default, tuple(order))
