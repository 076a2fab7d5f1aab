"""Links: collective and point-to-point times over a cluster's GPUs (ring models, `Topology`).

Its own module because the gradient sync model (planner/sync_model.py), the stage costs
(planner/costmodel.py) and the search all time transfers on the same cached link look-ups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from planner.devices import Device, device_for
from planner.memory import BF16_BYTES

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec
    from planner.models import ModelSpec

# Topology.sig: per rank list, its runs of ranks on one node as (node signature, the node's
# first-appearance number, ranks in the run).
Signature: TypeAlias = tuple[tuple[tuple[int | str, int, int], ...], ...]
# boundary_times: ((transfer, gather) forward, (transfer, gather) backward) seconds.
BoundaryTimes: TypeAlias = tuple[tuple[float, float], tuple[float, float]]


def ring_allreduce_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-reduce of `nbytes` over n ranks: 2(n-1)/n * bytes / bw + 2(n-1) latency hops."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def ring_allgather_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-gather rebuilding a `nbytes` tensor from n equal parts: (n-1)/n bytes/bw +
    (n-1) latency hops."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def ring_reduce_scatter_time(nbytes: float, n: int, bw: float, lat: float) -> float:
    """Ring reduce-scatter of `nbytes` over n ranks: same volume as an all-gather."""
    return ring_allgather_time(nbytes, n, bw, lat)


class Topology:
    """Fast link look-ups for the cost model: GPU -> node, slowest pair of a rank set.

    Wraps ClusterSpec.link (bandwidth and latency between two GPUs on named nodes) with caches, so
    that the search can ask for thousands of rank sets. Assumption: GPUs of one machine share its
    NIC; concurrent collectives of different groups do not slow each other.
    """

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self.nodes = cluster.nodes
        self.node_of: list[int] = []  # rank (cluster order) -> node index
        self.local_of: list[int] = []
        for i, n in enumerate(self.nodes):
            self.node_of.extend([i] * n.gpus_per_node)
            self.local_of.extend(range(n.gpus_per_node))
        self.group_of = [n.group for n in self.nodes]
        self.node_names = {n.name for n in self.nodes}
        group_names = {g.name for g in cluster.groups}
        self._by_name_override = any(
            x in self.node_names and x not in group_names
            for lk in cluster.links
            for x in lk.between
        )
        groups = {g.name: g for g in cluster.groups}
        self.devices = [
            device_for(n.gpu, groups[n.group].profile, n.gpus_per_node) for n in self.nodes
        ]
        self.nic = [n.nic_bw for n in self.nodes]
        self._link: dict[tuple[Any, ...], tuple[float, float]] = {}
        self._slowest: dict[tuple[int, ...], tuple[float, float]] = {}
        self._resources: dict[tuple[int, ...], tuple[int, ...]] = {}

    def device_of(self, rank: int) -> Device:
        return self.devices[self.node_of[rank]]

    def node_sig(self, n: int) -> int | str:
        """What the cost model sees of node n: its group (devices, intra link, NIC), or the node
        itself when links name single machines."""
        return n if self._by_name_override else self.group_of[n]

    def sig(self, *rank_lists: Iterable[int]) -> Signature:
        """Cost signature of one or more rank lists (e.g. a TP group, or both sides of a stage
        boundary): per rank its node's signature and the node's first-appearance number. Rank
        lists with equal signatures have equal costs (devices, links, NICs, shards), so caches
        keyed by it serve identical machines and identical pipelines once."""
        seen: dict[int, int] = {}
        out: list[tuple[tuple[int | str, int, int], ...]] = []
        node_of, by_name, group_of = self.node_of, self._by_name_override, self.group_of
        for ranks in rank_lists:
            run: list[tuple[int | str, int, int]] = []
            last: int | None = None
            count = 0
            for r in ranks:
                n = node_of[r]
                if n != last:
                    if last is not None:
                        run.append((last if by_name else group_of[last], seen[last], count))
                    if n not in seen:
                        seen[n] = len(seen)
                    last, count = n, 0
                count += 1
            if last is not None:
                run.append((last if by_name else group_of[last], seen[last], count))
            out.append(tuple(run))
        return tuple(out)

    def node_link(self, i: int, j: int) -> tuple[float, float]:
        """(bytes/s, s) between GPUs on node indices i and j (i == j: inside the machine)."""
        key = (i, j) if i <= j else (j, i)
        got = self._link.get(key)
        if got is None:
            a, b = self.nodes[key[0]], self.nodes[key[1]]
            if not self._by_name_override and i != j:
                gkey = ("g", a.group, b.group) if a.group <= b.group else ("g", b.group, a.group)
                got = self._link.get(gkey)
                if got is None:
                    got = self.cluster.link(a.name, b.name)
                    # same group pair but different nodes: depends only on the groups
                    self._link[gkey] = got
            else:
                # inside a machine, without per-node links: depends on the group only
                ikey = ("i", a.group) if not self._by_name_override else None
                got = self._link.get(ikey) if ikey else None
                if got is None:
                    got = self.cluster.link(a.name, b.name)
                    prof = self.devices[i].profile if i == j else None
                    if prof is not None and prof.profile.link:  # measured inside the node
                        got = prof.profile.link
                    if ikey:
                        self._link[ikey] = got
            self._link[key] = got
        return got

    def slowest(self, ranks: Iterable[int]) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest pair in a set of ranks: a ring runs at its pace."""
        key = ranks if isinstance(ranks, tuple) else tuple(ranks)
        got = self._slowest.get(key)
        if got is None:
            if len(self._slowest) > 100_000:
                self._slowest.clear()
            got = self._slowest[key] = self._slowest_uncached(key)
        return got

    def resources(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """What a collective over `ranks` occupies (planner.sync_model's overlap model): the NIC of
        every machine it touches (resource = node index), or, inside one machine, that machine's
        intra-node link (resource = number of nodes + node index)."""
        got = self._resources.get(ranks)
        if got is None:
            if len(self._resources) > 100_000:
                self._resources.clear()
            nodes = sorted(set(map(self.node_of.__getitem__, ranks)))
            got = tuple(nodes) if len(nodes) > 1 else (len(self.nodes) + nodes[0],)
            self._resources[ranks] = got
        return got

    def _slowest_uncached(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        nodes = Counter(map(self.node_of.__getitem__, ranks))
        bw, lat = float("inf"), 0.0
        if self._by_name_override:
            items = list(nodes)
            pairs = [(n, n) for n, c in nodes.items() if c > 1]
            pairs += [
                (items[x], items[y]) for x in range(len(items)) for y in range(x + 1, len(items))
            ]
        else:  # links depend on groups only: one or two representative nodes per group
            rep: dict[str, list[int]] = {}
            multi: dict[str, int] = {}
            for n, c in nodes.items():
                g = self.group_of[n]
                rep.setdefault(g, []).append(n)
                if c > 1:
                    multi.setdefault(g, n)
            pairs = [(n, n) for n in multi.values()]
            reps = [(v[0], v[1] if len(v) > 1 else None) for v in rep.values()]
            pairs += [(x[0], x[1]) for x in reps if x[1] is not None]
            pairs += [
                (reps[x][0], reps[y][0]) for x in range(len(reps)) for y in range(x + 1, len(reps))
            ]
        for x, y in pairs:
            b, t = self.node_link(x, y)
            if b < bw:
                bw = b
            if t > lat:
                lat = t
        if bw == float("inf"):
            return float("inf"), 0.0
        return bw, lat


def p2p_transfer_time(
    nbytes: float, senders: Sequence[int], receivers: Sequence[int], topo: Topology
) -> float:
    """Time to move a flat buffer from a TP=a stage to a TP=b stage, as the runtime does it.

    The buffer is partitioned evenly over the a senders and evenly over the b receivers; every
    (sender i, receiver j) pair whose parts overlap sends the intersection, all pairs in parallel.
    Time = the slowest pair (bytes/bw + latency), or a machine's NIC carrying all its inter-node
    bytes (out of the sending machine or into the receiving one), whichever is larger.
    """
    a, b = len(senders), len(receivers)
    out_bytes: dict[int, float] = {}
    in_bytes: dict[int, float] = {}
    worst = 0.0
    for i, s in enumerate(senders):
        lo_i, hi_i = nbytes * i / a, nbytes * (i + 1) / a
        j0 = int(lo_i * b // nbytes) if nbytes else 0
        for j in range(j0, b):
            lo_j, hi_j = nbytes * j / b, nbytes * (j + 1) / b
            if lo_j >= hi_i:
                break
            part = min(hi_i, hi_j) - max(lo_i, lo_j)
            if part <= 0:
                continue
            r = receivers[j]
            ns, nr = topo.node_of[s], topo.node_of[r]
            if s == r:
                continue
            bw, lat = topo.node_link(ns, nr)
            worst = max(worst, part / bw + lat)
            if ns != nr:
                out_bytes[ns] = out_bytes.get(ns, 0.0) + part
                in_bytes[nr] = in_bytes.get(nr, 0.0) + part
    for n, v in list(out_bytes.items()) + list(in_bytes.items()):
        worst = max(worst, v / topo.nic[n])
    return worst


def boundary_times(
    m: ModelSpec,
    mbs: int,
    senders: Sequence[int],
    receivers: Sequence[int],
    topo: Topology,
    sequence_parallel: bool = False,
) -> BoundaryTimes:
    """(forward, backward) seconds per micro-batch across one stage boundary.

    Forward: activation [s, b, h] bf16 split-sent senders -> receivers, then an all-gather inside
    the receiving TP group (if b > 1). Backward mirrors it: gradients go receivers -> senders, then
    the senders all-gather. Returns ((transfer_f, gather_f), (transfer_b, gather_b)).

    `sequence_parallel` (the plan's): a stage of TP degree > 1 holds its rank's part of the
    sequence, which is exactly its part of the split-sent buffer (s leads the layout), so the
    runtime leaves the all-gathers out (megatron_hexi.communicator); the transfers are the same.
    """
    nbytes = m.seq_length * mbs * m.hidden_size * BF16_BYTES
    tf = p2p_transfer_time(nbytes, senders, receivers, topo)
    tb = p2p_transfer_time(nbytes, receivers, senders, topo)
    if sequence_parallel:
        return (tf, 0.0), (tb, 0.0)
    gf = ring_allgather_time(nbytes, len(receivers), *topo.slowest(receivers))
    gb = ring_allgather_time(nbytes, len(senders), *topo.slowest(senders))
    return (tf, gf), (tb, gb)
