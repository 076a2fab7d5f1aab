"""Phase 2 of the search: lay out one pipeline on a group of machine chunks ("units").

A unit is a set of GPUs of one machine (same type, fast links). For each unit we choose how many
stages it hosts (its GPUs split into equal TP groups: any GPU count per machine); the units are
ordered with a top-tau greedy search that favours fast links between consecutive stages; layers
go to stages by a dynamic programme that minimises the pipeline's 1F1B time under every stage's
memory limit. All times and bytes come from planner.costmodel, shard sizes from planner.layout.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from planner.attention import PLAN_DEFAULT_BACKEND
from planner.costmodel import group_costs
from planner.devices import Device
from planner.host import EAGER_LOCAL, LayerImpl
from planner.layout import proportional_split
from planner.memory import BF16_BYTES, RankShape, layers_that_fit, sequence_split
from planner.schedule import linear_fit, pipeline_time, window_period
from planner.topology import BoundaryTimes, Signature, Topology, boundary_times

if TYPE_CHECKING:
    from planner.models import ModelSpec

# Schedule fits (`linear_fit`: fixed seconds, seconds per micro-batch) by a pipeline's stage
# times (fwd, bwd, xf, xb), shared by a search's contexts.
Fits: TypeAlias = dict[tuple[tuple[float, ...], ...], tuple[float, float]]

# Pipelines of at most this many units also get a per-unit pass over stage counts.
PER_UNIT_REFINE_MAX_UNITS = 16

# Beam width of the stage-ordering search (HexiScale's tau). Stated choice: 4 partial orders.
TOP_TAU = 4

# Pipelines on few machines also try every order of whole machines (up to this many distinct
# orders), re-tuning stage counts on the best BLOCK_ORDERS_REFINED of them.
BLOCK_ORDERS_MAX = 120
BLOCK_ORDERS_REFINED = 2


@dataclass(frozen=True)
class Unit:
    """GPUs of one machine that go to the same pipeline."""

    node: int  # node index in cluster order
    ranks: tuple[int, ...]  # global ranks (cluster order)
    key: tuple[str, int]  # interchangeability signature (group or node name, size)


def unit_options(n: int, model: ModelSpec, sequence_parallel: bool = False) -> list[int]:
    """Stage counts a unit of n GPUs may host: k stages of n/k GPUs (k divides n). Under
    sequence parallelism a TP degree t > 1 must also divide seq_length (the plan's rule: the
    sequence is cut evenly over the TP ranks); k = n (TP 1) is always there."""
    out = []
    for k in range(1, n + 1):
        t = n // k
        if n % k == 0 and t <= model.num_query_groups and t <= model.ffn_hidden_size:
            if sequence_parallel and t > 1 and model.seq_length % t:
                continue
            out.append(k)
    return out


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
    units: tuple[Unit, ...] = ()  # the units in stage order and the stages each hosts
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
    memory limits): its times are reused and only the layers that fit are computed here."""

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
        self._unit_stage: dict[tuple[Any, ...], StageDraft] = {}
        self._unit_boundary: dict[tuple[Any, ...], BoundaryTimes] = {}
        self._fit: dict[tuple[Any, ...], int] = {}  # layers_that_fit by its arguments
        # build_pipeline templates by (unit kinds, node pattern, ks, m)
        self._pipes: dict[tuple[Any, ...], _Template | None] = {}
        self._rows: dict[tuple[Any, ...], _Rows] = {}  # their stages, by all of that but m
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
            self._boundary, self._unit_boundary = timings._boundary, timings._unit_boundary

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
        """`costmodel.layers_that_fit` for this search's model, micro-batch and recompute,
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

    def unit_stage(
        self,
        unit: Unit,
        ranks: tuple[int, ...],
        first: bool,
        last: bool,
        position: int,
        num_stages: int,
    ) -> StageDraft:
        """`stage` for a TP group inside one unit: keyed by the unit's kind (one machine type
        and size), so the cost signature need not be recomputed from the ranks."""
        key = (unit.key, len(ranks), first, last, num_stages - position)
        got = self._unit_stage.get(key)
        if got is None:
            got = self._unit_stage[key] = self.stage(ranks, first, last, position, num_stages)
        return StageDraft(ranks, got.shards, got.cf, got.cb, got.ef, got.eb, got.nmax)

    def unit_boundary(
        self, ua: Unit, a: Sequence[int], ub: Unit, b: Sequence[int]
    ) -> BoundaryTimes:
        """`boundary` between TP groups inside units ua and ub (same machine or not)."""
        key = (ua.key, len(a), ub.key, len(b), ua.node == ub.node)
        got = self._unit_boundary.get(key)
        if got is None:
            got = self._unit_boundary[key] = self.boundary(a, b)
        return got

    def boundary(self, a: Sequence[int], b: Sequence[int]) -> BoundaryTimes:
        key = self.topo.sig(a, b)
        got = self._boundary.get(key)
        if got is None:
            got = boundary_times(self.model, self.mbs, a, b, self.topo, self.sequence_parallel)
            self._boundary[key] = got
        return got

    def link_cost(self, u: Unit, v: Unit) -> float:
        """Seconds to move one activation between two units (the ordering's edge weight)."""
        bw, lat = self.topo.node_link(u.node, v.node)
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
    nmax = [min(int(x), hi) for x in nmax]
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
    lo = max(ck + ek for ck, ek in zip(c, e))
    caps = [min(nmax[k], max(1, int((lo - e[k]) / c[k] + 1e-9))) for k in range(p)]
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
    ctx: Context, units: Sequence[Unit], ks: Sequence[int], m_est: int
) -> PipelineDraft | None:
    """PipelineDraft for units in this order hosting ks[i] stages each, or None if it cannot fit.

    Solved once per (unit kinds in order, which units share a machine, stage counts, m): pipelines
    on identical machines get the same layout, re-mapped to their own ranks.
    """
    tpl = _template(ctx, units, ks, m_est)
    if tpl is None:
        return None
    groups = _tp_groups(units, ks)
    r = tpl.rows
    stages = [
        StageDraft(g, sh, f, b, ef, eb, n, x)
        for g, sh, f, b, ef, eb, n, x in zip(
            groups, r.shards, r.cf, r.cb, r.ef, r.eb, r.nmax, tpl.layers
        )
    ]
    return PipelineDraft(stages, r.xf, r.xb, units=tuple(units), ks=tuple(ks))


class _Template:
    """A laid-out pipeline without ranks: its stages (_Rows), the layer counts and phase 2's
    objective."""

    __slots__ = ("rows", "layers", "obj")

    def __init__(self, rows: _Rows, layers: list[int], obj: float):
        self.rows, self.layers, self.obj = rows, layers, obj


def _template(
    ctx: Context, units: Sequence[Unit], ks: Sequence[int], m_est: int
) -> _Template | None:
    """The memoised PipelineDraft (ranks of whichever units built it first; `obj` set) or None."""
    if sum(ks) > ctx.model.num_layers:
        return None
    seen: dict[int, int] = {}
    pattern = tuple(seen.setdefault(u.node, len(seen)) for u in units)
    key = (tuple(u.key for u in units), pattern, tuple(ks), m_est)
    tpl = ctx._pipes.get(key, _MISSING)
    if tpl is _MISSING:
        rkey = key[:3]
        rows = ctx._rows.get(rkey)
        if rows is None:
            rows = ctx._rows[rkey] = _build_rows(ctx, units, ks)
        tpl = ctx._pipes[key] = _lay_out(ctx, rows, m_est)
    return tpl


class _Choice:
    """A scored (order, stage counts) pair; the draft is re-mapped only for the winner."""

    __slots__ = ("units", "ks")

    def __init__(self, units: Iterable[Unit], ks: Iterable[int]):
        self.units, self.ks = tuple(units), tuple(ks)


class _Scored(NamedTuple):
    """What the search compares: phase 2's objective of a choice (lower is better)."""

    obj: float
    choice: _Choice


def _score(ctx: Context, order: Sequence[Unit], ks: Sequence[int], m_est: int) -> _Scored | None:
    """_Scored or None: what the search compares, without building the draft."""
    tpl = _template(ctx, order, ks, m_est)
    return None if tpl is None else _Scored(tpl.obj, _Choice(order, ks))


def _tp_groups(units: Sequence[Unit], ks: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for u, k in zip(units, ks):
        t = len(u.ranks) // k
        out.extend(u.ranks[i * t : (i + 1) * t] for i in range(k))
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
        self.c = [f + b for f, b in zip(cf, cb)]
        self.e = [f + b for f, b in zip(ef, eb)]
        self.order = sorted(range(len(cf)), key=self.c.__getitem__)  # cheapest first
        self.x = [f + b for f, b in zip(xf, xb)]
        self.sxf, self.sxb = sum(xf), sum(xb)


def _build_rows(ctx: Context, units: Sequence[Unit], ks: Sequence[int]) -> _Rows:
    """_Rows for units in this order hosting ks[i] stages each (at most L stages)."""
    p = sum(ks)
    stage_cache, boundary_cache = ctx._unit_stage, ctx._unit_boundary
    shards: list[dict[str, tuple[int, ...]]] = []
    cf: list[float] = []
    cb: list[float] = []
    ef: list[float] = []
    eb: list[float] = []
    nmax: list[int] = []
    xf: list[float] = []
    xb: list[float] = []
    i = 0
    prev: tuple[Unit, int] | None = None  # (unit, TP size) of the previous unit's last stage
    for u, k in zip(units, ks):
        t = len(u.ranks) // k
        inner: BoundaryTimes | None = None  # between two TP groups of this unit
        for j in range(k):
            first, last = i == 0, i == p - 1
            st = stage_cache.get((u.key, t, first, last, p - i))
            if st is None:
                st = ctx.unit_stage(u, u.ranks[j * t : (j + 1) * t], first, last, i, p)
            ef_i = st.ef
            if i:
                if j:
                    if inner is None:
                        got = boundary_cache.get((u.key, t, u.key, t, True))
                        if got is None:
                            a, b = u.ranks[(j - 1) * t : j * t], u.ranks[j * t : (j + 1) * t]
                            got = ctx.unit_boundary(u, a, u, b)
                        inner = got
                    bd = inner
                else:
                    assert prev is not None
                    pu, pt = prev
                    got = boundary_cache.get((pu.key, pt, u.key, t, pu.node == u.node))
                    if got is None:
                        pj = len(pu.ranks) // pt - 1
                        got = ctx.unit_boundary(
                            pu, pu.ranks[pj * pt : (pj + 1) * pt], u, u.ranks[:t]
                        )
                    bd = got
                (tf, gf), (tb, gb) = bd
                xf.append(tf)
                xb.append(tb)
                ef_i += gf
                eb[-1] += gb
            shards.append(st.shards)
            cf.append(st.cf)
            cb.append(st.cb)
            ef.append(ef_i)
            eb.append(st.eb)
            nmax.append(st.nmax)
            i += 1
        prev = (u, t)
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


def order_units(ctx: Context, units: Sequence[Unit], tau: int = TOP_TAU) -> list[list[Unit]]:
    """Top-tau greedy orders of the units: keep the tau partial orders with the smallest sum of
    boundary transfer times, extend each by every unused unit, repeat; returns the final orders.

    Interchangeable units (same key) are tried once per step.
    """
    beam: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    n = len(units)
    for _ in range(n):
        nxt: dict[tuple[tuple[str, int], ...], tuple[tuple[int, ...], float]] = {}
        for path, score in beam:
            used = set(path)
            seen = set()
            for i, u in enumerate(units):
                if i in used or u.key in seen:
                    continue
                seen.add(u.key)
                s = score + (ctx.link_cost(units[path[-1]], u) if path else 0.0)
                new = path + (i,)
                sig = tuple(units[j].key for j in new)
                if sig not in nxt or s < nxt[sig][1]:
                    nxt[sig] = (new, s)
        beam = sorted(nxt.values(), key=lambda x: (x[1], [units[j].key for j in x[0]]))[:tau]
    return [[units[i] for i in path] for path, _ in beam]


def best_pipeline(
    ctx: Context,
    units: Sequence[Unit],
    m_est: int,
    exhaustive: bool = False,
    polish: bool = False,
    tune_orders: bool = False,
) -> PipelineDraft | None:
    """The best PipelineDraft for these units (None if nothing fits), fitted for the schedule.

    Heuristic: candidate orders = top-tau orders, their reverses, and units by memory (largest
    first: early stages hold more micro-batches); stage counts chosen per GPU type by coordinate
    descent (for the best top-tau order and the memory order; the others take the counts
    chosen so far, or with `tune_orders` are tuned too). Polish (the search's finalists): also
    every order of whole machines, when few (`_block_orders`). The search polishes its
    finalists with and without `tune_orders` and keeps what the simulator scores best: the
    cheap objective that picks a pipeline's layout does not always agree with it.
    Exhaustive: every distinct order x every per-unit stage count.
    """
    if exhaustive:
        orders, seen = [], set()
        for perm in itertools.permutations(range(len(units))):
            sig = tuple(units[i].key for i in perm)
            if sig not in seen:
                seen.add(sig)
                orders.append([units[i] for i in perm])
    else:
        orders = order_units(ctx, units)
        orders += [list(reversed(o)) for o in orders]
        orders.append(
            sorted(
                units,
                key=lambda u: (
                    -ctx.topo.device_of(u.ranks[0]).memory_bytes,
                    -ctx.topo.device_of(u.ranks[0]).flops,
                    u.node,
                ),
            )
        )
    uniq, seen = [], set()
    for o in orders:
        sig = tuple(u.key for u in o)
        if sig not in seen:
            seen.add(sig)
            uniq.append(o)
    best = None
    for n_order, order in enumerate(uniq):
        opts = [unit_options(len(u.ranks), ctx.model, ctx.sequence_parallel) for u in order]
        if exhaustive:
            for ks in itertools.product(*opts):
                got = _score(ctx, order, ks, m_est)
                if got is not None and (best is None or got.obj < best.obj):
                    best = got
            continue
        if tune_orders and best is not None:
            # every order gets its own stage counts, starting also from the counts chosen so
            # far: scored only with another order's counts, an order was undervalued (at
            # 10 Gbit/s the search missed a layout it found at 25 Gbit/s that is better at 10
            # too: tests/planner/test_search_consistency.py)
            chosen = {u.key: k for u, k in zip(best.choice.units, best.choice.ks)}
            got = _coordinate_descent(ctx, order, opts, m_est, chosen)
        elif n_order == 0 or n_order == len(uniq) - 1:  # best top-tau order, memory order
            got = _coordinate_descent(ctx, order, opts, m_est)
        elif best is not None:  # other orders: the chosen stage counts
            sel = {u.key: k for u, k in zip(best.choice.units, best.choice.ks)}
            got = _score(ctx, order, tuple(sel[u.key] for u in order), m_est)
        else:
            got = _coordinate_descent(ctx, order, opts, m_est)
        if got is not None and (best is None or got.obj < best.obj):
            best = got
    if polish and not exhaustive and best is not None:
        best = _block_orders(ctx, units, m_est, best, seen)
    if best is None:
        return None
    draft = build_pipeline(ctx, best.choice.units, best.choice.ks, m_est)
    assert draft is not None  # its template was scored above
    return draft.fit(ctx.fits)


def _block_orders(
    ctx: Context,
    units: Sequence[Unit],
    m_est: int,
    best: _Scored,
    tried: set[tuple[tuple[str, int], ...]],
) -> _Scored:
    """Every order of whole machines (a machine's units kept together), when there are at most
    BLOCK_ORDERS_MAX distinct ones: each scored with the chosen stage counts per unit kind, the
    BLOCK_ORDERS_REFINED best then re-tuned by coordinate descent."""
    by_node: dict[int, list[Unit]] = {}
    for u in sorted(units, key=lambda u: u.ranks):
        by_node.setdefault(u.node, []).append(u)
    blocks = list(by_node.values())
    if len(blocks) < 2:
        return best
    kinds = [tuple(u.key for u in b) for b in blocks]
    count, n = 1, len(blocks)
    for i in range(2, n + 1):
        count *= i
        if count > 40 * BLOCK_ORDERS_MAX:
            return best
    perms, seen = [], set()
    for perm in itertools.permutations(range(n)):
        sig = tuple(kinds[i] for i in perm)
        if sig in seen:
            continue
        seen.add(sig)
        perms.append([u for i in perm for u in blocks[i]])
        if len(perms) > BLOCK_ORDERS_MAX:
            return best
    # each order scored with the stage counts chosen so far and with the fewest stages per unit
    sels = [
        {u.key: k for u, k in zip(best.choice.units, best.choice.ks)},
        {u.key: unit_options(len(u.ranks), ctx.model, ctx.sequence_parallel)[0] for u in units},
    ]
    scored = []
    for i, order in enumerate(perms):
        if tuple(u.key for u in order) in tried:
            continue
        objs = [
            got.obj
            for got in (_score(ctx, order, tuple(sel[u.key] for u in order), m_est) for sel in sels)
            if got is not None
        ]
        if objs:
            scored.append((min(objs), i, order))
    scored.sort(key=lambda x: (x[0], x[1]))
    for _, _, order in scored[:BLOCK_ORDERS_REFINED]:
        opts = [unit_options(len(u.ranks), ctx.model, ctx.sequence_parallel) for u in order]
        got = _coordinate_descent(ctx, order, opts, m_est)
        if got is not None and got.obj < best.obj:
            best = got
    return best


def _coordinate_descent(
    ctx: Context,
    order: Sequence[Unit],
    opts: Sequence[Sequence[int]],
    m_est: int,
    chosen: Mapping[tuple[str, int], int] | None = None,
) -> _Scored | None:
    """Choose one stage count per unit key (GPU type) by coordinate descent from two starts, and
    from `chosen` (counts per key found for another order) when given."""
    keys = sorted({u.key for u in order})
    choices = {k: opts[[u.key for u in order].index(k)] for k in keys}
    best = None
    L = ctx.model.num_layers
    starts = [{k: choices[k][0] for k in keys}]
    # start 2: as many stages as memory may need, without exceeding the layers
    most = {k: choices[k][-1] for k in keys}
    if sum(most[u.key] for u in order) > L:
        most = {
            k: max(
                [x for x in choices[k] if x * sum(1 for u in order if u.key == k) <= L]
                or [choices[k][0]]
            )
            for k in keys
        }
    starts.append(most)
    if chosen is not None:
        starts.append({k: chosen[k] for k in keys})
    cache: dict[tuple[int, ...], _Scored | None] = {}

    def score(sel: Mapping[tuple[str, int], int]) -> _Scored | None:
        ks = tuple(sel[u.key] for u in order)
        if ks not in cache:
            cache[ks] = _score(ctx, order, ks, m_est)
        return cache[ks]

    for sel in starts:
        cur = score(sel)
        for _ in range(3):
            improved = False
            for k in keys:
                for x in choices[k]:
                    if x == sel[k]:
                        continue
                    trial = {**sel, k: x}
                    got = score(trial)
                    if got is not None and (cur is None or got.obj < cur.obj - 1e-12):
                        sel, cur, improved = trial, got, True
            if not improved:
                break
        if cur is not None and len(order) <= PER_UNIT_REFINE_MAX_UNITS:
            # then per unit: machines of one type may host different stage counts
            ks = list(cur.choice.ks)
            for i in [j for _ in range(2) for j in reversed(range(len(order)))]:
                for x in opts[i]:
                    if x == ks[i]:
                        continue
                    cand = tuple(ks[:i] + [x] + ks[i + 1 :])
                    if cand not in cache:
                        cache[cand] = _score(ctx, order, cand, m_est)
                    got = cache[cand]
                    if got is not None and got.obj < cur.obj - 1e-12:
                        cur, ks = got, list(cand)
            # and swaps: which machine of a type hosts more stages (a two-coordinate move)
            for i in range(len(order)):
                for j in range(i + 1, len(order)):
                    if order[i].key != order[j].key or ks[i] == ks[j]:
                        continue
                    swapped = list(ks)
                    swapped[i], swapped[j] = ks[j], ks[i]
                    cand = tuple(swapped)
                    if cand not in cache:
                        cache[cand] = _score(ctx, order, cand, m_est)
                    got = cache[cand]
                    if got is not None and got.obj < cur.obj - 1e-12:
                        cur, ks = got, list(cand)
        if cur is not None and (best is None or cur.obj < best.obj):
            best = cur
    return best


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
