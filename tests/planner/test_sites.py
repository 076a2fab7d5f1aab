"""Sites in cluster files: links between sites cap every pair of ranks on different sites."""

import pytest

from planner.cluster import DEFAULT_INTER_NODE_LATENCY_S, load_cluster, load_cluster_dict
from planner.errors import ClusterError
from planner.sites import DEFAULT_SITE_LATENCY_S
from planner.topology import Topology

GBIT = 1e9 / 8


def _cluster(sites, extra_group=None):
    nodes = [
        {"name": "a", "gpu": "A100-SXM-80GB", "gpus_per_node": 2, "intra_node": "nvlink",
         "nic": "100 Gbit/s", "site": "east"},
        {"name": "b", "gpu": "RTX-4090", "gpus_per_node": 1, "count": 2, "intra_node": "host",
         "nic": "25 Gbit/s", "site": "west"},
    ]  # fmt: skip
    if extra_group:
        nodes.append(extra_group)
    return load_cluster_dict({"name": "c", "nodes": nodes, "sites": sites})


def test_site_link_caps_pairs_across_sites_only(examples_dir):
    c = load_cluster(examples_dir / "clusters" / "two-site-mini.yaml")
    # across sites: the slower of NIC (100 / 25 Gbit/s) and the 1 Gbit/s site link, its 10 ms
    assert c.link("a100", "rtx4090") == (1 * GBIT, 10e-3)
    assert c.link("a100", "rtx3090") == (1 * GBIT, 10e-3)
    # inside a site: the machines' own link, as without sites
    assert c.link("rtx4090", "rtx3090") == (10 * GBIT, DEFAULT_INTER_NODE_LATENCY_S)
    assert c.link("a100", "a100")[0] == 300e9
    topo = Topology(c)
    assert topo.slowest([0, 1]) == (300e9, 5e-6)
    assert topo.slowest([0, 1, 2]) == (1 * GBIT, 10e-3)
    assert topo.slowest([2, 3]) == (10 * GBIT, DEFAULT_INTER_NODE_LATENCY_S)
    again = load_cluster_dict(c.to_dict())
    assert again.link("a100", "rtx3090") == c.link("a100", "rtx3090")
    assert again.to_dict() == c.to_dict()


def test_site_link_faster_than_nic_leaves_the_nic():
    c = _cluster({"default": {"bandwidth": "400 Gbit/s", "latency": "1 us"}})
    # NICs are slower than the site link; the latency is the larger of the two
    assert c.link("a", "b-0") == (25 * GBIT, DEFAULT_INTER_NODE_LATENCY_S)
    assert c.link("b-0", "b-1") == (25 * GBIT, DEFAULT_INTER_NODE_LATENCY_S)


def test_pair_link_wins_over_default_and_latency_defaults():
    north = {"name": "n", "gpu": "RTX-3090", "gpus_per_node": 1, "intra_node": "host",
             "nic": "10 Gbit/s", "site": "north"}  # fmt: skip
    c = _cluster(
        {
            "default": {"bandwidth": "100 Mbit/s"},
            "links": [{"between": ["west", "east"], "bandwidth": "2 Gbit/s", "latency": "3 ms"}],
        },
        north,
    )
    assert c.link("a", "b-1") == (2 * GBIT, 3e-3)
    assert c.link("a", "n") == (0.1 * GBIT, DEFAULT_SITE_LATENCY_S)
    assert c.link("n", "b-0") == (0.1 * GBIT, DEFAULT_SITE_LATENCY_S)
    assert load_cluster_dict(c.to_dict()).link("a", "n") == c.link("a", "n")


def test_clusters_without_sites_keep_their_links(examples_dir):
    mini = load_cluster(examples_dir / "clusters" / "mini-hetero.yaml")
    assert mini.link("a100", "rtx3090") == (10 * GBIT, DEFAULT_INTER_NODE_LATENCY_S)
    for name in ("mini-hetero.yaml", "mixed-lab.yaml", "paper-hetero-a.yaml"):
        c = load_cluster(examples_dir / "clusters" / name)
        assert c.sites is None and "sites" not in c.to_dict()
        for a in c.nodes:
            for b in c.nodes:
                if a.name != b.name:
                    assert c.link(a.name, b.name) == c._node_link(a, b)


@pytest.mark.parametrize(
    ("sites", "line"),
    [
        ({"links": [{"between": ["east", "south"], "bandwidth": "1 Gbit/s"}]},
         "sites.links[0].between: 'south' is not the site of any node group"),
        ({}, "sites: no link between sites 'east' and 'west'"),
        ({"links": [{"between": ["east", "west"], "bandwidth": "fast"}]},
         "sites.links[0].bandwidth"),
        ({"default": {"bandwidth": "1 Gbit/s", "latency": "3 fortnights"}},
         "sites.default.latency"),
        ({"links": [{"between": ["east", "east"], "bandwidth": "1 Gbit/s"}]},
         "sites.links[0].between: a site link joins two different sites"),
        ({"default": {"bandwidth": "1 Gbit/s"}, "speed": 3}, "sites.speed: unknown field"),
    ],
)  # fmt: skip
def test_bad_sites_are_one_line(sites, line):
    with pytest.raises(ClusterError) as err:
        _cluster(sites)
    assert len(err.value.problems) == 1 and line in err.value.problems[0]
