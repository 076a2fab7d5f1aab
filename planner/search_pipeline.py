"""Phase 2 of the search: lay out one pipeline on a group of machine chunks.

A chunk is a set of GPUs of one machine (same type, fast links). For each chunk we choose how many
stages it hosts (its GPUs split into equal TP groups: any GPU count per machine); the chunks are
ordered with a top-tau greedy search that favours fast links between consecutive stages; layers
go to stages by a dynamic programme that minimises the pipeline's 1F1B time under every stage's
memory limit. All times and bytes come from planner.costmodel, shard sizes from planner.layout.

This module lays out one pipeline for a given chunk order and stage counts (`build_pipeline`);
which order and counts to take is planner/search_order.py's choice (`best_pipeline`).
"""

from __future__ import annotations

import functools
import heapq
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from planner.attention import PLAN_DEFAULT_BACKEND
from planner.costmodel import group_costs
from planner.devices import Device
from planner.host import EAGER_LOCAL, LayerImpl
from planner.memory import BF16_BYTES, RankShape, layers_that_fit, sequence_split
from planner.schedule import linear_fit, pipeline_time, window_period
from planner.splits import proportional_split
from planner.topology import BoundaryTimes, Signature, Topology, boundary_times

if TYPE_CHECKING:
    from planner.models import ModelSpec

# Schedule fits (`linear_fit`: fixed seconds, seconds per micro-batch) by a pipeline's stage
# times (fwd, bwd, xf, xb), shared by a search's contexts.
Fits: TypeAlias = dict[tuple[tuple[float, ...], ...], tuple[float, float]]


@dataclass(frozen=True)
class MachineChunk:
    """GPUs of one machine that go to the same pipeline: the whole machine, or one of its equal
    chunks at a finer coarsening level (planner.search_partition.make_chunks)."""

    node: int  # node index in cluster order
    ranks: tuple[int, ...]  # global ranks (cluster order)
    key: tuple[str, int]  # interchangeability signature (group or node name, size)


def chunk_stage_options(
    n: int, model: ModelSpec, sequence_parallel: bool = False
) -> tuple[int, ...]:
    """Stage counts a chunk of n GPUs may host: k stages of n/k GPUs (k divides n). Under
    sequence parallelism a TP degree t > 1 must also divide seq_length (the plan's rule: the
    sequence is cut evenly over the TP ranks); k = n (TP 1) is always there."""
    seq = model.seq_length if sequence_parallel else 0
    return _stage_options(n, model.num_query_groups, model.ffn_hidden_size, seq)


@functools.lru_cache(maxsize=4096)
def _stage_options(n: int, query_groups: int, ffn: int, seq: int) -> tuple[int, ...]:
    """chunk_stage_options by the numbers it reads (seq: 0 without sequence parallelism); the
    search asks it for every chunk of every order it scores."""
    out = []
    for k in range(1, n + 1):
        t = n // k
        if n % k == 0 and t <= query_groups and t <= ffn:
            if seq and t > 1 and seq % t:
                continue
            out.append(k)
    return tuple(out)


@dataclass
class StageDraft:
    ranks: tuple[int, ...]
    shards: dict[str, tuple[int, ...]]  # query_groups, ffn, vocab: per-rank sizes
    cf: float  # per layer forward seconds (compute + TP all-reduces)
    cb: float  # per layer backward seconds
    ef: float  # extra forward seconds (embedding / head / received all-gather)
    eb: float
    nmax: int  # most layers that fit in memory at this position
    layers: int = 0


@dataclass
class PipelineDraft:
    """A laid-out pipeline: stages with layer counts, and its schedule inputs."""

    stages: list[StageDraft]
    xf: list[float]
    xb: list[float]
    fixed: float = 0.0  # time(m) ~ fixed + m * rate
    rate: float = 0.0
    chunks: tuple[MachineChunk, ...] = ()  # the chunks in stage order and the stages each hosts
    ks: tuple[int, ...] = ()

    def fwd_bwd(self) -> tuple[list[float], list[float]]:
        return (
            [s.layers * s.cf + s.ef for s in self.stages],
            [s.layers * s.cb + s.eb for s in self.stages],
        )

    def time(self, m: int) -> float:
        f, b = self.fwd_bwd()
        return pipeline_time(f, b, self.xf, self.xb, m)

    def fit(self, memo: Fits) -> PipelineDraft:
        """Set `fixed` and `rate` from the schedule (`memo`: fits by stage times, so that
        identical pipelines are simulated once)."""
        f, b = self.fwd_bwd()
        key = (tuple(f), tuple(b), tuple(self.xf), tuple(self.xb))
        got = memo.get(key)
        if got is None:
            got = memo[key] = linear_fit(f, b, self.xf, self.xb)
        self.fixed, self.rate = got
        return self


class Context:
    """Inputs and caches of one search for one (micro-batch, recompute, optimizer share) knob:
    model, topology, batch knobs, the attention backend, sequence parallelism and the layer
    implementation (one per search); `fits` is shared by the search's contexts.

    `optimizer_fraction`: the share of its optimizer state a rank is assumed to hold while
    stages are laid out (1, or 1/K for the distributed optimizer over K pipelines); the
    simulator then checks the exact shares.

    `timings`: a context whose stage and boundary times are this one's (same model, topology,
    micro-batch, recompute and settings that set times; another optimizer share changes only
    memory limits): its times are reused and only the layers that fit are computed here.

    `stages`: a context whose stages are this one's (same model, machines, micro-batch,
    recompute, optimizer share and settings; only the links between machines differ, which a
    stage, one machine's TP group, never uses): its stage cache is shared."""

    def __init__(
        self,
        model: ModelSpec,
        topo: Topology,
        mbs: int,
        recompute: bool,
        optimizer_fraction: float,
        fits: Fits,
        attention_backend: str = PLAN_DEFAULT_BACKEND,
        sequence_parallel: bool = False,
        layer_impl: LayerImpl = EAGER_LOCAL,
        timings: Context | None = None,
        stages: Context | None = None,
    ):
        self.model, self.topo, self.mbs, self.recompute = model, topo, mbs, recompute
        self.layer_impl = layer_impl
        self.attention_backend = attention_backend
        self.sequence_parallel = sequence_parallel
        self.optimizer_fraction = optimizer_fraction
        self.fits = fits
        # best pipeline per part signature (planner.search keeps its own entries)
        self.pipelines: dict[tuple[Any, ...], Any] = {}
        self._stage: dict[tuple[Any, ...], StageDraft] = {}
        self._boundary: dict[Signature, BoundaryTimes] = {}
        self._chunk_stage: dict[tuple[Any, ...], StageDraft] = {}
        self._chunk_boundary: dict[tuple[Any, ...], BoundaryTimes] = {}
        self._fit: dict[tuple[Any, ...], int] = {}  # layers_that_fit by its arguments
        # layouts by ((chunk kinds, node pattern), ks, m): `layout_template`
        self._pipes: dict[tuple[Any, ...], _Template | None] = {}
        self._rows: dict[tuple[Any, ...], _Rows] = {}  # their stages, by all of that but m
        self._blocks: dict[tuple[Any, ...], _Block] = {}  # a chunk's stages at one place
        self.timings = timings
        if timings is not None:
            same = (mbs, recompute, attention_backend, sequence_parallel, layer_impl)
            assert timings.model is model and timings.topo is topo
            assert same == (
                timings.mbs,
                timings.recompute,
                timings.attention_backend,
                timings.sequence_parallel,
                timings.layer_impl,
            )
            self._boundary, self._chunk_boundary = timings._boundary, timings._chunk_boundary
        if stages is not None:
            assert stages.model is model and stages.layer_impl == layer_impl
            assert (mbs, recompute, optimizer_fraction, attention_backend, sequence_parallel) == (
                stages.mbs,
                stages.recompute,
                stages.optimizer_fraction,
                stages.attention_backend,
                stages.sequence_parallel,
            )
            self._stage, self._chunk_stage = stages._stage, stages._chunk_stage
            self._fit = stages._fit

    def stage(
        self, ranks: Sequence[int], first: bool, last: bool, position: int, num_stages: int
    ) -> StageDraft:
        """StageDraft for a TP group at a position (costs, extras before boundaries, nmax)."""
        m, topo = self.model, self.topo
        # keyed by the cost signature: identical machines (same group) share one computation
        key = (topo.sig(ranks), first, last, num_stages - position)
        got = self._stage.get(key)
        if got is not None:
            return StageDraft(tuple(ranks), got.shards, got.cf, got.cb, got.ef, got.eb, got.nmax)
        devs = [topo.device_of(r) for r in ranks]
        if self.timings is not None:  # the same times; only the memory limit is this context's
            tw = self.timings.stage(ranks, first, last, position, num_stages)
            st = StageDraft(
                tuple(ranks), tw.shards, tw.cf, tw.cb, tw.ef, tw.eb,
                self._nmax(devs, tw.shards, first, last, position, num_stages),
            )  # fmt: skip
            self._stage[key] = st
            return StageDraft(st.ranks, st.shards, st.cf, st.cb, st.ef, st.eb, st.nmax)
        speeds = [d.flops for d in devs]
        shards = {
            "query_groups": tuple(proportional_split(m.num_query_groups, speeds)),
            "ffn": tuple(proportional_split(m.ffn_hidden_size, speeds)),
            "vocab": tuple(proportional_split(m.vocab_size, speeds)),
        }
        costs = group_costs(m, devs, topo.slowest(ranks), self.attention_backend, self.layer_impl)
        cf, tf, cb, tb = costs.layer_times(
            self.mbs, shards["query_groups"], shards["ffn"], self.recompute
        )
        ef = eb = 0.0
        if first:
            a, b = costs.embedding_times(self.mbs)
            ef, eb = ef + a, eb + b
        if last:
            a, b = costs.head_times(self.mbs, shards["vocab"])
            ef, eb = ef + a, eb + b
        nmax = self._nmax(devs, shards, first, last, position, num_stages)
        st = StageDraft(tuple(ranks), shards, cf + tf, cb + tb, ef, eb, nmax)
        self._stage[key] = st
        return StageDraft(st.ranks, st.shards, st.cf, st.cb, st.ef, st.eb, st.nmax)

    def _nmax(
        self,
        devs: Sequence[Device],
        shards: Mapping[str, Sequence[int]],
        first: bool,
        last: bool,
        position: int,
        num_stages: int,
    ) -> int:
        """The most layers a stage of these devices and shards holds at this position.
        Memory: 1F1B keeps at most num_stages - position micro-batches in flight; ranks with
        the same memory and shards (a TP group of one GPU type) are asked once."""
        needs = set(
            zip(
                (d.memory_bytes for d in devs),
                shards["query_groups"],
                shards["ffn"],
                shards["vocab"],
            )
        )
        tp = len(devs)
        return min(
            self._layers_that_fit(capacity, qg, ff, vv, first, last, position, num_stages, tp)
            for capacity, qg, ff, vv in needs
        )

    def _layers_that_fit(
        self,
        capacity: float,
        qg: int,
        ffn: int,
        vocab: int,
        first: bool,
        last: bool,
        position: int,
        num_stages: int,
        tp: int = 1,
    ) -> int:
        """`memory.layers_that_fit` for this search's model, micro-batch and recompute,
        memoised: many stages of one search share a GPU type, shards and position. `tp`: the
        stage's TP degree (the sequence split under sequence parallelism)."""
        split = sequence_split(tp, self.sequence_parallel)
        key = (capacity, qg, ffn, vocab, first, last, position, num_stages, split)
        got = self._fit.get(key)
        if got is None:
            shape = RankShape(
                self.mbs, qg, ffn, vocab, first, last, position, num_stages,
                num_stages - position, self.recompute, self.optimizer_fraction,
                self.attention_backend, split,
            )  # fmt: skip
            got = self._fit[key] = layers_that_fit(capacity, self.model, shape)
        return got

    def chunk_stage(
        self,
        chunk: MachineChunk,
        ranks: tuple[int, ...],
        first: bool,
        last: bool,
        position: int,
        num_stages: int,
    ) -> StageDraft:
        """`stage` for a TP group inside one chunk: keyed by the chunk's kind (one machine type
        and size), so the cost signature need not be recomputed from the ranks."""
        key = (chunk.key, len(ranks), first, last, num_stages - position)
        got = self._chunk_stage.get(key)
        if got is None:
            got = self._chunk_stage[key] = self.stage(ranks, first, last, position, num_stages)
        return StageDraft(ranks, got.shards, got.cf, got.cb, got.ef, got.eb, got.nmax)

    def chunk_boundary(
        self, ua: MachineChunk, a: Sequence[int], ub: MachineChunk, b: Sequence[int]
    ) -> BoundaryTimes:
        """`boundary` between TP groups inside chunks ua and ub (same machine or not)."""
        key = (ua.key, len(a), ub.key, len(b), ua.node == ub.node)
        got = self._chunk_boundary.get(key)
        if got is None:
            got = self._chunk_boundary[key] = self.boundary(a, b)
        return got

    def boundary(self, a: Sequence[int], b: Sequence[int]) -> BoundaryTimes:
        key = self.topo.sig(a, b)
        got = self._boundary.get(key)
        if got is None:
            got = boundary_times(self.model, self.mbs, a, b, self.topo, self.sequence_parallel)
            self._boundary[key] = got
        return got

    def link_cost(self, ch: MachineChunk, v: MachineChunk) -> float:
        """Seconds to move one activation between two chunks (the ordering's edge weight)."""
        bw, lat = self.topo.node_link(ch.node, v.node)
        return self.model.seq_length * self.mbs * self.model.hidden_size * BF16_BYTES / bw + lat


def assign_layers(
    L: int,
    c: Sequence[float],
    e: Sequence[float],
    nmax: Sequence[int],
    m: int,
    order: Sequence[int] | None = None,
) -> list[int] | None:
    """Layer counts n_k minimising (m-1) * max_k t_k + sum_k t_k with t_k = n_k c_k + e_k.

    Subject to 1 <= n_k <= nmax_k and sum n_k = L. For a bound B on every t_k, the least sum
    comes from giving the layers to the cheapest stages first, each up to its cap under B; the
    optimum is at one of the values B = n c_k + e_k. Those are swept in increasing order (a heap
    of each stage's next value) from the smallest feasible B, and the sweep stops once
    (m-1) * B + (the least sum with no bound) cannot beat the best found: exact, and usually a
    few steps. Returns a list or None. `order`: the stages by c, cheapest first (stable), when
    the caller keeps it.
    """
    p = len(c)
    if p > L:
        return None
    hi = L - p + 1
    nmax = [x if x < hi else hi for x in map(int, nmax)]
    if min(nmax) < 1 or sum(nmax) < L:
        return None
    if order is None:
        order = sorted(range(p), key=c.__getitem__)  # cheapest first (stable)

    def fill(cp: Sequence[int]) -> tuple[list[int], float, float]:
        left, n, T, S = L - p, [1] * p, 0.0, 0.0
        for k in order:
            x = cp[k] - 1
            if x > left:
                x = left
            left -= x
            n[k] += x
            t = n[k] * c[k] + e[k]
            S += t
            if t > T:
                T = t
        return n, (m - 1) * T + S, S

    unbounded = fill(nmax)
    if m <= 1:
        return unbounded[0]
    lo = max(map(operator.add, c, e))
    caps = [int((lo - ek) / ck + 1e-9) for ck, ek in zip(c, e)]
    caps = [1 if x < 1 else (x if x < cap else cap) for x, cap in zip(caps, nmax)]
    heap = [((caps[k] + 1) * c[k] + e[k], k) for k in range(p) if caps[k] < nmax[k]]
    heapq.heapify(heap)
    total = sum(caps)

    def advance(v: float) -> None:  # raise the bound to v: every stage whose next value is <= v
        nonlocal total
        lim = v + abs(v) * 1e-12 + 1e-15
        while heap and heap[0][0] <= lim:
            _, k = heapq.heappop(heap)
            caps[k] += 1
            total += 1
            if caps[k] < nmax[k]:
                heapq.heappush(heap, ((caps[k] + 1) * c[k] + e[k], k))

    advance(lo)
    while total < L:  # smallest feasible bound
        if not heap:
            return None
        advance(heap[0][0])
    best_n, best, _ = fill(caps)
    s_inf = unbounded[2]
    while heap:
        v = heap[0][0]
        if (m - 1) * v + s_inf >= best:
            break
        advance(v)
        n, J, _ = fill(caps)
        if J < best:
            best_n, best = n, J
    return best_n


_MISSING: Any = object()  # a sentinel: the cached template may be None


def build_pipeline(
    ctx: Context, chunks: Sequence[MachineChunk], ks: Sequence[int], m_est: int
) -> PipelineDraft | None:
    """PipelineDraft for chunks in this order hosting ks[i] stages each, or None if it cannot fit.

    Solved once per (chunk kinds in order, which chunks share a machine, stage counts, m): pipelines
    on identical machines get the same layout, re-mapped to their own ranks.
    """
    tpl = layout_template(ctx, chunks, tuple(ks), m_est)
    if tpl is None:
        return None
    groups = _tp_groups(chunks, ks)
    r = tpl.rows
    stages = [
        StageDraft(g, sh, f, b, ef, eb, n, x)
        for g, sh, f, b, ef, eb, n, x in zip(
            groups, r.shards, r.cf, r.cb, r.ef, r.eb, r.nmax, tpl.layers
        )
    ]
    return PipelineDraft(stages, r.xf, r.xb, chunks=tuple(chunks), ks=tuple(ks))


class _Template:
    """A laid-out pipeline without ranks: its stages (_Rows), the layer counts and phase 2's
    objective."""

    __slots__ = ("rows", "layers", "obj")

    def __init__(self, rows: _Rows, layers: list[int], obj: float):
        self.rows, self.layers, self.obj = rows, layers, obj


OrderKey: TypeAlias = tuple[tuple[tuple[str, int], ...], tuple[int, ...]]


def order_key(chunks: Sequence[MachineChunk]) -> OrderKey:
    """What a layout of chunks in this order depends on besides the stage counts: the chunk
    kinds in order, and which of them share a machine (each machine numbered by its first
    chunk). Callers that score many stage counts for one order compute it once."""
    seen: dict[int, int] = {}
    pattern = tuple(seen.setdefault(ch.node, len(seen)) for ch in chunks)
    return tuple(ch.key for ch in chunks), pattern


def layout_template(
    ctx: Context,
    chunks: Sequence[MachineChunk],
    ks: tuple[int, ...],
    m_est: int,
    okey: OrderKey | None = None,
) -> _Template | None:
    """The memoised layout of chunks in this order hosting ks[i] stages each, for m_est
    micro-batches (`obj` set), or None where it cannot fit. `okey`: `order_key(chunks)`."""
    if sum(ks) > ctx.model.num_layers:
        return None
    rkey = (order_key(chunks) if okey is None else okey, ks)
    key = (rkey, m_est)
    tpl = ctx._pipes.get(key, _MISSING)
    if tpl is _MISSING:
        rows = ctx._rows.get(rkey)
        if rows is None:
            rows = ctx._rows[rkey] = _build_rows(ctx, chunks, ks)
        tpl = ctx._pipes[key] = _lay_out(ctx, rows, m_est)
    return tpl


def _tp_groups(chunks: Sequence[MachineChunk], ks: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for ch, k in zip(chunks, ks):
        t = len(ch.ranks) // k
        out.extend(ch.ranks[i * t : (i + 1) * t] for i in range(k))
    return out


class _Rows:
    """A pipeline's stages before layers are assigned (whatever the micro-batch count): per
    stage its shards, per-layer seconds, extras (the boundary all-gathers around it included)
    and the most layers that fit; the boundary transfers; and the sums the layer assignment and
    the objective read (per layer, per stage, per boundary both ways)."""

    __slots__ = (
        "shards", "cf", "cb", "ef", "eb", "nmax", "xf", "xb", "c", "e", "order", "x", "sxf", "sxb",
    )  # fmt: skip

    def __init__(
        self,
        shards: list[dict[str, tuple[int, ...]]],
        cf: list[float],
        cb: list[float],
        ef: list[float],
        eb: list[float],
        nmax: list[int],
        xf: list[float],
        xb: list[float],
    ):
        self.shards, self.cf, self.cb, self.ef, self.eb, self.nmax = shards, cf, cb, ef, eb, nmax
        self.xf, self.xb = xf, xb
        self.c = list(map(operator.add, cf, cb))
        self.e = list(map(operator.add, ef, eb))
        self.order = sorted(range(len(cf)), key=self.c.__getitem__)  # cheapest first
        self.x = list(map(operator.add, xf, xb))
        self.sxf, self.sxb = sum(xf), sum(xb)


class _Block:
    """The stages one chunk hosts at one place in a pipeline (`_build_rows`' unit): their rows
    with the boundaries between them applied, those boundaries' transfers, and the TP size. The
    first stage's forward extra and the last one's backward extra still lack the boundaries to
    the chunks before and after it. A machine of 8 GPUs at TP 1 hosts 8 stages: one lookup
    instead of 8."""

    __slots__ = ("t", "shards", "cf", "cb", "ef", "eb", "nmax", "xf", "xb")

    def __init__(self, ctx: Context, ch: MachineChunk, k: int, i0: int, p: int):
        t = self.t = len(ch.ranks) // k
        self.shards: list[dict[str, tuple[int, ...]]] = []
        self.cf: list[float] = []
        self.cb: list[float] = []
        self.ef: list[float] = []
        self.eb: list[float] = []
        self.nmax: list[int] = []
        self.xf: list[float] = []
        self.xb: list[float] = []
        inner: BoundaryTimes | None = None  # between two TP groups of this chunk
        for j in range(k):
            i = i0 + j
            st = ctx.chunk_stage(ch, ch.ranks[j * t : (j + 1) * t], i == 0, i == p - 1, i, p)
            ef_j = st.ef
            if j:
                if inner is None:
                    a, b = ch.ranks[(j - 1) * t : j * t], ch.ranks[j * t : (j + 1) * t]
                    inner = ctx.chunk_boundary(ch, a, ch, b)
                (tf, gf), (tb, gb) = inner
                self.xf.append(tf)
                self.xb.append(tb)
                ef_j += gf
                self.eb[-1] += gb
            self.shards.append(st.shards)
            self.cf.append(st.cf)
            self.cb.append(st.cb)
            self.ef.append(ef_j)
            self.eb.append(st.eb)
            self.nmax.append(st.nmax)


def _build_rows(ctx: Context, chunks: Sequence[MachineChunk], ks: Sequence[int]) -> _Rows:
    """_Rows for chunks in this order hosting ks[i] stages each (at most L stages): each
    chunk's _Block, joined by the boundaries between chunks."""
    p = sum(ks)
    blocks, boundary_cache = ctx._blocks, ctx._chunk_boundary
    shards: list[dict[str, tuple[int, ...]]] = []
    cf: list[float] = []
    cb: list[float] = []
    ef: list[float] = []
    eb: list[float] = []
    nmax: list[int] = []
    xf: list[float] = []
    xb: list[float] = []
    i = 0
    prev: tuple[MachineChunk, int] | None = None  # the previous chunk and its TP size
    for ch, k in zip(chunks, ks):
        key = (ch.key, k, i == 0, i + k == p, p - i)
        blk = blocks.get(key)
        if blk is None:
            blk = blocks[key] = _Block(ctx, ch, k, i, p)
        t = blk.t
        ef.extend(blk.ef)
        if i:
            assert prev is not None
            pu, pt = prev
            got = boundary_cache.get((pu.key, pt, ch.key, t, pu.node == ch.node))
            if got is None:
                pj = len(pu.ranks) // pt - 1
                got = ctx.chunk_boundary(pu, pu.ranks[pj * pt : (pj + 1) * pt], ch, ch.ranks[:t])
            (tf, gf), (tb, gb) = got
            xf.append(tf)
            xb.append(tb)
            ef[i] += gf
            eb[-1] += gb
        shards.extend(blk.shards)
        cf.extend(blk.cf)
        cb.extend(blk.cb)
        eb.extend(blk.eb)
        nmax.extend(blk.nmax)
        xf.extend(blk.xf)
        xb.extend(blk.xb)
        i += k
        prev = (ch, t)
    return _Rows(shards, cf, cb, ef, eb, nmax, xf, xb)


def _lay_out(ctx: Context, r: _Rows, m_est: int) -> _Template | None:
    """_Template of these rows for m_est micro-batches (layers assigned), or None. Its `obj`
    is phase 2's estimate of the 1F1B time of m_est micro-batches: the first micro-batch
    through every stage and link, then m_est - 1 periods of the steady state (which slow links
    lengthen, `steady_period`)."""
    n = assign_layers(ctx.model.num_layers, r.c, r.e, r.nmax, m_est, r.order)
    if n is None:
        return None
    f = [x * c + e for x, c, e in zip(n, r.cf, r.ef)]
    b = [x * c + e for x, c, e in zip(n, r.cb, r.eb)]
    period = window_period([a + c for a, c in zip(f, b)], r.x)
    obj = (m_est - 1) * period + sum(f) + sum(b) + r.sxf + r.sxb
    return _Template(r, n, obj)


def draft_to_stages(draft: PipelineDraft, num_layers: int) -> list[dict[str, Any]]:
    """Plan `stages` dicts (layers assigned in order, explicit shards) from a PipelineDraft."""
    out, first = [], 0
    for s in draft.stages:
        d: dict[str, Any] = {"ranks": list(s.ranks), "layers": [first, first + s.layers]}
        first += s.layers
        kinds = ["query_groups", "ffn"]
        if d["layers"][0] == 0 or d["layers"][1] == num_layers:
            kinds.append("vocab")
        if len(s.ranks) > 1:
            d["shards"] = {k: list(s.shards[k]) for k in kinds}
        out.append(d)
    return out
