"""The plan's transformer implementation: the field, old plans' meaning, the planning commands'
flag and default, and that it changes no cost (the planner charges TE and the local spec alike)."""

import dataclasses
import json
import os

import pytest

from planner import transformer_impl
from planner.cluster import load_cluster
from planner.models import load_model
from planner.plan import load_plan, plan_from_dict
from planner.plan_validation import validate_plan_dict
from planner.search import search_plan
from planner.simulator import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example(name):
    with open(os.path.join(ROOT, "examples/plans", name)) as f:
        return json.load(f)


def test_names_and_default_rule(monkeypatch):
    assert transformer_impl.TRANSFORMER_IMPLS == ("transformer_engine", "local")
    assert transformer_impl.PLAN_DEFAULT_IMPL == "local"
    for installed in (False, True):
        monkeypatch.setattr(transformer_impl, "te_installed", lambda i=installed: i)
        assert transformer_impl.default_impl(gpu_cluster=False) == "local"
        assert transformer_impl.default_impl(gpu_cluster=True) == (
            "transformer_engine" if installed else "local"
        )


def test_te_installed_finds_without_importing(monkeypatch):
    import importlib.util
    import sys

    asked = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: asked.append(name))
    assert transformer_impl.te_installed() is False
    assert asked == ["transformer_engine"] and "transformer_engine" not in sys.modules


def test_field_round_trip_validation_and_old_plans():
    data = _example("hetero-4rank.json")
    assert "transformer_impl" not in data["training"]
    assert plan_from_dict(data).training.transformer_impl == "local"  # what it meant then
    for impl in transformer_impl.TRANSFORMER_IMPLS:
        d = {**data, "training": {**data["training"], "transformer_impl": impl}}
        assert validate_plan_dict(d) == []
        plan = plan_from_dict(d)
        assert plan.training.transformer_impl == impl
        written = plan.to_dict()["training"]
        if impl == "local":  # the meaning of an absent field: not written
            assert "transformer_impl" not in written
        else:
            assert written["transformer_impl"] == impl
    for bad in ("te", "", 1, None, True):
        d = {**data, "training": {**data["training"], "transformer_impl": bad}}
        problems = validate_plan_dict(d)
        assert problems == [
            f"training.transformer_impl: must be one of transformer_engine, local, got {bad!r}"
        ], problems


@pytest.mark.parametrize("name", ["hetero-4rank.json", "mixed-lab-manual.json"])
def test_the_implementation_changes_no_estimate(name):
    plan = plan_from_dict(_example(name))
    te = dataclasses.replace(
        plan, training=dataclasses.replace(plan.training, transformer_impl="transformer_engine")
    )
    assert simulate(te).to_dict() == simulate(plan).to_dict()


def test_cli_flag_default_and_show(hexi_plan, hexi_manual, hexi_search, tmp_path, monkeypatch):
    """Without the flag: local here (no Transformer Engine installed), transformer_engine on a
    GPU cluster where it is; the CPU cluster stays local. The flag is recorded as given."""
    out = tmp_path / "manual.json"
    assert hexi_manual(out)[::2] == (0, "")
    assert load_plan(out).training.transformer_impl == "local"
    code, line, err = hexi_plan("validate", out)
    assert code == 0 and line.endswith(", transformer-impl local\n"), line
    assert hexi_manual(out, "--transformer-impl", "transformer_engine")[::2] == (0, "")
    assert json.loads(out.read_text())["training"]["transformer_impl"] == "transformer_engine"
    code, table, err = hexi_plan("show", out)
    assert (code, err) == (0, "")
    assert table.splitlines()[1].endswith(", transformer-impl transformer_engine")

    monkeypatch.setattr(transformer_impl, "te_installed", lambda: True)
    searched = tmp_path / "plan.json"
    for cluster, expected in (("mini-hetero.yaml", "transformer_engine"), ("cpu-1.yaml", "local")):
        code, _, err = hexi_search(searched, cluster=cluster)
        assert (code, err) == (0, ""), err
        assert load_plan(searched).training.transformer_impl == expected, cluster
    assert hexi_manual(out)[::2] == (0, "")
    assert load_plan(out).training.transformer_impl == "transformer_engine"
    assert hexi_manual(out, "--transformer-impl", "local")[::2] == (0, "")
    assert load_plan(out).training.transformer_impl == "local"

    code, _, err = hexi_manual(out, "--transformer-impl", "te")
    assert code == 2 and "--transformer-impl" in err and "invalid choice" in err


def test_search_records_the_implementation_and_nothing_else_changes():
    cluster = load_cluster(os.path.join(ROOT, "examples/clusters/mini-hetero.yaml"))
    model = load_model("tiny")
    local = search_plan(cluster, model, 8)
    te = search_plan(cluster, model, 8, transformer_impl="transformer_engine")
    assert local.training.transformer_impl == "local"
    assert te.training.transformer_impl == "transformer_engine"
    a, b = local.to_dict(), te.to_dict()
    assert b["training"].pop("transformer_impl") == "transformer_engine"
    assert a == b
