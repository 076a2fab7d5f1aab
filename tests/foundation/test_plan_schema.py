"""planner/data/plan.schema.json describes plan format v1's structure, and agrees with the code."""

import copy
import dataclasses
import json
from importlib import resources
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")

from planner import cluster as cluster_mod  # noqa: E402
from planner import islands as islands_mod  # noqa: E402
from planner import plan_validation as plan_mod  # noqa: E402
from planner.models import ModelSpec  # noqa: E402

DATA = Path(__file__).parent / "data"
BROKEN = {
    k: v
    for k, v in json.loads((DATA / "broken_plans.json").read_text()).items()
    if not k.startswith("_")
}


@pytest.fixture(scope="module")
def schema():
    return json.loads(resources.files("planner").joinpath("data/plan.schema.json").read_text())


@pytest.fixture(scope="module")
def validator(schema):
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(validator, data):
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)
    ]


def test_schema_is_draft_2020_12(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_example_plans_validate(validator, examples_dir):
    plans = sorted((examples_dir / "plans").glob("*.json"))
    assert len(plans) >= 2
    for path in plans:
        assert _errors(validator, json.loads(path.read_text())) == [], path


def test_built_plans_validate(validator, examples_dir):
    """What build_plan writes (with an estimate and the optional training keys) validates."""
    from planner.cluster import load_cluster
    from planner.models import load_model
    from planner.plan import build_plan

    plan = build_plan(
        load_cluster(examples_dir / "clusters" / "mixed-lab.yaml"),
        load_model("llama3-8b"),
        64,
        json.loads((examples_dir / "pipelines" / "mixed-lab.json").read_text()),
        recompute=True,
        use_distributed_optimizer=True,
        optimizer_shard="memory",
        estimate={
            "iteration_time_s": 1.5,
            "tokens_per_s": 3e5,
            "mfu": 0.4,
            "peak_memory_gb": [20.5] * 36,
            "bottleneck": "pipeline 0",
        },
    )
    assert _errors(validator, plan.to_dict()) == []
    # the overlap settings, as a plan written through the planner's own Training
    training = dataclasses.replace(
        plan.training, overlap_grad_reduce=True, overlap_param_gather=True, attention_backend="auto"
    )
    overlapped = dataclasses.replace(plan, training=training).to_dict()
    assert overlapped["training"]["overlap_grad_reduce"] is True
    assert overlapped["training"]["overlap_param_gather"] is True
    assert overlapped["training"]["attention_backend"] == "auto"
    assert _errors(validator, overlapped) == []


@pytest.mark.parametrize("name", sorted(k for k, v in BROKEN.items() if v["schema_rejects"]))
def test_structurally_broken_plans_fail_the_schema(name, validator):
    assert _errors(validator, json.loads((DATA / "broken_plans" / name).read_text()))


@pytest.mark.parametrize(
    "name", sorted(k for k, v in BROKEN.items() if v["schema_rejects"] is False)
)
def test_semantically_broken_plans_pass_the_schema(name, validator):
    """These break rules between fields: only validate_plan_dict can catch them."""
    assert _errors(validator, json.loads((DATA / "broken_plans" / name).read_text())) == []


@pytest.mark.parametrize(
    "path, value",
    [
        (("pipelines", 0, "stages", 0, "ranks"), []),
        (("pipelines", 0, "stages", 0, "ranks"), [0, -1]),
        (("pipelines", 0, "stages", 0, "layers"), [0]),
        (("pipelines", 0, "stages", 0, "layers"), ["0", 3]),
        (("pipelines", 0, "stages", 0, "shards"), [[3, 1]]),
        (("pipelines", 0, "micro_batch_size"), True),
        (("pipelines", 0, "stages"), {"ranks": [0, 1]}),
        (("ranks", 0, "local_rank"), "0"),
        (("ranks", 0, "extra"), 1),
        (("cluster", "nodes", 0, "count"), 0),
        (("cluster", "nodes", 0, "nic"), 12.5),
        (("cluster", "nodes", 0, "hostname"), "h0"),  # allowed alone...
        (("cluster", "links"), [{"between": ["a100"], "bandwidth": "1 GB/s"}]),
        (("model", "swiglu"), "yes"),
        (("training", "optimizer_shard"), "random"),
        (("training", "overlap_grad_reduce"), "yes"),
        (("training", "overlap_param_gather"), 1),
        (("training", "attention_backend"), "flashy"),
        (("training", "attention_backend"), True),
        (("estimate",), {"mfu": "high"}),
    ],
)
def test_structural_mutations(path, value, validator, examples_dir):
    data = json.loads((examples_dir / "plans" / "hetero-4rank.json").read_text())
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    if path[-1] == "hostname":  # ...but not next to hostnames
        target["hostnames"] = ["h0"]
    assert _errors(validator, data), path
    if path[0] != "estimate":  # informational: the code does not look
        assert plan_mod.validate_plan_dict(data), path  # the code refuses them too


def _props(schema, name):
    return set(schema["$defs"][name]["properties"])


def test_schema_keys_match_the_code(schema):
    """The schema lists exactly the fields the validator accepts, so the two cannot drift."""
    assert set(schema["properties"]) == plan_mod._TOP_KEYS
    assert set(schema["required"]) == plan_mod._TOP_KEYS - {"estimate", "comment", "islands"}
    assert _props(schema, "training") == plan_mod._TRAINING_KEYS
    assert _props(schema, "pipeline") == plan_mod._PIPELINE_KEYS
    assert _props(schema, "stage") == plan_mod._STAGE_KEYS
    assert set(schema["$defs"]["stage"]["properties"]["shards"]["properties"]) == set(
        plan_mod.SHARD_KINDS
    )
    assert _props(schema, "rank") == plan_mod._RANK_KEYS
    assert _props(schema, "model") == {f.name for f in dataclasses.fields(ModelSpec)}
    assert set(schema["$defs"]["model"]["required"]) == set(
        f.name for f in dataclasses.fields(ModelSpec) if f.default is dataclasses.MISSING
    )
    assert _props(schema, "cluster") == cluster_mod._TOP_KEYS
    assert _props(schema, "node_group") == cluster_mod._GROUP_KEYS
    assert _props(schema, "link") == cluster_mod._LINK_KEYS
    assert _props(schema, "outer") == islands_mod._OUTER_KEYS
    assert _props(schema, "island") == {"pipelines"}


def test_schema_does_not_mutate(validator, examples_dir):
    data = json.loads((examples_dir / "plans" / "hetero-4rank.json").read_text())
    before = copy.deepcopy(data)
    list(validator.iter_errors(data))
    assert data == before
