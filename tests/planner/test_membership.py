"""planner.membership: the cluster of the nodes that run processes, and the smallest node set an
elastic job can shrink to."""

import pytest

from planner.cluster import load_cluster, load_cluster_dict
from planner.errors import ClusterError, SpecError
from planner.membership import (
    PlanningOptions,
    plan_for,
    present_cluster,
    smallest_fitting_nodes,
)
from planner.models import load_model

LAB = {
    "name": "lab",
    "nodes": [
        {"name": "big", "gpu": "A100-SXM-80GB", "gpus_per_node": 4, "count": 2,
         "intra_node": "nvlink", "nic": "100 Gbit/s", "hostnames": ["h0", "h1"]},
        {"name": "small", "gpu": "RTX-3090", "gpus_per_node": 2, "count": 2,
         "intra_node": "host", "nic": "10 Gbit/s"},
    ],
    "links": [
        {"between": ["big", "small"], "bandwidth": "1 Gbit/s", "latency": "200 us"},
        {"between": ["big-0", "big-1"], "bandwidth": "400 Gbit/s"},
    ],
}  # fmt: skip


def test_present_cluster_keeps_nodes_links_and_hosts():
    lab = load_cluster_dict(LAB)
    cut = present_cluster(lab, {"small-1": 1, "big-1": 3, "big-0": 4})
    assert [(n.name, n.gpu, n.gpus_per_node, n.hostname) for n in cut.nodes] == [
        ("big-0", "A100-SXM-80GB", 4, "h0"),
        ("big-1", "A100-SXM-80GB", 3, "h1"),
        ("small-1", "RTX-3090", 1, None),
    ]
    names = [n.name for n in cut.nodes]
    for a in names:
        for b in names:
            if a != b:
                assert cut.link(a, b) == lab.link(a, b), (a, b)
    assert cut.node("big-1").intra_node_bw == lab.node("big-1").intra_node_bw
    # the cut cluster is a cluster file of its own: it round-trips through a plan's JSON
    again = load_cluster_dict(cut.to_dict())
    assert again.to_dict() == cut.to_dict()
    assert again.link("big-0", "small-1") == lab.link("big-0", "small-1")


def test_present_cluster_errors_name_the_node():
    lab = load_cluster_dict(LAB)
    with pytest.raises(ClusterError) as e:
        present_cluster(lab, {"big-0": 1, "gpu-box": 2, "small-0": 3})
    assert e.value.problems == [
        "node 'gpu-box' runs processes but is not a node of cluster 'lab' (its nodes: big-0, "
        "big-1, small-0, small-1)",
        "node 'small-0' runs 3 processes but has 2 GPU(s) in cluster 'lab'",
    ]


def test_smallest_fitting_nodes():
    cluster = load_cluster("examples/clusters/paper-hetero-a.yaml")
    options = PlanningOptions(global_batch_size=64)
    model = load_model("llama2-7b")
    fit = smallest_fitting_nodes(cluster, model, options)
    # the two 4090 machines hold the least memory (4 x 24 GB, then 8 x 24 GB; the 3090s tie with
    # the 8 x 4090 machine and come later in the file)
    assert (fit.count, fit.nodes) == (2, ("rtx4090x4", "rtx4090x8"))
    assert {r.node for r in fit.plan.ranks} <= set(fit.nodes)
    # one node fewer does not fit, and the count is the smallest that does
    alone = present_cluster(cluster, {"rtx4090x4": 4})
    with pytest.raises(SpecError, match="no plan fits"):
        plan_for(alone, model, options)


def test_nothing_fits_is_the_planner_error():
    cluster = load_cluster("examples/clusters/mini-hetero.yaml")
    with pytest.raises(SpecError, match="no plan fits: llama2-70b"):
        smallest_fitting_nodes(cluster, load_model("llama2-70b"), PlanningOptions(64))
