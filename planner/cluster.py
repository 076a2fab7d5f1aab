"""Cluster spec: which machines exist, which GPUs they hold, and how fast they talk.

Parsed from YAML (see README) into `ClusterSpec`. Node groups with `count` expand to nodes named
`name-0`, `name-1`, ...; ranks are numbered in cluster order (node by node, local rank inside).
Every problem is one line that names the node and the field. Node, group and host names are
restricted to letters, digits, '.', '_' and '-' (they reach host lists and shell text), and the
totals are bounded (planner/limits.py) before any group is expanded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from planner.catalog import get_gpu
from planner.errors import ClusterError, SpecError
from planner.inputs import document_problems, int_problem, name_problem, read_yaml, short
from planner.limits import MAX_GPUS, MAX_GPUS_PER_NODE, MAX_LINKS, MAX_NODES
from planner.sites import SiteLink, SiteLinks, parse_sites
from planner.units import format_bandwidth, format_latency, parse_bandwidth, parse_latency

# Stated assumptions, used when a cluster file gives no measured latency:
# one small-message hop inside a machine (NVLink or PCIe, NCCL), and over TCP Ethernet between
# machines (kernel TCP stack plus NCCL socket transport), both typical published figures.
DEFAULT_INTRA_NODE_LATENCY_S = 5e-6
DEFAULT_INTER_NODE_LATENCY_S = 30e-6

_GROUP_KEYS = {
    "name",
    "gpu",
    "gpus_per_node",
    "count",
    "intra_node",
    "nic",
    "hostname",
    "hostnames",
    "nic_latency",
    "profile",
    "partition",
    "site",
}
_TOP_KEYS = {"name", "nodes", "links", "description", "sites"}
_LINK_KEYS = {"between", "bandwidth", "latency"}


@dataclass(frozen=True)
class NodeGroup:
    """One line of the `nodes:` list: `count` identical machines."""

    name: str
    gpu: str
    gpus_per_node: int
    count: Optional[int]
    intra_node_bw: float  # bytes/s between two GPUs of one machine
    nic_bw: float  # bytes/s out of one machine
    nic_latency: float  # seconds
    hostnames: tuple[str, ...] = ()
    profile: Optional[str] = None
    partition: Optional[str] = None
    intra_node_text: str = ""
    nic_text: str = ""
    site: Optional[str] = None  # the site (building, region) its machines stand in


@dataclass(frozen=True)
class Node:
    name: str
    group: str
    gpu: str
    gpus_per_node: int
    intra_node_bw: float
    nic_bw: float
    nic_latency: float
    hostname: Optional[str]
    site: Optional[str] = None


@dataclass(frozen=True)
class LinkOverride:
    between: tuple[str, ...]  # two node or group names
    bandwidth: float  # bytes/s
    latency: Optional[float]  # seconds


@dataclass
class ClusterSpec:
    name: str
    groups: list[NodeGroup]
    links: list[LinkOverride] = field(default_factory=list)
    description: str = ""
    sites: Optional[SiteLinks] = None  # planner.sites: links between the groups' sites
    _index: Optional[
        tuple[tuple[int, int], dict[str, Node], dict[frozenset[str], tuple[int, LinkOverride]]]
    ] = field(default=None, init=False, repr=False, compare=False)

    def _lookup(self) -> tuple[dict[str, Node], dict[frozenset[str], tuple[int, LinkOverride]]]:
        """(node by name, latest link by unordered pair of names), built once per shape: `link`
        is called for every pair of machines, so it must not scan nodes or links."""
        key = (len(self.groups), len(self.links))
        if self._index is None or self._index[0] != key:
            by_name = {n.name: n for n in self.nodes}
            by_pair: dict[frozenset[str], tuple[int, LinkOverride]] = {}
            for i, lk in enumerate(self.links):  # later overrides win
                by_pair[frozenset(lk.between)] = (i, lk)
            self._index = (key, by_name, by_pair)
        return self._index[1], self._index[2]

    @property
    def nodes(self) -> list[Node]:
        """Nodes in cluster order, groups expanded."""
        out = []
        for g in self.groups:
            names = [g.name] if g.count is None else [f"{g.name}-{i}" for i in range(g.count)]
            for i, n in enumerate(names):
                host = g.hostnames[i] if g.hostnames else None
                out.append(
                    Node(
                        n,
                        g.name,
                        g.gpu,
                        g.gpus_per_node,
                        g.intra_node_bw,
                        g.nic_bw,
                        g.nic_latency,
                        host,
                        g.site,
                    )
                )
        return out

    def node(self, name: str) -> Node:
        node = self._lookup()[0].get(name)
        if node is not None:
            return node
        raise SpecError(f"cluster {self.name!r} has no node {name!r}")

    @property
    def num_gpus(self) -> int:
        return sum(n.gpus_per_node for n in self.nodes)

    def gpu_slots(self) -> list[tuple[str, int, str]]:
        """(node name, local rank, gpu type) for every GPU, in cluster order."""
        return [(n.name, lr, n.gpu) for n in self.nodes for lr in range(n.gpus_per_node)]

    def link(self, node_a: str, node_b: str) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) between two GPUs on the named nodes; on different
        sites the slower of that and the site link (planner.sites)."""
        a, b = self.node(node_a), self.node(node_b)
        if a.name == b.name:
            return a.intra_node_bw, DEFAULT_INTRA_NODE_LATENCY_S
        bw, lat = self._node_link(a, b)
        if self.sites is not None and a.site != b.site:
            return self.sites.cap(a.site, b.site, bw, lat)
        return bw, lat

    def site_link(self, site_a: Optional[str], site_b: Optional[str]) -> Optional[SiteLink]:
        """The link between two sites (None: the same site, or a cluster without sites)."""
        if self.sites is None or site_a == site_b:
            return None
        return self.sites.between(site_a, site_b)

    def _node_link(self, a: Node, b: Node) -> tuple[float, float]:
        by_pair = self._lookup()[1]
        candidates = [
            by_pair.get(frozenset(pair))
            for pair in ((a.name, b.name), (a.group, b.group), (a.name, b.group), (a.group, b.name))
        ]
        found = [c for c in candidates if c is not None]
        if found:
            lk = max(found, key=lambda c: c[0])[1]
            return lk.bandwidth, (
                lk.latency if lk.latency is not None else max(a.nic_latency, b.nic_latency)
            )
        return min(a.nic_bw, b.nic_bw), max(a.nic_latency, b.nic_latency)

    def to_dict(self) -> dict[str, Any]:
        """The canonical form embedded in plans; `load_cluster_dict` reads it back."""
        nodes = []
        for g in self.groups:
            d: dict[str, Any] = {"name": g.name, "gpu": g.gpu, "gpus_per_node": g.gpus_per_node}
            if g.count is not None:
                d["count"] = g.count
            d["intra_node"] = format_bandwidth(g.intra_node_bw)
            d["nic"] = format_bandwidth(g.nic_bw)
            d["nic_latency"] = format_latency(g.nic_latency)
            if g.hostnames:
                d["hostnames"] = list(g.hostnames)
            if g.profile:
                d["profile"] = g.profile
            if g.partition:
                d["partition"] = g.partition
            if g.site is not None:
                d["site"] = g.site
            nodes.append(d)
        out: dict[str, Any] = {"name": self.name, "nodes": nodes}
        if self.links:
            out["links"] = [
                {
                    "between": list(lk.between),
                    "bandwidth": format_bandwidth(lk.bandwidth),
                    **({"latency": format_latency(lk.latency)} if lk.latency is not None else {}),
                }
                for lk in self.links
            ]
        if self.sites is not None:
            out["sites"] = self.sites.to_dict()
        return out


def _bounded_int(hi: int) -> Callable[[Any, str], int]:
    """A `take` parser for an integer in [1, hi]."""

    def parse(value: Any, where: str) -> int:
        problem = int_problem(value, where, 1, hi)
        if problem:
            raise SpecError(problem)
        return value

    return parse


def _parse_group(raw: object, i: int, problems: list[str]) -> NodeGroup | None:
    label = f"nodes[{i}]"
    if not isinstance(raw, dict):
        problems.append(
            f"{label}: must be a mapping with name, gpu, gpus_per_node, intra_node, nic"
        )
        return None
    if "name" in raw:
        label = (
            f"nodes[{i}] ({raw['name']})"
            if name_problem(raw["name"], "") is None
            else f"nodes[{i}]"
        )
    for key in sorted(set(raw) - _GROUP_KEYS):
        problems.append(f"{label}.{key}: unknown field (known: {', '.join(sorted(_GROUP_KEYS))})")
    missing = [k for k in ("name", "gpu", "gpus_per_node", "intra_node", "nic") if k not in raw]
    for k in missing:
        problems.append(f"{label}.{k}: missing required field")
    if missing:
        return None
    start = len(problems)

    def take(key: str, fn: Callable[[Any, str], Any]) -> Any:
        try:
            return fn(raw[key], f"{label}.{key}")
        except SpecError as e:
            problems.extend(e.problems)
            return None

    name = raw["name"]
    bad_name = name_problem(name, f"{label}.name")
    if bad_name:
        problems.append(bad_name)
    gpu = take("gpu", lambda v, w: get_gpu(v, w).name)
    gpn = take("gpus_per_node", _bounded_int(MAX_GPUS_PER_NODE))
    count = take("count", _bounded_int(MAX_NODES)) if "count" in raw else None
    intra = take("intra_node", parse_bandwidth)
    nic = take("nic", parse_bandwidth)
    lat = (
        take("nic_latency", parse_latency) if "nic_latency" in raw else DEFAULT_INTER_NODE_LATENCY_S
    )
    hostnames: tuple[str, ...] = ()
    if "hostname" in raw and "hostnames" in raw:
        problems.append(f"{label}.hostname: give either hostname or hostnames, not both")
    elif "hostname" in raw:
        if (count or 1) != 1:
            problems.append(
                f"{label}.hostname: a group of {count} nodes needs `hostnames`, a list of {count}"
            )
        elif bad_host := name_problem(raw["hostname"], f"{label}.hostname", "host name"):
            problems.append(bad_host)
        else:
            hostnames = (raw["hostname"],)
    elif "hostnames" in raw:
        hs = raw["hostnames"]
        if not isinstance(hs, list) or len(hs) != (count or 1):
            problems.append(f"{label}.hostnames: must be a list of {count or 1} host names")
        else:
            bad = [
                p
                for j, h in enumerate(hs)
                if (p := name_problem(h, f"{label}.hostnames[{j}]", "host name"))
            ]
            if bad:
                problems.append(bad[0])
            else:
                hostnames = tuple(hs)
    profile = raw.get("profile")
    if profile is not None and (not isinstance(profile, str) or not profile.strip()):
        problems.append(
            f"{label}.profile: must be the path of a profile JSON file, got {profile!r}"
        )
    partition = raw.get("partition")
    if partition is not None and (
        bad_partition := name_problem(partition, f"{label}.partition", "partition name")
    ):
        problems.append(bad_partition)
    site = raw.get("site")
    if site is not None and (bad_site := name_problem(site, f"{label}.site", "site name")):
        problems.append(bad_site)
    if len(problems) > start:
        return None
    return NodeGroup(
        name,
        gpu,
        gpn,
        count,
        intra,
        nic,
        lat,
        hostnames,
        profile,
        partition,
        str(raw["intra_node"]),
        str(raw["nic"]),
        site,
    )


def load_cluster_dict(data: object, source: str = "cluster") -> ClusterSpec:
    """Build a ClusterSpec from parsed YAML/JSON; raises ClusterError listing every problem."""
    problems = document_problems(data)
    if problems:
        raise ClusterError(problems)
    if not isinstance(data, dict):
        raise ClusterError(f"{source}: top level must be a mapping with `name` and `nodes`")
    for key in sorted(set(data) - _TOP_KEYS):
        problems.append(f"{key}: unknown top-level field (known: {', '.join(sorted(_TOP_KEYS))})")
    if "nodes" not in data:
        problems.append("nodes: missing required field")
        raise ClusterError(problems)
    raw_nodes = data["nodes"]
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ClusterError(problems + ["nodes: must be a non-empty list"])
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            problems.append(f"{key}: must be a string, got {data[key]!r}")
    groups = [g for g in (_parse_group(r, i, problems) for i, r in enumerate(raw_nodes)) if g]
    if not problems:  # bound the totals before `spec.nodes` expands the groups
        num_nodes = sum(g.count or 1 for g in groups)
        num_gpus = sum((g.count or 1) * g.gpus_per_node for g in groups)
        if num_nodes > MAX_NODES:
            problems.append(
                f"nodes: {num_nodes:,} machines in all, above the limit of "
                f"{MAX_NODES:,} (limits in planner/limits.py)"
            )
        if num_gpus > MAX_GPUS:
            problems.append(
                f"nodes: {num_gpus:,} GPUs in all, above the limit of {MAX_GPUS:,} "
                f"(limits in planner/limits.py)"
            )
    spec = ClusterSpec(
        str(data.get("name", "cluster")), groups, [], str(data.get("description", ""))
    )
    seen: dict[str, Node] = {}
    hosts: dict[str, str] = {}
    for node in spec.nodes if not problems else []:
        if node.name in seen:
            problems.append(f"nodes ({node.group}).name: node name {node.name!r} appears twice")
        seen[node.name] = node
        if node.hostname:
            if node.hostname in hosts:
                problems.append(
                    f"nodes ({node.group}).hostnames: host {node.hostname!r} given "
                    f"to both {hosts[node.hostname]} and {node.name}"
                )
            hosts[node.hostname] = node.name
    group_names = {g.name for g in groups}
    nodes_ok = not problems  # else unknown names in links may only echo a broken node
    links = data.get("links", [])
    if links is None:  # `links:` with nothing after it
        links = []
    if not isinstance(links, list):
        problems.append(
            f"links: must be a list of {{between, bandwidth, latency}}, got {short(links)}"
        )
        links = []
    elif len(links) > MAX_LINKS:
        problems.append(
            f"links: {len(links):,} link overrides, above the limit of {MAX_LINKS:,} "
            f"(limits in planner/limits.py)"
        )
        links = []
    for j, raw in enumerate(links):
        where = f"links[{j}]"
        if not isinstance(raw, dict):
            problems.append(f"{where}: must be a mapping with between and bandwidth")
            continue
        for key in sorted(set(raw) - _LINK_KEYS):
            problems.append(f"{where}.{key}: unknown field (known: between, bandwidth, latency)")
        between = raw.get("between")
        if not isinstance(between, list) or len(between) != 2:
            problems.append(f"{where}.between: must be a list of two node or group names")
            continue
        for name in between:
            if not isinstance(name, str):
                problems.append(f"{where}.between: {name!r} is not a node or group name")
            elif nodes_ok and name not in group_names and name not in seen:
                problems.append(f"{where}.between: {name!r} is neither a node nor a node group")
        if "bandwidth" not in raw:
            problems.append(f"{where}.bandwidth: missing required field")
            continue
        try:
            bw = parse_bandwidth(raw["bandwidth"], f"{where}.bandwidth")
            lat = parse_latency(raw["latency"], f"{where}.latency") if "latency" in raw else None
            spec.links.append(LinkOverride(tuple(between), bw, lat))
        except SpecError as e:
            problems.extend(e.problems)
    if not problems:
        spec.sites = parse_sites(data.get("sites"), [(g.name, g.site) for g in groups], problems)
    if problems:
        raise ClusterError(problems)
    return spec


def load_cluster(path: str | os.PathLike[str]) -> ClusterSpec:
    """Read a cluster YAML file; errors name the file and the field."""
    try:
        data = read_yaml(path, "cluster file")
    except SpecError as e:
        raise ClusterError(e.problems)
    try:
        return load_cluster_dict(data, "cluster")
    except ClusterError as e:
        raise ClusterError([f"{path}: {p}" for p in e.problems])
