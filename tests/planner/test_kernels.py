"""The kernel model of catalog GPUs (planner.kernels): GEMM and elementwise times by hand, the
achieved rate growing with size, a large layer at the old flat rate, and the search choosing
larger micro-batches where they pay and stopping where they do not."""

import json

import pytest
from gpu_runs import GPU_CHECK_MODEL, one_gpu_cluster

from conftest import REPO
from planner import flops, kernels
from planner.devices import device_for
from planner.models import load_model, model_from_dict
from planner.search import search_plan
from planner.searcher import Searcher

A100 = device_for("A100-SXM-80GB")
K = A100.kernels
assert K is not None
PEAK, BW = 312e12, 2039e9


def test_catalog_gpus_are_kernel_timed_cpu_and_profiles_are_not():
    assert K == kernels.KernelDevice(PEAK, BW)
    assert device_for("CPU").kernels is None
    assert device_for("H200").kernels is not None


def test_gemm_time_by_hand():
    # tiny: the floor
    assert kernels.matmul_time(K, 8, 8, 8) == kernels.GEMM_FLOOR_S == 3e-6
    # large: ideal at 0.6 of peak plus the 5 us tail
    m = n = k = 8192
    ideal = 2 * m * n * k / (PEAK * 0.6)
    assert kernels.matmul_time(K, m, k, n) == pytest.approx(ideal + 5e-6, rel=1e-12)
    # mid-sized (ideal 2 us < tail): twice the ideal
    m, k, n = 256, 1024, 1024
    ideal = 2 * m * k * n / (PEAK * 0.6)
    assert 1.5e-6 < ideal < 3e-6
    want = max(3e-6, 2 * ideal, (m * k + k * n + m * n) * 2 / (BW * 0.8))
    assert kernels.matmul_time(K, m, k, n) == pytest.approx(want, rel=1e-12)
    # a matrix-vector product is bound by its bytes
    m, k, n = 1, 16384, 16384
    moved = (m * k + k * n + m * n) * 2 / (BW * 0.8)
    assert kernels.matmul_time(K, m, k, n) == pytest.approx(moved, rel=1e-12)
    # an empty share runs nothing
    assert kernels.matmul_time(K, 4096, 4096, 0) == 0.0
    assert kernels.elementwise_time(K, 0) == 0.0
    assert kernels.elementwise_time(K, 8) == 2e-6
    assert kernels.elementwise_time(K, 1e9) == pytest.approx(1e9 / (BW * 0.8))


def test_achieved_rate_grows_with_size_towards_the_gemm_fraction():
    rates = []
    for size in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384):
        rates.append(2 * size**3 / kernels.matmul_time(K, size, size, size) / PEAK)
    assert rates == sorted(rates)
    assert rates[0] < 0.01 and 0.59 < rates[-1] < 0.6


def test_a_large_layer_runs_near_the_flat_rate():
    """llama2-7b at 4,096 tokens: a layer's forward (GEMMs, norms, rotary, SwiGLU, adds) comes
    out at about the 0.55 of peak the flat model charged; a 270M model's layer at 1,024 tokens
    lower, as its GEMMs are small."""
    m = load_model("llama2-7b")
    t = kernels.attention_times(K, m, 1, 32).fwd + kernels.mlp_times(K, m, 1, 11008).fwd
    rate = flops.layer_flops(m, 1) / t / PEAK
    assert 0.53 < rate < 0.58, rate
    small = model_from_dict(GPU_CHECK_MODEL)
    t = kernels.attention_times(K, small, 1, 8).fwd + kernels.mlp_times(K, small, 1, 2816).fwd
    assert 0.3 < flops.layer_flops(small, 1) / t / PEAK < 0.45  # 0.41
    # backward: every GEMM twice, every elementwise pass's bytes twice
    a = kernels.attention_times(K, m, 1, 32)
    assert a.bwd == pytest.approx(2 * a.fwd)


def test_fused_attention_by_hand():
    """A fused backend's scores: the causal half of the two products at the flash rate, q, k,
    v and the output moved once, 2.5x the FLOPs backward; the unfused products over the whole
    s x s tensor cost more in the forward (llama2-7b on an A100). The GPU check's 1.1B model at
    8 x 4,096 tokens on an H200 comes out within 6 % of its measured step there (layers and
    head; 0.5475 s with CUDA graphs, docs/results/gpu/2026-12-04-nvidia-h200-b.json), and
    above 0.69 s with the unfused products."""
    s, d, heads, mbs = 4096, 128, 32, 1
    flops = 0.5 * 4 * mbs * heads * s * s * d
    got = kernels.fused_attention_times(K, s, d, heads, mbs)
    assert got.fwd == pytest.approx(flops / (PEAK * 0.35))
    assert got.bwd == pytest.approx(2.5 * flops / (PEAK * 0.35))
    assert kernels.fused_attention_times(K, s, d, 0, mbs) == (0.0, 0.0)
    m = load_model("llama2-7b")
    fused, unfused = (kernels.attention_times(K, m, 1, 32, f) for f in (True, False))
    assert fused.fwd < unfused.fwd
    run = json.loads((REPO / "docs/results/gpu/2026-12-04-nvidia-h200-b.json").read_text())
    perf = model_from_dict(run["config"]["perf"]["model"])
    h200 = device_for("H200").kernels
    assert h200 is not None

    def step(fused: bool) -> float:
        a = kernels.attention_times(h200, perf, 8, perf.num_query_groups, fused)
        f = kernels.mlp_times(h200, perf, 8, perf.ffn_hidden_size)
        head = kernels.head_times(h200, 8 * perf.seq_length, perf.hidden_size, perf.vocab_size)
        return perf.num_layers * (a.fwd + a.bwd + f.fwd + f.bwd) + head.fwd + head.bwd

    assert step(True) / 0.5475 - 1 == pytest.approx(0, abs=0.06)
    assert step(False) > 0.69


def test_a_tp_rank_without_heads_only_normalises_and_adds():
    m = load_model("llama2-7b")
    t = kernels.attention_times(K, m, 1, 0)
    tokens_h = 4096 * 4096
    norm = kernels.elementwise_time(K, kernels.NORM_BYTES * tokens_h)
    add = kernels.elementwise_time(K, kernels.ADD_BYTES * tokens_h)
    assert t.fwd == pytest.approx(norm + add)


def test_head_times_by_hand():
    tokens, h, rows = 4096, 4096, 16000
    gemm = kernels.matmul_time(K, tokens, h, rows)
    got = kernels.head_times(K, tokens, h, rows)
    fwd_bytes, bwd_bytes = 2 + 3 * 4, 2 * 4 + 2
    assert got.fwd == pytest.approx(gemm + fwd_bytes * tokens * rows / (BW * 0.8))
    assert got.bwd == pytest.approx(2 * gemm + bwd_bytes * tokens * rows / (BW * 0.8))


@pytest.mark.parametrize(
    "gpu,chosen,tried",
    [
        # small GEMMs and the host favour big micro-batches on a fast GPU: up to the largest
        ("H200", 64, [1, 2, 4, 8, 16, 32, 64]),
        # a T4 gains to 8; 16 does not beat 8, so 32 and 64 are never searched
        ("T4", 8, [1, 2, 4, 8, 16]),
    ],
)
def test_search_takes_larger_micro_batches_while_they_pay(monkeypatch, gpu, chosen, tried):
    sizes = []
    context = Searcher.context

    def recording(self, mbs, rc, k):
        sizes.append(mbs)
        return context(self, mbs, rc, k)

    monkeypatch.setattr(Searcher, "context", recording)
    m = model_from_dict(GPU_CHECK_MODEL)
    plan = search_plan(one_gpu_cluster(gpu), m, 64, recompute="off", attention_backend="auto")
    assert [p.micro_batch_size for p in plan.pipelines] == [chosen]
    assert sorted(set(sizes)) == tried
    # a micro-batch size asked for is the only one searched
    sizes.clear()
    search_plan(
        one_gpu_cluster(gpu), m, 64, micro_batch_size=2, recompute="off", attention_backend="auto"
    )
    assert set(sizes) == {2}
