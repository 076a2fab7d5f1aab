"""hexi-cluster detect (with stand-in nvidia-smi/sysfs) and bench (two "nodes" on this machine)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from harness import free_port
from launch.hexi_launch_helpers import cluster_dict, hexi_launch, make_plan
from megatron_hexi.cluster_tools import detect as det
from planner.cluster import load_cluster_dict

TOPO_NV = (
    "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tNV12\t0-31\t0\n"
    "GPU1\tNV12\t X \t0-31\t0\n"
)
TOPO_PCIE = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPHB\t0-15\nGPU1\tPHB\t X \t0-15\n"


def fake_smi(names, topo):
    def run(args, **kw):
        if args[:2] == ["nvidia-smi", "topo"]:
            return subprocess.CompletedProcess(args, 0, topo, "")
        if args[0] == "nvidia-smi":
            return subprocess.CompletedProcess(args, 0, "".join(n + "\n" for n in names), "")
        raise OSError("not found")

    return run


@pytest.fixture
def sysfs(tmp_path):
    eth = tmp_path / "sys/class/net/eth0"
    (eth / "device").mkdir(parents=True)
    (eth / "operstate").write_text("up\n")
    (eth / "speed").write_text("25000\n")
    (tmp_path / "sys/class/net/lo").mkdir()
    return tmp_path


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _loads(text):
    nodes = yaml.safe_load(text)
    return load_cluster_dict({"name": "t", "nodes": nodes})


def test_detect_nvlink_a100(sysfs):
    entry, notes = det.detect(
        name="box", run=fake_smi(["NVIDIA A100-SXM4-80GB"] * 2, TOPO_NV), sys_root=str(sysfs)
    )
    assert entry["gpu"] == "A100-SXM-80GB" and entry["gpus_per_node"] == 2
    assert entry["intra_node"] == "nvlink" and entry["nic"] == "25 Gbit/s"
    spec = _loads(det.to_yaml(entry, notes))
    n = spec.nodes[0]
    assert (n.name, n.gpu, n.gpus_per_node) == ("box", "A100-SXM-80GB", 2)


def test_detect_pcie_geforce(sysfs):
    entry, notes = det.detect(
        run=fake_smi(["NVIDIA GeForce RTX 4090"] * 2, TOPO_PCIE), sys_root=str(sysfs)
    )
    assert (entry["gpu"], entry["intra_node"]) == ("RTX-4090", "host")
    assert any("no NVLink" in n for n in notes)
    _loads(det.to_yaml(entry, notes))


@pytest.mark.parametrize(
    "names,needle",
    [
        (["NVIDIA Mystery 9000"], "not in the catalog"),
        (["NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"], "mixes GPU models"),
        ([], "no GPU found"),
    ],
)
def test_detect_refuses(names, needle, tmp_path):
    with pytest.raises(det.DetectError) as e:
        det.detect(run=fake_smi(names, ""), sys_root=str(tmp_path))
    assert needle in str(e.value) and len(e.value.problems) == 1


def test_detect_cli_without_gpu(tmp_path):
    """This machine (CI: no GPU, maybe no nvidia-smi): exit 2 with one line, or a CPU entry."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "megatron_hexi.cluster_tools.cli", "detect"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    if r.returncode == 0:
        pytest.skip("this machine has a GPU")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "no GPU found" in r.stderr and "--allow-cpu" in r.stderr
    out = tmp_path / "node.yaml"
    r = subprocess.run(
        cmd + ["--allow-cpu", "--cpu-ranks", "2", "--name", "cpu0", "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    n = _loads(out.read_text()).nodes[0]
    assert (n.name, n.gpu, n.gpus_per_node) == ("cpu0", "CPU", 2)


def test_bench_two_nodes_locally(tmp_path):
    """hexi-launch torchrun scripts running the bench as two plan nodes on this machine."""
    plan_path = tmp_path / "plan.json"
    groups = [("a100", 2, 1), ("rtx4090", 1, 1)]
    make_plan(plan_path, groups)
    d, links = tmp_path / "nodes", tmp_path / "links.yaml"
    port = free_port()
    r = hexi_launch(
        "torchrun",
        plan_path,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--timeout-s",
        "90",
        "--entry-module",
        "megatron_hexi.cluster_tools.bench",
        "-o",
        d,
        "--",
        "-o",
        links,
        "--sizes",
        "8B",
        "256KB",
        "--iters",
        "3",
        "--timeout-s",
        "30",
    )
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            ["bash", str(s)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for s in sorted(d.glob("*.sh"))
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    text = links.read_text()
    assert "#   a100-0: " in text  # within-node figure, as a comment
    data = yaml.safe_load(text)
    assert [lk["between"] for lk in data["links"]] == [["a100-0", "rtx4090-0"]]
    merged = {**cluster_dict(groups), "links": data["links"]}
    spec = load_cluster_dict(merged)
    bw, lat = spec.link("a100-0", "rtx4090-0")
    assert bw > 1e6 and 0 < lat < 0.1
