"""Segment rank sets of the weighted gradient sync, by hand."""

import pytest

from planner.cluster import load_cluster_dict
from planner.models import load_model
from planner.sync_model import StageLayout, rank_sets, sync_time
from planner.topology import Topology, ring_allreduce_time

TINY = load_model("tiny")  # h 64, g 4 (1 head per group, d 16), f 256, V 128, 4 layers


def test_segments_tp2_vs_tp1():
    a = [StageLayout((0, 1), (0, 4), (2, 2), (128, 128), (64, 64))]
    b = [StageLayout((2,), (0, 4), (4,), (256,), (128,))]
    sets = rank_sets(TINY, [a, b])
    h = 64
    per_group = (16 + 32) * h + 16 * h
    per_ffn = 3 * h
    # per rank pair: 2 query groups + 128 ffn columns for 4 layers + 64 vocab rows (embedding
    # and output)
    expect = 4 * (2 * per_group + 128 * per_ffn) + 2 * 64 * h
    assert sets[(0, 2)] == expect and sets[(1, 2)] == expect
    assert sets[(0, 1, 2)] == 4 * 2 * h + h  # layer norms + final norm
    assert sum(sets.values()) == expect * 2 + 4 * 2 * h + h


def test_uneven_boundaries_cut_atomic_segments():
    a = [StageLayout((0, 1), (0, 4), (3, 1), (200, 56), (100, 28))]
    b = [StageLayout((2, 3), (0, 4), (1, 3), (56, 200), (28, 100))]
    sets = rank_sets(TINY, [a, b])
    h = 64
    per_group = 64 * h
    # query groups: [0,1)->{0,2}, [1,3)->{0,3}, [3,4)->{1,3}
    assert sets[(0, 2)] == 4 * (1 * per_group + 56 * 3 * h) + 2 * 28 * h
    assert sets[(1, 3)] == 4 * (1 * per_group + 56 * 3 * h) + 2 * 28 * h
    assert sets[(0, 3)] == 4 * (2 * per_group + 144 * 3 * h) + 2 * 72 * h


def test_sync_time():
    cl = load_cluster_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "n",
                    "gpu": "A100-SXM-80GB",
                    "gpus_per_node": 2,
                    "count": 2,
                    "intra_node": "100 GB/s",
                    "nic": "1 GB/s",
                    "nic_latency": "0 us",
                }
            ],
        }
    )
    topo = Topology(cl)
    sets = {(0, 2): 10**6, (0, 1): 5 * 10**5, (3,): 7}
    t, worst = sync_time(sets, topo)
    assert t == pytest.approx(
        ring_allreduce_time(4e6, 2, 1e9, 0) + ring_allreduce_time(2e6, 2, 100e9, 5e-6)
    )
    assert worst[1] == (0, 2)
