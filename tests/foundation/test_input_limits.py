"""The bounds of planner/limits.py admit real inputs up to the limit and refuse one step beyond,
and the strict readers keep what ordinary files use (anchors without aliases, dates, "Gbps")."""

import pytest

from planner import limits
from planner.cluster import load_cluster_dict
from planner.errors import SpecError
from planner.inputs import document_problems, parse_yaml, read_text
from planner.models import model_from_dict
from planner.units import parse_bandwidth


def _cluster(count, gpus_per_node):
    return {
        "name": "big",
        "nodes": [
            {
                "name": "h",
                "gpu": "H100-SXM",
                "count": count,
                "gpus_per_node": gpus_per_node,
                "intra_node": "nvlink4",
                "nic": "400 Gbit/s",
            }
        ],
    }


def test_cluster_at_the_gpu_limit_loads():
    c = load_cluster_dict(_cluster(limits.MAX_GPUS // 8, 8))
    assert c.num_gpus == limits.MAX_GPUS


@pytest.mark.parametrize(
    "count, per_node, field",
    [
        (limits.MAX_NODES + 1, 1, f"nodes[0] (h).count: {limits.MAX_NODES + 1} is above the limit"),
        (1, limits.MAX_GPUS_PER_NODE + 1, "nodes[0] (h).gpus_per_node: 1025 is above the limit"),
        (limits.MAX_GPUS // 16 + 1, 16, f"nodes: {limits.MAX_GPUS + 16:,} GPUs in all"),
    ],
)
def test_cluster_one_beyond_a_limit_is_refused(count, per_node, field):
    with pytest.raises(SpecError) as info:
        load_cluster_dict(_cluster(count, per_node))
    assert len(info.value.problems) == 1 and field in info.value.problems[0]


_MODEL = {
    "num_layers": 4,
    "hidden_size": 64,
    "ffn_hidden_size": 256,
    "num_attention_heads": 4,
    "num_query_groups": 4,
    "vocab_size": 128,
    "seq_length": 32,
}


@pytest.mark.parametrize("key", sorted(limits.MODEL_INT_BOUNDS))
def test_model_bounds(key):
    hi = limits.MODEL_INT_BOUNDS[key]
    at = {**_MODEL, key: hi}
    if key == "num_query_groups":
        at["num_attention_heads"] = hi
    if key in ("num_attention_heads", "num_query_groups"):
        at["kv_channels"] = 16  # hidden_size need not divide by the head count
    model_from_dict(at)
    with pytest.raises(SpecError) as info:
        model_from_dict({**at, key: hi + 1})
    assert f"model.{key}: {hi + 1} is above the limit" in str(info.value)


def test_read_text_bounds_the_size(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * 101)
    assert read_text(path, "cluster file", 101) == "#" * 101
    with pytest.raises(SpecError) as info:
        read_text(path, "cluster file", 100)
    assert info.value.problems == [f"{path}: cluster file is larger than the limit of 100 bytes"]


def test_yaml_keeps_what_ordinary_files_use():
    data = parse_yaml("a: &x 1\nday: 2024-01-02\nbig: 1_000\n", "f")
    assert data == {"a": 1, "day": "2024-01-02", "big": 1000}
    assert parse_bandwidth("8 Gbps") == 1e9 and parse_bandwidth("8 GB/s") == 8e9


def test_yaml_refuses_aliases_even_when_small():
    with pytest.raises(SpecError, match=r"^f: line 2: not valid YAML: aliases"):
        parse_yaml("a: &x 1\nb: *x\n", "f")


def test_document_walk_names_the_first_bad_value_in_order():
    data = {"a": [1, {"b": float("nan")}], "c": float("inf"), "d": "x\x07"}
    assert document_problems(data, "plan") == [
        "plan.a[1].b: nan is not a finite number",
        "plan.c: inf is not a finite number",
        "plan.d: 'x\\x07' contains a control character",
    ]
    deep = []
    for _ in range(limits.MAX_NESTING + 5):
        deep = [deep]
    assert "nested more than" in document_problems(deep)[0]
    assert document_problems({"text": "tabs\tand\nnewlines are text"}) == []
