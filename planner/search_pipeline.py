"""Phase 2 of the search: lay out one pipeline on a group of machine chunks ("units").

A unit is a set of GPUs of one machine (same type, fast links). For each unit we choose how many
stages it hosts (its GPUs split into equal TP groups: any GPU count per machine); the units are
ordered with a top-tau greedy search that favours fast links between consecutive stages; layers
go to stages by a dynamic programme that minimises the pipeline's 1F1B time under every stage's
memory limit. All times and bytes come from planner.costmodel.
"""
import itertools
from dataclasses import dataclass

import numpy as np

from planner import costmodel as cm
from planner.schedule import linear_fit, pipeline_time

_FITS = {}     # schedule fits by stage times: identical pipelines are simulated once

# Pipelines of at most this many units also get a per-unit pass over stage counts.
PER_UNIT_REFINE_MAX_UNITS = 16

# Beam width of the stage-ordering search (HexiScale's tau). Stated choice: 4 partial orders.
TOP_TAU = 4


@dataclass(frozen=True)
class Unit:
    """GPUs of one machine that go to the same pipeline."""
    node: int                  # node index in cluster order
    ranks: tuple               # global ranks (cluster order)
    key: tuple                 # interchangeability signature (group or node, size)


def unit_options(n, model):
    """Stage counts a unit of n GPUs may host: k stages of n/k GPUs (k divides n)."""
    out = []
    for k in range(1, n + 1):
        t = n // k
        if n % k == 0 and t <= model.num_query_groups and t <= model.ffn_hidden_size:
            out.append(k)
    return out


@dataclass
class StageDraft:
    ranks: tuple
    shards: dict               # query_groups, ffn, vocab: per-rank sizes
    cf: float                  # per layer forward seconds (compute + TP all-reduces)
    cb: float                  # per layer backward seconds
    ef: float                  # extra forward seconds (embedding / head / received all-gather)
    eb: float
    nmax: int                  # most layers that fit in memory at this position
    layers: int = 0


@dataclass
class PipelineDraft:
    """A laid-out pipeline: stages with layer counts, and its schedule inputs."""
    stages: list
    xf: list
    xb: list
    fixed: float = 0.0         # time(m) ~ fixed + m * rate
    rate: float = 0.0
    units: tuple = ()          # the units in stage order and the stages each hosts
    ks: tuple = ()

    def fwd_bwd(self):
        return ([s.layers * s.cf + s.ef for s in self.stages],
                [s.layers * s.cb + s.eb for s in self.stages])

    def time(self, m):
        f, b = self.fwd_bwd()
        return pipeline_time(f, b, self.xf, self.xb, m)

    def fit(self):
        f, b = self.fwd_bwd()
        key = (tuple(f), tuple(b), tuple(self.xf), tuple(self.xb))
        got = _FITS.get(key)
        if got is None:
            got = _FITS[key] = linear_fit(f, b, self.xf, self.xb)
        self.fixed, self.rate = got
        return self


class Context:
    """Search-wide inputs and caches: model, topology, batch knobs, memory rule."""

    def __init__(self, model, topo, mbs, recompute, state_bytes_per_param):
        self.model, self.topo, self.mbs, self.recompute = model, topo, mbs, recompute
        self.state_bytes = state_bytes_per_param
        self._stage = {}
        self._boundary = {}

    def stage(self, ranks, first, last, position, num_stages):
        """StageDraft for a TP group at a position (costs, extras before boundaries, nmax)."""
        m, topo = self.model, self.topo
        key = (ranks, first, last, num_stages - position)
        got = self._stage.get(key)
        if got is not None:
            return StageDraft(got.ranks, got.shards, got.cf, got.cb, got.ef, got.eb, got.nmax)
        devs = [topo.device_of(r) for r in ranks]
        speeds = [d.flops for d in devs]
        shards = {"query_groups": cm.proportional_split(m.num_query_groups, speeds),
                  "ffn": cm.proportional_split(m.ffn_hidden_size, speeds),
                  "vocab": cm.proportional_split(m.vocab_size, speeds)}
        link = topo.slowest(ranks)
        cf, tf, cb, tb = cm.layer_times(m, self.mbs, devs, shards["query_groups"], shards["ffn"],
                                        link, self.recompute)
        ef = eb = 0.0
        if first:
            a, b = cm.embedding_times(m, self.mbs, len(ranks), link)
            ef, eb = ef + a, eb + b
        if last:
            a, b = cm.head_times(m, self.mbs, devs, shards["vocab"], link)
            ef, eb = ef + a, eb + b
        inflight = num_stages - position   # upper bound of 1F1B in-flight micro-batches
        nmax = 10 ** 9
        for i, r in enumerate(ranks):
            qg, ff, vv = shards["query_groups"][i], shards["ffn"][i], shards["vocab"][i]
            fixed_params = cm.stage_params(m, qg, ff, vv, 0, first, last)
            fixed = (cm.FRAMEWORK_RESERVE_BYTES + fixed_params * self.state_bytes
                     + (m.seq_length * self.mbs * vv * cm.FP32_BYTES if last else 0)
                     + (cm.layer_activation_bytes(m, self.mbs, qg, ff, False)
                        if self.recompute else 0))
            per_layer = (cm.layer_params(m, qg, ff) * self.state_bytes
                         + inflight * cm.layer_activation_bytes(m, self.mbs, qg, ff,
                                                                self.recompute))
            room = devs[i].memory_bytes - fixed
            nmax = min(nmax, int(room // per_layer) if room > 0 else 0)
        st = StageDraft(tuple(ranks), shards, cf + tf, cb + tb, ef, eb, nmax)
        self._stage[key] = st
        return StageDraft(st.ranks, st.shards, st.cf, st.cb, st.ef, st.eb, st.nmax)

    def boundary(self, a, b):
        key = (a, b)
        got = self._boundary.get(key)
        if got is None:
            got = cm.boundary_times(self.model, self.mbs, a, b, self.topo)
            self._boundary[key] = got
        return got

    def link_cost(self, u, v):
        """Seconds to move one activation between two units (the ordering's edge weight)."""
        bw, lat = self.topo.node_link(u.node, v.node)
        return self.model.seq_length * self.mbs * self.model.hidden_size * cm.BF16_BYTES / bw + lat


def assign_layers(L, c, e, nmax, m):
    """Layer counts n_k minimising (m-1) * max_k t_k + sum_k t_k with t_k = n_k c_k + e_k.

    Subject to 1 <= n_k <= nmax_k and sum n_k = L. Every candidate bottleneck B (one of the
    values n c_k + e_k) is tried: stages take at most their cap under B, and the layers go to the
    cheapest stages first (optimal for the sum under linear costs). Returns a list or None.
    """
    p = len(c)
    c, e, nmax = np.asarray(c, float), np.asarray(e, float), np.minimum(np.asarray(nmax), L - p + 1)
    if p > L or (nmax < 1).any() or nmax.sum() < L:
        return None
    cand = np.unique(np.concatenate([np.arange(1, nmax[k] + 1) * c[k] + e[k] for k in range(p)]))
    lo = np.max(c + e)
    cand = cand[cand >= lo - 1e-15]
    caps = np.minimum(nmax[None, :], np.floor((cand[:, None] - e[None, :]) / c[None, :] + 1e-9))
    ok = (caps >= 1).all(axis=1) & (caps.sum(axis=1) >= L)
    if not ok.any():
        return None
    caps, cand = caps[ok], cand[ok]
    order = np.argsort(c, kind="stable")
    extra = caps[:, order] - 1
    before = np.cumsum(extra, axis=1) - extra
    fill = np.clip((L - p) - before, 0, extra)
    n_sorted = 1 + fill
    t = n_sorted * c[order][None, :] + e[order][None, :]
    J = (m - 1) * t.max(axis=1) + t.sum(axis=1)
    best = int(np.argmin(J))
    n = np.empty(p, dtype=int)
    n[order] = n_sorted[best].astype(int)
    return [int(x) for x in n]


def build_pipeline(ctx, units, ks, m_est):
    """PipelineDraft for units in this order hosting ks[i] stages each, or None if it cannot fit."""
    tp_groups = []
    for u, k in zip(units, ks):
        t = len(u.ranks) // k
        tp_groups.extend(tuple(u.ranks[i * t:(i + 1) * t]) for i in range(k))
    p = len(tp_groups)
    L = ctx.model.num_layers
    if p > L:
        return None
    stages = [ctx.stage(g, i == 0, i == p - 1, i, p) for i, g in enumerate(tp_groups)]
    xf, xb = [], []
    for i in range(p - 1):
        (tf, gf), (tb, gb) = ctx.boundary(stages[i].ranks, stages[i + 1].ranks)
        xf.append(tf)
        xb.append(tb)
        stages[i + 1].ef += gf
        stages[i].eb += gb
    c = [s.cf + s.cb for s in stages]
    e = [s.ef + s.eb for s in stages]
    n = assign_layers(L, c, e, [s.nmax for s in stages], m_est)
    if n is None:
        return None
    for s, x in zip(stages, n):
        s.layers = x
    return PipelineDraft(stages, xf, xb, units=tuple(units), ks=tuple(ks))


def _objective(draft, m_est):
    f, b = draft.fwd_bwd()
    comm = sum(draft.xf) + sum(draft.xb)
    return (m_est - 1) * max(x + y for x, y in zip(f, b)) + sum(f) + sum(b) + comm


def order_units(ctx, units, tau=TOP_TAU):
    """Top-tau greedy orders of the units: keep the tau partial orders with the smallest sum of
    boundary transfer times, extend each by every unused unit, repeat; returns the final orders.

    Interchangeable units (same key) are tried once per step.
    """
    beam = [((), 0.0)]
    n = len(units)
    for _ in range(n):
        nxt = {}
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


def best_pipeline(ctx, units, m_est, exhaustive=False):
    """The best PipelineDraft for these units (None if nothing fits), fitted for the schedule.

    Heuristic: candidate orders = top-tau orders, their reverses, and units by memory (largest
    first: early stages hold more micro-batches); stage counts chosen per GPU type by coordinate
    descent. Exhaustive: every distinct order x every per-unit stage count.
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
        orders.append(sorted(units, key=lambda u: (-ctx.topo.device_of(u.ranks[0]).memory_bytes,
                                                   -ctx.topo.device_of(u.ranks[0]).flops, u.node)))
    uniq, seen = [], set()
    for o in orders:
        sig = tuple(u.key for u in o)
        if sig not in seen:
            seen.add(sig)
            uniq.append(o)
    best = None
    for n_order, order in enumerate(uniq):
        opts = [unit_options(len(u.ranks), ctx.model) for u in order]
        if exhaustive:
            for ks in itertools.product(*opts):
                d = build_pipeline(ctx, order, ks, m_est)
                if d is not None:
                    obj = _objective(d, m_est)
                    if best is None or obj < best[0]:
                        best = (obj, d)
            continue
        if n_order == 0 or n_order == len(uniq) - 1:     # best top-tau order, memory order
            got = _coordinate_descent(ctx, order, opts, m_est)
        elif best is not None:                           # other orders: the chosen stage counts
            sel = {u.key: k for u, k in zip(best[1].units, best[1].ks)}
            d = build_pipeline(ctx, order, tuple(sel[u.key] for u in order), m_est)
            got = None if d is None else (_objective(d, m_est), d)
        else:
            got = _coordinate_descent(ctx, order, opts, m_est)
        if got is not None and (best is None or got[0] < best[0]):
            best = got
    return None if best is None else best[1].fit()


def _coordinate_descent(ctx, order, opts, m_est):
    """Choose one stage count per unit key (GPU type) by coordinate descent from two starts."""
    keys = sorted({u.key for u in order})
    choices = {k: opts[[u.key for u in order].index(k)] for k in keys}
    best = None
    L = ctx.model.num_layers
    starts = [{k: choices[k][0] for k in keys}]
    # start 2: as many stages as memory may need, without exceeding the layers
    most = {k: choices[k][-1] for k in keys}
    if sum(most[u.key] for u in order) > L:
        most = {k: max([x for x in choices[k]
                        if x * sum(1 for u in order if u.key == k) <= L] or [choices[k][0]])
                for k in keys}
    starts.append(most)
    cache = {}

    def score(sel):
        ks = tuple(sel[u.key] for u in order)
        if ks not in cache:
            d = build_pipeline(ctx, order, ks, m_est)
            cache[ks] = None if d is None else (_objective(d, m_est), d)
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
                    if got is not None and (cur is None or got[0] < cur[0] - 1e-12):
                        sel, cur, improved = trial, got, True
            if not improved:
                break
        if cur is not None and len(order) <= PER_UNIT_REFINE_MAX_UNITS:
            # then per unit: machines of one type may host different stage counts
            ks = list(cur[1].ks)
            for i in [j for _ in range(2) for j in reversed(range(len(order)))]:
                for x in opts[i]:
                    if x == ks[i]:
                        continue
                    trial = tuple(ks[:i] + [x] + ks[i + 1:])
                    if trial not in cache:
                        d = build_pipeline(ctx, order, trial, m_est)
                        cache[trial] = None if d is None else (_objective(d, m_est), d)
                    got = cache[trial]
                    if got is not None and got[0] < cur[0] - 1e-12:
                        cur, ks = got, list(trial)
        if cur is not None and (best is None or cur[0] < best[0]):
            best = cur
    return best


def draft_to_stages(draft, num_layers):
    """Plan `stages` dicts (layers assigned in order, explicit shards) from a PipelineDraft."""
    out, first = [], 0
    for s in draft.stages:
        d = {"ranks": list(s.ranks), "layers": [first, first + s.layers]}
        first += s.layers
        kinds = ["query_groups", "ffn"]
        if d["layers"][0] == 0 or d["layers"][1] == num_layers:
            kinds.append("vocab")
        if len(s.ranks) > 1:
            d["shards"] = {k: list(s.shards[k]) for k in kinds}
        out.append(d)
    return out
