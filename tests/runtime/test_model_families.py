"""The model features other families need train exactly under uneven shards: GPT-style layers
(LayerNorm, GELU, linear biases, learned absolute position embeddings with a table longer than
the sequence), q/k/v-only biases (Qwen2) and Llama 3.x's RoPE frequency scaling.

Each model trains under an uneven TP-2 stage before a TP-1 stage beside a one-stage pipeline,
with and without sequence parallelism, and must match its one-rank plan within 1e-5. The
position table is the one replicated tensor used before sequence parallelism splits the
sequence; counting its gradient once per TP rank (as norms are counted) is caught.
"""

import dataclasses

import pytest

from harness import run_distributed
from planner.models import load_model
from runtime.plans import PLANS, REFERENCE, write_plan
from runtime.workers import max_relative_difference, train_each

TOLERANCE = 1e-5
BIAS_SCALE = 1e-2
_TINY = load_model("tiny")
MODELS = {
    "gpt-style": dataclasses.replace(
        _TINY,
        normalization="LayerNorm",
        swiglu=False,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        max_position_embeddings=2 * _TINY.seq_length,
    ),
    "qkv-bias": dataclasses.replace(_TINY, add_qkv_bias=True),
    "llama3-rope": dataclasses.replace(
        _TINY, rope_scaling=True, rope_scaling_factor=8.0, rotary_base=500000
    ),
}
PLAN = "two_pipelines_uneven_tp2"


def _difference(result, ref):
    """(largest relative difference, what it is) over losses, grad norms and parameters."""
    assert result["params"].keys() == ref["params"].keys()
    pairs = [(f"loss {i}", a, b) for i, (a, b) in enumerate(zip(result["losses"], ref["losses"]))]
    pairs += [
        (f"grad norm {i}", a, b)
        for i, (a, b) in enumerate(zip(result["grad_norms"], ref["grad_norms"]))
    ]
    out = max((max_relative_difference(a, b), what) for what, a, b in pairs)
    for k, b in ref["params"].items():
        # Biases start at zero and move by about lr per step (largest entries ~3e-3 here), so
        # fp32 summation-order noise is measured against the weights' scale (init std 0.02).
        scale = max(b.abs().max().item(), BIAS_SCALE)
        out = max(out, ((result["params"][k] - b).abs().max().item() / scale, k))
    return out


def _runs(tmp_path, world, pipelines, sequence_parallel):
    out = []
    for name, model in MODELS.items():
        for sp in sequence_parallel:
            tag = f"{name}-{'sp' if sp else 'plain'}-{world}"
            training = {"sequence_parallel": True} if sp else {}
            out.append((write_plan(tmp_path, tag, model, world, pipelines, **training), []))
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    runs = _runs(tmp_path_factory.mktemp("ref"), 1, REFERENCE, [False])
    return dict(zip(MODELS, run_distributed(train_each, 1, runs, timeout=400)[0]))


def test_families_match_one_rank_under_uneven_shards(references, tmp_path):
    _, world, pipelines = PLANS[PLAN]
    runs = _runs(tmp_path, world, pipelines, [False, True])
    results = run_distributed(train_each, world, runs, timeout=600)[0]
    names = [(n, sp) for n in MODELS for sp in ("plain", "sp")]
    for (name, variant), result in zip(names, results):
        diff, where = _difference(result, references[name])
        print(f"{name} {variant}: max relative difference {diff:.2e} ({where})")
        assert diff < TOLERANCE, (name, variant, diff, where)
        ref = references[name]
        assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3  # training moved the weights
    sp_runs = [r for (_, v), r in zip(names, results) if v == "sp"]
    assert all(any(r["sequence_parallel"].values()) for r in sp_runs)


def _train_with_position_table_summed_per_tp_rank(runs):
    """`train_each` with the position table's gradient counted on every TP rank under sequence
    parallelism, as a norm's partial gradient is: the mistake `whole_sequence` prevents."""
    import planner.layout as layout

    real = layout.param_shards

    def broken(m, v):
        return [dataclasses.replace(s, whole_sequence=False) for s in real(m, v)]

    layout.param_shards = broken
    return train_each(runs)


def test_position_table_counted_per_tp_rank_is_caught(references, tmp_path):
    _, world, pipelines = PLANS[PLAN]
    model = MODELS["gpt-style"]
    path = write_plan(tmp_path, "broken", model, world, pipelines, sequence_parallel=True)
    result = run_distributed(
        _train_with_position_table_summed_per_tp_rank, world, [(path, [])], timeout=400
    )[0][0]
    diff, where = _difference(result, references["gpt-style"])
    print(f"position table summed per TP rank: max relative difference {diff:.2e} ({where})")
    assert diff > 100 * TOLERANCE
