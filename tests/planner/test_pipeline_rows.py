"""A pipeline's stage rows, as the search builds them from its caches (per chunk blocks, stages
shared between contexts that differ only in links between machines or in the optimizer share),
equal the rows computed stage by stage from the cost model with no cache shared: every float to
the bit.

The reference below asks `boundary_times` and a fresh context's `stage` for each TP group, in
pipeline order: boundary all-gathers go to the receiving stage's forward extra and the sending
stage's backward extra."""

import pytest

from conftest import REPO
from planner.cluster import load_cluster
from planner.models import load_model
from planner.neighbours import scaled_links
from planner.search_partition import make_chunks
from planner.search_pipeline import Context, _build_rows
from planner.topology import Topology, boundary_times

MODEL = load_model("llama2-7b")
CLUSTER = load_cluster(str(REPO / "examples" / "clusters" / "paper-hetero-b.yaml"))


def fresh(topo, fraction=1.0, sequence_parallel=False, **shared):
    return Context(MODEL, topo, 1, False, fraction, {}, "auto", sequence_parallel, **shared)


def reference_rows(ctx, chunks, ks):
    """(cf, cb, ef, eb, nmax, xf, xb) stage by stage, from an uncached context's costs."""
    groups = []
    for ch, k in zip(chunks, ks):
        t = len(ch.ranks) // k
        groups += [ch.ranks[j * t : (j + 1) * t] for j in range(k)]
    p = len(groups)
    stages = [ctx.stage(g, i == 0, i == p - 1, i, p) for i, g in enumerate(groups)]
    cf, cb = [s.cf for s in stages], [s.cb for s in stages]
    ef, eb, nmax = [s.ef for s in stages], [s.eb for s in stages], [s.nmax for s in stages]
    xf, xb = [], []
    for i in range(1, p):
        (tf, gf), (tb, gb) = boundary_times(
            MODEL, ctx.mbs, groups[i - 1], groups[i], ctx.topo, ctx.sequence_parallel
        )
        xf.append(tf)
        xb.append(tb)
        ef[i] += gf
        eb[i - 1] += gb
    return cf, cb, ef, eb, nmax, xf, xb


def rows_of(ctx, chunks, ks):
    r = _build_rows(ctx, chunks, ks)
    return r.cf, r.cb, r.ef, r.eb, r.nmax, r.xf, r.xb


def pipelines():
    """Chunk orders and stage counts: machines whole and split 2 and 4 ways, one stage per chunk,
    every GPU a stage, and a mix; two chunks of one machine next to each other and apart; each
    order also reversed. One context serves them all, so blocks cached for one serve the next."""
    topo = Topology(CLUSTER)
    out = []
    for level in (1, 2, 4):
        chunks = make_chunks(topo, level, False)
        orders = [chunks[:: max(1, len(chunks) // 5)][:5]]  # five machines
        if level > 1:  # machine 0's first two chunks together, then apart
            orders += [chunks[:4], [chunks[0], chunks[2], chunks[1], chunks[3]]]
        for n, order in enumerate(orders):
            sizes = [len(ch.ranks) for ch in order]
            mixed = [sz if i % 2 else 1 for i, sz in enumerate(sizes)]
            for counts in ([1] * len(order), sizes, mixed):
                for way, o, k in (("", order, counts), ("reversed", order[::-1], counts[::-1])):
                    name = f"level{level}-order{n}{way}-{'-'.join(map(str, k))}"
                    out.append((name, o, tuple(k)))
    return out


CASES = pipelines()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["sp_off", "sp_on"])
def test_rows_equal_stage_by_stage(sequence_parallel):
    topo = Topology(CLUSTER)
    ctx = fresh(topo, sequence_parallel=sequence_parallel)
    for name, chunks, ks in CASES:
        want = reference_rows(fresh(topo, sequence_parallel=sequence_parallel), chunks, ks)
        assert rows_of(ctx, chunks, ks) == want, name


def test_shared_stages_and_times_change_no_row():
    """A context at other link speeds that shares the file's stages, and a context with another
    optimizer share that shares its times, give the rows of contexts that share nothing."""
    topo = Topology(CLUSTER)
    fast = Topology(scaled_links(CLUSTER, 4.0))
    base = fresh(topo)
    at_speed = fresh(fast, stages=base)
    sharded = fresh(topo, 0.25, timings=base)
    for _, chunks, ks in CASES:
        rows_of(base, chunks, ks)  # fills the shared caches first
    for name, chunks, ks in CASES:
        assert rows_of(at_speed, chunks, ks) == reference_rows(fresh(fast), chunks, ks), name
        assert rows_of(sharded, chunks, ks) == reference_rows(fresh(topo, 0.25), chunks, ks), name


def test_the_comparison_catches_a_boundary_left_out(monkeypatch):
    """The rows with the all-gathers of the boundaries between chunks dropped: the check above
    would fail."""
    import planner.search_pipeline as sp

    topo = Topology(CLUSTER)
    name, chunks, ks = next(c for c in CASES if c[0].startswith("level1-"))
    ctx = fresh(topo, sequence_parallel=False)
    want = reference_rows(fresh(topo), chunks, ks)
    real = sp.Context.chunk_boundary

    def no_gather(self, ua, a, ub, b):
        (tf, _), (tb, _) = real(self, ua, a, ub, b)
        return (tf, 0.0), (tb, 0.0)

    monkeypatch.setattr(sp.Context, "chunk_boundary", no_gather)
    assert rows_of(ctx, chunks, ks) != want
