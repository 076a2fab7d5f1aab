"""The simulator on islands: inner step per island, outer sync by hand, outer memory."""

import math
import re

import pytest

from planner import outer_traffic
from planner.cluster import load_cluster
from planner.islands import OuterSettings
from planner.layout import rank_params, total_params
from planner.models import load_model
from planner.outer_sync import outer_sync
from planner.outer_traffic import outer_bytes_by_fragment, outer_bytes_per_rank, outer_ranges
from planner.plan import build_plan
from planner.simulator import simulate
from planner.topology import Topology

# Island 0: ranks 0-1 (2x A100, TP 2) at site east; island 1: ranks 2 -> 3 (RTX 4090 -> RTX 3090,
# two stages) at site west; 1 Gbit/s, 10 ms between the sites (examples/clusters/two-site-mini).
PIPELINES = [
    {"micro_batch_size": 1, "num_microbatches": 4, "stages": [{"ranks": [0, 1], "layers": [0, 4]}]},
    {"micro_batch_size": 1, "num_microbatches": 4,
     "stages": [{"ranks": [2], "layers": [0, 2]}, {"ranks": [3], "layers": [2, 4]}]},
]  # fmt: skip
SITE_BW, SITE_LAT = 1e9 / 8, 10e-3
# norms (two per layer, hidden 64, four layers) and the final norm: every TP rank holds them
REPLICATED = 2 * 64 * 4 + 64


def _plan(examples_dir, outer=None, islands=((0,), (1,)), **kw):
    cluster = load_cluster(examples_dir / "clusters" / "two-site-mini.yaml")
    return build_plan(cluster, load_model("tiny"), 8, PIPELINES, islands=islands, outer=outer, **kw)


def representative_elements(plan, island):
    """{rank: elements it represents per fragment} of one island's ranks (planner.outer_traffic)."""
    out = {}
    for r in outer_ranges(plan):
        rep = r.representatives[island]
        out.setdefault(rep, [0] * plan.training.outer.fragments)[r.fragment] += r.numel
    return out


def test_representatives_send_each_range_once(examples_dir):
    plan = _plan(examples_dir, OuterSettings(10))
    p = total_params(plan.model)
    r0 = representative_elements(plan, 0)
    # TP 2: rank 0 sends the replicated norms once, the sharded rest is cut in halves
    assert r0 == {0: [(p - REPLICATED) // 2 + REPLICATED], 1: [(p - REPLICATED) // 2]}
    r1 = representative_elements(_plan(examples_dir, OuterSettings(10, fragments=2)), 1)
    assert r1 == {2: [rank_params(plan, 2), 0], 3: [0, rank_params(plan, 3)]}
    assert sum(r1[2]) + sum(r1[3]) == p


def test_outer_sync_by_hand_fp32(examples_dir):
    h = 10
    plan = _plan(examples_dir, OuterSettings(h))
    est = simulate(plan)
    p = total_params(plan.model)
    # ring all-reduce of fp32 over two islands: each representative sends 4 bytes per element;
    # each direction of the site link carries one island's 4 P bytes, 2 latency hops
    exchange = 4 * p / SITE_BW + 2 * SITE_LAT
    assert est.outer_sync_time_s == pytest.approx(exchange / h, rel=1e-12)
    assert est.cross_site_bytes_per_step == pytest.approx(2 * 4 * p / h, rel=1e-12)
    assert est.iteration_time_s == pytest.approx(est.inner_step_time_s + exchange / h)
    assert est.tokens_per_s == pytest.approx(8 * plan.model.seq_length / est.iteration_time_s)
    # islands of one pipeline each: no gradient sync inside them, none across them
    assert est.grad_sync_time_s == 0.0
    assert est.inner_step_time_s >= max(est.pipeline_time_s)
    sync = simulate(_plan(examples_dir, None, islands=()))
    assert sync.grad_sync_time_s > 0.1  # the synchronous plan all-reduces over the site link
    assert sync.inner_step_time_s is None and "outer_sync_time_s" not in sync.to_dict()
    d = est.to_dict()
    assert d["outer_sync_time_s"] == est.outer_sync_time_s
    assert d["cross_site_bytes_per_step"] == est.cross_site_bytes_per_step


def test_outer_sync_by_hand_int8_fragments(examples_dir):
    h, f = 4, 2
    plan = _plan(examples_dir, OuterSettings(h, compression="int8", fragments=f))
    topo = Topology(plan.cluster)

    def int8(e):  # one island's payload of one range, sent to the one other island
        return e + 4 * math.ceil(e / 256)

    sent = {}  # (rank, fragment) -> bytes: one int8 buffer per range, as the runtime sends
    for r in outer_ranges(plan):
        for rep in r.representatives:
            sent[rep, r.fragment] = sent.get((rep, r.fragment), 0) + int8(r.numel)
    frag_bytes = [sum(b for (_, k), b in sent.items() if k == fk) for fk in range(f)]
    assert plan.model.num_layers == 4  # fragment 0: embedding + layers 0-1; 1: the rest
    island_bytes = [
        [sum(sent.get((r, k), 0) for r in (0, 1)), sum(sent.get((r, k), 0) for r in (2, 3))]
        for k in range(f)
    ]
    times = [max(b) / SITE_BW + SITE_LAT for b in island_bytes]  # all-gather: 1 hop
    for window in (0.0, 0.5 * min(times), 10.0):
        got = outer_sync(plan, topo, [window, window + 1])
        assert got.fragment_bytes == tuple(frag_bytes)
        assert got.fragment_times == pytest.approx(times, rel=1e-12)
        # fragments sync after different steps (offsets 0 and 2): each hides in one window
        exposed = sum(max(0.0, t - window) for t in times) / h
        assert got.time_per_step == pytest.approx(exposed, rel=1e-12, abs=1e-15)
        assert got.bytes_per_step == pytest.approx(sum(frag_bytes) / h)


def test_broken_byte_count_is_caught(examples_dir, monkeypatch):
    """Counting int8 as fp32 (a wrong outer_bytes_sent) must break the hand comparison."""
    plan = _plan(examples_dir, OuterSettings(4, compression="int8"))
    good = outer_sync(plan, Topology(plan.cluster), [0.0, 0.0])
    monkeypatch.setattr(outer_traffic, "outer_bytes_sent", lambda e, k, c: 2 * (k - 1) * 4 * e // k)
    bad = outer_sync(plan, Topology(plan.cluster), [0.0, 0.0])
    assert bad.fragment_bytes[0] > 3 * good.fragment_bytes[0]


@pytest.mark.parametrize(
    "outer, dist",
    [
        (OuterSettings(10), False),
        (OuterSettings(4, compression="int8", fragments=2), False),
        (OuterSettings(6, compression="bf16", fragments=3), False),
        (OuterSettings(10), True),
        (OuterSettings(4, compression="int8", fragments=2), True),
    ],
)
def test_simulated_bytes_are_the_runtimes(examples_dir, outer, dist):
    """The simulator's cross-site bytes are planner.outer_traffic's, which the runtime's metric
    is checked against: per fragment, and per step (both islands' next island is on the other
    site, so every byte crosses a site link)."""
    plan = _plan(examples_dir, outer, use_distributed_optimizer=dist)
    sent = outer_bytes_by_fragment(plan)
    got = outer_sync(plan, Topology(plan.cluster), [0.0, 0.0])
    assert got.fragment_bytes == tuple(sum(row[f] for row in sent) for f in range(outer.fragments))
    est = simulate(plan)
    assert est.cross_site_bytes_per_step == sum(outer_bytes_per_rank(plan)) / outer.interval
    if dist:  # representatives are the masters' owners: every rank of an island sends
        assert all(sum(row) > 0 for row in sent)


def test_outer_state_memory(examples_dir):
    plain = simulate(_plan(examples_dir, None, islands=()))
    est = simulate(_plan(examples_dir, OuterSettings(10)))
    plan = _plan(examples_dir, OuterSettings(10))
    for r in range(4):
        outer = 8 * rank_params(plan, r) / 1e9  # fp32 theta_outer + fp32 momentum
        assert est.memory_terms_gb[r]["outer"] == pytest.approx(outer)
        assert est.peak_memory_gb[r] == pytest.approx(plain.peak_memory_gb[r] + outer)
    dist = simulate(_plan(examples_dir, OuterSettings(10), use_distributed_optimizer=True))
    # sharded like the optimizer state: each island keeps one copy of every element
    total = sum(t["outer"] for t in dist.memory_terms_gb)
    assert total == pytest.approx(2 * 8 * total_params(plan.model) / 1e9)
    assert dist.memory_terms_gb[0]["outer"] < est.memory_terms_gb[0]["outer"]


def test_bottleneck_names_the_plans_pipeline(examples_dir):
    """An island simulated alone numbers its pipelines from 0; the text says the plan's."""
    plan = _plan(examples_dir, OuterSettings(10), islands=((1,), (0,)))
    text = simulate(plan).bottleneck
    m = re.match(r"island (\d) of 2: [a-z-]+: pipeline (\d) stage", text)
    assert m is not None, text
    assert plan.islands[int(m[1])] == (int(m[2]),)
