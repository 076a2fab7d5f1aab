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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

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


class Neighbour(NamedTuple):
    """A setting next to the requested one that changes how stages are laid out."""

    sequence_parallel: bool
    distributed_optimizer: bool


def neighbours(sequence_parallel: bool, distributed_optimizer: bool) -> list[Neighbour]:
    """The settings one toggle away: sequence parallelism off/on, distributed optimizer off/on."""
    return [
        Neighbour(not sequence_parallel, distributed_optimizer),
        Neighbour(sequence_parallel, not distributed_optimizer),
    ]


class NeighbourContexts(Generic[C]):
    """The search's pipeline contexts for its neighbouring settings, with their own caches."""

    def __init__(self, searcher: SearchState[C], finalists: int):
        self.s = searcher
        self.finalists = finalists  # how many of a setting's candidates the search polishes
        self._contexts: dict[tuple[int, bool, float, Neighbour], Context] = {}

    def context(self, n: Neighbour, mbs: int, rc: bool, K: int) -> Context:
        fraction = 1 / K if n.distributed_optimizer else 1.0
        key = (mbs, rc, fraction, n)
        got = self._contexts.get(key)
        if got is None:
            s = self.s
            # the distributed optimizer flipped alone changes only memory limits: the requested
            # setting's stage and boundary times are reused
            same_times = n.sequence_parallel == s.sequence_parallel
            got = self._contexts[key] = Context(
                s.model,
                s.topo,
                mbs,
                rc,
                fraction,
                s._fits,
                s.attention_backend,
                n.sequence_parallel,
                s.layer_impl,
                s.context(mbs, rc, K) if same_times else None,
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
            laid: list[C] = []
            for cand in cands[:BIG_POOL] if big else cands:
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


__all__ = ["LaidOut", "Neighbour", "NeighbourContexts", "SearchState", "neighbours"]
