"""The plan's `islands` and `training.outer`, and the arithmetic planner.islands shares."""

import json

import pytest

from planner.errors import PlanError
from planner.islands import (
    INT8_BLOCK,
    OuterSettings,
    fragment_layers,
    outer_bytes_sent,
    outer_update,
    payload_bytes,
    syncs_after_step,
)
from planner.plan import load_plan, plan_from_dict


@pytest.fixture()
def plan_dict(examples_dir):
    return json.loads((examples_dir / "plans" / "hetero-4rank.json").read_text())


def test_islands_and_outer_round_trip(plan_dict):
    plan_dict["islands"] = [{"pipelines": [1]}, {"pipelines": [0]}]
    plan_dict["training"]["outer"] = {"interval": 8, "momentum": 0.5, "compression": "int8"}
    plan = plan_from_dict(plan_dict)
    assert plan.islands == ((1,), (0,))
    assert plan.training.outer == OuterSettings(8, "nesterov", 0.7, 0.5, "int8", 1)
    assert plan.island_of() == [1, 0]
    assert plan.island_pipelines() == [(1,), (0,)]
    islands = {plan.rank_view(r).pipeline: plan.rank_view(r).island for r in range(4)}
    assert islands == {0: 1, 1: 0}
    again = plan_from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict()
    assert again.to_dict()["training"]["outer"]["optimizer"] == "nesterov"


def test_a_plan_without_islands_is_one_island_and_unchanged(plan_dict, examples_dir):
    plan = load_plan(examples_dir / "plans" / "hetero-4rank.json")
    assert plan.islands == () and plan.training.outer is None
    assert plan.island_pipelines() == [(0, 1)]
    assert {plan.rank_view(r).island for r in range(plan.world_size)} == {0}
    assert plan.to_dict() == plan_dict


def test_each_broken_field_is_one_line(plan_dict):
    plan_dict["islands"] = [{"pipelines": [0, 1]}, {"pipelines": [1]}]
    plan_dict["training"]["outer"] = {"interval": 0, "fragments": 9, "compression": "fp8"}
    with pytest.raises(PlanError) as e:
        plan_from_dict(plan_dict)
    lines = str(e.value).splitlines()
    assert len([x for x in lines if "islands[1].pipelines: pipeline 1 is also in" in x]) == 1
    assert len([x for x in lines if "training.outer.interval" in x]) == 1
    assert len([x for x in lines if "training.outer.fragments: 9 fragments" in x]) == 1
    assert len([x for x in lines if "training.outer.compression" in x]) == 1


def test_fragments_cover_the_layers_and_stagger():
    assert fragment_layers(10, 3) == [(0, 4), (4, 7), (7, 10)]
    outer = OuterSettings(interval=6, fragments=3)
    starts = {f: [s for s in range(1, 13) if syncs_after_step(s, f, outer)] for f in range(3)}
    assert starts == {0: [6, 12], 1: [2, 8], 2: [4, 10]}
    one = OuterSettings(interval=4)
    assert [s for s in range(1, 13) if syncs_after_step(s, 0, one)] == [4, 8, 12]


def test_outer_update_rules():
    # sgd with lr 1 and no momentum lands on the average: synchronous training at H = 1
    sgd = OuterSettings(1, "sgd", 1.0, 0.0)
    assert outer_update(5.0, 5.0 - 3.0, 0.0, sgd) == (3.0, 2.0)
    nesterov = OuterSettings(4, "nesterov", 0.5, 0.9)
    theta, buf = outer_update(1.0, 0.2, 0.1, nesterov)
    assert buf == pytest.approx(0.9 * 0.1 + 0.2)
    assert theta == pytest.approx(1.0 - 0.5 * (0.2 + 0.9 * buf))
    momentum = OuterSettings(4, "sgd", 0.5, 0.9)
    assert outer_update(1.0, 0.2, 0.1, momentum)[0] == pytest.approx(1.0 - 0.5 * buf)


def test_bytes_across_islands():
    n = 10 * INT8_BLOCK + 1
    assert payload_bytes(n, "none") == 4 * n
    assert payload_bytes(n, "bf16") == 2 * n
    assert payload_bytes(n, "int8") == n + 4 * 11
    assert outer_bytes_sent(n, 1, "none") == 0
    assert outer_bytes_sent(n, 2, "none") == 4 * n  # ring all-reduce: 2 (k-1)/k of the buffer
    assert outer_bytes_sent(n, 4, "none") == (6 * 4 * n) // 4
    assert outer_bytes_sent(n, 3, "int8") == 2 * (n + 44)
