"""--transformer-impl and the plan's training.transformer_impl in the runtime: the flag follows
the plan, a plan that asks for Transformer Engine where it cannot run is one clear error before
anything is built, start-up planning picks TE only where it can run, and TE's names of its fused
norms are read as the layout's. (TE itself cannot be installed on CPU machines: the TE build
runs in tools/bench/gpu_check.py's te cases wherever a GPU with TE is at hand.)"""

import dataclasses
import json

import pytest

from megatron_hexi.arguments import check_against_plan, parse_args, planning_inputs
from megatron_hexi.layer_specs import check_transformer_impl, te_to_local_name
from planner import transformer_impl
from planner.errors import SpecError
from planner.layout import rank_param_shards
from planner.plan import load_plan
from runtime.entry import REPO_FLAGS, run_entry


@pytest.fixture(scope="module")
def plan_path(repo_root):
    return repo_root / "examples/plans/hetero-4rank.json"


def _with_impl(plan, impl):
    return dataclasses.replace(
        plan, training=dataclasses.replace(plan.training, transformer_impl=impl)
    )


@pytest.mark.parametrize(
    "flag, plan_impl, message",
    [
        (
            "transformer_engine",
            "local",
            "--transformer-impl transformer_engine contradicts the plan (transformer_impl: "
            "local); re-plan with hexi-plan ... --transformer-impl transformer_engine",
        ),
        (
            "local",
            "transformer_engine",
            "--transformer-impl local contradicts the plan (transformer_impl: "
            "transformer_engine); re-plan with hexi-plan ... --transformer-impl local",
        ),
        ("local", "local", None),
        ("transformer_engine", "transformer_engine", None),
        (None, "transformer_engine", None),
    ],
)
def test_flag_follows_the_plan(plan_path, flag, plan_impl, message):
    flags = [] if flag is None else ["--transformer-impl", flag]
    args = parse_args(["--hetero-plan-path", str(plan_path), *REPO_FLAGS, *flags])
    plan = _with_impl(load_plan(plan_path), plan_impl)
    if message is None:
        check_against_plan(args, plan)
        return
    with pytest.raises(SpecError) as e:
        check_against_plan(args, plan)
    assert e.value.problems == [message]


def test_transformer_engine_where_it_cannot_run_is_one_clear_error():
    check_transformer_impl("local", cuda=False)
    check_transformer_impl("local", cuda=True)
    with pytest.raises(SpecError) as e:
        check_transformer_impl("transformer_engine", cuda=False)
    assert e.value.problems == [
        "the plan's training.transformer_impl is transformer_engine, which runs on CUDA only, "
        "and this run is on the CPU: re-plan with hexi-plan ... --transformer-impl local to run "
        "the plan on CPU processes"
    ]
    with pytest.raises(SpecError) as e:  # no Transformer Engine on this machine
        check_transformer_impl("transformer_engine", cuda=True)
    (line,) = e.value.problems
    assert line.startswith(
        "the plan's training.transformer_impl is transformer_engine, but Transformer Engine "
        "cannot be imported here (ModuleNotFoundError: No module named 'transformer_engine')"
    ), line
    assert line.endswith(
        "install it (pip install '.[gpu]') or re-plan with hexi-plan ... --transformer-impl local"
    )


def test_a_te_plan_on_cpu_stops_before_any_process_group(repo_root, plan_path, tmp_path):
    data = json.loads(plan_path.read_text())
    data["training"]["transformer_impl"] = "transformer_engine"
    te_plan = tmp_path / "te.json"
    te_plan.write_text(json.dumps(data))
    code, err = run_entry(
        repo_root, "--hetero-plan-path", te_plan, "--hetero-device", "cpu", *REPO_FLAGS
    )
    assert code == 2, err
    assert err == (
        "pretrain_gpt.py: error: the plan's training.transformer_impl is transformer_engine, "
        "which runs on CUDA only, and this run is on the CPU: re-plan with hexi-plan ... "
        "--transformer-impl local to run the plan on CPU processes\n"
    ), err


def test_start_up_planning_picks_te_only_where_it_runs(repo_root, monkeypatch):
    cluster = str(repo_root / "examples/clusters/mini-hetero.yaml")
    base = ["--hetero-cluster", cluster, "--hetero-model", "tiny", "--global-batch-size", "8"]

    def chosen(cuda, *flags):
        args = parse_args([*base, *REPO_FLAGS, *flags])
        return planning_inputs(args, cuda=cuda).options.transformer_impl

    assert chosen(False) == chosen(True) == "local"  # no Transformer Engine here
    monkeypatch.setattr(transformer_impl, "te_installed", lambda: True)
    assert chosen(False) == "local"
    assert chosen(True) == "transformer_engine"
    assert chosen(True, "--transformer-impl", "local") == "local"
    assert chosen(False, "--transformer-impl", "transformer_engine") == "transformer_engine"


def test_te_norm_names_are_read_as_the_layouts(plan_path):
    """Transformer Engine's LayerNorm + linear layers hold the norm before them as
    `layer_norm_weight` (and `layer_norm_bias` for LayerNorm); every other TE parameter has the
    local spec's name. Mapped back, a TE stage's names are exactly the layout's."""
    plan = load_plan(plan_path)
    te_names = {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    seen = set()
    for rank in range(plan.world_size):
        for shard in rank_param_shards(plan, rank):
            local = shard.local_name
            te = local
            for part, fused in te_names.items():
                if part in local:
                    te = local.replace(part, fused)
                    seen.add(te.rsplit(".", 1)[-1])
            assert te_to_local_name(te) == local
            assert te_to_local_name(local) == local
    assert seen == {"layer_norm_weight"}  # the tiny model's RMSNorm: weights only
    assert te_to_local_name("decoder.layers.3.mlp.linear_fc1.layer_norm_bias") == (
        "decoder.layers.3.pre_mlp_layernorm.bias"
    )


def test_te_config_carries_the_attention_backend(plan_path):
    from megatron.core.transformer.enums import AttnBackend

    from megatron_hexi.model import stage_config

    plan = load_plan(plan_path)
    view = plan.rank_view(0)
    te = stage_config(plan, view, transformer_impl="transformer_engine", attention_backend="flash")
    assert te.attention_backend == AttnBackend.flash
    assert not te.use_cpu_initialization  # TE allocates its shards on the GPU
    local = stage_config(plan, view, attention_backend="unfused")
    assert local.attention_backend == AttnBackend.auto  # the local spec picks its own
    assert local.use_cpu_initialization
