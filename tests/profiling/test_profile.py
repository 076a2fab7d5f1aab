"""hexi-profile on a tiny model under --max-seconds, and the planner using the profile."""
import json
import os
import subprocess
import sys

import pytest

from planner.cluster import load_cluster_dict
from planner.costmodel import Topology
from planner.models import load_model
from planner.plan import build_plan
from planner.profile import cost_sources
from planner.simulator import simulate

TWO_STAGES = [{"micro_batch_size": 2, "num_microbatches": 4, "stages": [
    {"ranks": [0, 1], "layers": [0, 2]}, {"ranks": [2], "layers": [2, 4]}]}]


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory, repo_root):
    out = tmp_path_factory.mktemp("profile") / "cpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_hexi.profile",
                           "--model", "tiny", "--tp-widths", "1", "2", "--micro-batch-sizes", "1",
                           "2", "--comm-procs", "2", "--reps", "3", "--max-seconds", "25",
                           "--device", "cpu", "-o", str(out)],
                          capture_output=True, text=True, env=env, cwd=repo_root, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc


def test_profile_contents(tiny_profile):
    path, proc = tiny_profile
    assert "hexi-profile [" in proc.stderr          # progress bar on stderr
    data = json.loads(path.read_text())
    assert data["format"] == "hexi-device-profile/1" and data["device"] == "CPU"
    assert data["matmul_tflops"] > 0 and data["threads"] == 1
    widths = {(e["tp"], e["mbs"]) for e in data["layer"]}
    assert (1, 1) in widths
    for e in data["layer"]:
        assert e["fwd_s"] > 0 and e["bwd_s"] > 0 and e["bwd_recompute_s"] > 0
    assert data["head"] and data["embedding"]
    assert data["optimizer"]["s_per_param"] > 0
    assert data["seconds"] < 40
    comm = data["comm"]
    assert comm["procs"] == 2 and comm["backend"] == "gloo"
    for kind in ("allreduce", "allgather", "p2p"):
        assert comm[kind] and all(p["s"] > 0 for p in comm[kind])


def _cluster(profile):
    group = {"name": "cpu", "gpu": "CPU", "gpus_per_node": 3, "intra_node": "host",
             "nic": "10 Gbit/s"}
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
    from planner.profile import DeviceProfile
    prof = DeviceProfile(json.loads(path.read_text()), str(path))
    top = max(e["mbs"] for e in prof.data["layer"])
    assert prof.layer("fwd_s", 1.0, 2 * top) > prof.layer("fwd_s", 1.0, top) > 0


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
