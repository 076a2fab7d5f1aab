"""The cost model's gradient collectives are exactly the runtime's buckets.

planner.sync_model re-derives, for speed, the rank sets and volumes that planner.layout gives the
runtime (gradient_segments; megatron_hexi.grad_sync buckets segments by Segment.ranks, fp32), and
the distributed optimizer's shares (layout.optimizer_elements). For example plans, searched plans
(tied embeddings, GQA) and hand-made uneven shards, the rank sets and bytes per rank set must be
equal, with and without the distributed optimizer, and so must the shares, even and by memory.
"""

import dataclasses
import glob
import os

import pytest

from planner.cluster import load_cluster_dict
from planner.layout import (
    canonical_shards,
    gradient_segments,
    optimizer_weight,
    plan_optimizer_elements,
    reduced_together,
    segment_numel,
)
from planner.models import load_model
from planner.plan import build_plan, load_plan
from planner.random_clusters import random_cluster
from planner.search import search_plan
from planner.simulator import layouts_of
from planner.sync_model import fast_optimizer_elements, rank_sets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRAD_BYTES = 4  # fp32 gradient buffers, reduced as fp32


def runtime_buckets(plan, distributed_optimizer):
    """{rank set: bytes} of the runtime's collectives: planner.layout's segments and its
    `reduced_together`, which megatron_hexi.grad_sync buckets by."""
    shapes = {s.name: s.shape for s in canonical_shards(plan.model)}
    out = {}
    for seg in gradient_segments(plan):
        if reduced_together(seg, distributed_optimizer):
            out[seg.ranks] = out.get(seg.ranks, 0) + GRAD_BYTES * segment_numel(
                shapes[seg.name], seg
            )
    return out


def predicted_buckets(plan, distributed_optimizer):
    sets = rank_sets(plan.model, layouts_of(plan), distributed_optimizer)
    return {k: GRAD_BYTES * v for k, v in sets.items() if len(k) > 1}


def _cluster(n_nodes=3, per=2):
    return load_cluster_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "a",
                    "gpu": "A100-SXM-80GB",
                    "gpus_per_node": per,
                    "count": n_nodes,
                    "intra_node": "nvlink",
                    "nic": "100 Gbit/s",
                }
            ],
        }
    )


def _uneven_plan(model):
    """Three pipelines of different shapes with uneven, mismatched TP shards."""
    g, f, v = model.num_query_groups, model.ffn_hidden_size, model.vocab_size
    pipes = [
        {
            "micro_batch_size": 1,
            "num_microbatches": 2,
            "stages": [
                {
                    "ranks": [0, 1],
                    "layers": [0, 3],
                    "shards": {
                        "query_groups": [g - 1, 1],
                        "ffn": [f - 56, 56],
                        "vocab": [v - 28, 28],
                    },
                },
                {"ranks": [2], "layers": [3, model.num_layers]},
            ],
        },
        {
            "micro_batch_size": 1,
            "num_microbatches": 1,
            "stages": [
                {
                    "ranks": [3, 4],
                    "layers": [0, 1],
                    "shards": {
                        "query_groups": [1, g - 1],
                        "ffn": [100, f - 100],
                        "vocab": [v - 50, 50],
                    },
                },
                {"ranks": [5], "layers": [1, model.num_layers]},
            ],
        },
        {
            "micro_batch_size": 1,
            "num_microbatches": 1,
            "stages": [
                {
                    "ranks": [6, 7, 8],
                    "layers": [0, model.num_layers],
                    "shards": {
                        "query_groups": [2, 1, g - 3],
                        "ffn": [30, 70, f - 100],
                        "vocab": [10, 20, v - 30],
                    },
                }
            ],
        },
    ]
    return build_plan(_cluster(3, 3), model, 4, pipes)


def _models():
    tiny = load_model("tiny")
    return {
        "tiny": tiny,
        "tiny-tied": load_model("tiny-tied"),
        "tiny-gqa": load_model("tiny-gqa"),
        "layernorm-bias": dataclasses.replace(
            tiny, normalization="LayerNorm", add_bias_linear=True, swiglu=False
        ),
        "gpt-learned-positions": dataclasses.replace(
            tiny,
            normalization="LayerNorm",
            add_bias_linear=True,
            swiglu=False,
            position_embedding_type="learned_absolute",
            max_position_embeddings=2 * tiny.seq_length,
        ),
        "qkv-bias": dataclasses.replace(load_model("tiny-gqa"), add_qkv_bias=True),
    }


def _plans():
    out = [
        (os.path.basename(p), load_plan(p))
        for p in sorted(glob.glob(os.path.join(ROOT, "examples/plans/*.json")))
    ]
    for name, model in _models().items():
        out.append((f"uneven-{name}", _uneven_plan(model)))
        one = build_plan(
            _cluster(1, 2),
            model,
            2,
            [
                {
                    "micro_batch_size": 1,
                    "num_microbatches": 2,
                    "stages": [{"ranks": [0, 1], "layers": [0, model.num_layers]}],
                }
            ],
        )
        out.append((f"one-pipeline-tp2-{name}", one))
    for name in ("tiny", "tiny-tied", "tiny-gqa"):
        for seed in (3, 11):
            plan = search_plan(
                random_cluster(seed, max_gpus=12),
                load_model(name),
                16,
                micro_batch_size=1,
                recompute="off",
            )
            out.append((f"hexi-{name}-{seed}", plan))
    return out


PLANS = _plans()


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_sync_model_rank_sets_equal_runtime_buckets(distributed_optimizer):
    multi = 0
    for name, plan in PLANS:
        want = runtime_buckets(plan, distributed_optimizer)
        got = predicted_buckets(plan, distributed_optimizer)
        assert got == want, name
        multi += len(plan.pipelines) > 1
    assert multi >= 8  # the comparison covers real cross-pipeline syncs


@pytest.mark.parametrize("optimizer_shard", ["even", "memory"])
def test_sync_model_optimizer_shares_equal_layout(optimizer_shard):
    kinds = 0
    for name, plan in PLANS:
        plan = dataclasses.replace(
            plan,
            training=dataclasses.replace(
                plan.training, use_distributed_optimizer=True, optimizer_shard=optimizer_shard
            ),
        )
        want = plan_optimizer_elements(plan)
        gpus = [e.gpu for e in plan.ranks]
        got = fast_optimizer_elements(
            plan.model,
            layouts_of(plan),
            lambda r, gpus=gpus: optimizer_weight(gpus[r], optimizer_shard),
        )
        assert got == want, name
        kinds += len(set(gpus)) > 1
    assert kinds >= 2  # the memory weights differ between holders somewhere
