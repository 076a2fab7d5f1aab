"""The CPU patches follow the run's device, not CUDA's visibility, and the tests pin the CPU.

A CPU run on a GPU host (`--hetero-device cpu` while torch sees CUDA) must be patched exactly like
a run on a machine without CUDA; otherwise megatron-core puts its buffers on the GPU next to a
CPU model. This machine has no GPU, so the rank makes `torch.cuda.is_available()` say True.
"""

import math
import os

from harness import run_distributed, run_torchrun


def _cpu_run_while_cuda_looks_available(plan_path):
    """One rank: CUDA 'available', --hetero-device cpu, then what the patches did and one step."""
    import torch

    torch.cuda.is_available = lambda: True  # what a GPU host reports
    from megatron.core import utils as core_utils
    from megatron.core.tensor_parallel import random as tp_random

    from megatron_hexi.arguments import parse_args, run_config
    from megatron_hexi.patches import PATCH_MODULES, applied_cpu_patches, remove_cpu_patches
    from megatron_hexi.training import Trainer, init_distributed
    from planner.plan import load_plan

    args = parse_args(
        [
            "--hetero-plan-path",
            plan_path,
            "--train-iters",
            "1",
            "--lr",
            "1e-3",
            "--mock-data",
            "--hetero-device",
            "cpu",
            "--attention-dropout",
            "0",
            "--hidden-dropout",
            "0",
        ]
    )
    plan, config = load_plan(plan_path), run_config(args)
    device = init_distributed(plan, config)
    out = {
        "device": str(device),
        "applied": list(applied_cpu_patches()),
        "all": list(PATCH_MODULES),
        # what patched upstream code sees as "the current CUDA device" and "the CUDA RNG"
        "current_device": str(core_utils.torch.cuda.current_device()),
        "rng_is_cpu": bool(torch.equal(tp_random._get_cuda_rng_state(), torch.get_rng_state())),
    }
    trainer = Trainer(plan, config, device)
    metrics = trainer.train_step(0)
    out["loss"] = metrics["lm_loss"]
    out["param_devices"] = sorted({p.device.type for p in trainer.model.parameters()})
    remove_cpu_patches()  # still reversible after a forced application
    out["after_remove"] = list(applied_cpu_patches())
    out["torch_restored"] = core_utils.torch is torch
    return out


def test_cpu_run_is_patched_when_cuda_looks_available(tmp_path):
    from planner.cluster import load_cluster_dict
    from planner.models import load_model
    from planner.plan import build_plan, save_plan

    cluster = load_cluster_dict(
        {
            "name": "cpu-1",
            "nodes": [
                {
                    "name": "cpu",
                    "gpu": "CPU",
                    "gpus_per_node": 1,
                    "intra_node": "host",
                    "nic": "10 Gbit/s",
                }
            ],
        }
    )
    one_rank = {
        "micro_batch_size": 1,
        "num_microbatches": 2,
        "stages": [{"ranks": [0], "layers": [0, 4]}],
    }
    plan = build_plan(cluster, load_model("tiny"), 2, [one_rank])
    save_plan(plan, tmp_path / "plan.json")
    [r] = run_distributed(
        _cpu_run_while_cuda_looks_available, 1, str(tmp_path / "plan.json"), timeout=180
    )
    assert r["device"] == "cpu"
    assert r["applied"] == r["all"] and r["applied"], r["applied"]
    assert r["current_device"] == "cpu" and r["rng_is_cpu"]
    assert r["param_devices"] == ["cpu"]
    assert math.isfinite(r["loss"]) and 3.0 < r["loss"] < 6.0, r["loss"]  # ~ln(128) = 4.85
    assert r["after_remove"] == [] and r["torch_restored"]


def _visible_devices():
    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()


def test_harness_hides_cuda(tmp_path, monkeypatch):
    # Even when the test process itself exposes a GPU, the ranks it starts see none.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run_distributed(_visible_devices, 2, timeout=60) == [("", 0), ("", 0)]
    # A benchmark on a GPU asks for the GPU explicitly.
    assert run_distributed(_visible_devices, 1, timeout=60, hide_cuda=False)[0][0] == "0"
    script = tmp_path / "show_env.py"
    script.write_text(
        "import os, sys\n"
        "with open(sys.argv[1] + os.environ['RANK'], 'w') as f:\n"
        "    f.write(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n"
    )
    code, out, err = run_torchrun([script, tmp_path / "env"], 1, timeout=60)
    assert code == 0, err
    assert (tmp_path / "env0").read_text() == "''"


def test_conftest_hides_cuda():
    # Every other way a test starts a process (subprocess with os.environ) inherits this.
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
