"""Islands at elastic start-up: the start-up planner's --islands is hexi-plan plan's, the nodes
present keep their sites, and a checkpoint's islands continue by site (planner.island_match)."""

import json
from dataclasses import replace

import pytest

from megatron_hexi.arguments import parse_args, planning_inputs
from megatron_hexi.config import CheckpointConfig
from megatron_hexi.launch.elastic import elastic_setup
from megatron_hexi.startup_plan import _decide
from planner.cluster import load_cluster
from planner.errors import SpecError
from planner.island_match import island_sites, source_islands
from planner.membership import present_cluster
from planner.plan import load_plan, plan_from_dict

THREE_SITES = """\
name: three-sites
nodes:
  - {name: a100, gpu: A100-SXM-80GB, gpus_per_node: 2, intra_node: nvlink, nic: "100 Gbit/s",
     site: east}
  - {name: rtx4090, gpu: RTX-4090, gpus_per_node: 1, intra_node: host, nic: "25 Gbit/s", site: west}
  - {name: rtx3090, gpu: RTX-3090, gpus_per_node: 1, intra_node: host, nic: "10 Gbit/s", site: west}
  - {name: a100n, gpu: A100-SXM-80GB, gpus_per_node: 1, intra_node: nvlink, nic: "100 Gbit/s",
     site: north}
sites:
  default: {bandwidth: "1 Gbit/s", latency: "10 ms"}
  links:
    - {between: [east, north], bandwidth: "2 Gbit/s", latency: "8 ms"}
"""
STARTUP = ["--mock-data", "--lr", "1e-3", "--train-iters", "4", "--sequence-parallel"]


def _startup(cluster_path, model, batch, *flags):
    """The plan a start with every node of the file present would train under (launch rank 0's
    decision, without the collectives around it)."""
    args = parse_args(
        [
            "--hetero-cluster",
            str(cluster_path),
            "--hetero-model",
            str(model),
            "--global-batch-size",
            str(batch),
            *STARTUP,
            *flags,
        ]
    )
    inputs = planning_inputs(args, cuda=False)
    present = {n.name: n.gpus_per_node for n in inputs.cluster.nodes}
    decision = _decide(inputs, CheckpointConfig(), present)
    assert not decision.problems, decision.problems
    return plan_from_dict(decision.plan, "start-up plan"), inputs


def _layout(plan):
    d = plan.to_dict()
    return {k: d.get(k) for k in ("pipelines", "islands", "training", "ranks")}


def test_startup_islands_equal_hexi_plan(examples_dir, hexi_plan, tmp_path):
    """`--islands sites` at start-up on the two-site cluster file: the plan of `hexi-plan plan
    --islands sites` (same pipelines, islands, batch split, H and outer settings); with the
    --outer-* flags given, those; one site left, synchronous; the flags go only with
    --hetero-cluster."""
    cluster = examples_dir / "clusters" / "two-site-mini.yaml"
    model = examples_dir / "models" / "small-1b.yaml"
    common = ["--transformer-impl", "local", "--no-overlap-grad-reduce"]
    out = tmp_path / "plan.json"
    code, _, err = hexi_plan(
        "plan", "--cluster", cluster, "--model", model, "--global-batch-size", 64,
        "--islands", "sites", "--outer-fragments", "2", *common, "-o", out,
    )  # fmt: skip
    assert code == 0, err
    want = load_plan(out)
    got, _ = _startup(cluster, model, 64, "--islands", "sites", "--outer-fragments", "2")
    assert len(got.islands) == 2 and got.training.outer.fragments == 2
    assert _layout(got) == _layout(want)
    assert island_sites(got) == island_sites(want) == ["east", "west"]
    assert got.cluster.sites is not None  # the site link is planned with, as hexi-plan's

    # hexi-launch --elastic shows the plan of the first start (every node present)
    setup = elastic_setup(
        str(cluster),
        str(model),
        [*STARTUP, "--global-batch-size", "64", "--islands", "sites", "--outer-fragments", "2"]
        + ["--save", "c", "--load", "c", "--hetero-load-if-exists", "--transformer-impl", "local"],
        1,
        0,
        "job",
        None,
    )
    assert _layout(setup.plan) == _layout(want)

    # off (the default): synchronous, as hexi-plan plan without --islands
    sync, _ = _startup(cluster, model, 64)
    assert not sync.islands and sync.training.outer is None

    # west gone: sites with one site left plans synchronously on east
    _, inputs = _startup(cluster, model, 64, "--islands", "sites")
    decision = _decide(inputs, CheckpointConfig(), {"a100": 2})
    left = plan_from_dict(decision.plan, "start-up plan")
    assert not left.islands and left.training.outer is None
    assert island_sites(left) == ["east"]

    # a cluster file of one site: hexi-plan's error
    one_site = examples_dir / "clusters" / "mini-hetero.yaml"
    _, inputs = _startup(one_site, model, 64)
    inputs = replace(inputs, islands=replace(inputs.islands, mode="sites"))
    decision = _decide(inputs, CheckpointConfig(), {n.name: 1 for n in inputs.cluster.nodes})
    assert decision.problems == (
        "planning at start-up for 3 process(es) on nodes a100 (1), rtx4090 (1), rtx3090 (1): "
        "--islands: cluster 'mini-hetero' has one site; name each node group's `site` (and give "
        "the links between sites) to plan islands",
    )

    with pytest.raises(SpecError) as e:
        parse_args(["--hetero-plan-path", str(out), *STARTUP, "--islands", "sites"])
    assert e.value.problems == [
        "--islands goes with --hetero-cluster (planning at start-up); a plan file already "
        "says its islands and outer step"
    ]
    with pytest.raises(SpecError) as e:
        _startup(cluster, model, 64, "--outer-lr", "0.5")
    assert e.value.problems == [
        "--outer-lr: needs --islands sites or auto (plans without islands are synchronous)"
    ]


def test_site_lost_plans_the_rest_as_islands(examples_dir, tmp_path):
    """Three sites, then west gone: the start plans east and north as islands, the sites
    section keeps only the links between sites that have nodes (the plan reloads), and each
    island continues from the saved island of its site."""
    path = tmp_path / "three.yaml"
    path.write_text(THREE_SITES)
    model = examples_dir / "models" / "small-1b.yaml"
    flags = ("--islands", "sites", "--outer-interval", "4")
    full, inputs = _startup(path, model, 64, *flags)
    assert island_sites(full) == ["east", "west", "north"]
    cut = present_cluster(inputs.cluster, {"a100": 2, "a100n": 1})
    assert cut.to_dict()["sites"]["links"] == [
        {"between": ["east", "north"], "bandwidth": "0.25 GB/s", "latency": "8000 us"}
    ]
    decision = _decide(inputs, CheckpointConfig(), {"a100": 2, "a100n": 1})
    left = plan_from_dict(json.loads(json.dumps(decision.plan)), "start-up plan")
    assert island_sites(left) == ["east", "north"]
    assert left.training.outer.interval == 4
    assert source_islands(3, island_sites(full), island_sites(left)) == [0, 2]
    assert load_cluster(path).sites is not None


@pytest.mark.parametrize(
    "saved, saved_sites, sites, want",
    [
        (3, ["east", "west", "north"], ["east", "north"], [0, 2]),  # a site lost
        (2, ["east", "west"], ["west", "east"], [1, 0]),  # the same islands, other order
        (2, ["east", "west"], ["west"], [1]),  # one left (synchronous)
        (1, None, ["east", "west"], [0, 0]),  # a one-island checkpoint starts every island
        (2, None, [None, None], [0, 1]),  # no sites anywhere: by index, as before
        (2, None, ["east", "west"], [0, 1]),  # a checkpoint written before identities
        (2, [None, None], ["east", "west"], [0, 1]),  # saved on a cluster without sites
    ],
)
def test_source_islands(saved, saved_sites, sites, want):
    assert source_islands(saved, saved_sites, sites) == want
    assert source_islands(saved, saved_sites, sites, joinable=True) == want


def test_a_site_that_joins_starts_from_the_outer_state():
    assert source_islands(2, ["east", "north"], ["east", "west", "north"], joinable=True) == [
        0,
        None,
        1,
    ]


@pytest.mark.parametrize(
    "saved, saved_sites, sites, line",
    [
        (
            2,
            ["east", "west"],
            ["east", "north"],
            "saved with islands on sites east, west; this plan's island on site north has no "
            "saved island to continue from (a site joins only from the outer state of a plan "
            "with outer steps)",
        ),
        (
            3,
            None,
            ["east", "west"],
            "saved with 3 islands, this plan has 2, and the islands are not identified by site "
            "on both sides: each island's weights continue only in an island of its own (a "
            "one-island checkpoint starts every island)",
        ),
    ],
)
def test_unmatched_islands_are_one_line(saved, saved_sites, sites, line):
    with pytest.raises(SpecError) as e:
        source_islands(saved, saved_sites, sites)
    assert e.value.problems == [line]


def test_no_island_continuing_is_one_line():
    with pytest.raises(SpecError) as e:
        source_islands(2, ["east", "west"], ["north", "south"], joinable=True)
    assert e.value.problems == [
        "saved with islands on sites east, west; this plan's island on site north has no saved "
        "island to continue from (no island continues)"
    ]
