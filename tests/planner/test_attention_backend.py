"""The plan's attention backend: the field, the flag, and the cost model's memory and time terms
(checked by hand), old plans' meaning, and what the search does with it."""

import dataclasses
import json
import os

import pytest
from host_zero import pinned_model, zero_host_time

from planner import attention, kernels
from planner.cluster import load_cluster
from planner.costmodel import group_costs
from planner.devices import device_for
from planner.memory import RankShape, layer_activation_bytes, rank_memory
from planner.models import load_model
from planner.plan import load_plan, plan_from_dict
from planner.plan_validation import validate_plan_dict
from planner.search import search_plan
from planner.simulator import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L7 = load_model("llama2-7b")
S = 4096

# simulate() of the example plans as the model stood before the attention backend existed (no
# score traffic was charged, the 5as/h memory term was): iteration seconds, max and sum of peak
# memory GB. The times were re-recorded when catalog GPUs came to be timed kernel by kernel
# (planner.kernels), by the same rule: a fused backend's time is the time without score traffic.
BEFORE = {
    "hetero-4rank.json": (0.0037458091076923083, 1.50603968, 6.012069888),
    "mixed-lab-manual.json": (45.711676918293875, 88.06125952, 1040.3768473600003),
}


def _example(name):
    with open(os.path.join(ROOT, "examples/plans", name)) as f:
        return json.load(f)


def _with_backend(plan, backend):
    return dataclasses.replace(
        plan, training=dataclasses.replace(plan.training, attention_backend=backend)
    )


def test_names_and_rule():
    assert attention.ATTENTION_BACKENDS == ("auto", "flash", "fused", "unfused", "local")
    assert attention.FUSED_BACKENDS == {"auto", "flash", "fused"}
    assert [attention.keeps_scores(b) for b in attention.ATTENTION_BACKENDS] == [
        False,
        False,
        False,
        True,
        True,
    ]
    with pytest.raises(ValueError, match="attention backend"):
        attention.keeps_scores("te")


@pytest.mark.parametrize("backend", attention.ATTENTION_BACKENDS)
def test_activation_memory_of_one_layer_by_hand(backend):
    """llama2-7b, s = 4096, b = 1, one rank: s*b*h*(10 + 8) + 8 * s*b*f (SwiGLU), plus
    5*a*s^2*b = 160 sbh (the scores, softmax, dropout mask) only where the backend keeps them."""
    sbh, sbf = S * 4096, S * 11008
    unfused = (18 + 160) * sbh + 8 * sbf
    fused = 18 * sbh + 8 * sbf
    want = unfused if backend in ("unfused", "local") else fused
    assert layer_activation_bytes(L7, 1, 32, 11008, False, backend) == want
    # TP 2: the rank's half of the heads keeps half of the term
    half = (14 + (80 if backend in ("unfused", "local") else 0)) * sbh + 4 * sbf
    assert layer_activation_bytes(L7, 1, 16, 5504, False, backend) == half
    # full recompute keeps the layer input only, whatever the backend
    assert layer_activation_bytes(L7, 1, 32, 11008, True, backend) == 2 * sbh
    shape = RankShape(1, 32, 11008, 32000, False, False, 0, 1, 1, False, 1.0, backend)
    assert rank_memory(L7, shape, 1).activations == want


def test_unfused_time_term_by_hand(monkeypatch):
    """Unfused attention pays 13 B forward and 19 B backward per element of the [b, a, s, s]
    scores at the device's memory bandwidth (A100-SXM-80GB: 2039 GB/s), on top of its score
    products' kernels (planner.kernels: the two batched products over the whole tensor)."""
    zero_host_time(monkeypatch)
    dev = device_for("A100-SXM-80GB")
    assert dev.mem_bw == 2039e9 and dev.kernels is not None
    elements = 1 * 32 * S * S
    xf, xb = 13 * elements / 2039e9, 19 * elements / 2039e9
    assert xf == pytest.approx(3.4229e-3, rel=1e-4)  # 3.4 ms forward per layer
    products = kernels.attention_times(dev.kernels, L7, 1, 32, False)
    mlp = kernels.mlp_times(dev.kernels, L7, 1, 11008)
    ar = group_costs(L7, [dev], (1e12, 0.0), "auto").layer_times(1, [32], [11008], False)
    for rc in (False, True):
        for backend in ("unfused", "local"):
            costs = group_costs(L7, [dev], (1e12, 0.0), backend)
            cf, tf, cb, tb = costs.layer_times(1, [32], [11008], rc)
            assert cf == pytest.approx(products.fwd + mlp.fwd + xf, rel=1e-9)
            # full recompute repeats the forward, its traffic included
            redo = products.fwd + mlp.fwd + xf if rc else 0.0
            assert cb == pytest.approx(products.bwd + mlp.bwd + xb + redo, rel=1e-9)
            assert (tf, tb) == (ar[1], ar[3] * (2 if rc else 1))
    # flash and fused cost as auto does
    for backend in ("flash", "fused"):
        got = group_costs(L7, [dev], (1e12, 0.0), backend).layer_times(1, [32], [11008], False)
        assert got == group_costs(L7, [dev], (1e12, 0.0), "auto").layer_times(
            1, [32], [11008], False
        )
    # TP: each rank moves its heads' share; the group waits for the slowest
    slow = device_for("RTX-4090")
    two = group_costs(L7, [dev, slow], (1e12, 0.0), "unfused")
    cf, _, _, _ = two.layer_times(1, [24, 8], [8256, 2752], False)
    fused_two = group_costs(L7, [dev, slow], (1e12, 0.0), "auto")
    per_rank = [
        kernels.attention_times(d.kernels, L7, 1, q).fwd + 13 * 32 * S * S * q / 32 / d.mem_bw
        for q, d in ((24, dev), (8, slow))
    ]
    c_mlp = max(kernels.mlp_times(d.kernels, L7, 1, x).fwd for x, d in ((8256, dev), (2752, slow)))
    assert cf == pytest.approx(max(per_rank) + c_mlp, rel=1e-12)
    assert cf > fused_two.layer_times(1, [24, 8], [8256, 2752], False)[0]


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_old_plan_loads_as_unfused_and_costs_as_before(name, monkeypatch):
    pinned_model(monkeypatch)
    data = _example(name)
    assert "attention_backend" not in data["training"]
    plan = plan_from_dict(data)
    assert plan.training.attention_backend == "unfused"
    assert plan.to_dict() == data  # written back byte for byte: no field added
    iteration, peak_max, peak_sum = BEFORE[name]
    est = simulate(plan)
    explicit = simulate(plan_from_dict({**data, "training": {**data["training"]}}))
    assert est.iteration_time_s == explicit.iteration_time_s
    # memory: exactly today's (the 5as/h term was always charged)
    assert max(est.peak_memory_gb) == peak_max
    assert sum(est.peak_memory_gb) == pytest.approx(peak_sum, rel=1e-15)
    # time: today's model charged no score traffic, which is a fused backend's time now
    fused = simulate(_with_backend(plan, "auto"))
    assert fused.iteration_time_s == iteration
    assert est.iteration_time_s > iteration
    assert max(fused.peak_memory_gb) < peak_max


def test_field_round_trip_and_validation():
    data = _example("hetero-4rank.json")
    for backend in attention.ATTENTION_BACKENDS:
        d = {**data, "training": {**data["training"], "attention_backend": backend}}
        assert validate_plan_dict(d) == []
        plan = plan_from_dict(d)
        assert plan.training.attention_backend == backend
        written = plan.to_dict()["training"]
        if backend == "unfused":  # the meaning of an absent field: not written
            assert "attention_backend" not in written
        else:
            assert written["attention_backend"] == backend
    for bad in ("flash2", "", 1, None, True):
        d = {**data, "training": {**data["training"], "attention_backend": bad}}
        problems = validate_plan_dict(d)
        assert len(problems) == 1, problems
        assert problems[0].startswith("training.attention_backend: must be one of auto, flash")


def test_cli_default_is_auto_and_show_prints_it(hexi_plan, hexi_manual, hexi_search, tmp_path):
    out = tmp_path / "manual.json"
    assert hexi_manual(out)[::2] == (0, "")
    assert json.loads(out.read_text())["training"]["attention_backend"] == "auto"
    code, table, err = hexi_plan("show", out)
    assert (code, err) == (0, "")
    assert table.splitlines()[1].endswith(
        ", attention auto, sequence-parallel off, transformer-impl local"
    )
    code, line, err = hexi_plan("validate", out)
    assert code == 0 and line.endswith(
        ", attention auto, sequence-parallel off, transformer-impl local\n"
    )
    assert hexi_manual(out, "--attention-backend", "local")[::2] == (0, "")
    assert load_plan(out).training.attention_backend == "local"
    assert (
        hexi_plan("show", out)[1]
        .splitlines()[1]
        .endswith(", attention local, sequence-parallel off, transformer-impl local")
    )

    searched = tmp_path / "plan.json"
    code, _, err = hexi_search(searched)
    assert (code, err) == (0, ""), err
    plan = load_plan(searched)
    assert plan.training.attention_backend == "auto"
    assert plan.estimate["iteration_time_s"] == simulate(plan).iteration_time_s
    code, _, err = hexi_search(searched, "--attention-backend", "unfused")
    assert (code, err) == (0, ""), err
    assert "attention_backend" not in json.loads(searched.read_text())["training"]

    code, _, err = hexi_search(searched, "--attention-backend", "te")
    assert code == 2 and "--attention-backend" in err and "invalid choice" in err


def test_searched_consumer_plan_needs_less_with_a_fused_backend():
    """paper-hetero-consumer (24 GB GPUs), llama2-7b, batch 64: unfused attention keeps 160 of a
    layer's 194 sbh, so its plan needs full recompute; with auto it needs none (and is faster)."""
    cluster = load_cluster(os.path.join(ROOT, "examples/clusters/paper-hetero-consumer.yaml"))
    plans = {
        b: search_plan(cluster, L7, 64, micro_batch_size=1, attention_backend=b)
        for b in ("unfused", "auto")
    }
    assert plans["unfused"].training.recompute
    assert not plans["auto"].training.recompute
    assert plans["auto"].training.attention_backend == "auto"
    assert "attention_backend" not in plans["unfused"].to_dict()["training"]
    assert plans["auto"].estimate["tokens_per_s"] > plans["unfused"].estimate["tokens_per_s"]
    # each plan is costed with its own backend: re-scored, the estimate stands
    for plan in plans.values():
        assert simulate(plan).iteration_time_s == plan.estimate["iteration_time_s"]
