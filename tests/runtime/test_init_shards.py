"""Initial weights drawn per shard: every plan's ranks hold exactly the one-rank model's slices,
and a rank draws only the blocks its pieces overlap.

In-process on the layout's shards (the stage model only supplies tensors of these shapes; the
equivalence tests cover the model path end to end).
"""

import math

import pytest
import torch

from megatron_hexi import model as hexi_model
from megatron_hexi.model import (
    INIT_BLOCK,
    block_seed,
    full_tensor,
    init_blocks,
    initialise_weights,
    take_pieces,
)
from planner.layout import canonical_shards, rank_param_shards
from planner.models import load_model, model_from_dict
from planner.plan import build_plan
from runtime.plans import GLOBAL_BATCH, PLANS, REFERENCE, cpu_cluster

SEED = 1234

# GQA with biases and LayerNorm: fused QKV and [gate; up] biases are cut into pieces too, and
# sizes are not multiples of INIT_BLOCK (QKV 3 groups x 64 rows, FFN 2 x 200 rows, vocab 200).
BIASED = model_from_dict(
    {
        "num_layers": 4,
        "hidden_size": 96,
        "ffn_hidden_size": 200,
        "num_attention_heads": 6,
        "num_query_groups": 3,
        "vocab_size": 200,
        "seq_length": 16,
        "normalization": "LayerNorm",
        "add_bias_linear": True,
        "name": "biased-gqa",
    }
)

EXTRA_PLANS = {
    # Uneven TP=3 shards that start mid-block: FFN 90/70/40, vocabulary 90/70/40, and a TP=2
    # last stage with its own vocabulary cut.
    "biased_gqa_tp3_tp2": (
        BIASED,
        5,
        [
            {
                "micro_batch_size": 1,
                "num_microbatches": 8,
                "stages": [
                    {
                        "ranks": [0, 1, 2],
                        "layers": [0, 2],
                        "shards": {
                            "query_groups": [1, 1, 1],
                            "ffn": [90, 70, 40],
                            "vocab": [90, 70, 40],
                        },
                    },
                    {
                        "ranks": [3, 4],
                        "layers": [2, 4],
                        "shards": {"query_groups": [2, 1], "ffn": [101, 99], "vocab": [7, 193]},
                    },
                ],
            }
        ],
    ),
}


def _model(spec):
    return spec if not isinstance(spec, str) else load_model(spec)


def _plan(spec, world, pipelines):
    return build_plan(cpu_cluster(world), _model(spec), GLOBAL_BATCH, pipelines)


def _initialised(plan, rank, seed=SEED):
    """This rank's parameters after initialise_weights; NaN marks anything left unwritten."""
    params = [(s, torch.full(s.local_shape, math.nan)) for s in rank_param_shards(plan, rank)]
    initialise_weights(plan, params, seed)
    return params


_one_rank = {}


def one_rank_params(spec):
    """{canonical name: tensor} of the one-rank plan of model `spec`."""
    key = _model(spec).name
    if key not in _one_rank:
        plan = _plan(spec, 1, REFERENCE)
        _one_rank[key] = {s.name: p for s, p in _initialised(plan, 0)}
        assert set(_one_rank[key]) == {s.name for s in canonical_shards(plan.model)}
    return _one_rank[key]


ALL_PLANS = {**PLANS, **EXTRA_PLANS}


@pytest.mark.parametrize("name", sorted(ALL_PLANS))
def test_every_rank_holds_the_one_rank_slices(name):
    spec, world, pipelines = ALL_PLANS[name]
    plan = _plan(spec, world, pipelines)
    ref = one_rank_params(spec)
    seen = set()
    for rank in range(world):
        for shard, p in _initialised(plan, rank):
            expected = take_pieces(ref[shard.name], shard)
            assert torch.equal(p, expected), f"rank {rank} {shard.local_name}"
            seen.add(shard.name)
    assert seen == set(ref)  # the plan covers every parameter, so all were compared


def test_one_rank_model_is_the_full_tensors_with_megatron_scales():
    """The reference itself: full_tensor per parameter, N(0, std), output projections scaled by
    1/sqrt(2 x layers), ones and zeros where megatron-core puts them."""
    m = BIASED
    ref = one_rank_params(m)
    blocks = init_blocks(m)
    for s in canonical_shards(m):
        assert torch.equal(ref[s.name], full_tensor(s, SEED, m, blocks)), s.name
        t = ref[s.name]
        if s.init == "ones":
            assert torch.equal(t, torch.ones(s.shape))
        elif s.init == "zeros":
            assert torch.equal(t, torch.zeros(s.shape))
        else:
            std = m.init_method_std / (
                math.sqrt(2 * m.num_layers) if s.init == "scaled_normal" else 1
            )
            assert abs(t.std().item() / std - 1) < 0.05, s.name
            assert abs(t.mean().item()) < 0.05 * std, s.name


def test_blocks_are_independent_and_the_seed_matters():
    """No block repeats another's values (within a tensor, across layers), and another seed gives
    another model; the same seed gives the same one."""
    m = load_model("tiny")
    ref = one_rank_params("tiny")
    fc1 = ref["decoder.layers.0.mlp.linear_fc1.weight"]
    firsts = [fc1[j * INIT_BLOCK, 0].item() for j in range(fc1.shape[0] // INIT_BLOCK)]
    assert len(set(firsts)) == len(firsts)
    assert not torch.equal(
        ref["decoder.layers.0.mlp.linear_fc1.weight"], ref["decoder.layers.1.mlp.linear_fc1.weight"]
    )
    shard = next(s for s in canonical_shards(m) if s.name == "output_layer.weight")
    again = full_tensor(shard, SEED, m)
    assert torch.equal(again, ref[shard.name])
    assert not torch.allclose(full_tensor(shard, SEED + 1, m), again)


def test_block_seeds_are_distinct_for_a_70b_model():
    """torch's CPU generator keeps 32 bits of a seed: every block of a 70B model gets its own."""
    m = load_model("llama2-70b")
    blocks = init_blocks(m)
    total = sum(-(-s.shape[s.dim] // INIT_BLOCK) for s in canonical_shards(m))
    assert max(first for _, first in blocks.values()) < total
    seeds = {block_seed(SEED, k) for k in range(total)}
    assert len(seeds) == total and max(seeds) < 2**32


def test_a_rank_draws_only_the_blocks_its_pieces_overlap(monkeypatch):
    """Rank 3 of an even TP=8 llama2-7b stage: pieces start mid-block (4000 vocabulary rows,
    1376 FFN columns), fused [gate; up] is two pieces. Elements drawn are exactly those of the
    overlapped blocks, at most a block of slack at each end of each piece, about 1/8 of the
    tensor, never the full tensor."""
    drawn = []
    real = hexi_model._draw_block

    def counting(shape, seed32, scale):
        drawn.append(math.prod(shape))
        return real(shape, seed32, scale)

    monkeypatch.setattr(hexi_model, "_draw_block", counting)

    m = load_model("llama2-7b")
    plan = _plan(
        "llama2-7b",
        8,
        [
            {
                "micro_batch_size": 1,
                "num_microbatches": GLOBAL_BATCH,
                "stages": [{"ranks": list(range(8)), "layers": [0, 32]}],
            }
        ],
    )
    wanted = {
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    }
    shards = [s for s in rank_param_shards(plan, 3) if s.name in wanted]
    assert {s.name for s in shards} == wanted
    for shard in shards:
        drawn.clear()
        p = torch.full(shard.local_shape, math.nan)
        initialise_weights(plan, [(shard, p)], SEED)
        assert not p.isnan().any()
        size = shard.shape[shard.dim]
        other = math.prod(shard.shape) // size
        expected = 0
        for piece in shard.pieces:
            lo = piece.global_start // INIT_BLOCK * INIT_BLOCK
            hi = min(-(-(piece.global_start + piece.length) // INIT_BLOCK) * INIT_BLOCK, size)
            assert hi - lo <= piece.length + 2 * (INIT_BLOCK - 1)
            expected += (hi - lo) * other
        assert sum(drawn) == expected, shard.name
        assert max(drawn) <= INIT_BLOCK * other
        assert sum(drawn) <= 1.1 * math.prod(shard.shape) / 8, shard.name
    assert any(p.global_start % INIT_BLOCK for s in shards for p in s.pieces)  # slack exercised
    assert init_blocks(m)["decoder.layers.0.mlp.linear_fc2.weight"][0] > 0
