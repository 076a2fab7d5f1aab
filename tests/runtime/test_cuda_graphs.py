"""CUDA graphs in the runtime: the flags follow the plan, graphs are refused on CPU (one line,
before any process group) and without Transformer Engine for TE's graphs, the stage's
TransformerConfig carries the plan's graphs, and the RNG tracker is graph-safe under them.
(Capturing needs CUDA: tools/bench/gpu_check.py's graph cases run it on a GPU.)"""

import dataclasses
import json
from types import SimpleNamespace

import pytest

from megatron_hexi import cuda_graphs
from megatron_hexi.arguments import check_against_plan, parse_args, planning_inputs
from planner.errors import SpecError
from planner.plan import load_plan
from runtime.entry import REPO_FLAGS, run_entry


@pytest.fixture(scope="module")
def plan_path(repo_root):
    return repo_root / "examples/plans/hetero-4rank.json"


def _with_graphs(plan, impl, scope=()):
    training = dataclasses.replace(plan.training, cuda_graph_impl=impl, cuda_graph_scope=scope)
    return dataclasses.replace(plan, training=training)


@pytest.mark.parametrize(
    "flags, impl, scope, message",
    [
        ([], "local", (), None),
        (["--cuda-graph-impl", "local"], "local", (), None),
        (["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"], "local", ("attn",), None),
        (["--cuda-graph-scope", "attn", "mlp"], "local", ("attn", "mlp"), None),
        (["--cuda-graph-impl", "none"], "none", (), None),
        (
            ["--cuda-graph-impl", "local"],
            "none",
            (),
            "--cuda-graph-impl local contradicts the plan (cuda_graph_impl: none); re-plan "
            "with hexi-plan ... --cuda-graph-impl local",
        ),
        (
            ["--cuda-graph-impl", "none"],
            "transformer_engine",
            (),
            "--cuda-graph-impl none contradicts the plan (cuda_graph_impl: transformer_engine); "
            "re-plan with hexi-plan ... --cuda-graph-impl none",
        ),
        (
            ["--cuda-graph-scope", "mlp"],
            "local",
            ("attn",),
            "--cuda-graph-scope mlp contradicts the plan (cuda_graph_impl: local, "
            "cuda_graph_scope: attn); re-plan with hexi-plan ... --cuda-graph-impl IMPL "
            "--cuda-graph-scope mlp",
        ),
        (
            ["--cuda-graph-scope", "attn"],
            "none",
            (),
            "--cuda-graph-scope attn contradicts the plan (cuda_graph_impl: none, "
            "cuda_graph_scope: whole layers); re-plan with hexi-plan ... --cuda-graph-impl IMPL "
            "--cuda-graph-scope attn",
        ),
    ],
)
def test_flags_follow_the_plan(plan_path, flags, impl, scope, message):
    args = parse_args(["--hetero-plan-path", str(plan_path), *REPO_FLAGS, *flags])
    plan = _with_graphs(load_plan(plan_path), impl, scope)
    if message is None:
        check_against_plan(args, plan)
        return
    with pytest.raises(SpecError) as e:
        check_against_plan(args, plan)
    assert e.value.problems == [message]


def test_graphs_where_they_cannot_run_are_one_clear_error(monkeypatch):
    for impl in ("none", "local", "transformer_engine"):
        cuda_graphs.check_cuda_graphs("none", cuda=impl != "none")
    cuda_graphs.check_cuda_graphs("local", cuda=True)
    for impl in ("local", "transformer_engine"):
        with pytest.raises(SpecError) as e:
            cuda_graphs.check_cuda_graphs(impl, cuda=False)
        assert e.value.problems == [
            f"the plan's training.cuda_graph_impl is {impl}: CUDA graphs run on CUDA only, and "
            "this run is on the CPU: re-plan with hexi-plan ... --cuda-graph-impl none to run "
            "the plan on CPU processes"
        ]
    with pytest.raises(SpecError) as e:  # no Transformer Engine on this machine
        cuda_graphs.check_cuda_graphs("transformer_engine", cuda=True)
    (line,) = e.value.problems
    assert line == (
        "the plan's training.cuda_graph_impl is transformer_engine, but Transformer Engine "
        "cannot be imported here (ModuleNotFoundError: No module named 'transformer_engine'); "
        "install it or re-plan with hexi-plan ... --cuda-graph-impl local"
    ), line


def test_graph_plan_on_cpu_stops_before_any_process_group(repo_root, plan_path, tmp_path):
    data = json.loads(plan_path.read_text())
    data["training"]["cuda_graph_impl"] = "local"
    graphs = tmp_path / "graphs.json"
    graphs.write_text(json.dumps(data))
    code, err = run_entry(
        repo_root, "--hetero-plan-path", graphs, "--hetero-device", "cpu", *REPO_FLAGS
    )
    assert (code, err) == (
        2,
        "pretrain_gpt.py: error: the plan's training.cuda_graph_impl is local: CUDA graphs run "
        "on CUDA only, and this run is on the CPU: re-plan with hexi-plan ... --cuda-graph-impl "
        "none to run the plan on CPU processes\n",
    )


def test_start_up_planning_records_the_flags(repo_root):
    cluster = str(repo_root / "examples/clusters/mini-hetero.yaml")
    base = ["--hetero-cluster", cluster, "--hetero-model", "tiny", "--global-batch-size", "8"]

    def options(*flags):
        o = planning_inputs(parse_args([*base, *REPO_FLAGS, *flags]), cuda=True).options
        return o.cuda_graph_impl, o.cuda_graph_scope

    assert options() == ("none", ())
    assert options("--cuda-graph-impl", "local") == ("local", ())
    assert options("--cuda-graph-impl", "local", "--cuda-graph-scope", "mlp") == ("local", ("mlp",))
    with pytest.raises(SpecError) as e:
        options("--cuda-graph-scope", "mlp")
    assert e.value.problems == [
        "--cuda-graph-scope: needs --cuda-graph-impl local or transformer_engine"
    ]


def test_stage_config_carries_the_plans_graphs(plan_path):
    from megatron.core.transformer.enums import CudaGraphScope

    from megatron_hexi.model import stage_config

    plan = load_plan(plan_path)
    view = plan.rank_view(0)
    none = stage_config(plan, view)
    assert (none.cuda_graph_impl, none.cuda_graph_scope) == ("none", [])
    whole = stage_config(_with_graphs(plan, "local"), view)
    assert (whole.cuda_graph_impl, whole.cuda_graph_scope) == ("local", [])
    parts = stage_config(_with_graphs(plan, "local", ("attn", "mlp")), view)
    assert parts.cuda_graph_scope == [CudaGraphScope.attn, CudaGraphScope.mlp]
    te = stage_config(_with_graphs(plan, "transformer_engine", ("mlp",)), view)
    assert (te.cuda_graph_impl, te.cuda_graph_scope) == ("transformer_engine", [CudaGraphScope.mlp])
    # everything else is the config without graphs (init methods are fresh closures each time)
    differ = {
        f.name for f in dataclasses.fields(none) if getattr(whole, f.name) != getattr(none, f.name)
    }
    assert differ == {
        "cuda_graph_impl",
        "init_method",
        "output_layer_init_method",
        "embedding_init_method",
    }


@pytest.mark.parametrize(
    "impl, te, graph_safe",
    [("none", False, False), ("local", False, True), ("transformer_engine", True, True)],
)
def test_seed_rng_picks_the_graph_safe_tracker(monkeypatch, impl, te, graph_safe):
    from megatron_hexi import model

    calls = []
    monkeypatch.setattr(
        model, "model_parallel_cuda_manual_seed", lambda *a, **k: calls.append((a, k))
    )
    model.seed_rng(77, 1, impl)
    assert calls == [
        (
            (77,),
            {
                "tp_rank": 1,
                "ep_rank": 0,
                "etp_rank": 0,
                "force_reset_rng": True,
                "te_rng_tracker": te,
                "use_cudagraphable_rng": graph_safe,
            },
        )
    ]


def test_seed_rng_without_graphs_keeps_megatrons_tracker():
    """The real call (on CPU, megatron-core's plain tracker): made anew, seeded per TP rank."""
    from megatron.core.tensor_parallel import random

    from megatron_hexi.model import seed_rng
    from megatron_hexi.patches import apply_cpu_patches

    apply_cpu_patches()
    seed_rng(5, 0)
    first = random.get_cuda_rng_tracker()
    assert type(first) is random.CudaRNGStatesTracker and not first.use_cudagraphable_rng
    seed_rng(5, 1)
    second = random.get_cuda_rng_tracker()
    assert second is not first and set(second.get_states()) == set(first.get_states())
    assert not random.is_graph_safe_cuda_rng_tracker(second)


def test_local_graphs_set_megatron_cores_pipeline_size(plan_path, monkeypatch):
    from megatron.core import parallel_state

    from megatron_hexi.model import stage_config

    plan = load_plan(plan_path)
    assert sorted({plan.rank_view(r).num_stages for r in range(plan.world_size)}) == [1, 2]
    from megatron.core.transformer.cuda_graphs import (
        _determine_if_first_last_layer_of_this_vp_chunk as first_last,
    )

    for rank in range(plan.world_size):
        monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", None)
        monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", None)
        view = plan.rank_view(rank)
        cuda_graphs.set_megatron_globals(stage_config(plan, view), view)
        assert parallel_state._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is None
        assert parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK is None
        graphs = _with_graphs(plan, "local")
        config = stage_config(graphs, view)
        cuda_graphs.set_megatron_globals(config, view)
        assert parallel_state.get_pipeline_model_parallel_world_size() == view.num_stages
        assert parallel_state.get_pipeline_model_parallel_rank() == view.stage
        # what each graph runner asks when it is made (no process group of megatron-core's
        # exists): whether its layer, numbered from 1 within the stage, is the stage's first
        # or last
        n = view.layers[1] - view.layers[0]
        ends = [first_last(SimpleNamespace(config=config, layer_number=i)) for i in (1, n)]
        assert ends == [(True, n == 1), (n == 1, True)]


def test_checkpoint_rng_state_of_a_graph_safe_tracker(monkeypatch):
    """The graph-safe tracker holds generators (CUDA graphs register them): a checkpoint saves
    their states and loads them back into the same generators. Shown with CPU generators in a
    tracker of that kind (a CUDA one needs CUDA)."""
    import torch
    from megatron.core.tensor_parallel import random

    from megatron_hexi import checkpoint

    tracker = random.CudaRNGStatesTracker()
    gens = {"a": torch.Generator().manual_seed(1), "b": torch.Generator().manual_seed(2)}
    tracker.set_states(dict(gens))
    monkeypatch.setattr(random, "get_cuda_rng_tracker", lambda: tracker)
    saved = checkpoint.rng_state()
    expected = {k: torch.rand(3, generator=g) for k, g in gens.items()}  # the saved streams
    checkpoint.set_rng_state(saved)
    states = tracker.get_states()
    assert states["a"] is gens["a"] and states["b"] is gens["b"]  # the same generators
    for k, g in gens.items():
        assert torch.equal(torch.rand(3, generator=g), expected[k])
