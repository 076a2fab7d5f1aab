"""An elastic restart that loses a whole site continues with the islands of the other sites.

Three sites (east: two processes, west and north: one each) train as three islands (two
fragments, H = 2) and save after step 3, with fragment 1's outer step taken and not yet written.
The restart finds west gone: under the plan of east and north as islands (other shards, other
batch split), each island continues from the weights and Adam state of its own site's saved
island, theta_outer and the outer momentum carry over, fragment 1's result (averaged over the
three islands) is written by the two, and later outer steps average the two by their samples:
equal to the one-process reference that drops west at step 3 (tests/runtime/diloco_reference.py).
Matching the saved islands by index instead (north's island from west's weights) is caught.
The two-island run saves after step 5 (fragment 1 in flight again); west comes back for step 6:
its island joins from theta_outer with the Adam state of east's island, as in the reference.
With north gone too, east trains on synchronously from its own island, as the reference does.
An island on a site the checkpoint has none of, without outer state to join from, is refused
in one line.
"""

import json

import pytest

from harness import run_distributed
from megatron_hexi.checkpoint import Checkpoint, CheckpointError
from megatron_hexi.checkpoint.loader import _source_islands
from planner.cluster import load_cluster_dict
from planner.islands import OuterSettings
from planner.membership import present_cluster
from planner.models import load_model
from planner.plan import build_plan, save_plan
from runtime.diloco_reference import diloco
from runtime.equivalence import TOLERANCE
from runtime.island_workers import train_islands
from runtime.plans import GLOBAL_BATCH, REFERENCE, write_plan
from runtime.workers import max_relative_difference

FLAGS = ["--train-iters", "6"]
SAVED_AT = 3  # H = 2, two fragments: fragment 1 syncs after step 3 and lands before step 4's update
BACK_AT = 5  # west back, after the two-island run's checkpoint of step 5
OUTER = OuterSettings(2, "nesterov", 0.7, 0.9, fragments=2)


def _node(name, gpus, site):
    return {
        "name": name,
        "gpu": "CPU",
        "gpus_per_node": gpus,
        "intra_node": "host",
        "nic": "10 Gbit/s",
        "site": site,
    }


CLUSTER = load_cluster_dict(
    {
        "name": "three-cpu-sites",
        "nodes": [_node("east", 2, "east"), _node("west", 1, "west"), _node("north", 1, "north")],
        "sites": {"default": {"bandwidth": "1 Gbit/s", "latency": "10 ms"}},
    }
)
WHOLE = [  # east: TP = 2 with uneven shards, 4 samples; west and north: 2 samples each
    {
        "micro_batch_size": 1,
        "num_microbatches": 4,
        "stages": [
            {
                "ranks": [0, 1],
                "layers": [0, 4],
                "shards": {"query_groups": [3, 1], "ffn": [192, 64], "vocab": [96, 32]},
            }
        ],
    },
    {"micro_batch_size": 1, "num_microbatches": 2, "stages": [{"ranks": [2], "layers": [0, 4]}]},
    {"micro_batch_size": 2, "num_microbatches": 1, "stages": [{"ranks": [3], "layers": [0, 4]}]},
]
WEST_LOST = [  # east 6 samples under other shards, north 2 (its rank is now rank 2)
    {
        "micro_batch_size": 3,
        "num_microbatches": 2,
        "stages": [
            {"ranks": [0, 1], "layers": [0, 4], "shards": {"ffn": [96, 160], "vocab": [40, 88]}}
        ],
    },
    {"micro_batch_size": 1, "num_microbatches": 2, "stages": [{"ranks": [2], "layers": [0, 4]}]},
]
EAST_ONLY = [
    {
        "micro_batch_size": 2,
        "num_microbatches": 4,
        "stages": [{"ranks": [0, 1], "layers": [0, 4]}],
    }
]


def _plan(directory, name, present, pipelines, islands=(), outer=None):
    cluster = present_cluster(CLUSTER, present)
    plan = build_plan(
        cluster, load_model("tiny"), GLOBAL_BATCH, pipelines, islands=islands, outer=outer
    )
    path = directory / f"{name}.json"
    save_plan(plan, path)
    return path


def _difference(result, ref, first):
    losses = first["losses"] + result["losses"]
    loss = max(max_relative_difference(a, b) for a, b in zip(losses, ref["losses"]))
    params = [
        max(max_relative_difference(g[k], w[k]) for k in w)
        for g, w in zip(result["islands"], ref["islands"])
    ]
    assert len(result["islands"]) == len(ref["islands"])
    return loss, params


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("island_loss")
    whole = _plan(d, "whole", {"east": 2, "west": 1, "north": 1}, WHOLE, [[0], [1], [2]], OUTER)
    west_lost = _plan(d, "west_lost", {"east": 2, "north": 1}, WEST_LOST, [[0], [1]], OUTER)
    east_only = _plan(d, "east_only", {"east": 2}, EAST_ONLY)
    one = write_plan(d, "one-rank", "tiny", 1, REFERENCE)
    refs = run_distributed(
        diloco,
        1,
        [
            (whole, SAVED_AT, west_lost),
            (whole, SAVED_AT, east_only),
            (whole, SAVED_AT, west_lost, BACK_AT, whole),
        ],
        one,
        extra_flags=FLAGS,
        timeout=300,
    )[0]
    ckpt = d / "ckpt"
    first = run_distributed(
        train_islands,
        4,
        whole,
        extra_flags=[*FLAGS, "--save", str(ckpt), "--exit-interval", str(SAVED_AT)],
        timeout=400,
    )[0]
    return {
        "dir": d,
        "ckpt": ckpt,
        "first": first,
        "refs": refs,
        "whole": whole,
        "plans": (west_lost, east_only),
    }


def test_site_lost_continues_with_the_other_islands(runs):
    meta = json.loads((runs["ckpt"] / f"iter_000000{SAVED_AT}" / "checkpoint.json").read_text())
    assert meta["islands"] == 3 and meta["island_sites"] == ["east", "west", "north"]
    assert meta["outer_landed"] == [1]
    west_lost = runs["plans"][0]
    again = runs["dir"] / "ckpt_two"
    result = run_distributed(
        train_islands,
        3,
        west_lost,
        extra_flags=[*FLAGS, "--load", str(runs["ckpt"]), "--save", str(again)]
        + ["--save-interval", str(BACK_AT)],
        timeout=400,
    )[0]
    loss, params = _difference(result, runs["refs"][0], runs["first"])
    print(f"west lost after step {SAVED_AT}: loss {loss:.2e}, parameters per island {params}")
    assert len(runs["first"]["losses"]) == SAVED_AT and len(result["losses"]) == 3
    assert result["outer_step"] == [0, 1, 0]  # fragment 0 after steps 4 and 6, 1 after 5
    assert loss < TOLERANCE and max(params) < TOLERANCE

    # west back after step 5: three islands again, west's from theta_outer
    meta = json.loads((again / f"iter_000000{BACK_AT}" / "checkpoint.json").read_text())
    assert meta["island_sites"] == ["east", "north"] and meta["outer_landed"] == [1]
    back = run_distributed(
        train_islands,
        4,
        runs["whole"],
        extra_flags=[*FLAGS, "--load", str(again), "--ckpt-step", str(BACK_AT)],
        timeout=400,
    )[0]
    two = {"losses": runs["first"]["losses"] + result["losses"][: BACK_AT - SAVED_AT]}
    loss, params = _difference(back, runs["refs"][2], two)
    print(f"west back after step {BACK_AT}: loss {loss:.2e}, parameters per island {params}")
    assert len(back["losses"]) == 1 and back["outer_step"] == [0]
    assert loss < TOLERANCE and max(params) < TOLERANCE


def test_islands_matched_by_index_are_caught(runs):
    west_lost = runs["plans"][0]
    result = run_distributed(
        train_islands,
        3,
        west_lost,
        extra_flags=[*FLAGS, "--load", str(runs["ckpt"])],
        defect="islands_by_index",
        timeout=400,
    )[0]
    loss, params = _difference(result, runs["refs"][0], runs["first"])
    print(f"islands by index: loss {loss:.2e}, parameters per island {params}")
    assert params[1] > 100 * TOLERANCE, "north continued from west's island unnoticed"


def test_one_site_left_trains_synchronously(runs):
    east_only = runs["plans"][1]
    result = run_distributed(
        train_islands, 2, east_only, extra_flags=[*FLAGS, "--load", str(runs["ckpt"])], timeout=400
    )[0]
    loss, params = _difference(result, runs["refs"][1], runs["first"])
    print(f"only east left after step {SAVED_AT}: loss {loss:.2e}, parameters {params}")
    assert result["outer_step"] == [None] * 3
    assert loss < TOLERANCE and max(params) < TOLERANCE


def test_island_without_saved_site_is_one_line(runs):
    """An island on a site the checkpoint has no island of, under a plan without outer steps
    (nothing to join from): one line naming the checkpoint and the site (checked where the load
    checks it, on every rank alike)."""
    from planner.plan import load_plan

    cluster = dict(CLUSTER.to_dict())
    cluster["nodes"] = [*cluster["nodes"], _node("south", 1, "south")]
    south = load_cluster_dict(cluster)
    plan = build_plan(
        present_cluster(south, {"east": 2, "south": 1}),
        load_model("tiny"),
        GLOBAL_BATCH,
        WEST_LOST,
        islands=[[0], [1]],
    )
    with Checkpoint(str(runs["ckpt"]), None) as ckpt:
        with pytest.raises(CheckpointError) as e:
            _source_islands(ckpt, plan, False)
        assert str(e.value) == (
            f"{ckpt.dir}: saved with islands on sites east, west, north; this plan's island on "
            f"site south has no saved island to continue from (a site joins only from the "
            f"outer state of a plan with outer steps)"
        )
        assert _source_islands(ckpt, plan, True) == [0, None]
        assert _source_islands(ckpt, load_plan(runs["plans"][0]), False) == [0, 2]
