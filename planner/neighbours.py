"""Neighbour settings: the search also lays out its finalists as it would for a neighbouring
setting, and lets the simulator score those layouts under the setting asked for.

A search with sequence parallelism on, or with the distributed optimizer, lays out pipelines with
other memory limits and other TP degrees than the search without it; a layout found for the
neighbouring setting can be faster under the requested one (paper-hetero-b, llama2-7b, batch 64:
the plan searched without sequence parallelism, re-costed with it, was 3.6 % faster than the plan
searched with it). A user who flips a setting should never get a worse plan than one the planner
already knew, so each finalist's partition is also laid out in the neighbouring settings'
contexts (sequence parallelism toggled, distributed optimizer toggled), and the candidates join
the finalists; the simulator scores every one under the requested setting. Layouts that the
requested setting forbids (with sequence parallelism, a TP degree that does not divide
seq_length) are dropped.

Link speeds are neighbours too: the pipeline orders and stage counts the search lays out depend
on what the links between machines cost, and a layout laid out for slower or faster links can
win at the requested speed (paper-hetero-b, llama-30b at 4,096 tokens: the plan searched at
25 Gbit/s, re-costed at 10, made 11,403 tokens/s against the 10 Gbit/s plan's own 11,395). The
best partitions are also laid out on the same cluster with every link between machines
LINK_SCALES times as fast, with sequence parallelism as asked and toggled, polished as the
search polishes its own finalists, and the simulator scores them on the real links.

Why a quarter to four times, and sequence parallelism toggled there too: a search's answer may
itself come from one of its neighbours, so the plan searched at twice the speed can be a layout
laid out for four times the speed (paper-hetero-b, llama2-7b: 70,427 tokens/s re-costed at the
file's speeds against 69,499 with only half and twice), and the plan searched without sequence
parallelism can be one laid out for other links (the same cluster with it on: 3.735 s against
3.713 s without the toggled contexts). With one step more in each direction, what the searches
at half and twice the speed take from their nearest link neighbours is laid out here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from planner.cluster import ClusterSpec
from planner.host import LayerImpl
from planner.models import ModelSpec
from planner.search_pipeline import Context, Fits, MachineChunk, PipelineDraft
from planner.topology import Topology


class LaidOut(Protocol):
    """What this module reads of a search's candidate: its pipelines and where it came from."""

    @property
    def drafts(self) -> Sequence[PipelineDraft]: ...
    @property
    def ctx(self) -> Context: ...
    @property
    def parts(self) -> list[list[MachineChunk]]: ...
    @property
    def cache(self) -> Any: ...


C = TypeVar("C", bound=LaidOut)


class SearchState(Protocol[C]):
    """What this module uses of the search (planner.searcher.Searcher): its inputs, its layout of
    a partition in a context, and its cheap ranking of candidates."""

    @property
    def model(self) -> ModelSpec: ...
    @property
    def topo(self) -> Topology: ...
    @property
    def _fits(self) -> Fits: ...
    @property
    def attention_backend(self) -> str: ...
    @property
    def sequence_parallel(self) -> bool: ...
    @property
    def dist_opt(self) -> bool: ...
    @property
    def layer_impl(self) -> LayerImpl: ...

    def evaluate(
        self,
        ctx: Context,
        parts: list[list[MachineChunk]],
        mbs: int,
        exhaustive: bool,
        cache: Any,
        polish: bool = False,
        tune_orders: bool = False,
    ) -> C | None: ...

    def proxy(self, cand: C) -> float: ...

    def context(self, mbs: int, rc: bool, K: int) -> Context: ...


# On big chunk graphs (planner.searcher.SMALL_CHUNK_GRAPH) a neighbour's context starts with cold
# layout caches: only the requested setting's best few candidates are laid out there, the best
# of them polished one way, to keep the search's time within a fifth of what it was.
BIG_POOL = 6
BIG_FINALISTS = 2


# The link speeds a search also lays out for, as factors of every link between machines: a
# quarter, half, twice and four times as fast (stated choice: the next speeds of common NICs are
# 2-2.5x apart, 10 / 25 / 40-50 / 100 Gbit/s, and a neighbour's answer may come from its own
# neighbour: module docstring).
LINK_SCALES = (0.25, 0.5, 2.0, 4.0)


class Neighbour(NamedTuple):
    """A setting next to the requested one that changes how stages are laid out: sequence
    parallelism, the distributed optimizer, or the links between machines `link_scale` times
    as fast."""

    sequence_parallel: bool
    distributed_optimizer: bool
    link_scale: float = 1.0


def neighbours(sequence_parallel: bool, distributed_optimizer: bool) -> list[Neighbour]:
    """The settings one step away: sequence parallelism off/on, distributed optimizer off/on,
    the links between machines at each of LINK_SCALES with sequence parallelism either way."""
    toggled_sp = (sequence_parallel, not sequence_parallel)
    return [
        Neighbour(not sequence_parallel, distributed_optimizer),
        Neighbour(sequence_parallel, not distributed_optimizer),
        *(Neighbour(sp, distributed_optimizer, f) for f in LINK_SCALES for sp in toggled_sp),
    ]


def scaled_links(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    """The same cluster with every link between machines `factor` times as fast (NICs and
    per-pair links; the links inside a machine as they are)."""
    return dataclasses.replace(
        cluster,
        groups=[dataclasses.replace(g, nic_bw=g.nic_bw * factor) for g in cluster.groups],
        links=[dataclasses.replace(lk, bandwidth=lk.bandwidth * factor) for lk in cluster.links],
    )


class NeighbourContexts(Generic[C]):
    """The search's pipeline contexts for its neighbouring settings, with their own caches."""

    def __init__(self, searcher: SearchState[C], finalists: int):
        self.s = searcher
        self.finalists = finalists  # how many of a setting's candidates the search polishes
        self._contexts: dict[tuple[int, bool, float, Neighbour], Context] = {}
        self._topologies: dict[float, Topology] = {}

    def topology(self, link_scale: float) -> Topology:
        """The search's topology, or the one of its cluster with links `link_scale` as fast."""
        if link_scale == 1.0:
            return self.s.topo
        got = self._topologies.get(link_scale)
        if got is None:
            got = Topology(scaled_links(self.s.topo.cluster, link_scale))
            self._topologies[link_scale] = got
        return got

    def context(self, n: Neighbour, mbs: int, rc: bool, K: int) -> Context:
        fraction = 1 / K if n.distributed_optimizer else 1.0
        key = (mbs, rc, fraction, n)
        got = self._contexts.get(key)
        if got is None:
            s = self.s
            # the distributed optimizer flipped alone changes only memory limits: the requested
            # setting's stage and boundary times are reused
            same_times = n.sequence_parallel == s.sequence_parallel and n.link_scale == 1.0
            # other links between machines change no stage (a TP group inside one machine): the
            # stages of the same setting at the file's speed are reused
            stages = None
            if n.link_scale != 1.0:
                at_file_speed = Neighbour(n.sequence_parallel, n.distributed_optimizer)
                own = (s.sequence_parallel, s.dist_opt) == at_file_speed[:2]
                stages = s.context(mbs, rc, K) if own else self.context(at_file_speed, mbs, rc, K)
                if stages.optimizer_fraction != fraction:
                    stages = None
            got = self._contexts[key] = Context(
                s.model,
                self.topology(n.link_scale),
                mbs,
                rc,
                fraction,
                s._fits,
                s.attention_backend,
                n.sequence_parallel,
                s.layer_impl,
                s.context(mbs, rc, K) if same_times else None,
                stages,
            )
        return got

    def candidates(self, cands: list[C], mbs: int, rc: bool, big: bool) -> list[C]:
        """For each neighbour: the search's candidate partitions (`cands`) laid out in its
        context, ranked by the requested setting's proxy; the best FINALISTS of them polished
        both ways, as the search polishes its own. Only layouts the requested setting allows."""
        s = self.s
        seq = s.model.seq_length

        def allowed(c: C) -> bool:
            # with sequence parallelism the sequence is cut evenly over a stage's TP ranks
            return not s.sequence_parallel or all(
                len(st.ranks) == 1 or seq % len(st.ranks) == 0 for d in c.drafts for st in d.stages
            )

        out: list[C] = []
        for n in neighbours(s.sequence_parallel, s.dist_opt):
            # a link speed's layouts start from cold caches: the few best partitions only; on
            # small graphs their best layouts are polished both ways, as the search's own
            # finalists (mixed-lab, llama2-13b, links twice as fast: the layout that wins there
            # comes from the file's speed only through the second way)
            few = big or n.link_scale != 1.0
            laid: list[C] = []
            for cand in cands[:BIG_POOL] if few else cands:
                ctx = self.context(n, mbs, rc, len(cand.parts))
                got = s.evaluate(ctx, cand.parts, mbs, False, ctx.pipelines)
                if got is not None and allowed(got):
                    laid.append(got)
            laid.sort(key=s.proxy)
            for cand in laid[: BIG_FINALISTS if big else self.finalists]:
                out.append(cand)
                for tune_orders in (False,) if big else (False, True):
                    got = s.evaluate(
                        cand.ctx, cand.parts, mbs, False, cand.cache, True, tune_orders
                    )
                    if got is not None and allowed(got):
                        out.append(got)
        return out


__all__ = [
    "LINK_SCALES",
    "LaidOut",
    "Neighbour",
    "NeighbourContexts",
    "SearchState",
    "neighbours",
    "scaled_links",
]
