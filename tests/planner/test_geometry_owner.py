"""planner.layout owns parameter geometry: everything else agrees with it.

- Its closed-form parameter counts equal the sum over `param_shards` for many model shapes
  (LayerNorm with biases, GQA, tied and untied embeddings, other head sizes) and layouts
  (uneven shards, first, middle, last and single stages).
- The simulator's per-rank weight and optimizer-state bytes equal what the runtime allocates:
  its parameters are `rank_param_shards`, and with the distributed optimizer it owns, per
  GradientSync bucket, `weighted_split` of every slot by `optimizer_weight`
  (megatron_hexi.grad_sync / distributed_optimizer, re-traced here with the same pure
  functions, since those modules need torch).
- The search's memory limit per stage is `rank_memory`'s; the splits keep their documented
  rounding; planner imports form a tree.
"""

import ast
import dataclasses
import glob
import math
import os
import random

import pytest

from planner import layout, splits
from planner.cluster import load_cluster_dict
from planner.memory import RankShape, layers_that_fit, rank_memory
from planner.models import load_model
from planner.plan import build_plan, load_plan, plan_from_dict
from planner.simulator import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEIGHT_BYTES, OPTIMIZER_BYTES = 2, 12  # bf16 weight; fp32 master + two Adam moments


def _models():
    tiny = load_model("tiny")
    layernorm = dataclasses.replace(
        tiny, normalization="LayerNorm", add_bias_linear=True, swiglu=False
    )
    return {
        "tiny": tiny,
        "tiny-gqa": load_model("tiny-gqa"),
        "tiny-tied": load_model("tiny-tied"),
        "layernorm-bias": layernorm,
        "layernorm-bias-swiglu-tied": dataclasses.replace(
            layernorm, swiglu=True, untie_embeddings_and_output_weights=False
        ),
        "gqa-layernorm-bias-tied": dataclasses.replace(
            load_model("tiny-gqa"),
            normalization="LayerNorm",
            add_bias_linear=True,
            untie_embeddings_and_output_weights=False,
        ),
        "head-dim-24": dataclasses.replace(tiny, kv_channels=24),
        "gpt-learned-positions": dataclasses.replace(
            layernorm, position_embedding_type="learned_absolute", max_position_embeddings=300
        ),
        "qkv-bias": dataclasses.replace(load_model("tiny-gqa"), add_qkv_bias=True),
    }


MODELS = _models()


def _cluster(gpus, kinds=("A100-SXM-80GB",)):
    return load_cluster_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": f"n{i}",
                    "gpu": kind,
                    "gpus_per_node": gpus,
                    "intra_node": "nvlink",
                    "nic": "100 Gbit/s",
                }
                for i, kind in enumerate(kinds)
            ],
        }
    )


def _pipelines(m):
    """Three pipelines: one stage of the whole model; three stages with uneven TP shards (an
    embedding stage of TP 2, a middle stage, a TP-3 last stage); two even TP-2 stages."""
    g, f, v, L = m.num_query_groups, m.ffn_hidden_size, m.vocab_size, m.num_layers
    return [
        {
            "micro_batch_size": 1,
            "num_microbatches": 2,
            "stages": [{"ranks": [0], "layers": [0, L]}],
        },
        {
            "micro_batch_size": 1,
            "num_microbatches": 1,
            "stages": [
                {
                    "ranks": [1, 2],
                    "layers": [0, 1],
                    "shards": {
                        "query_groups": [g - 1, 1],
                        "ffn": [f - 56, 56],
                        "vocab": [v - 28, 28],
                    },
                },
                {"ranks": [3], "layers": [1, 3]},
                {
                    "ranks": [4, 5, 6],
                    "layers": [3, L],
                    "shards": {
                        "query_groups": [2, 1, g - 3],
                        "ffn": [30, 70, f - 100],
                        "vocab": [10, 20, v - 30],
                    },
                },
            ],
        },
        {
            "micro_batch_size": 1,
            "num_microbatches": 1,
            "stages": [{"ranks": [7, 8], "layers": [0, 2]}, {"ranks": [9, 10], "layers": [2, L]}],
        },
    ]


def _plan(m, kinds=("A100-SXM-80GB",), **training):
    gpus = 11 // len(kinds) + (11 % len(kinds) > 0)
    return build_plan(_cluster(gpus, kinds), m, 4, _pipelines(m), **training)


def _held(shards):
    return sum(math.prod(s.local_shape) for s in shards)


# ------------------------------------------------------------------------- (a) closed forms


@pytest.mark.parametrize("name", sorted(MODELS))
def test_closed_form_counts_equal_param_shards(name):
    m = MODELS[name]
    assert layout.total_params(m) == _held(layout.canonical_shards(m))
    plan = _plan(m)
    for r in range(plan.world_size):
        held = _held(layout.rank_param_shards(plan, r))
        assert layout.rank_params(plan, r) == held, (name, r)
        v = plan.rank_view(r)
        n_layers = v.layers[1] - v.layers[0]
        per_layer = layout.layer_params(m, v.query_groups[0], v.ffn[0])
        assert (
            layout.stage_params(
                m,
                v.query_groups[0],
                v.ffn[0],
                v.vocab[0] if v.vocab else 0,
                0,
                v.holds_embedding,
                v.holds_output,
            )
            + n_layers * per_layer
            == held
        )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unit_params_are_the_unit_tensors(name):
    """The closed-form UnitParams count the UnitTensors, and those are param_shards' tensors
    of one query group, one FFN column, one vocabulary row (one layer of a TP=1 model)."""
    m = MODELS[name]
    cuts, units = layout.unit_tensors(m), layout.unit_params(m)
    assert tuple(units) == tuple(sum(t.rows * t.inner for t in c) for c in cuts)
    assert layout.layer_params(m, 1, 0) - layout.layer_params(m, 0, 0) == units.query_group
    assert layout.layer_params(m, 0, 1) - layout.layer_params(m, 0, 0) == units.ffn_column
    shards = layout.param_shards(
        m, layout.StageView((0, 1), (1, 0), (m.heads_per_group, 0), (1, 0), (1, 0))
    )
    assert _held(shards) == (
        units.query_group
        + units.ffn_column
        + units.layer_replicated
        + (2 if m.untie_embeddings_and_output_weights else 1) * units.vocab_row
        + units.final_norm
        + units.position_table
    )


# ------------------------------------------------------- (b) planner bytes = runtime bytes


def runtime_optimizer_elements(plan):
    """Elements of fp32 master + Adam state per rank as the runtime builds them: each rank's
    GradientSync buckets (shard_optimizer_state=True: a segment joins its holders' bucket when
    `reduced_together`, else a bucket of this rank alone), and HeteroDistributedOptimizer's
    cut of every slot in a bucket by `weighted_split` with the bucket's `optimizer_weight`s."""
    mode = plan.training.optimizer_shard
    per_row = {
        s.name: math.prod(s.shape) // s.shape[s.dim] for s in layout.canonical_shards(plan.model)
    }
    segments = layout.gradient_segments(plan)
    out = {}
    for rank in range(plan.world_size):
        buckets = {}
        for seg in segments:
            if rank in seg.ranks:
                key = seg.ranks if layout.reduced_together(seg, True) else (rank,)
                buckets.setdefault(key, []).append(seg)
        owned = 0
        for ranks, slots in buckets.items():
            weights = [layout.optimizer_weight(plan.ranks[r].gpu, mode) for r in ranks]
            me = ranks.index(rank)
            for seg in slots:
                owned += splits.weighted_split(seg.end - seg.start, weights)[me] * per_row[seg.name]
        out[rank] = owned
    return out


def _with_training(plan, **training):
    data = plan.to_dict()
    data["training"] = {**data["training"], **training}
    return plan_from_dict(data)


def _cases():
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "examples/plans/*.json"))):
        out.append((os.path.basename(path), load_plan(path)))
    out.append(
        (
            "layernorm-bias",
            _plan(MODELS["layernorm-bias"], ("A100-SXM-80GB", "RTX-3090", "RTX-4090")),
        )
    )
    out.append(
        (
            "gqa-layernorm-bias-tied",
            _plan(MODELS["gqa-layernorm-bias-tied"], ("RTX-4090", "A100-SXM-80GB")),
        )
    )
    for name in ("gpt-learned-positions", "qkv-bias"):
        out.append((name, _plan(MODELS[name], ("RTX-4090", "A100-SXM-80GB", "RTX-3090"))))
    return [
        (
            f"{name}-{mode}",
            _with_training(
                plan,
                use_distributed_optimizer=mode != "plain",
                optimizer_shard=mode if mode != "plain" else "even",
            ),
        )
        for name, plan in out
        for mode in ("plain", "even", "memory")
    ]


@pytest.mark.parametrize("name, plan", _cases(), ids=[n for n, _ in _cases()])
def test_planner_bytes_per_rank_equal_runtime(name, plan):
    est = simulate(plan)
    sharded = plan.training.use_distributed_optimizer
    owned = runtime_optimizer_elements(plan) if sharded else None
    if sharded:
        assert layout.plan_optimizer_elements(plan) == owned
    for r, terms in enumerate(est.memory_terms_gb):
        held = _held(layout.rank_param_shards(plan, r))
        assert round(terms["weights"] * 1e9) == WEIGHT_BYTES * held, (name, r)
        state = OPTIMIZER_BYTES * (owned[r] if sharded else held)
        assert round(terms["optimizer"] * 1e9) == state, (name, r)


def test_memory_shares_follow_gpu_memory():
    """optimizer_shard memory: a segment's state is cut by the holders' catalog memory."""
    plan = _with_training(
        load_plan(os.path.join(ROOT, "examples/plans/mixed-lab-manual.json")),
        use_distributed_optimizer=True,
        optimizer_shard="memory",
    )
    owned = layout.plan_optimizer_elements(plan)
    assert sum(owned.values()) == layout.total_params(plan.model)
    gpu = {r: plan.ranks[r].gpu for r in range(plan.world_size)}
    cuts = 0
    for seg in layout.gradient_segments(plan):
        rows = dict(
            zip(
                seg.ranks,
                layout.optimizer_split(seg, lambda r: layout.optimizer_weight(gpu[r], "memory")),
            )
        )
        a100 = [n for r, n in rows.items() if gpu[r] == "A100-SXM-80GB"]
        rtx3090 = [n for r, n in rows.items() if gpu[r] == "RTX-3090"]
        if a100 and rtx3090:
            assert min(a100) >= max(rtx3090) and sum(rows.values()) == seg.end - seg.start
            cuts += min(a100) > max(rtx3090)
    assert cuts > 0
    assert splits.weighted_split(10, [24.0, 80.0, 24.0]) == [2, 6, 2]
    assert layout.optimizer_weight("RTX-3090", "memory") == 24.0
    assert layout.optimizer_weight("RTX-3090", "even") == 1.0


# ---------------------------------------------------------------- the search's memory limit


def test_layers_that_fit_is_rank_memorys_limit():
    rng = random.Random(7)
    for _ in range(300):
        m = MODELS[rng.choice(sorted(MODELS))]
        if rng.random() < 0.5:
            m = load_model(rng.choice(["llama2-7b", "llama2-13b", "llama3-8b"]))
        t = rng.choice([1, 2, 3])
        qg = max(1, m.num_query_groups // t)
        ffn, vocab = m.ffn_hidden_size // t, m.vocab_size // t
        first, last = rng.random() < 0.3, rng.random() < 0.3
        stages = rng.randint(1, 8)
        pos = rng.randrange(stages)
        mbs, rc = rng.choice([1, 2, 4]), rng.random() < 0.5
        frac = rng.choice([1.0, 0.5, 1 / 3])
        cap = rng.uniform(1e9, 90e9) if m.num_layers > 4 else rng.uniform(1.5e9, 1.6e9)
        shape = RankShape(mbs, qg, ffn, vocab, first, last, pos, stages, stages - pos, rc, frac)
        n = layers_that_fit(cap, m, shape)
        total = [rank_memory(m, shape, k).total for k in (n, n + 1)]
        assert total[1] > cap
        assert n == 0 or total[0] <= cap


# ---------------------------------------------------------------------------------- splits


def test_splits():
    assert splits.even_split(10, 3) == [4, 3, 3]
    # largest remainders; ties go to the lower index
    assert splits.weighted_split(10, [1, 1, 2]) == [3, 2, 5]
    assert splits.weighted_split(3, [2.0, 2.0, 1.0]) == [1, 1, 1]
    assert splits.weighted_split(0, [3, 1]) == [0, 0]
    assert splits.weighted_split(1, [1, 9, 1]) == [0, 1, 0]  # parts may be empty
    assert splits.weighted_split(7, [5.0, 5.0]) == splits.even_split(7, 2)
    # proportional: every part >= 1, the rest by the weighted split
    assert splits.proportional_split(3, [1, 100, 1]) == [1, 1, 1]
    assert splits.proportional_split(52, [1] * 8) == splits.even_split(52, 8)
    rng = random.Random(3)
    for _ in range(2000):
        w = [rng.choice([1, 2, 24.0, 80.0, rng.uniform(0.1, 9)]) for _ in range(rng.randint(1, 9))]
        total = rng.randint(len(w), 5000)
        got = splits.proportional_split(total, w)
        assert got == [1 + x for x in splits.weighted_split(total - len(w), w)]
        assert sum(got) == total and min(got) >= 1
        cut = splits.weighted_split(total, w)
        assert sum(cut) == total
        exact = [total * x / sum(w) for x in w]
        assert all(abs(c - e) < 1 for c, e in zip(cut, exact))
    with pytest.raises(Exception, match="non-empty"):
        splits.proportional_split(2, [1, 1, 1])


# ------------------------------------------------------------------------------- imports


def _planner_imports():
    """{planner module: planner modules it imports anywhere (functions included), except
    imports for type checking only}."""
    folder = os.path.join(ROOT, "planner")
    mods = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
    graph = {}
    for mod in mods:
        tree = ast.parse(open(os.path.join(folder, mod + ".py")).read())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
            for n in ast.walk(node)
        }
        deps = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "planner":
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("planner."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps.update(
                    a.name.split(".")[1] for a in node.names if a.name.startswith("planner.")
                )
        graph[mod] = deps & mods
    return graph


def test_planner_imports_form_a_tree():
    """No import cycle anywhere in the planner, the command-line front ends included, counting
    function-local imports too: none may dodge a cycle."""
    graph = _planner_imports()
    done, active = set(), []

    def visit(mod):
        assert mod not in active, "import cycle: " + " -> ".join(active + [mod])
        if mod in done:
            return
        active.append(mod)
        for dep in sorted(graph[mod]):
            visit(dep)
        active.pop()
        done.add(mod)

    for mod in sorted(graph):
        visit(mod)
    assert graph["flops"] == set()
    # the profile reader only reads and interpolates: the cost sources ask it, never the reverse
    cost_side = {"costmodel", "measured_costs", "devices", "topology", "memory"}
    assert not cost_side & graph["profiles"], graph["profiles"]
    assert "measured_costs" in graph["costmodel"] and "profiles" in graph["devices"]
    # the front ends share planner.cli_args; the search's sits beside the CLI, not below it
    assert "cli_args" in graph["cli"] and "cli_args" in graph["search_cli"]
    assert "cli" not in graph["search_cli"]
