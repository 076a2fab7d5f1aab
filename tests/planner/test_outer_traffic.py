"""planner.outer_traffic: the canonical ranges an outer step moves, who represents each island,
and the bytes each rank sends (the runtime's metric is checked against this in
tests/runtime/test_islands.py)."""

import math

from planner.islands import OuterSettings, outer_bytes_sent, payload_bytes
from planner.layout import canonical_shards, total_params
from planner.models import load_model
from planner.outer_traffic import fragment_of, outer_bytes_per_rank, outer_ranges
from planner.plan import build_plan
from runtime.plans import ISLAND_PIPELINES, ISLANDS, PLANS, cpu_cluster


def _plan(outer, islands=ISLANDS, pipelines=ISLAND_PIPELINES, world=6):
    return build_plan(
        cpu_cluster(world), load_model("tiny"), 8, pipelines, islands=islands, outer=outer
    )


def test_ranges_cover_the_model_once_with_one_representative_per_island():
    plan = _plan(OuterSettings(4))
    ranges = outer_ranges(plan)
    shapes = {s.name: s.shape for s in canonical_shards(plan.model)}
    # every canonical element in exactly one range
    assert sum(r.numel for r in ranges) == total_params(plan.model)
    for name, shape in shapes.items():
        mine = sorted(
            (r.segment.start, r.segment.end, r.segment.dim)
            for r in ranges
            if r.segment.name == name
        )
        assert mine[0][0] == 0 and mine[-1][1] == shape[mine[0][2]]
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
    first = {0: plan.pipelines[0].ranks, 1: plan.pipelines[2].ranks}
    for r in ranges:
        for island, rep in enumerate(r.representatives):
            assert rep in r.holders[island] and rep in first[island]  # lowest pipeline's
            assert rep == min(h for h in r.holders[island] if h in first[island])


def test_bytes_per_rank_sum_the_formula_over_represented_ranges():
    for compression in ("none", "bf16", "int8"):
        plan = _plan(OuterSettings(4, compression=compression))
        sent = outer_bytes_per_rank(plan)
        ranges = outer_ranges(plan)
        assert sum(sent) == sum(2 * outer_bytes_sent(r.numel, 2, compression) for r in ranges)
        assert sent[3] == 0  # pipeline 1 is not its island's lowest pipeline
    # two islands, fp32: each representative sends each of its elements once, 4 bytes
    plan = _plan(OuterSettings(4))
    assert sum(outer_bytes_per_rank(plan)) == 2 * 4 * total_params(plan.model)
    int8 = _plan(OuterSettings(4, compression="int8"))
    blocks = sum(math.ceil(r.numel / 256) for r in outer_ranges(int8))
    assert sum(outer_bytes_per_rank(int8)) == 2 * (total_params(plan.model) + 4 * blocks)
    assert payload_bytes(256, "int8") == 260


def test_no_outer_or_one_island_sends_nothing():
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    plan = build_plan(cpu_cluster(world), load_model(model), 8, pipelines)
    assert outer_bytes_per_rank(plan) == [0] * world
    one = build_plan(cpu_cluster(world), load_model(model), 8, pipelines, outer=OuterSettings(2))
    assert outer_bytes_per_rank(one) == [0] * world


def test_fragments_follow_layers():
    assert fragment_of("embedding.word_embeddings.weight", 4, 2) == 0
    assert fragment_of("decoder.layers.1.mlp.linear_fc1.weight", 4, 2) == 0
    assert fragment_of("decoder.layers.2.mlp.linear_fc1.weight", 4, 2) == 1
    assert fragment_of("decoder.final_layernorm.weight", 4, 2) == 1
    assert fragment_of("output_layer.weight", 4, 2) == 1
    plan = _plan(OuterSettings(4, fragments=2))
    assert {r.fragment for r in outer_ranges(plan)} == {0, 1}
