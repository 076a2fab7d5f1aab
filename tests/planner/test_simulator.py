"""Simulator: example plans, a single-GPU plan by hand, memory overflow reported."""

import os

import pytest
from host_zero import zero_host_time

from planner import flops, kernels
from planner.cluster import load_cluster_dict
from planner.devices import device_for
from planner.layout import total_params
from planner.memory import FRAMEWORK_RESERVE_BYTES, layer_activation_bytes
from planner.models import load_model
from planner.plan import build_plan, load_plan
from planner.simulator import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_single_gpu_by_hand(monkeypatch):
    zero_host_time(monkeypatch)
    cl = load_cluster_dict(
        {
            "name": "one",
            "nodes": [
                {
                    "name": "a",
                    "gpu": "A100-SXM-80GB",
                    "gpus_per_node": 1,
                    "intra_node": "nvlink",
                    "nic": "10 Gbit/s",
                }
            ],
        }
    )
    m = load_model("tiny")
    plan = build_plan(
        cl,
        m,
        4,
        [
            {
                "micro_batch_size": 2,
                "num_microbatches": 2,
                "stages": [{"ranks": [0], "layers": [0, 4]}],
            }
        ],
    )
    est = simulate(plan)
    dev = device_for("A100-SXM-80GB")
    assert dev.kernels is not None  # a catalog GPU: timed kernel by kernel
    att = kernels.attention_times(dev.kernels, m, 2, m.num_query_groups)
    mlp = kernels.mlp_times(dev.kernels, m, 2, m.ffn_hidden_size)
    head = kernels.head_times(dev.kernels, 2 * 32, m.hidden_size, m.vocab_size)
    layer = att.fwd + mlp.fwd
    assert att.bwd + mlp.bwd == pytest.approx(2 * layer)
    opt = total_params(m) * 30 / (2039e9)
    # unfused attention (the plan's default): its s x s tensors' traffic, 13 B forward and 19 B
    # backward per element of [b, a, s, s] = [2, 4, 32, 32], per layer, at 2039 GB/s
    scores = 4 * (13 + 19) * 2 * 4 * 32 * 32 / 2039e9
    per_microbatch = 4 * 3 * layer + head.fwd + head.bwd + scores
    assert est.iteration_time_s == pytest.approx(2 * per_microbatch + opt)
    assert est.mfu == pytest.approx(
        4 * flops.model_flops_per_sample(m) / (est.iteration_time_s * 312e12)
    )
    assert est.tokens_per_s == pytest.approx(4 * 32 / est.iteration_time_s)
    assert est.grad_sync_time_s == 0.0
    assert est.peak_memory_gb[0] == pytest.approx(
        (
            18 * total_params(m)
            + 4 * layer_activation_bytes(m, 2, 4, 256, False)
            + 32 * 2 * 128 * 4
            + FRAMEWORK_RESERVE_BYTES
        )
        / 1e9
    )


def test_example_plans_and_overflow_reported():
    est = simulate(load_plan(os.path.join(ROOT, "examples/plans/hetero-4rank.json")))
    assert est.fits_memory and est.iteration_time_s > 0
    est = simulate(load_plan(os.path.join(ROOT, "examples/plans/mixed-lab-manual.json")))
    assert not est.fits_memory and est.bottleneck.startswith("memory-bound: rank")
    d = est.to_dict()
    assert len(d["peak_memory_gb"]) == 36
