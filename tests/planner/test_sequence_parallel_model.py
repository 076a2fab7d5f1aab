"""Sequence parallelism in the planner: the activation terms it cuts (checked by hand against
Korthikanti et al. 2022, Sec. 4.2.2), the boundary all-gathers it leaves out, what the search
lays out with it, the flags, and that with it off every figure is the one the planner gave
before it existed."""

import dataclasses
import json
import os

import pytest
from host_zero import pinned_model

from planner.cli import build_parser
from planner.cli_args import with_seq_length
from planner.cluster import load_cluster, load_cluster_dict
from planner.membership import PlanningOptions, plan_for
from planner.memory import RankShape, layer_activation_bytes, rank_memory, sequence_split
from planner.models import load_model
from planner.plan import load_plan, plan_from_dict
from planner.plan_validation import validate_plan_dict
from planner.search import STRATEGIES, search_plan
from planner.search_pipeline import chunk_stage_options
from planner.simulator import simulate
from planner.topology import Topology, boundary_times, ring_allgather_time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L7 = load_model("llama2-7b")
TINY = load_model("tiny")
S = 4096
SBH = S * 4096  # llama2-7b, b = 1
SBF = S * 11008

# simulate() of the example plans before sequence parallelism existed (the planner without it):
# iteration seconds, max and sum of peak memory GB per backend. The times were re-recorded when
# catalog GPUs came to be timed kernel by kernel (planner.kernels), which left memory unchanged.
BEFORE = {
    ("hetero-4rank.json", "unfused"): (0.0037467481948576633, 1.50603968, 6.012069888),
    ("hetero-4rank.json", "auto"): (0.0037458091076923083, 1.50587584, 6.011762688),
    ("mixed-lab-manual.json", "unfused"): (47.62055127207165, 88.06125952, 1040.3768473600003),
    ("mixed-lab-manual.json", "auto"): (45.711676918293875, 45.11158656, 643.0923724799997),
}


def _example(name):
    with open(os.path.join(ROOT, "examples/plans", name)) as f:
        return json.load(f)


def _training(plan, **changes):
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, **changes))


def _cluster(name):
    return load_cluster(os.path.join(ROOT, "examples/clusters", name + ".yaml"))


# ----------------------------------------------------------------------------- cost model


def test_sequence_split_rule():
    assert [sequence_split(t, True) for t in (1, 2, 3, 4, 8)] == [1, 2, 3, 4, 8]
    assert [sequence_split(t, False) for t in (1, 2, 4, 8)] == [1, 1, 1, 1]


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_layer_activation_bytes_by_hand(backend):
    """llama2-7b, s = 4096, one TP rank of t with the sequence cut over sigma ranks:
    s*b*h*(10/sigma + 8/t) + 8 s*b*f/t (SwiGLU) [+ 160/t sbh unfused]. Under SP (sigma = t) this
    is Korthikanti's sbh(34/t + 5as/(ht)) with the SwiGLU MLP term."""
    scores = 160 if backend == "unfused" else 0
    for t in (1, 2, 4):
        qg, ffn = 32 // t, 11008 // t
        off = (10 + (8 + scores) / t) * SBH + 8 * SBF / t
        on = (10 / t + (8 + scores) / t) * SBH + 8 * SBF / t
        assert layer_activation_bytes(L7, 1, qg, ffn, False, backend) == off
        assert layer_activation_bytes(L7, 1, qg, ffn, False, backend, sequence_split=1) == off
        assert layer_activation_bytes(L7, 1, qg, ffn, False, backend, sequence_split=t) == on
        # two samples per micro-batch: twice the bytes
        two = layer_activation_bytes(L7, 2, qg, ffn, False, backend, sequence_split=t)
        assert two == 2 * on
        # full recompute keeps the layer input, s/sigma of its positions
        assert layer_activation_bytes(L7, 1, qg, ffn, True, backend) == 2 * SBH
        got = layer_activation_bytes(L7, 1, qg, ffn, True, backend, sequence_split=t)
        assert got == 2 * SBH / t
    # TP 4, fused: 2.5 + 2 = 4.5 sbh and 2 sbf; the cut saves 7.5 sbh = 252 MB per layer
    cut = layer_activation_bytes(L7, 1, 8, 2752, False, "auto", sequence_split=4)
    assert cut == 4.5 * SBH + 2 * SBF
    assert layer_activation_bytes(L7, 1, 8, 2752, False, "auto") - cut == 7.5 * SBH
    # the split acts on the replicated term only, whatever the rank's share of heads and columns
    assert layer_activation_bytes(L7, 1, 32, 11008, False, "auto", sequence_split=2) == (
        (5 + 8) * SBH + 8 * SBF
    )
    with pytest.raises(ValueError, match="sequence_split"):
        layer_activation_bytes(L7, 1, 32, 11008, False, sequence_split=0)


def test_default_is_byte_identical():
    """sequence_split 1 (and the default) gives the same value and type as before."""
    for rc in (False, True):
        for backend in ("auto", "unfused"):
            a = layer_activation_bytes(L7, 1, 16, 5504, rc, backend)
            b = layer_activation_bytes(L7, 1, 16, 5504, rc, backend, sequence_split=1)
            assert a == b and type(a) is type(b)
    assert type(layer_activation_bytes(L7, 1, 16, 5504, True)) is int


@pytest.mark.parametrize("recompute", [False, True])
def test_rank_memory_activations_by_hand(recompute):
    """A TP-2 rank of the first of 4 stages, 8 layers, 8 micro-batches: 4 in flight. Under SP the
    in-flight layers keep 5 + 4 sbh (+ 4 sbf), or 1 sbh each with recompute, plus one layer's
    working set for the recomputed micro-batch; logits and model state do not change."""

    def shape(split, last=False):
        return RankShape(
            1, 16, 5504, 16000, False, last, 0, 4, 8, recompute, 1.0, "auto", split
        )  # fmt: skip

    off, on = rank_memory(L7, shape(1), 8), rank_memory(L7, shape(2), 8)
    working = (5 + 4) * SBH + 4 * SBF
    if recompute:
        assert on.activations == 4 * 8 * SBH + working
        assert off.activations == 4 * 8 * 2 * SBH + (10 + 4) * SBH + 4 * SBF
    else:
        assert on.activations == 4 * 8 * working
        assert off.activations == 4 * 8 * ((10 + 4) * SBH + 4 * SBF)
    assert (on.weights, on.grads, on.optimizer, on.reserve) == (
        off.weights,
        off.grads,
        off.optimizer,
        off.reserve,
    )
    # the output layer gathers the whole sequence: logits [s, b, V_rank] fp32 either way
    last_on, last_off = rank_memory(L7, shape(2, True), 8), rank_memory(L7, shape(1, True), 8)
    assert last_on.logits == last_off.logits == S * 16000 * 4
    # positional order of the fields before it is kept: the split is the last field
    assert [f.name for f in dataclasses.fields(RankShape)][-1] == "sequence_split"


def test_boundary_leaves_out_the_all_gathers():
    """Under SP a TP group's part of the sequence is its part of the split-sent buffer: the same
    transfers, no all-gather on either side (megatron_hexi.communicator)."""
    topo = Topology(_cluster("mini-hetero"))
    (tf, gf), (tb, gb) = boundary_times(TINY, 1, [0, 1], [2], topo)
    assert gb > 0 and gf == 0  # TP 2 senders gather the gradient; a TP-1 receiver need not
    (tf2, gf2), (tb2, gb2) = boundary_times(TINY, 1, [0, 1], [2], topo, True)
    assert (tf2, tb2) == (tf, tb) and (gf2, gb2) == (0.0, 0.0)
    (tf, gf), (tb, gb) = boundary_times(TINY, 1, [2], [0, 1], topo)
    nbytes = 32 * 64 * 2
    assert gf == ring_allgather_time(nbytes, 2, *topo.slowest([0, 1]))
    assert boundary_times(TINY, 1, [2], [0, 1], topo, True) == ((tf, 0.0), (tb, 0.0))


# ------------------------------------------------------------------------------- simulator


@pytest.mark.parametrize("name,backend", sorted(BEFORE))
def test_off_is_the_old_model(name, backend, monkeypatch):
    pinned_model(monkeypatch)
    data = _example(name)
    assert "sequence_parallel" not in data["training"]
    data = {**data, "training": {**data["training"], "attention_backend": backend}}
    plan = plan_from_dict(data)
    assert plan.training.sequence_parallel is False
    explicit = plan_from_dict(
        {**data, "training": {**data["training"], "sequence_parallel": False}}
    )
    assert explicit.to_dict() == plan.to_dict()  # false is not written: same plan
    iteration, peak_max, peak_sum = BEFORE[(name, backend)]
    for p in (plan, explicit):
        est = simulate(p)
        assert est.iteration_time_s == iteration
        assert max(est.peak_memory_gb) == peak_max
        assert sum(est.peak_memory_gb) == peak_sum


@pytest.mark.parametrize("backend", ["unfused", "auto"])
def test_flipping_the_field_cuts_activations_on_tp_stages(backend):
    """mixed-lab-manual (llama2-7b, s = 4096; pipelines of TP 8, TP 8 and TP 2 stages): turned on,
    every rank's activations fall by in-flight x layers x 10 sbh (1 - 1/t), nothing else in its
    memory moves, and the iteration is no longer (no boundary all-gathers)."""
    data = _example("mixed-lab-manual.json")
    data = {**data, "training": {**data["training"], "attention_backend": backend}}
    plan = plan_from_dict(data)
    on_plan = _training(plan, sequence_parallel=True)
    assert validate_plan_dict(on_plan.to_dict()) == []
    off, on = simulate(plan), simulate(on_plan)
    checked = 0
    for pipe in plan.pipelines:
        p = len(pipe.stages)
        for k, st in enumerate(pipe.stages):
            t = len(st.ranks)
            inflight = min(p - k, pipe.num_microbatches)
            layers = st.layers[1] - st.layers[0]
            saved = inflight * layers * 10 * SBH * (1 - 1 / t) / 1e9
            for r in st.ranks:
                a, b = off.memory_terms_gb[r], on.memory_terms_gb[r]
                assert b["activations"] == pytest.approx(a["activations"] - saved, rel=1e-12)
                assert {k: v for k, v in a.items() if k != "activations"} == {
                    k: v for k, v in b.items() if k != "activations"
                }
                assert on.peak_memory_gb[r] < off.peak_memory_gb[r]
                checked += 1
    assert checked == plan.world_size
    assert on.iteration_time_s < off.iteration_time_s
    # with TP 1 everywhere nothing changes: hetero-4rank's TP-1 ranks 2 and 3
    small = plan_from_dict(_example("hetero-4rank.json"))
    a, b = simulate(small), simulate(_training(small, sequence_parallel=True))
    assert a.memory_terms_gb[2:] == b.memory_terms_gb[2:]
    assert b.memory_terms_gb[0]["activations"] < a.memory_terms_gb[0]["activations"]


# ---------------------------------------------------------------------------------- search


def test_unit_options_skip_tp_degrees_that_do_not_divide_the_sequence():
    m30 = with_seq_length(TINY, 30)  # 30 = 2 x 15: TP 2 and 1 only
    assert chunk_stage_options(4, m30) == (1, 2, 4)
    assert chunk_stage_options(4, m30, True) == (2, 4)
    assert chunk_stage_options(3, TINY) == (1, 3)
    assert chunk_stage_options(3, TINY, True) == (3,)  # TP 1 always remains
    assert chunk_stage_options(4, TINY, True) == (1, 2, 4)


def test_searched_plan_records_sp_and_uses_only_dividing_tp_degrees():
    """paper-hetero-consumer, llama2-7b at s = 4094 (2 x 2047): without SP the plan uses TP 4;
    with SP no stage may (4 does not divide 4094), the plan validates, records the field, and
    scores as its estimate; the same layout costs at least as much memory with SP turned off."""
    cluster = _cluster("paper-hetero-consumer")
    m = with_seq_length(L7, 4094)
    kw = dict(micro_batch_size=1, overlap_grad_reduce=True, attention_backend="auto")
    off = search_plan(cluster, m, 64, **kw)
    on = search_plan(cluster, m, 64, sequence_parallel=True, **kw)
    assert 4 in {len(s.ranks) for pp in off.pipelines for s in pp.stages}
    tps = {len(s.ranks) for pp in on.pipelines for s in pp.stages}
    assert tps <= {1, 2} and 2 in tps
    assert on.training.sequence_parallel and not off.training.sequence_parallel
    assert on.to_dict()["training"]["sequence_parallel"] is True
    assert "sequence_parallel" not in off.to_dict()["training"]
    assert validate_plan_dict(on.to_dict()) == []
    est = simulate(on)
    assert est.fits_memory and est.iteration_time_s == on.estimate["iteration_time_s"]
    same_layout_off = simulate(_training(on, sequence_parallel=False))
    tp_of = {r: len(s.ranks) for pp in on.pipelines for s in pp.stages for r in s.ranks}
    for r in range(on.world_size):
        if tp_of[r] > 1:  # less where the sequence is cut, the same elsewhere
            assert est.peak_memory_gb[r] < same_layout_off.peak_memory_gb[r], r
        else:
            assert est.peak_memory_gb[r] == same_layout_off.peak_memory_gb[r], r
    assert est.iteration_time_s <= same_layout_off.iteration_time_s


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_respects_the_divisibility(strategy):
    """A machine of 3 A100s and one of an RTX-4090, tiny (s = 32): with SP no strategy lays out a
    TP-3 stage, and every plan validates."""
    cluster = load_cluster_dict(
        {
            "name": "three-and-one",
            "nodes": [
                {"name": "a", "gpu": "A100-SXM-80GB", "gpus_per_node": 3, "intra_node": "nvlink",
                 "nic": "25 Gbit/s"},
                {"name": "b", "gpu": "RTX-4090", "gpus_per_node": 1, "intra_node": "host",
                 "nic": "25 Gbit/s"},
            ],
        }
    )  # fmt: skip
    plan = search_plan(cluster, TINY, 8, strategy=strategy, sequence_parallel=True)
    assert plan.training.sequence_parallel
    assert all(32 % len(s.ranks) == 0 for pp in plan.pipelines for s in pp.stages)
    assert validate_plan_dict(plan.to_dict()) == []
    assert simulate(plan).iteration_time_s == plan.estimate["iteration_time_s"]


# ------------------------------------------------------------------------------------- CLI


def _args(*argv):
    return build_parser().parse_args([str(a) for a in argv])


def test_flag_defaults():
    common = ["--cluster", "c.yaml", "--model", "tiny", "--global-batch-size", "8"]
    assert _args("plan", *common, "-o", "p.json").sequence_parallel is True
    assert (
        _args("plan", *common, "-o", "p.json", "--no-sequence-parallel").sequence_parallel is False
    )
    assert _args("min-nodes", *common).sequence_parallel is True
    assert _args("min-nodes", *common, "--no-sequence-parallel").sequence_parallel is False
    manual = [*common, "--pipelines", "x.json", "-o", "p.json"]
    assert _args("manual", *manual).sequence_parallel is False
    assert _args("manual", *manual, "--sequence-parallel").sequence_parallel is True
    assert PlanningOptions(8).sequence_parallel is True


def test_planning_options_reach_the_plan():
    """What the runtime's start-up planning and min-nodes go through (planner.membership)."""
    cluster = _cluster("mini-hetero")
    assert plan_for(cluster, TINY, PlanningOptions(8)).training.sequence_parallel is True
    off = plan_for(cluster, TINY, PlanningOptions(8, sequence_parallel=False))
    assert off.training.sequence_parallel is False


def test_plan_default_on_and_off(hexi_plan, hexi_search, tmp_path):
    out = tmp_path / "plan.json"
    code, _, err = hexi_search(out)
    assert (code, err) == (0, ""), err
    assert json.loads(out.read_text())["training"]["sequence_parallel"] is True
    code, line, err = hexi_plan("validate", out)
    assert code == 0 and line.endswith(", sequence-parallel on, transformer-impl local\n")
    code, _, err = hexi_search(out, "--no-sequence-parallel")
    assert (code, err) == (0, ""), err
    assert "sequence_parallel" not in json.loads(out.read_text())["training"]
    assert load_plan(out).training.sequence_parallel is False


def test_manual_default_off_and_on(hexi_plan, hexi_manual, examples_dir, tmp_path):
    out = tmp_path / "manual.json"
    pipes = examples_dir / "pipelines" / "hetero-4rank.json"
    code, _, err = hexi_manual(out, pipelines=pipes)
    assert (code, err) == (0, ""), err
    assert "sequence_parallel" not in json.loads(out.read_text())["training"]
    code, _, err = hexi_manual(out, "--sequence-parallel", pipelines=pipes)
    assert (code, err) == (0, ""), err
    plan = load_plan(out)
    assert plan.training.sequence_parallel is True
    code, table, err = hexi_plan("show", out)
    assert code == 0 and table.splitlines()[1].endswith(
        ", sequence-parallel on, transformer-impl local"
    )


def test_manual_tp3_with_seq_32_is_one_line_error(hexi_plan, hexi_manual, examples_dir, tmp_path):
    pipes = tmp_path / "tp3.json"
    pipes.write_text(
        json.dumps(
            [
                {"micro_batch_size": 1, "num_microbatches": 4,
                 "stages": [{"ranks": [0, 1, 2], "layers": [0, 4]}]},
                {"micro_batch_size": 1, "num_microbatches": 4,
                 "stages": [{"ranks": [3], "layers": [0, 4]}]},
            ]
        )
    )  # fmt: skip
    out = tmp_path / "manual.json"
    code, _, err = hexi_manual(out, pipelines=pipes)
    assert (code, err) == (0, ""), err  # off (manual's default): TP 3 is fine
    out.unlink()
    code, stdout, err = hexi_manual(out, "--sequence-parallel", pipelines=pipes)
    assert code == 2 and stdout == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hexi-plan: error: plan: pipelines[0].stages[0].ranks: ")
    assert "seq_length 32" in lines[0] and "TP degree 3" in lines[0]
    assert not out.exists()


def test_picture_lists_the_setting():
    from planner.picture import plan_figure

    plan = plan_from_dict(_example("hetero-4rank.json"))
    off = plan_figure(plan).axes[0].get_title(loc="left")
    on = plan_figure(_training(plan, sequence_parallel=True)).axes[0].get_title(loc="left")
    assert "sequence parallel" not in off
    assert "sequence parallel" in on
