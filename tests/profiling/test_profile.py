"""hexi-profile on a tiny model under --max-seconds, and the planner using the profile."""

import json
import os
import re
import subprocess
import sys

import pytest

from megatron_hexi.profile.cli import GRID_RESERVE
from planner.cluster import load_cluster_dict
from planner.measured_costs import cost_sources
from planner.models import load_model
from planner.plan import build_plan
from planner.simulator import simulate
from planner.topology import Topology

TWO_STAGES = [
    {
        "micro_batch_size": 2,
        "num_microbatches": 4,
        "stages": [{"ranks": [0, 1], "layers": [0, 2]}, {"ranks": [2], "layers": [2, 4]}],
    }
]


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory, repo_root):
    out = tmp_path_factory.mktemp("profile") / "cpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "megatron_hexi.profile",
            "--model",
            "tiny",
            "--tp-widths",
            "1",
            "2",
            "--micro-batch-sizes",
            "1",
            "2",
            "--comm-procs",
            "2",
            "--reps",
            "3",
            "--max-seconds",
            "25",
            "--device",
            "cpu",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo_root,
        # only against a hang: --max-seconds bounds the measuring (checked below), but a fresh
        # interpreter's imports and the comm job's start come first, and on a loaded machine (the
        # suite's other worker beside it) they alone have taken over 40 s
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc


def test_profile_contents(tiny_profile):
    path, proc = tiny_profile
    assert "hexi-profile [" in proc.stderr  # progress bar on stderr
    data = json.loads(path.read_text())
    assert data["format"] == "hexi-device-profile/1" and data["device"] == "CPU"
    assert data["matmul_tflops"] > 0 and data["threads"] == 1
    widths = {(e["tp"], e["mbs"]) for e in data["layer"]}
    assert (1, 1) in widths
    for e in data["layer"]:
        assert e["fwd_s"] > 0 and e["bwd_s"] > 0 and e["bwd_recompute_s"] > 0
        assert e["fwd_recompute_s"] > 0  # not ordered against fwd_s: two stages' own rounds
        # the host's part of each pass: on a CPU the host is the device, the part is the pass
        # (the call returns after the work; the fastest of the same runs on both sides)
        assert 0 < e["host_fwd_s"] <= e["fwd_s"] and 0 < e["host_bwd_s"] <= e["bwd_s"]
    assert data["head"] and data["embedding"]
    assert data["optimizer"]["s_per_param"] > 0
    _assert_grid_kept_to_the_budget(proc.stderr, budget_s=25)
    comm = data["comm"]
    assert comm["procs"] == 2 and comm["backend"] == "gloo"
    for kind in ("allreduce", "allgather", "p2p"):
        assert comm[kind] and all(p["s"] > 0 for p in comm[kind])
    # in-situ TP layers over the real 2-process group, one row per micro-batch size
    assert [(r["tp"], r["mbs"]) for r in data["tp_layer"]] == [(2, 1), (2, 2)]
    for r in data["tp_layer"]:
        for k in ("fwd_s", "bwd_s", "bwd_recompute_s"):
            assert r[k] > 0 and r["compute_" + k] > 0
        # one all-reduce with the partner waiting: a time, but not ordered against a layer
        # pass (on a loaded machine waking the partner can take longer than a tiny layer)
        assert 0 < r["allreduce_ready_s"] < 1.0
        # time inside the all-reduce calls (and an asynchronous one's wait): part of the pass,
        # from the same rounds (mean over ranks, the pass the slowest rank's)
        for k in ("fwd_s", "bwd_s", "bwd_recompute_s"):
            assert 0 < r["in_allreduce_" + k] <= r[k]
    # contention from the runtime's own 2-rank data-parallel step against the one-rank step
    cont = data["contention"]
    train = cont["training"]
    assert cont["procs"] == 2 and cont["slowdown"] >= 1.0
    # the layer probe compares with the grid's (tp 1, micro-batch 2) point; on a loaded machine
    # --max-seconds can end the grid before it (measured with two test suites at once), and the
    # probe then has nothing to compare with
    if any((e["tp"], e["mbs"]) == (1, 2) for e in data["layer"]):
        assert cont["probe_slowdown"] > 0
    else:
        assert cont["probe_slowdown"] is None and not data["complete"]
    assert train["step_s"] > 0 and train["one_rank_step_s"] > 0 and train["params"] > 0
    # bursts at the comm job's start, between grid rounds, before and after its TP runs: the
    # fastest is kept
    assert len(train["bursts_s"]) >= 3 and train["step_s"] == min(train["bursts_s"])
    assert train["one_rank_step_s"] <= train["one_rank_measured_s"]
    # runtime overheads: one-rank Trainer bursts spread over the profile, against the planner's
    # own prediction for the same plans
    rt = data["runtime"]
    assert len(rt["bursts"]) >= 2 and rt["per_microbatch_s"] >= 0 and rt["per_step_s"] >= 0
    assert [p["microbatches"] for p in rt["points"]] == [1, 4]
    assert all(p["step_s"] > 0 and p["predicted_s"] > 0 for p in rt["points"])
    assert cont["slowdown"] == pytest.approx(
        max((train["step_s"] - train["grad_allreduce_s"]) / train["one_rank_step_s"], 1.0)
    )


def _assert_grid_kept_to_the_budget(progress: str, budget_s: float) -> None:
    """--max-seconds rations the grid, the part that grows with the asked sizes: a grid point
    after the first starts only while GRID_RESERVE of the budget is left. Read from the progress
    lines (each ends with the elapsed seconds at its step), so that a loaded machine, which slows
    the parts that always run (imports, optimizer, comm job), cannot fail it: the whole profile's
    wall time is no contract."""
    steps = [
        (float(m.group(1)), m.group(2))
        for m in re.finditer(
            r"^hexi-profile \[[#.]*\] \d+/\d+ +([\d.]+)s/[\d.]+s (.*)$", progress, re.M
        )
    ]
    grid = [i for i, (_, what) in enumerate(steps) if re.match(r"round \d+ layer ", what)]
    assert grid, progress
    for i in grid[1:]:
        started = steps[i - 1][0]  # the step before it ended when it started
        assert started <= budget_s * (1 - GRID_RESERVE) + 0.05, (steps[i][1], started)


def test_budget_check_catches_a_grid_that_ignores_the_budget():
    def bar(*steps):
        return "".join(
            f"hexi-profile [##..] {i}/9 {t:5.1f}s/25s {w}\n" for i, (t, w) in enumerate(steps)
        )

    kept = bar(
        (3.0, "matmul"),
        (9.0, "round 1 layer tp1 mbs1: fwd"),
        (13.7, "round 1 layer tp1 mbs2: fwd"),
        (30.0, "optimizer"),
    )
    _assert_grid_kept_to_the_budget(kept, budget_s=25)
    ignored = bar(
        (3.0, "matmul"),
        (9.0, "round 1 layer tp1 mbs1: fwd"),
        (16.0, "round 1 layer tp1 mbs2: fwd"),
        (20.0, "round 2 layer tp1 mbs1: fwd"),
    )
    with pytest.raises(AssertionError, match="round 2 layer"):
        _assert_grid_kept_to_the_budget(ignored, budget_s=25)


def test_runtime_overheads_and_contention_arithmetic():
    """What the one-rank steps take beyond the planner's prediction splits into per micro-batch
    and per step (never negative); a data-parallel step (less its all-reduce) faster than every
    one-rank burst stands for the one-rank step."""
    from megatron_hexi.profile.cli import contention
    from megatron_hexi.profile.runtime_overhead import overheads

    got = overheads({1: 0.011, 4: 0.035}, {1: 0.009, 4: 0.030}, 100)
    assert got["per_microbatch_s"] == pytest.approx(0.001)
    assert got["per_step_s"] == pytest.approx(0.001)
    assert got["points"][1] == {"microbatches": 4, "step_s": 0.035, "predicted_s": 0.030}
    low = overheads({1: 0.008, 4: 0.026}, {1: 0.009, 4: 0.030}, 100)
    assert low["per_microbatch_s"] == 0.0 and low["per_step_s"] == 0.0
    curve = {"allreduce": [{"bytes": 1000, "s": 0.001}, {"bytes": 4000, "s": 0.004}]}

    def entry(step_s, one):
        cont = {
            "procs": 2,
            "together_s": 0.012,
            "training": {"procs": 2, "microbatches": 4, "step_s": step_s, "params": 1000},
        }
        return contention(cont, {"fwd_s": 0.004, "bwd_s": 0.006}, {1: 0.1, 4: one}, curve)

    slow = entry(0.30, 0.20)  # all-reduce of 4000 B: 4 ms
    assert slow["slowdown"] == pytest.approx(0.296 / 0.20)
    assert slow["probe_slowdown"] == pytest.approx(1.2)
    fast = entry(0.30, 0.35)
    assert fast["slowdown"] == pytest.approx(1.0)
    assert fast["training"]["one_rank_step_s"] == pytest.approx(0.296)
    assert fast["training"]["one_rank_measured_s"] == 0.35
    # no runtime steps and no grid point to compare with: no contention entry at all
    assert contention({"procs": 2, "together_s": 0.01}, None, None, curve) is None


def test_comm_job_failure_is_reported_not_waited_for():
    """A comm-job process that fails while the profiler waits for it: the profiler raises with
    the process's error at once (it does not sit out its wait)."""
    import time

    from torch.multiprocessing import ProcessRaisedException

    from megatron_hexi.profile import comm

    t0 = time.monotonic()
    job = comm.CommJob(2, 1, "cpu", 3, layer_job=comm.LayerJob(None, [1], 3, "float32", 1, "auto"))
    with pytest.raises(ProcessRaisedException, match="num_layers"):
        job.wait_ready(120)
    job.close()
    assert time.monotonic() - t0 < 60


def _cluster(profile):
    group = {
        "name": "cpu",
        "gpu": "CPU",
        "gpus_per_node": 3,
        "intra_node": "host",
        "nic": "10 Gbit/s",
    }
    if profile:
        group["profile"] = str(profile)
    return load_cluster_dict({"name": "cpu-3", "nodes": [group]})


def test_planner_uses_profile(tiny_profile, tmp_path):
    path, _ = tiny_profile
    model = load_model("tiny")
    with_p = simulate(build_plan(_cluster(path), model, 8, TWO_STAGES))
    without = simulate(build_plan(_cluster(None), model, 8, TWO_STAGES))
    assert with_p.iteration_time_s > 0 and with_p.iteration_time_s != without.iteration_time_s
    topo = Topology(_cluster(path))
    src = cost_sources(topo, model)
    assert "measured per-layer" in src["cpu"] and "contention" in src["cpu"]
    assert "no profile" in cost_sources(Topology(_cluster(None)), model)["cpu"]
    # another model: falls back to matmul_tflops, and says so
    other = cost_sources(topo, load_model("tiny-gqa"))
    assert "another model" in other["cpu"]
    simulate(build_plan(_cluster(path), load_model("tiny-gqa"), 8, TWO_STAGES))
    # interpolation: more micro-batch work never costs less
    from planner.profiles import DeviceProfile

    prof = DeviceProfile(json.loads(path.read_text()), str(path))
    top = max(e["mbs"] for e in prof.data["layer"])
    assert prof.layer("fwd_s", 1.0, 2 * top) > prof.layer("fwd_s", 1.0, top) > 0


def _synthetic_profile(tmp_path, slowdown=1.5, ready=None, cores=2, inside=None, device="CPU"):
    """A detailed profile of `tiny` with round numbers: every layer pass costs 10 ms x shard x
    micro-batch, and the in-situ 2-way TP layer 8 ms (fwd) / 14 ms (bwd) / 20 ms (recompute bwd)
    per micro-batch sample; `ready` and `inside`, where given, are the in-situ rows' ready
    all-reduce and time inside the all-reduce calls per sample; `device`: CPU, or a GPU's
    name."""
    model = load_model("tiny")
    layer = [
        {
            "tp": t,
            "query_groups": 4 // t,
            "ffn": 256 // t,
            "mbs": b,
            "fwd_s": 0.010 * b / t,
            "bwd_s": 0.020 * b / t,
            "bwd_recompute_s": 0.030 * b / t,
        }
        for t in (1, 2)
        for b in (1, 2)
    ]
    tp_layer = [
        {
            "tp": 2,
            "mbs": b,
            "fwd_s": 0.008 * b,
            "bwd_s": 0.014 * b,
            "bwd_recompute_s": 0.020 * b,
            "compute_fwd_s": 0.005 * b,
            "compute_bwd_s": 0.01 * b,
            "compute_bwd_recompute_s": 0.015 * b,
            **({} if ready is None else {"allreduce_ready_s": ready * b}),
            **(
                {}
                if inside is None
                else {
                    f"in_allreduce_{k}": inside * b for k in ("fwd_s", "bwd_s", "bwd_recompute_s")
                }
            ),
        }
        for b in (1, 2)
    ]
    curve = [{"bytes": 1 << k, "s": 1e-4 * (1 + (1 << k) / 1e8)} for k in (10, 14, 18, 22)]
    data = {
        "format": "hexi-device-profile/1",
        "device": device,
        "dtype": "float32",
        "threads": 1,
        "cpu_cores": cores,
        "matmul_tflops": 0.1,
        "model": model.__dict__,
        "layer": layer,
        "embedding": [],
        "head": [],
        "tp_layer": tp_layer,
        "contention": {"procs": 2, "slowdown": slowdown},
        "comm": {
            "procs": 2,
            "allreduce": curve,
            "allgather": curve,
            "p2p": curve,
            "fit": {"allreduce": {"bandwidth_gbs": 0.1, "latency_us": 50}},
        },
    }
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps(data))
    return path, model


def test_per_microbatch_overhead_by_the_layers_held(tmp_path):
    """The profile's per-micro-batch overhead (one-rank steps of the whole model beyond the
    prediction) is charged to a stage by its share of the layers: the stages of a pipeline add
    up to the one-rank plan's charge, instead of each paying it whole."""
    import types

    from planner.costmodel import stage_cost
    from planner.measured_costs import MeasuredCosts
    from planner.profiles import DeviceProfile, ProfiledDevice

    path, model = _synthetic_profile(tmp_path)
    data = json.loads(path.read_text())
    data["runtime"] = {"per_microbatch_s": 0.004, "per_step_s": 0.001}
    prof = DeviceProfile(data, str(path))
    dev = types.SimpleNamespace(name="CPU", profile=ProfiledDevice(prof, 1.5), flops=1e11)
    costs = MeasuredCosts(model, [dev], prof.link)
    assert model.num_layers == 4
    for n, want in ((4, 0.006), (2, 0.003), (3, 0.0045), (1, 0.0015)):
        assert costs.extra(1, [model.vocab_size], False, n) == pytest.approx((want, 0.0))
    # a first stage over a TP group: the layers' share, whatever each rank's vocabulary share
    # (the embedding's measured compute, by vocabulary share, comes on top)
    data["embedding"] = [
        {"tp": t, "vocab": 128 // t, "mbs": 1, "fwd_s": 0.001 / t, "bwd_s": 0.002 / t}
        for t in (1, 2)
    ]
    prof = DeviceProfile(data, str(path))
    dev = types.SimpleNamespace(name="CPU", profile=ProfiledDevice(prof, 1.5), flops=1e11)
    pair = MeasuredCosts(model, [dev, dev], prof.link)
    with_half, without = pair.extra(1, [96, 32], True, 2), pair.extra(1, [96, 32], True, 0)
    assert without == pytest.approx((0.00075 * 1.5, 0.0015 * 1.5))  # the embedding alone
    assert with_half[0] - without[0] == pytest.approx(0.003) and with_half[1] == without[1]
    # through a stage's cost: the forward of a 2-layer middle stage is its layers + half of it
    shards = {"query_groups": [4], "ffn": [256], "vocab": [model.vocab_size]}
    mid = stage_cost(model, 1, [dev], shards, 2, False, False, prof.link, False)
    assert mid.fwd == pytest.approx(2 * 0.010 * 1.5 + 0.003)


def test_a_recompute_stage_runs_the_forward_measured_under_recompute(tmp_path):
    """Under full recompute the forward saves no activations and runs faster: a recompute
    plan's layer forward is the profile's `fwd_recompute_s`, its backward `bwd_recompute_s`;
    a profile written before the forward under recompute was measured charges the plain
    forward."""
    import types

    from planner.measured_costs import MeasuredCosts
    from planner.profiles import DeviceProfile, ProfiledDevice

    path, model = _synthetic_profile(tmp_path)
    data = json.loads(path.read_text())
    old = DeviceProfile(json.loads(path.read_text()), str(path))
    for r in data["layer"]:
        r["fwd_recompute_s"] = 0.008 * r["mbs"] / r["tp"]  # the plain forward: 10 ms x b / t
    new = DeviceProfile(data, str(path))

    def times(prof, recompute):
        dev = types.SimpleNamespace(name="CPU", profile=ProfiledDevice(prof, 1.5), flops=1e11)
        return MeasuredCosts(model, [dev], prof.link).layer_times(2, [4], [256], recompute)

    assert times(new, True) == pytest.approx((0.016 * 1.5, 0.0, 0.060 * 1.5, 0.0))
    assert times(new, False) == pytest.approx((0.020 * 1.5, 0.0, 0.040 * 1.5, 0.0))
    assert times(old, True) == pytest.approx((0.020 * 1.5, 0.0, 0.060 * 1.5, 0.0))
    assert new.fwd_recompute_field == "fwd_recompute_s" and old.fwd_recompute_field == "fwd_s"


def test_in_situ_tp_comm(tmp_path):
    """A TP group as wide as the profile's in-situ runs pays what the measured TP layer takes
    beyond the model's own compute estimate (grid x contention); other widths use the curve."""
    import types

    from planner.measured_costs import MeasuredCosts
    from planner.profiles import DeviceProfile, ProfiledDevice

    path, model = _synthetic_profile(tmp_path)
    prof = DeviceProfile(json.loads(path.read_text()), str(path))
    dev = types.SimpleNamespace(
        name=prof.data["device"], profile=ProfiledDevice(prof, prof.contention(2)), flops=1e11
    )
    assert prof.contention(2) == pytest.approx(1.5)
    # forward: 8 ms measured, compute estimate 10 ms x 1/2 x 1.5 = 7.5 ms -> 0.5 ms of comm
    cf, tf, cb, tb = MeasuredCosts(model, [dev, dev], prof.link).layer_times(
        1, [2, 2], [128, 128], False
    )
    assert cf == pytest.approx(0.0075) and tf == pytest.approx(0.0005)
    assert cb == pytest.approx(0.015) and tb == pytest.approx(0.0)  # 14 ms < 15 ms: none
    _, _, cbr, tbr = MeasuredCosts(model, [dev, dev], prof.link).layer_times(
        2, [2, 2], [128, 128], True
    )
    assert cbr == pytest.approx(0.045) and tbr == pytest.approx(0.0)  # 40 ms < 45 ms
    assert cf + tf == pytest.approx(0.008)  # compute + comm give back the TP layer
    # a group on another link (not inside the profiled node): the all-reduce curve / fit
    other = (prof.link[0] / 10, prof.link[1])
    _, tf_other, _, _ = MeasuredCosts(model, [dev, dev], other).layer_times(
        1, [2, 2], [128, 128], False
    )
    nbytes = model.seq_length * model.hidden_size * 4
    assert tf_other == pytest.approx(2 * prof.allreduce(nbytes, 2, other))
    # a 4-way group: not the profiled width, so the measured curve's ring fit
    _, tf4, _, _ = MeasuredCosts(model, [dev] * 4, prof.link).layer_times(
        1, [1] * 4, [64] * 4, False
    )
    assert tf4 == pytest.approx(2 * prof.allreduce(nbytes, 4, prof.link)) and tf4 > 0


def _tp_layer_times(tmp_path, qg, ffn, ready, inside=None, device="CPU"):
    """MeasuredCosts.layer_times (micro-batch 1, no recompute) of a 2-way TP group of `device`
    ranks with shards `qg` / `ffn`, from the synthetic profile with these in-situ figures."""
    import types

    from planner.measured_costs import MeasuredCosts
    from planner.profiles import DeviceProfile, ProfiledDevice

    path, model = _synthetic_profile(tmp_path, 1.0, ready=ready, inside=inside, device=device)
    prof = DeviceProfile(json.loads(path.read_text()), str(path))
    dev = types.SimpleNamespace(name=device, profile=ProfiledDevice(prof, 1.0), flops=1e11)
    return MeasuredCosts(model, [dev, dev], prof.link).layer_times(1, qg, ffn, False)


def test_uneven_shards_absorb_the_skew(tmp_path):
    """GPU profiles: the in-situ comm of even shards holds the wait for a late partner; a rank
    with less to compute arrives early at every all-reduce, so an uneven group pays the
    all-reduces alone (`allreduce_ready_s`) once its imbalance exceeds that wait, and part of the
    wait below."""
    from planner.measured_costs import skew_absorbed

    assert skew_absorbed(3.0, 1.0, 0.0) == 3.0  # even: the in-situ figure
    assert skew_absorbed(3.0, 1.0, 0.5) == 2.5
    assert skew_absorbed(3.0, 1.0, 5.0) == 1.0  # the all-reduces alone
    assert skew_absorbed(3.0, 4.0, 5.0) == 3.0  # never above the in-situ figure

    def comm(ready, qg, ffn):
        return _tp_layer_times(tmp_path, qg, ffn, ready, device="NVIDIA H200")

    # even shards: 8 ms measured, 5 ms computed -> 3 ms of comm, with or without the ready figure
    even = comm(0.0004, [2, 2], [128, 128])
    assert even[1] == pytest.approx(0.003) == comm(None, [2, 2], [128, 128])[1]
    # 3:1 shards: the busy rank computes 7.5 ms against 2.5 ms: the two all-reduces alone
    cf, tf, _, _ = comm(0.0004, [3, 1], [192, 64])
    assert cf == pytest.approx(0.0075) and tf == pytest.approx(0.0008)
    # a profile without the ready figure charges the in-situ comm whole, as before
    assert comm(None, [3, 1], [192, 64])[1] == pytest.approx(0.003)


def test_a_cpu_node_pays_the_in_situ_comm_whole(tmp_path):
    """On a CPU node an uneven group's busy rank spends as long inside its all-reduce calls as
    the even runs' ranks (measured in training): the imbalance absorbs nothing, whatever the
    ready all-reduce and the time inside the calls read."""

    def comm(qg, ffn, device, inside=None):
        return _tp_layer_times(tmp_path, qg, ffn, 0.0004, inside, device)[1]

    assert comm([3, 1], [192, 64], "CPU") == pytest.approx(0.003)
    assert comm([3, 1], [192, 64], "CPU", inside=0.001) == pytest.approx(0.003)
    assert comm([2, 2], [128, 128], "CPU") == pytest.approx(0.003)
    # the same profile on a GPU absorbs the skew
    assert comm([3, 1], [192, 64], "NVIDIA H200") == pytest.approx(0.0008)


def test_a_collective_of_fewer_bytes_is_never_charged_more(tmp_path):
    """A measured curve's slow small point (a call whose partner left the barrier late) is
    capped by the larger sizes, wherever the planner asks for that size."""
    from planner.profiles import DeviceProfile

    path, _ = _synthetic_profile(tmp_path, slowdown=1.0)
    data = json.loads(path.read_text())
    slow = [{"bytes": 1024, "s": 2.6e-3}, {"bytes": 4096, "s": 0.34e-3}]
    slow += [{"bytes": 65536, "s": 1.45e-3}, {"bytes": 262144, "s": 0.71e-3}]
    data["comm"]["allreduce"] = slow
    prof = DeviceProfile(data, str(path))
    link = prof.link
    assert prof.allreduce(1024, 2, link) == pytest.approx(0.34e-3)
    assert prof.allreduce(65536, 2, link) == pytest.approx(0.71e-3)
    assert prof.allreduce(262144, 2, link) == pytest.approx(0.71e-3)
    assert prof.allreduce(4096, 2, link) == pytest.approx(0.34e-3)


def _cpu_node(path, procs=2):
    return {
        "name": "cpu",
        "gpu": "CPU",
        "gpus_per_node": procs,
        "intra_node": "host",
        "nic": "10 Gbit/s",
        "profile": str(path),
    }


def test_uneven_tp_rank_computes_under_partial_contention(tmp_path):
    """A TP rank with a quarter of the layer waits in the all-reduces most of the time: its
    partner computes under the contention of 1 + a third of a process, not of two."""
    from planner.cpu_sharing import busy_shares, shared_node_slowdowns
    from planner.simulator import layouts_of
    from planner.topology import Topology

    path, model = _synthetic_profile(tmp_path, slowdown=1.5)
    cluster = load_cluster_dict({"name": "cpu-2", "nodes": [_cpu_node(path)]})
    stage = {"ranks": [0, 1], "layers": [0, model.num_layers]}
    shards = {"query_groups": [3, 1], "ffn": [192, 64], "vocab": [96, 32]}
    plans = {
        name: build_plan(
            cluster,
            model,
            4,
            [{"micro_batch_size": 1, "num_microbatches": 4, "stages": [dict(stage, **extra)]}],
        )
        for name, extra in (("even", {}), ("uneven", {"shards": shards}))
    }
    topo = Topology(cluster)
    for name, plan in plans.items():
        est = simulate(plan)
        period = est.pipeline_time_s[0]
        busy = busy_shares(model, topo, layouts_of(plan), est.stages, [(1, 4)], period)
        slow = shared_node_slowdowns(topo, busy)
        if name == "even":  # both compute all the time: the full contention stays
            assert slow == {}
        else:  # rank 1 computes a third of rank 0's time: 1 + 0.5 x 1/3; rank 0 all of it
            assert slow[0] == pytest.approx(1 + 0.5 / 3, rel=0.02) and 1 not in slow


def test_overlap_hides_only_what_a_free_core_runs(tmp_path):
    """Two data-parallel processes on a 2-core CPU node: the hidden part of an overlapped sync
    is paid for in proportion to how busy the other process keeps the second core (gloo's work
    takes the cores the backward runs on): equal pipelines pay nearly all of it, a long pipeline
    beside a short one (6 and 1 micro-batches) a seventh. With a core to spare, none."""
    model = load_model("tiny")

    def step(cores, overlap, nmbs=(4, 4)):
        """(exposed, serial) sync seconds: serial is every bucket's collective in a row."""
        folder = tmp_path / f"{cores}{overlap}{nmbs}"
        folder.mkdir(exist_ok=True)
        path, _ = _synthetic_profile(folder, slowdown=1.0, cores=cores)
        cluster = load_cluster_dict({"name": "cpu", "nodes": [_cpu_node(path)]})
        pipelines = [
            {
                "micro_batch_size": 1,
                "num_microbatches": n,
                "stages": [{"ranks": [r], "layers": [0, model.num_layers]}],
            }
            for r, n in enumerate(nmbs)
        ]
        training = {"overlap_grad_reduce": True} if overlap else {}
        # buckets of 20,000 elements: the sync can start during the backward
        plan = build_plan(cluster, model, sum(nmbs), pipelines, **training)
        est = simulate(plan, bucket_elements=20_000)
        return est.grad_sync_time_s, est.grad_sync_serial_s

    free, buckets = step(4, True)  # a spare core: the sync model's own exposed part
    serial, _ = step(4, False)  # one collective, after the backward
    assert 0 < free < serial < buckets  # each bucket pays its own latency
    assert step(2, False)[0] == pytest.approx(serial, rel=1e-12)
    paid = (step(2, True)[0] - free) / (buckets - free)
    assert 0.9 < paid <= 1.0  # the other process computes nearly all the time
    free, buckets = step(4, True, (6, 1))
    paid = (step(2, True, (6, 1))[0] - free) / (buckets - free)
    assert 0.1 < paid < 0.25  # it computes a seventh of the time


def test_contention_only_while_the_others_compute(tmp_path):
    """Processes sharing a profiled CPU node slow each other only while they compute: equal
    data-parallel pipelines pay (nearly) the full contention, while a long pipeline beside a
    short one pays little and the short one nearly all of it."""
    model = load_model("tiny")
    one_stage = {"ranks": [0], "layers": [0, model.num_layers]}

    def pipelines(*nmbs):
        return [
            {"micro_batch_size": 1, "num_microbatches": n, "stages": [dict(one_stage, ranks=[r])]}
            for r, n in enumerate(nmbs)
        ]

    def times(slowdown, *nmbs):
        path, _ = _synthetic_profile(tmp_path / str(slowdown), slowdown)
        cluster = load_cluster_dict({"name": "cpu-2", "nodes": [_cpu_node(path)]})
        return simulate(build_plan(cluster, model, sum(nmbs), pipelines(*nmbs))).pipeline_time_s

    for d in ("1.0", "1.5"):
        (tmp_path / d).mkdir()
    alone, shared = times(1.0, 4, 4), times(1.5, 4, 4)
    for a, b in zip(alone, shared):
        assert 1.35 < b / a <= 1.5
    alone, shared = times(1.0, 6, 1), times(1.5, 6, 1)
    long_ratio, short_ratio = shared[0] / alone[0], shared[1] / alone[1]
    assert 1.0 < long_ratio < 1.15  # the short pipeline computes about 1/6 of the step
    assert 1.4 < short_ratio <= 1.5


def test_simulate_cli_reports_sources(tiny_profile, tmp_path, hexi_plan):
    from planner.plan import save_plan

    path, _ = tiny_profile
    plan_path = tmp_path / "plan.json"
    save_plan(build_plan(_cluster(path), load_model("tiny"), 8, TWO_STAGES), plan_path)
    code, out, err = hexi_plan("simulate", plan_path)
    assert code == 0, err
    assert "cost source      cpu: CPU: profile" in out
    code, out, err = hexi_plan("simulate", plan_path, "--json")
    assert json.loads(out)["cost_source"]["cpu"].startswith("CPU: profile")


@pytest.mark.parametrize(
    "backend, module", [("unfused", "DotProductAttention"), ("auto", "SDPAttention")]
)
def test_profiled_stages_run_the_backend_given(backend, module, tmp_path):
    """hexi-profile --attention-backend: every measured stage is built with that backend."""
    import torch
    import torch.distributed as dist

    from megatron_hexi.model import seed_rng
    from megatron_hexi.patches import apply_cpu_patches
    from megatron_hexi.profile import measure
    from planner.models import load_model

    apply_cpu_patches()
    seed_rng(1234, 0)  # as hexi-profile: DotProductAttention forks megatron's RNG tracker
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = load_model("tiny")
        view = measure.shard_view(model, 1, 1)
        cpu = torch.device("cpu")
        stage = measure.Stage(model, view, 1, cpu, torch.float32, attention_backend=backend)
        fwd, bwd = stage.time(1, warmup=0)
    finally:
        dist.destroy_process_group()
    built = {type(m).__name__ for m in stage.net.modules() if m._get_name().endswith("Attention")}
    assert built - {"SelfAttention"} == {module}
    assert fwd > 0 and bwd > 0


def test_all_reduce_clock_times_calls_and_asynchronous_waits(monkeypatch):
    """The in-situ TP runs' clock counts the time inside each all-reduce call and inside the
    wait on an asynchronous one's handle (megatron-core's backward overlaps its input-gradient
    all-reduce with the weight-gradient GEMM), and puts torch.distributed back on exit."""
    import time

    import torch.distributed as dist

    from megatron_hexi.profile.comm import AllReduceClock

    class Work:
        def wait(self):
            time.sleep(0.03)
            return True

    def fake_all_reduce(tensor, group=None, async_op=False):
        time.sleep(0.01)
        return Work() if async_op else None

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    clock = AllReduceClock()
    t0 = time.perf_counter()
    with clock:
        assert dist.all_reduce is not fake_all_reduce
        dist.all_reduce(None)  # as megatron-core's forward calls it
        handle = dist.all_reduce(None, async_op=True)
        time.sleep(0.02)  # the weight-gradient GEMM: not inside the all-reduce
        assert handle.wait() is True
    t1 = time.perf_counter()
    assert dist.all_reduce is fake_all_reduce
    assert len(clock.calls) == 3
    assert 0.05 <= clock.within(t0, t1) < t1 - t0 - 0.02
    assert clock.within(t1, t1 + 1.0) == 0.0


def test_a_stage_is_timed_by_the_mean_of_its_burst():
    """A training step is the sum of its passes: a stage's time is the mean of a burst of runs
    after warm-up, not its fastest run (the fastest forward plus the fastest backward read 10 %
    low on a 2-core VM, and the one-rank steps then charged the gap as runtime overhead)."""
    import types

    from megatron_hexi.profile.measure import Stage

    runs = iter([(9.0, 9.0), (1.0, 2.0), (3.0, 8.0)])
    stage = types.SimpleNamespace(run=lambda: next(runs))
    assert Stage.time(stage, 2, warmup=1) == (2.0, 5.0)
