"""Cost-model formulas against hand-computed numbers."""

import dataclasses
import json

import pytest
from host_zero import zero_host_time

from planner import flops, layout, splits
from planner.cluster import load_cluster_dict
from planner.costmodel import AnalyticCosts, group_costs
from planner.devices import device_for, optimizer_step_time
from planner.memory import RankShape, in_flight_microbatches, layer_activation_bytes, rank_memory
from planner.models import load_model
from planner.schedule import pipeline_time, simulate_1f1b
from planner.topology import (
    Topology,
    boundary_times,
    p2p_transfer_time,
    ring_allgather_time,
    ring_allreduce_time,
)

TINY = load_model("tiny")  # h 64, a 4, g 4, d 16, f 256, V 128, s 32
GQA = load_model("tiny-gqa")  # h 64, a 8, g 4, d 8, f 192, V 120, s 32
L7 = load_model("llama2-7b")


def test_attention_flops_hand_computed():
    # qkv 2*32*64*(64+2*64) + scores/context 2*(2*32*32*4*16) + proj 2*32*64*64
    assert flops.attention_flops(TINY, 1) == 786432 + 262144 + 262144
    # GQA: k and v are h x g*d = 64 x 32: qkv 2*32*64*(64 + 64)
    assert flops.attention_flops(GQA, 1) == 524288 + 2 * (2 * 32 * 32 * 8 * 8) + 2 * 32 * 64 * 64


def test_mlp_head_and_model_flops():
    assert flops.mlp_flops(TINY, 2) == 3 * 2 * 2 * 32 * 64 * 256
    assert flops.head_flops(TINY, 1) == 2 * 32 * 64 * 128
    per_sample = 3 * (4 * (1310720 + 3145728) + 524288)
    assert flops.model_flops_per_sample(TINY) == per_sample


def test_llama2_7b_layer_flops_match_closed_form():
    b, s, h, f = 1, 4096, 4096, 11008
    closed = 8 * b * s * h * h + 4 * b * s * s * h + 6 * b * s * h * f  # MHA, causal not halved
    assert flops.layer_flops(L7, b) == closed
    assert closed == pytest.approx(1.9327e12, rel=1e-4)


def test_ring_collectives():
    assert ring_allreduce_time(1e9, 4, 1e9, 1e-5) == pytest.approx(1.5 + 6e-5)
    assert ring_allgather_time(1e9, 4, 1e9, 1e-5) == pytest.approx(0.75 + 3e-5)
    assert ring_allreduce_time(1e9, 1, 1e9, 1e-5) == 0.0


def _cluster():
    return load_cluster_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": "a",
                    "gpu": "A100-SXM-80GB",
                    "gpus_per_node": 4,
                    "intra_node": "100 GB/s",
                    "nic": "8 GB/s",
                    "nic_latency": "10 us",
                },
                {
                    "name": "b",
                    "gpu": "RTX-4090",
                    "gpus_per_node": 4,
                    "intra_node": "10 GB/s",
                    "nic": "8 GB/s",
                    "nic_latency": "10 us",
                },
            ],
        }
    )


def test_p2p_split_transfer_and_nic_limit():
    topo = Topology(_cluster())
    n = 3e9
    # 2 senders on node a -> 3 receivers on node b: largest pair part n/3; but all n bytes leave
    # node a through its 8 GB/s NIC, which dominates.
    t = p2p_transfer_time(n, [0, 1], [4, 5, 6], topo)
    assert t == pytest.approx(n / 8e9)
    # inside one machine: pairs in parallel, no NIC: largest part n/3 at 100 GB/s + 5 us
    t = p2p_transfer_time(n, [0, 1], [1, 2, 3], topo)
    assert t == pytest.approx(n / 3 / 100e9 + 5e-6)


def test_boundary_includes_allgather():
    topo = Topology(_cluster())
    (tf, gf), (tb, gb) = boundary_times(TINY, 1, [0], [4, 5], topo)
    nbytes = 32 * 64 * 2
    assert gf == pytest.approx(ring_allgather_time(nbytes, 2, 10e9, 5e-6))
    assert gb == 0.0  # one sender: nothing to gather
    assert tf == pytest.approx(max(nbytes / 2 / 8e9 + 10e-6, nbytes / 8e9))


def test_slowest_pair():
    topo = Topology(_cluster())
    assert topo.slowest([0, 1]) == (100e9, 5e-6)
    assert topo.slowest([0, 1, 4]) == pytest.approx((8e9, 10e-6))


def test_proportional_split():
    assert splits.proportional_split(52, [1] * 8) == [7, 7, 7, 7, 6, 6, 6, 6]
    assert splits.proportional_split(10, [2, 1, 1]) == [4, 3, 3]
    assert sum(splits.proportional_split(11008, [165, 71, 71])) == 11008


def test_uneven_tp_shards_cost_in_proportion(monkeypatch):
    zero_host_time(monkeypatch)
    # timed from FLOPs at the sustained rate (the kernel model's own figures:
    # tests/planner/test_kernels.py)
    dev = dataclasses.replace(device_for("A100-SXM-80GB"), kernels=None)
    # fused attention: FLOPs alone (tests/planner/test_attention_backend.py: the unfused term)
    costs = group_costs(TINY, [dev, dev], (1e9, 0.0), "auto")
    assert isinstance(costs, AnalyticCosts)
    cf, tf, cb, tb = costs.layer_times(1, [3, 1], [192, 64], False)
    expect = (
        flops.attention_flops(TINY, 1) * 3 / 4 + flops.mlp_flops(TINY, 1) * 192 / 256
    ) / dev.flops
    assert cf == pytest.approx(expect)
    assert tf == pytest.approx(2 * ring_allreduce_time(32 * 64 * 2, 2, 1e9, 0.0))
    assert cb == pytest.approx(2 * cf) and tb == pytest.approx(tf)
    cf2, tf2, cb2, tb2 = costs.layer_times(1, [3, 1], [192, 64], True)
    assert cb2 == pytest.approx(3 * cf) and tb2 == pytest.approx(2 * tf)


def test_params_and_memory():
    assert layout.layer_params(TINY, 4, 256) == 4 * 64 * 64 + 3 * 64 * 256 + 2 * 64
    assert layout.total_params(TINY) == 4 * 65664 + 2 * 128 * 64 + 64
    tied = load_model("tiny-tied")
    assert layout.total_params(tied) == 4 * 65664 + 128 * 64 + 64
    # llama2-7b, one GPU: 18 B/param
    one_gpu = RankShape(1, 32, 11008, 32000, True, True, 0, 1, 8, False)
    mem = rank_memory(L7, one_gpu, 32)
    P = layout.total_params(L7)
    assert P == pytest.approx(6.738e9, rel=1e-3)
    assert mem.weights + mem.grads + mem.optimizer == pytest.approx(18 * P)
    sbh = 4096 * 4096
    # unfused attention (a plan's default backend): + 5as/h = 5 * 32 * 4096 / 4096 = 160
    assert one_gpu.attention_backend == "unfused"
    # SwiGLU MLP: 8 bytes per FFN column per token (gate, up, SiLU(gate), product, bf16)
    sbf = 4096 * 11008
    assert layer_activation_bytes(L7, 1, 32, 11008, False) == (18 + 160) * sbh + 8 * sbf
    # TP 2: 10 + 8/2 + 160/2, and half the FFN columns
    assert layer_activation_bytes(L7, 1, 16, 5504, False) == (14 + 80) * sbh + 4 * sbf
    assert layer_activation_bytes(L7, 1, 16, 5504, True) == 2 * sbh
    assert mem.activations == 1 * 32 * ((18 + 160) * sbh + 8 * sbf)  # one stage: 1 in flight
    assert mem.logits == 4096 * 32000 * 4
    # stage 0 of 4 keeps 4 micro-batches, stage 3 one; fewer if fewer micro-batches
    assert in_flight_microbatches(0, 4, 8) == 4
    assert in_flight_microbatches(3, 4, 8) == 1
    assert in_flight_microbatches(0, 4, 2) == 2
    middle = RankShape(1, 32, 11008, 32000, False, False, 0, 1, 1, False, 0.5)
    half = rank_memory(L7, middle, 1)
    assert half.optimizer == pytest.approx(12 * layout.layer_params(L7, 32, 11008) * 0.5)


def test_optimizer_step_time():
    assert optimizer_step_time(1e9, 1e12) == pytest.approx(0.03)


def test_profile_hook(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"device": "RTX-4090", "matmul_tflops": 100.0, "memory_gb": 23}))
    d = device_for("RTX-4090", str(prof))
    assert d.flops == 100e12 and d.memory_bytes == 23e9 and d.peak_flops == 165.2e12
    assert device_for("RTX-4090").flops == pytest.approx(165.2e12 * 0.55)


def test_1f1b_uniform_closed_form():
    # equal stages, no communication: (m + p - 1) * (f + b)
    assert simulate_1f1b([1.0] * 4, [2.0] * 4, [0.0] * 3, [0.0] * 3, 8) == pytest.approx(33.0)
    assert simulate_1f1b([1.0], [2.0], [], [], 5) == pytest.approx(15.0)
    # fewer micro-batches than stages
    assert simulate_1f1b([1.0] * 4, [2.0] * 4, [0.0] * 3, [0.0] * 3, 2) == pytest.approx(15.0)


def test_1f1b_transfers_and_slow_stage():
    # two stages, transfer 0.5 each way, m = 1: f0 + x + f1 + b1 + x + b0
    assert simulate_1f1b([1.0, 1.0], [2.0, 2.0], [0.5], [0.5], 1) == pytest.approx(7.0)
    # a slow stage sets the steady state: m * (f+b) of the slow stage dominates
    t = simulate_1f1b([1.0, 3.0], [2.0, 6.0], [0.0], [0.0], 50)
    assert t == pytest.approx(50 * 9 + 1 + 2)


def test_extrapolation_matches_simulation():
    import random

    rng = random.Random(1)
    for _ in range(10):
        p = rng.randint(1, 6)
        f = [rng.uniform(0.5, 2) for _ in range(p)]
        b = [x * rng.uniform(1.5, 3) for x in f]
        xf = [rng.uniform(0, 0.3) for _ in range(p - 1)]
        xb = [rng.uniform(0, 0.3) for _ in range(p - 1)]
        m = rng.randint(60, 200)
        assert pipeline_time(f, b, xf, xb, m) == pytest.approx(
            simulate_1f1b(f, b, xf, xb, m), rel=1e-3
        )


def test_compiled_1f1b_equals_sweep_simulation():
    import random

    from planner.schedule import simulate_1f1b_sweep

    rng = random.Random(5)
    for _ in range(200):
        p, m = rng.randint(1, 9), rng.randint(1, 40)
        f = [rng.uniform(0.1, 2) for _ in range(p)]
        b = [x * rng.uniform(1, 3) for x in f]
        xf = [rng.choice([0.0, rng.uniform(0, 2)]) for _ in range(p - 1)]
        xb = [rng.uniform(0, 2) for _ in range(p - 1)]
        assert simulate_1f1b(f, b, xf, xb, m) == simulate_1f1b_sweep(f, b, xf, xb, m)


def test_steady_period_is_the_growth_rate_with_slow_links():
    import random

    from planner.schedule import steady_period

    # two stages, slow link: the cycle f0+b0+f1+b1+xf+xb spans two micro-batches
    assert steady_period([1.0, 1.0], [2.0, 2.0], [2.0], [2.0]) == pytest.approx(5.0)
    rng = random.Random(3)
    for _ in range(30):
        p = rng.randint(1, 20)
        f = [rng.uniform(0.1, 2) for _ in range(p)]
        b = [x * rng.uniform(1, 3) for x in f]
        xf = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(p - 1)]
        xb = [rng.uniform(0, 3) for _ in range(p - 1)]
        m = 10 * p + 200
        rate = (simulate_1f1b(f, b, xf, xb, 2 * m) - simulate_1f1b(f, b, xf, xb, m)) / m
        assert steady_period(f, b, xf, xb) == pytest.approx(rate, rel=2e-3)
        # extrapolation beyond the simulated count, with slow links
        m2 = rng.randint(100, 300)
        assert pipeline_time(f, b, xf, xb, m2) == pytest.approx(
            simulate_1f1b(f, b, xf, xb, m2), rel=1e-2
        )
