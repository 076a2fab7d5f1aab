"""The plan's CUDA graphs (training.cuda_graph_impl, cuda_graph_scope): the fields, old plans'
meaning, validation (one line naming the field), `show`, and the planning commands' flags."""

import json
import os

import pytest

from planner import cuda_graphs
from planner.plan import load_plan, plan_from_dict
from planner.plan_validation import validate_plan_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example(name="hetero-4rank.json"):
    with open(os.path.join(ROOT, "examples/plans", name)) as f:
        return json.load(f)


def _with(data, **training):
    return {**data, "training": {**data["training"], **training}}


def test_names():
    assert cuda_graphs.CUDA_GRAPH_IMPLS == ("none", "local", "transformer_engine")
    assert cuda_graphs.PLAN_DEFAULT_GRAPH_IMPL == "none"
    assert cuda_graphs.CUDA_GRAPH_SCOPES == ("attn", "mlp")


def test_round_trip_and_old_plans():
    data = _example()
    assert "cuda_graph_impl" not in data["training"]
    old = plan_from_dict(data).training
    assert (old.cuda_graph_impl, old.cuda_graph_scope) == ("none", ())  # what it meant then
    assert "cuda_graph_impl" not in plan_from_dict(data).to_dict()["training"]
    for impl in ("local", "transformer_engine"):
        for scope in ([], ["attn"], ["mlp", "attn"]):
            d = _with(data, cuda_graph_impl=impl, cuda_graph_scope=scope)
            assert validate_plan_dict(d) == []
            t = plan_from_dict(d).training
            assert (t.cuda_graph_impl, t.cuda_graph_scope) == (impl, tuple(scope))
            written = plan_from_dict(d).to_dict()["training"]
            assert written["cuda_graph_impl"] == impl
            assert written.get("cuda_graph_scope", []) == scope  # empty: not written
            assert plan_from_dict(_with(data, **written)).training == t
    d = _with(data, cuda_graph_impl="none")
    assert validate_plan_dict(d) == []
    assert "cuda_graph_impl" not in plan_from_dict(d).to_dict()["training"]


@pytest.mark.parametrize(
    "fields, line",
    [
        (
            {"cuda_graph_impl": "full"},
            "training.cuda_graph_impl: must be one of none, local, transformer_engine, got 'full'",
        ),
        (
            {"cuda_graph_impl": True},
            "training.cuda_graph_impl: must be one of none, local, transformer_engine, got True",
        ),
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": "attn"},
            "training.cuda_graph_scope: must be a list of attn and mlp (empty or absent: the "
            "whole layer), got 'attn'",
        ),
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": ["moe"]},
            "training.cuda_graph_scope: must be a list of attn and mlp (empty or absent: the "
            "whole layer), got ['moe']",
        ),
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]},
            "training.cuda_graph_scope: full_iteration (the whole step in one graph) is not "
            "supported by this runtime, which captures per layer; give attn and/or mlp, or no "
            "scope for whole layers",
        ),
        (
            {"cuda_graph_impl": "local", "cuda_graph_scope": ["attn", "attn"]},
            "training.cuda_graph_scope: repeats a scope: ['attn', 'attn']",
        ),
        (
            {"cuda_graph_scope": ["attn"]},
            "training.cuda_graph_scope: given without CUDA graphs (cuda_graph_impl: none)",
        ),
        (
            {"cuda_graph_impl": "local", "recompute": True},
            "training.cuda_graph_impl: local graphs cannot capture full activation recompute "
            "(recompute: true); megatron-core allows it only in whole-step capture",
        ),
        (
            {
                "cuda_graph_impl": "transformer_engine",
                "use_distributed_optimizer": True,
                "overlap_param_gather": True,
            },
            "training.cuda_graph_impl: transformer_engine graphs cannot run the overlapped "
            "parameter gather's forward pre-hooks (overlap_param_gather: true)",
        ),
    ],
)
def test_validation_is_one_line_naming_the_field(fields, line):
    assert validate_plan_dict(_with(_example(), **fields)) == [line]


def test_the_schema_agrees():
    jsonschema = pytest.importorskip("jsonschema")
    from importlib import resources

    schema = json.loads(resources.files("planner").joinpath("data/plan.schema.json").read_text())
    check = jsonschema.Draft202012Validator(schema)
    data = _example()
    ok = _with(data, cuda_graph_impl="local", cuda_graph_scope=["attn", "mlp"])
    assert list(check.iter_errors(ok)) == []
    for bad in (
        {"cuda_graph_impl": "full"},
        {"cuda_graph_scope": ["full_iteration"]},
        {"cuda_graph_scope": ["attn", "attn"]},
    ):
        assert list(check.iter_errors(_with(data, **bad))), bad
        assert validate_plan_dict(_with(data, **{"cuda_graph_impl": "local", **bad})), bad


def test_manual_flags_show_and_picture(hexi_plan, hexi_manual, tmp_path):
    out = tmp_path / "manual.json"
    assert hexi_manual(out)[::2] == (0, "")
    plan = load_plan(out)
    assert (plan.training.cuda_graph_impl, plan.training.cuda_graph_scope) == ("none", ())
    code, table, _ = hexi_plan("show", out)
    assert code == 0 and "cuda-graphs" not in table  # plans without graphs read as before

    assert hexi_manual(out, "--cuda-graph-impl", "local")[::2] == (0, "")
    assert json.loads(out.read_text())["training"]["cuda_graph_impl"] == "local"
    code, table, err = hexi_plan("show", out)
    assert (code, err) == (0, "")
    assert table.splitlines()[1].endswith(", cuda-graphs local (whole layers)")
    flags = ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "mlp")
    assert hexi_manual(out, *flags)[::2] == (0, "")
    assert json.loads(out.read_text())["training"]["cuda_graph_scope"] == ["attn", "mlp"]
    code, line, _ = hexi_plan("validate", out)
    assert code == 0 and line.endswith(", cuda-graphs transformer_engine (attn, mlp)\n"), line

    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert hexi_plan("show", out, "--png", png)[0] == 0 and png.stat().st_size > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ("--cuda-graph-scope", "attn"),
            "hexi-plan: error: --cuda-graph-scope: needs --cuda-graph-impl local or "
            "transformer_engine\n",
        ),
        (
            ("--cuda-graph-impl", "local", "--cuda-graph-scope", "mlp", "mlp"),
            "hexi-plan: error: --cuda-graph-scope: repeats a scope: mlp mlp\n",
        ),
    ],
)
def test_manual_flag_errors(hexi_manual, tmp_path, flags, message):
    code, _, err = hexi_manual(tmp_path / "p.json", *flags)
    assert (code, err) == (2, message)


def test_bad_flag_values_are_refused(hexi_manual, tmp_path):
    code, _, err = hexi_manual(tmp_path / "p.json", "--cuda-graph-impl", "full")
    assert code == 2 and "--cuda-graph-impl" in err and "invalid choice" in err
    code, _, err = hexi_manual(
        tmp_path / "p.json", "--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"
    )
    assert code == 2 and "--cuda-graph-scope" in err and "invalid choice" in err


def test_plan_and_min_nodes_record_the_graphs(hexi_plan, hexi_search, tmp_path, examples_dir):
    """The search plans without recompute under graphs; recompute on or an overlapped parameter
    gather with graphs is one line."""
    out = tmp_path / "plan.json"
    code, _, err = hexi_search(out, "--cuda-graph-impl", "local", "--cuda-graph-scope", "attn")
    assert (code, err) == (0, ""), err
    t = load_plan(out).training
    assert (t.cuda_graph_impl, t.cuda_graph_scope, t.recompute) == ("local", ("attn",), False)
    code, _, err = hexi_search(out)
    assert (code, err) == (0, "") and load_plan(out).training.cuda_graph_impl == "none"
    code, _, err = hexi_search(out, "--cuda-graph-impl", "local", "--recompute", "on")
    assert (code, err) == (
        2,
        "hexi-plan: error: --recompute on: --cuda-graph-impl local cannot capture full "
        "activation recompute\n",
    )
    code, _, err = hexi_search(
        out, "--cuda-graph-impl", "local", "--use-distributed-optimizer", "--overlap-param-gather"
    )
    assert (code, err) == (
        2,
        "hexi-plan: error: --overlap-param-gather: --cuda-graph-impl local cannot run the "
        "overlapped parameter gather's forward pre-hooks\n",
    )
    # the distributed optimizer's overlapped gather is on by default, but not with graphs
    code, _, err = hexi_search(out, "--cuda-graph-impl", "local", "--use-distributed-optimizer")
    assert (code, err) == (0, ""), err
    assert load_plan(out).training.overlap_param_gather is False
    code, text, err = hexi_plan(
        "min-nodes",
        "--cluster",
        examples_dir / "clusters" / "mini-hetero.yaml",
        "--model",
        "tiny",
        "--global-batch-size",
        8,
        "--cuda-graph-impl",
        "local",
    )
    assert (code, err) == (0, "") and text.startswith("1 of "), (text, err)
