"""Overlapped gradient sync (`overlap_grad_reduce`) and parameter gather (`overlap_param_gather`)
learn exactly what the one-rank plan learns.

Each launch trains one equivalence plan three times in the same processes: overlapped gradient
sync alone, with the distributed optimizer, and with the distributed optimizer and overlapped
parameter gather; one of the three also cuts buckets small enough (`--ddp-bucket-size`) that
parameters span several buckets. Every run must start all its buckets during the backward pass
(else nothing overlapped) and match the one-rank plan to 1e-5.
"""

import pytest

from harness import run_distributed
from runtime.equivalence import TOLERANCE, compare, reference
from runtime.plans import PLANS, write_plan
from runtime.workers import train_each

# Smaller than every weight matrix of the test models (hidden 64): each is cut over several
# buckets, and small tensors (norms) share one.
SMALL_BUCKET = ["--ddp-bucket-size", "1000"]

VARIANTS = {
    "overlap": {"overlap_grad_reduce": True},
    "overlap+distopt": {"overlap_grad_reduce": True, "use_distributed_optimizer": True},
    "overlap+distopt+param_gather": {
        "overlap_grad_reduce": True,
        "use_distributed_optimizer": True,
        "optimizer_shard": "memory",
        "overlap_param_gather": True,
    },
}
# Which variant of each plan runs with small buckets (each variant gets it on some plan).
SMALL_BUCKETS_FOR = {
    "two_pipelines_uneven_tp2": "overlap",
    "tp_1_2_3_gqa": "overlap+distopt",
    "single_beside_three_stages": "overlap+distopt+param_gather",
    "tied_embeddings_across_tp": "overlap",
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_overlap_matches_one_rank(name, tmp_path, tmp_path_factory):
    model, world, pipelines = PLANS[name]
    ref = reference(tmp_path_factory, model)
    runs = [
        (
            write_plan(tmp_path, f"{name}-{i}", model, world, pipelines, **training),
            SMALL_BUCKET if SMALL_BUCKETS_FOR[name] == variant else [],
        )
        for i, (variant, training) in enumerate(VARIANTS.items())
    ]
    results = run_distributed(train_each, world, runs, timeout=600)[0]
    for variant, (_, flags), result in zip(VARIANTS, runs, results):
        loss, norm, param = compare(result, ref)
        print(
            f"{name} {variant}{' ' + ' '.join(flags) if flags else ''}: max relative "
            f"difference loss {loss:.2e}, grad norm {norm:.2e}, parameters {param:.2e}; "
            f"buckets per rank {result['buckets']}, exposed sync (ms) "
            f"{[round(s * 1e3, 2) for s in result['grad_sync_exposed_s']]}"
        )
        assert loss < TOLERANCE and norm < TOLERANCE and param < TOLERANCE, variant
        # Every bucket started during the backward: the sync overlapped.
        assert result["started_in_backward"] == result["buckets"], variant
        if flags:  # the small bound cut the parameters over many buckets
            assert max(result["buckets"].values()) > 20, result["buckets"]
        assert all(s >= 0 for s in result["grad_sync_exposed_s"])


# Three pipelines cut at different layers, so the rank sets of consecutive layers cross:
# layers 0 {0, 2, 4}, 1 {1, 2, 4}, 2 {1, 2, 5}, 3 {1, 3, 5}. Rank 2 meets rank 4 and rank 5
# in opposite orders of layers from rank 1's, and small buckets make hundreds of collectives.
CROSSING = [
    {
        "micro_batch_size": 1,
        "num_microbatches": 3,
        "stages": [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [1, 4]}],
    },
    {
        "micro_batch_size": 1,
        "num_microbatches": 3,
        "stages": [{"ranks": [2], "layers": [0, 3]}, {"ranks": [3], "layers": [3, 4]}],
    },
    {
        "micro_batch_size": 2,
        "num_microbatches": 1,
        "stages": [{"ranks": [4], "layers": [0, 2]}, {"ranks": [5], "layers": [2, 4]}],
    },
]


def test_crossing_rank_sets_issue_one_global_order(tmp_path, tmp_path_factory):
    """Overlapping rank sets whose collectives cross, with buckets of a few rows each: the run
    finishes (under the harness timeout), matches one rank, and the buckets every rank starts
    form one global order: each bucket is the same on all its holders, and the ranks' start
    orders together have no cycle (a cycle is what deadlocks NCCL, even where gloo copes)."""

    from runtime.workers import train_listing_buckets

    ref = reference(tmp_path_factory, "tiny")
    path = write_plan(tmp_path, "crossing", "tiny", 6, CROSSING, overlap_grad_reduce=True)
    result = run_distributed(
        train_listing_buckets, 6, path, extra_flags=["--ddp-bucket-size", "500"], timeout=400
    )[0]
    loss, norm, param = compare(result, ref)
    order = result["bucket_order"]
    print(
        f"crossing rank sets: max relative difference loss {loss:.2e}, grad norm {norm:.2e}, "
        f"parameters {param:.2e}; buckets per rank { {r: len(b) for r, b in order.items()} }"
    )
    assert loss < TOLERANCE and norm < TOLERANCE and param < TOLERANCE
    assert result["started_in_backward"] == {r: len(b) for r, b in order.items()}
    assert order_problems(order) == []
    shared = {b for buckets in order.values() for b in buckets if len(b[0]) > 1}
    assert len({ranks for ranks, _ in shared}) >= 4  # the crossing rank sets are there
    assert len(shared) > 100


def order_problems(order):
    """What keeps the ranks' bucket start orders ({plan rank: [(rank set, slices)]}) from being
    one global order: a bucket that differs between its holders, or a cycle among the orders."""
    import networkx as nx

    holders, graph = {}, nx.DiGraph()
    for rank, buckets in order.items():
        shared = [b for b in buckets if len(b[0]) > 1]
        for bucket in shared:
            holders.setdefault(bucket, set()).add(rank)
        graph.add_nodes_from(shared)
        graph.add_edges_from(zip(shared, shared[1:]))
    problems = [
        f"bucket over {bucket[0]} is held by {sorted(ranks)} only"
        for bucket, ranks in holders.items()
        if ranks != set(bucket[0])
    ]
    if not nx.is_directed_acyclic_graph(graph):
        problems.append(f"the start orders form a cycle: {nx.find_cycle(graph)[:3]} ...")
    return problems


def bucket_orders(plan, bucket_size, overlap=True):
    """Every rank's buckets as GradientSync builds them from the plan (in one process: no
    process groups; the order does not depend on them)."""
    from types import SimpleNamespace

    import torch

    from megatron_hexi.grad_sync import GradientSync
    from planner.layout import gradient_segments, rank_param_shards

    segments = gradient_segments(plan)
    groups = SimpleNamespace(launch_of=list(range(plan.world_size)), segment_groups={}, island=None)
    order = {}
    for rank in range(plan.world_size):
        params = [
            (shard, torch.nn.Parameter(torch.zeros(shard.local_shape)))
            for shard in rank_param_shards(plan, rank)
        ]
        sync = GradientSync(
            rank, params, segments, groups, overlap=overlap, bucket_size=bucket_size
        )
        order[rank] = [
            (b.ranks, tuple((s.name, s.dim, s.global_start, s.length) for s in b.slots))
            for b in sync.buckets
        ]
    return order


@pytest.mark.parametrize("bucket_size", [None, 64, 500, 5000])
def test_bucket_orders_are_one_global_order(bucket_size, tmp_path):
    """On every equivalence plan and the crossing one, at several bucket bounds (None: one
    bucket per rank set), each rank's buckets hold exactly its share of the segments, respect
    the bound (a single row may exceed it) and, over all ranks, form one global order."""
    import math

    from planner.layout import canonical_shards, gradient_segments
    from planner.plan import load_plan

    for name, (model, world, pipelines) in {**PLANS, "crossing": ("tiny", 6, CROSSING)}.items():
        plan = load_plan(write_plan(tmp_path, name, model, world, pipelines))
        order = bucket_orders(plan, bucket_size)
        assert order_problems(order) == [], name
        row = {s.name: math.prod(s.shape) // s.shape[s.dim] for s in canonical_shards(plan.model)}
        for rank, buckets in order.items():
            held = sum(
                (seg.end - seg.start) * row[seg.name]
                for seg in gradient_segments(plan)
                if rank in seg.ranks
            )
            sizes = [sum(n * row[name] for name, _, _, n in slices) for _, slices in buckets]
            assert sum(sizes) == held, (name, rank)
            if bucket_size is not None:
                widest = max(row[name] for _, slices in buckets for name, _, _, _ in slices)
                assert max(sizes) <= max(bucket_size, widest), (name, rank)


def test_broken_order_is_caught(tmp_path):
    """The order check fails when one rank starts its buckets in another order, or holds a
    bucket its peers cut differently."""
    from planner.plan import load_plan

    plan = load_plan(write_plan(tmp_path, "crossing", "tiny", 6, CROSSING))
    order = bucket_orders(plan, 500)
    reversed_on_2 = {**order, 2: list(reversed(order[2]))}
    assert any("cycle" in p for p in order_problems(reversed_on_2))
    other_cut = {**order, 2: bucket_orders(plan, 400)[2]}
    assert any("held by" in p for p in order_problems(other_cut))


@pytest.mark.parametrize("overlapped", [False, True])
def test_iteration_line_shows_the_exposed_sync(overlapped, tmp_path):
    """With overlap on, Megatron's iteration line carries the mean exposed gradient sync of the
    interval; with it off the line is Megatron's as before."""
    from megatron_hexi.training import IntervalLog
    from planner.plan import load_plan

    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    plan = load_plan(
        write_plan(tmp_path, "p", model, world, pipelines, overlap_grad_reduce=overlapped)
    )
    log = IntervalLog(plan, 10, 1e9, False)
    for it, exposed in ((1, 0.010), (2, 0.015)):
        log.add(
            {
                "iteration": it,
                "step_time_s": 0.5,
                "tokens_per_s": 512.0,
                "mfu": 0.1,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "success": True,
                "lm_loss": 4.0,
                "grad_sync_exposed_s": exposed,
            }
        )
    line = log.line()
    assert ("| grad sync exposed (ms): 12.5 |" in line) == overlapped, line


@pytest.mark.parametrize("bucket_size", [512, 4096])
def test_planner_costs_the_runtime_buckets(bucket_size, tmp_path):
    """The overlap model's buckets (planner.sync_model.buckets over `collectives`) are the
    runtime's: per rank set, the same number of collectives of the same sizes (bounds that
    whole rows of every tensor fill exactly, as the planner cuts at any element)."""
    import math

    from planner.layout import canonical_shards
    from planner.plan import load_plan
    from planner.simulator import layouts_of
    from planner.sync_model import buckets, collectives

    compared = 0
    for name, (model, world, pipelines) in {**PLANS, "crossing": ("tiny", 6, CROSSING)}.items():
        plan = load_plan(write_plan(tmp_path, name, model, world, pipelines))
        row = {s.name: math.prod(s.shape) // s.shape[s.dim] for s in canonical_shards(plan.model)}
        runtime = {}
        for bucket_ranks, slices in (
            b for held in bucket_orders(plan, bucket_size).values() for b in held
        ):
            if len(bucket_ranks) > 1:  # each holder lists it: keyed by its slices, once
                runtime.setdefault(bucket_ranks, {})[slices] = sum(
                    n * row[s] for s, _, _, n in slices
                )
        sets = collectives(plan.model, layouts_of(plan))
        for ranks, layers in sets.items():
            if len(ranks) < 2:
                continue
            want = sorted(runtime[ranks].values())
            got = sorted(
                size
                for _, k, e, last in buckets(layers, bucket_size)
                for size in [e] * (k - 1) + [last]
            )
            assert got == want, (name, ranks)
            compared += len(want)
        assert set(runtime) == {k for k in sets if len(k) > 1}
    assert compared > 100
