"""One search's state: its inputs, its caches, and the `hexi` strategy over them.

planner.search runs a strategy with a Searcher (`run_strategy`); the baselines
(planner.search_baselines) and the neighbouring settings (planner.neighbours) read it. The
outer loop covers micro-batch size and recompute; the K pipelines, the coarsening level and the
partition seeds of each are searched here, the pipelines laid out by planner.search_order and
planner.search_pipeline, the batch shared out by planner.search_candidates.
"""

from __future__ import annotations

import math
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from planner.attention import ATTENTION_BACKENDS, PLAN_DEFAULT_BACKEND, keeps_scores
from planner.cli_args import PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER
from planner.cuda_graphs import PLAN_DEFAULT_GRAPH_IMPL
from planner.errors import SpecError
from planner.host import EAGER_LOCAL, LayerImpl
from planner.layout import total_params
from planner.memory import (
    FRAMEWORK_RESERVE_BYTES,
    GRAD_BYTES_PER_PARAM,
    OPTIMIZER_BYTES_PER_PARAM,
    WEIGHT_BYTES_PER_PARAM,
    layer_activation_bytes,
)
from planner.neighbours import NeighbourContexts
from planner.outer_sync import OUTER_BYTES_PER_PARAM
from planner.schedule import last_backward_ends
from planner.search_candidates import FINALISTS, Candidate, Solution, allocate, rebalance
from planner.search_order import best_pipeline
from planner.search_partition import (
    Evaluation,
    greedy_partition,
    make_chunks,
    metis_partition,
    refine,
    striped_partition,
)
from planner.search_pipeline import (
    Context,
    Fits,
    MachineChunk,
    PipelineDraft,
    build_pipeline,
)
from planner.simulator import Estimate, SimulationCache, simulate_layout
from planner.sync_model import (
    StageLayout,
    collectives,
    overlapped_sync_time,
    rank_sets,
    stage_timings,
    sync_time,
)
from planner.topology import Topology

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec
    from planner.models import ModelSpec

# Searched when --micro-batch-size is not given, in turn: the first two always, each next one
# while the size before it beat the one before that. A fast GPU running small GEMMs or waiting
# for its host (planner.kernels, planner.host) gains from fewer, larger micro-batches, until
# memory or the pipeline's fill and drain say stop; a large model's GEMMs are big at 1 already.
MICRO_BATCH_CANDIDATES = (1, 2, 4)  # the sizes the uniform baseline searches too
LARGER_MICRO_BATCHES = (8, 16, 32, 64)
SMALL_CHUNK_GRAPH = 64  # below this, every K and partition seed is tried
# The neighbouring settings (planner.neighbours) are laid out for the recompute and micro-batch
# knobs whose best plan is within this factor of the search's best (stated choice: a neighbour's
# layout has won by up to a few per cent; a knob 10 % behind is not worth its layouts' time).
NEIGHBOUR_MARGIN = 1.10


class _Progress:
    """Progress lines on stderr, only once a search has run for a while."""

    def __init__(self, enabled: bool):
        self.enabled, self.start, self.last = enabled, time.time(), time.time()

    def __call__(self, msg: str) -> None:
        now = time.time()
        if self.enabled and now - self.start > 2 and now - self.last > 1:
            print(f"hexi-plan: {now - self.start:.0f} s: {msg}", file=sys.stderr, flush=True)
            self.last = now


def _k_grid(n: int, cap: int) -> list[int]:
    """Numbers of pipelines to try: all up to 16 (up to 4 on big graphs), then x1.5 steps."""
    small = 16 if n <= SMALL_CHUNK_GRAPH else 4
    ks = set(range(1, min(n, cap, small) + 1))
    x = small
    while x < min(n, cap):
        x = int(math.ceil(x * 1.5))
        ks.add(min(x, n, cap))
    ks.update(k for k in (n, cap) if k <= min(n, cap))
    return sorted(ks)


class Searcher:
    """One search: inputs, caches, and the candidates it found."""

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        recompute: str = "auto",
        seed: int = 0,
        use_distributed_optimizer: bool = False,
        progress: bool = False,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        attention_backend: str = PLAN_DEFAULT_BACKEND,
        sequence_parallel: bool = False,
        layer_impl: LayerImpl = EAGER_LOCAL,
        cuda_graph_impl: str = PLAN_DEFAULT_GRAPH_IMPL,
        cuda_graph_scope: tuple[str, ...] = (),
    ):
        if recompute not in ("auto", "on", "off"):
            raise SpecError(f"--recompute: must be auto, on or off, got {recompute!r}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise SpecError(
                f"--attention-backend: must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {attention_backend!r}"
            )
        self.attention_backend = attention_backend
        self.sequence_parallel = sequence_parallel
        self.layer_impl = layer_impl
        # recorded in the plan; `layer_impl` says what they cost (planner.host.layer_impl)
        self.cuda_graph_impl = cuda_graph_impl
        self.cuda_graph_scope = cuda_graph_scope
        if overlap_param_gather and not use_distributed_optimizer:
            raise SpecError(PARAM_GATHER_NEEDS_DISTRIBUTED_OPTIMIZER)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        if global_batch_size < 1:
            raise SpecError("--global-batch-size: must be a positive integer")
        self.cluster, self.model, self.gbs = cluster, model, global_batch_size
        self.seed, self.dist_opt = seed, use_distributed_optimizer
        # islands (planner.search_islands): ranks also keep fp32 outer parameters and momentum
        self.outer_state = False
        self.topo = Topology(cluster)
        self.progress = _Progress(progress)
        if micro_batch_size is not None:
            if micro_batch_size < 1 or global_batch_size % micro_batch_size:
                raise SpecError(
                    f"--micro-batch-size: {micro_batch_size} must be positive and "
                    f"divide --global-batch-size {global_batch_size}"
                )
            self.mbs_list = [micro_batch_size]
        else:
            self.mbs_list = [b for b in MICRO_BATCH_CANDIDATES if global_batch_size % b == 0]
        # hexi: after mbs_list, in the same turn (`_micro_batches`)
        free = micro_batch_size is None
        self.larger_mbs = [b for b in LARGER_MICRO_BATCHES if free and global_batch_size % b == 0]
        self.rc_list = {"auto": [False, True], "on": [True], "off": [False]}[recompute]
        self.by_name = self.topo._by_name_override
        self.max_chunks = max(n.gpus_per_node for n in self.topo.nodes)
        # caches of this search
        self._contexts: dict[tuple[int, bool, float], Context] = {}
        self._fits: Fits = {}  # schedule fits by stage times
        self.simulations = SimulationCache()
        # `simulate`'s answers while a candidate holds them (held all, they add 160 MB at 8,192
        # GPUs; the repeats come while the first is still held: 286 hits against 287)
        self._estimates: weakref.WeakValueDictionary[tuple[Any, ...], Estimate] = (
            weakref.WeakValueDictionary()
        )
        self.neighbours = NeighbourContexts(self, FINALISTS)

    # -------------------------------------------------------------------------------- helpers
    def context(self, mbs: int, rc: bool, K: int) -> Context:
        """Shared per (micro-batch, recompute, optimizer share) so caches carry across K."""
        fraction = 1 / K if self.dist_opt else 1.0
        if self.outer_state:  # sharded like the optimizer state: a larger state per parameter
            fraction *= 1 + OUTER_BYTES_PER_PARAM / OPTIMIZER_BYTES_PER_PARAM
        key = (mbs, rc, fraction)
        if key not in self._contexts:
            # another optimizer share changes only memory limits: the stage and boundary times
            # of the knob's first context are reused
            timings = next((c for k, c in self._contexts.items() if k[:2] == key[:2]), None)
            self._contexts[key] = Context(
                self.model,
                self.topo,
                mbs,
                rc,
                fraction,
                self._fits,
                self.attention_backend,
                self.sequence_parallel,
                self.layer_impl,
                timings,
            )
        return self._contexts[key]

    def chunk_levels(self) -> list[int]:
        out, c = [], 1
        while c <= self.max_chunks:
            out.append(c)
            c *= 2
        return out

    def _pipeline(
        self,
        ctx: Context,
        part: Sequence[MachineChunk],
        m_est: int,
        exhaustive: bool,
        cache: dict[tuple[Any, ...], Solution | None],
        polish: bool = False,
        tune_orders: bool = False,
    ) -> PipelineDraft | None:
        """Best draft for a part; solved once per interchangeable signature, then re-mapped."""
        if len(part) > self.model.num_layers:  # every chunk hosts at least one stage
            return None
        key = (tuple(sorted(ch.key for ch in part)), m_est, exhaustive, polish, tune_orders)
        if key in cache:
            sol = cache[key]
            if sol is None:
                return None
            pool: dict[tuple[str, int], list[MachineChunk]] = {}
            for ch in sorted(part, key=lambda ch: ch.ranks):
                pool.setdefault(ch.key, []).append(ch)
            chunks = [pool[k].pop(0) for k in sol.chunk_keys]
            draft = build_pipeline(ctx, chunks, sol.ks, m_est)
            assert draft is not None  # laid out for another part of the same kinds
            return draft.fit(ctx.fits)
        d = best_pipeline(ctx, part, m_est, exhaustive, polish, tune_orders)
        cache[key] = None if d is None else Solution(tuple(ch.key for ch in d.chunks), d.ks)
        return d

    def evaluate(
        self,
        ctx: Context,
        parts: list[list[MachineChunk]],
        mbs: int,
        exhaustive: bool,
        cache: dict[tuple[Any, ...], Solution | None],
        polish: bool = False,
        tune_orders: bool = False,
    ) -> Candidate | None:
        """Candidate for a partition (pipelines laid out, micro-batches allocated) or None."""
        U = self.gbs // mbs
        K = len(parts)
        if U < K:
            return None
        flops = [sum(self.topo.devices[ch.node].flops * len(ch.ranks) for ch in p) for p in parts]
        tot = sum(flops)
        drafts = []
        for p, f in zip(parts, flops):
            m_est = 2 ** round(math.log2(max(1.0, U * f / tot)))
            d = self._pipeline(ctx, p, m_est, exhaustive, cache, polish, tune_orders)
            if d is None:
                return None
            drafts.append(d)
        ms = allocate(drafts, U)
        if ms is None:
            return None
        return Candidate(
            drafts,
            ms,
            mbs,
            ctx.recompute,
            max(d.fixed + d.rate * m for d, m in zip(drafts, ms)),
            ctx,
            parts,
            cache,
        )

    def proxy(self, cand: Candidate) -> float:
        """Pipelines' time + exposed gradient sync: ranks candidates before the exact score."""
        if cand.sync is None and (self.overlap_grad_reduce or self.overlap_param_gather):
            layouts = cand.layouts(self.model)
            ends, fwd, bwd = [], [], []
            for d, m in zip(cand.drafts, cand.ms):
                f, b = d.fwd_bwd()
                e = last_backward_ends(f, b, d.xf, d.xb, m)
                shift = d.fixed + d.rate * m - e[0]  # end where the draft's fit ends it
                ends.append([x + shift for x in e])
                fwd.append(f)
                bwd.append(b)
            cand.sync = overlapped_sync_time(
                collectives(self.model, layouts, self.dist_opt),
                self.topo,
                self.dist_opt,
                stage_timings(layouts, ends, fwd, bwd),
                cand.pipe_time,
                self.overlap_grad_reduce,
                self.overlap_param_gather,
            ).exposed
        if cand.sync is None:
            cand.sync = sync_time(
                rank_sets(self.model, cand.layouts(self.model), self.dist_opt),
                self.topo,
                self.dist_opt,
            )[0]
        return cand.pipe_time + cand.sync

    def score(self, cand: Candidate) -> tuple[bool, float]:
        """(does not fit, iteration seconds) from the simulator, after exact rebalancing."""
        if cand.estimate is None:
            cand.ms, _ = rebalance(cand.drafts, cand.ms)
            cand.estimate = self.simulate(
                cand.layouts(self.model), [(cand.mbs, m) for m in cand.ms], cand.recompute
            )
        e = cand.estimate
        return (not e.fits_memory, e.iteration_time_s)

    def simulate(
        self, layouts: list[list[StageLayout]], batches: list[tuple[int, int]], recompute: bool
    ) -> Estimate:
        """The simulator's estimate of pipelines laid out as `layouts`, with (micro-batch size,
        micro-batches) per pipeline, under this search's settings and caches.

        Memoised by its arguments: polishing often finds the layout it started from, and a
        neighbouring setting's context often lays out the requested one's (paper-hetero-b,
        llama2-7b with the distributed optimizer: 196 distinct layouts in 483 calls)."""
        key = (tuple(map(tuple, layouts)), tuple(batches), recompute)
        got = self._estimates.get(key)
        if got is None:
            got = self._estimates[key] = self._simulate(layouts, batches, recompute)
        return got

    def _simulate(
        self, layouts: list[list[StageLayout]], batches: list[tuple[int, int]], recompute: bool
    ) -> Estimate:
        return simulate_layout(
            self.model,
            self.cluster,
            layouts,
            batches,
            recompute,
            self.dist_opt,
            "even",
            self.topo,
            self.simulations,
            self.overlap_grad_reduce,
            self.overlap_param_gather,
            attention_backend=self.attention_backend,
            sequence_parallel=self.sequence_parallel,
            layer_impl=self.layer_impl,
            outer_state=self.outer_state,
        )

    # ----------------------------------------------------------------------------- strategies
    def hexi(self) -> Candidate | None:
        best = None
        # per (recompute, micro-batch) searched: its ranked candidates, whether the chunk graph
        # is big, and its best; the neighbouring settings are laid out afterwards, for the
        # knobs whose best came near the overall best only
        pools: list[tuple[bool, int, list[Candidate], bool, Candidate]] = []
        for rc in self.rc_list:
            best_at: list[Candidate | None] = []
            for mbs in self._micro_batches(best_at):
                cands = []
                for c in self.chunk_levels():
                    chunks = make_chunks(self.topo, c, self.by_name)
                    n = len(chunks)
                    U = self.gbs // mbs
                    for K in _k_grid(n, U):
                        if c > 1 and n > SMALL_CHUNK_GRAPH and K != c:
                            continue
                        if K * self.model.num_layers < n:  # a pipeline would get > L chunks
                            continue
                        ctx = self.context(mbs, rc, K)
                        cache = ctx.pipelines
                        seeds = [striped_partition(chunks, K)] if K == c and c > 1 else []
                        seeds.append(greedy_partition(self.topo, chunks, K))
                        if 2 * K <= n:  # METIS needs room to balance; greedy covers the rest
                            seeds.append(metis_partition(self.topo, chunks, K, self.seed))
                        seen = set()
                        for parts in seeds:
                            if parts is None:
                                continue
                            sig = tuple(sorted(tuple(sorted(ch.ranks for ch in p)) for p in parts))
                            if sig in seen:
                                continue
                            seen.add(sig)
                            cand = self.evaluate(ctx, parts, mbs, False, cache)
                            if cand is not None:
                                cands.append(cand)
                        self.progress(
                            f"recompute={rc} micro-batch {mbs}: {n} chunks, K={K}, "
                            f"{len(cands)} candidates"
                        )
                # cheap first cut per K (pipelines only), then rank with the gradient sync
                per_k: dict[int, list[Candidate]] = {}
                for cand in sorted(cands, key=lambda c: c.pipe_time):
                    per_k.setdefault(len(cand.drafts), []).append(cand)
                big = bool(cands) and sum(len(ch) for ch in cands[0].parts) > SMALL_CHUNK_GRAPH
                keep = 3 if big else None
                cands = sorted((c for v in per_k.values() for c in v[:keep]), key=self.proxy)
                finals = cands[:FINALISTS]
                finals += self._unsynced_contenders(per_k, finals)
                for cand in finals[:2]:  # refine the two best with the cost model
                    refined = self._refine(cand)
                    if refined is not None:
                        finals.append(refined)
                for cand in list(finals):  # polish the finalists' pipelines, two ways
                    for tune_orders in (False, True):
                        polished = self.evaluate(
                            cand.ctx, cand.parts, mbs, False, cand.cache, True, tune_orders
                        )
                        if polished is not None:
                            finals.append(polished)
                here = min(finals, key=self.score, default=None)
                best_at.append(here)
                if here is not None:
                    pools.append((rc, mbs, cands, big, here))
                    if best is None or self.score(here) < self.score(best):
                        best = here
        if best is None:
            return None
        best_misfit, best_time = self.score(best)
        for rc, mbs, cands, big, here in pools:
            misfit, time_s = self.score(here)
            if misfit > best_misfit or time_s > NEIGHBOUR_MARGIN * best_time:
                continue
            for cand in self.neighbours.candidates(cands, mbs, rc, big):
                if self.score(cand) < self.score(best):
                    best = cand
        return best

    def _unsynced_contenders(
        self, per_k: dict[int, list[Candidate]], finals: list[Candidate]
    ) -> list[Candidate]:
        """Per pipeline count and chunk size, the candidate the proxy ranks best, where its
        pipelines alone (before the gradient sync) beat every finalist. The proxy charges an
        unpolished layout the sync its stage order exposes, and polishing (whole-machine
        orders) can hide nearly all of it: mixed-lab, llama2-7b, links at half speed: 4
        pipelines of single-GPU chunks took 5.41 s before the sync and 13.2 s with it
        unpolished, so they never reached the finalists; polished, they make 5.44 s against
        the 5.96 s of the 2-pipeline plan that won before."""
        if not finals:
            return []
        bound = self.proxy(finals[0])  # the finalists come ranked by the proxy
        chosen = {id(c) for c in finals}
        groups: dict[tuple[int, int], list[Candidate]] = {}
        for k, v in per_k.items():
            for c in v:
                chunk_gpus = max(len(ch.ranks) for p in c.parts for ch in p)
                groups.setdefault((k, chunk_gpus), []).append(c)
        out = []
        for _, v in sorted(groups.items()):
            best = min(v, key=self.proxy)
            if id(best) not in chosen and best.pipe_time < bound:
                out.append(best)
        return out

    def _micro_batches(self, best_at: list[Candidate | None]) -> Iterator[int]:
        """The micro-batch sizes hexi searches: the first two of mbs_list and `larger_mbs`, then
        each next one while the size before it beat the one before that (`best_at`: the best
        candidate found per size so far, filled in by the caller between steps)."""
        sizes = [*self.mbs_list, *self.larger_mbs]
        yield from sizes[:2]
        for mbs in sizes[2:]:
            if len(best_at) < 2 or best_at[-1] is None:
                return
            last, before = best_at[-1], best_at[-2]
            if before is not None and self.score(last) >= self.score(before):
                return
            yield mbs

    def _refine(self, cand: Candidate) -> Candidate | None:
        ctx, mbs, cache = cand.ctx, cand.mbs, cand.cache

        def evaluate(parts: list[list[MachineChunk]]) -> Evaluation | None:
            got = self.evaluate(ctx, parts, mbs, False, cache)
            if got is None:
                return None
            times = [d.fixed + d.rate * m for d, m in zip(got.drafts, got.ms)]
            flops = [
                sum(self.topo.devices[ch.node].flops * len(ch.ranks) for ch in p) for p in parts
            ]
            order = sorted(range(len(parts)), key=lambda i: -times[i] * flops[i] / got.ms[i])
            return self.proxy(got), order, got

        big = sum(len(p) for p in cand.parts) > SMALL_CHUNK_GRAPH
        parts, res = refine(
            cand.parts, evaluate, max_rounds=2 if big else 4, max_trials=16 if big else 64
        )
        if res is None or parts is cand.parts:
            return None
        return res[2]  # the Candidate of `evaluate` above

    def explain_infeasible(self, strategy: str) -> str:
        """One line: which memory term does not fit, by how much, and what would."""
        m, topo = self.model, self.topo
        P = total_params(m)
        N = topo.cluster.num_gpus
        devs = [topo.device_of(r) for r in range(N)]
        room = sum(d.memory_bytes - FRAMEWORK_RESERVE_BYTES for d in devs)
        K_max = N if self.dist_opt else 1
        state = P * (
            WEIGHT_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM / K_max
        )
        name = m.name or "the model"
        if state > room:
            hints = []
            if not self.dist_opt:
                ds = P * (WEIGHT_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM)
                if ds < room:
                    hints.append(
                        "--use-distributed-optimizer (shards the 12 B/param fp32 master "
                        "and Adam state over pipelines)"
                    )
            big = max(devs, key=lambda d: d.memory_bytes)
            more = math.ceil((state - room) / (big.memory_bytes - FRAMEWORK_RESERVE_BYTES))
            hints.append(f"about {more} more {big.name} GPUs")
            return (
                f"no plan fits: {name} ({P / 1e9:.2f} B parameters) needs {state / 1e9:.1f} GB "
                f"for weights, grads and optimizer state, but the {N} GPUs offer "
                f"{room / 1e9:.1f} GB after a {FRAMEWORK_RESERVE_BYTES / 1e9:g} GB reserve "
                f"each ({(state - room) / 1e9:.1f} GB missing); would fit with: "
                + " or ".join(hints)
            )
        mbs = min(self.mbs_list)
        rc = max(self.rc_list)
        act = layer_activation_bytes(
            m, mbs, m.num_query_groups, m.ffn_hidden_size, rc, self.attention_backend
        )
        hints = []
        if not rc:
            hints.append("--recompute on")
        if mbs > 1:
            hints.append("--micro-batch-size 1")
        if keeps_scores(self.attention_backend):
            hints.append("--attention-backend auto (keeps no s x s scores)")
        if not self.sequence_parallel:
            hints.append("--sequence-parallel (cuts a TP stage's norm and dropout activations)")
        hints.append("more GPUs")
        if not self.dist_opt:
            hints.append("--use-distributed-optimizer")
        return (
            f"no {strategy} plan fits: model state needs {state / 1e9:.1f} GB of "
            f"{room / 1e9:.1f} GB, and activations of the in-flight micro-batches "
            f"({act / 1e9:.2f} GB per layer per micro-batch of {mbs}"
            f"{' with recompute' if rc else ''}) or a stage's embedding / LM head do not fit "
            f"in what is left on the GPUs; try " + ", ".join(hints)
        )
