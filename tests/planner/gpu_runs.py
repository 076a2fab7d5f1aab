"""The GPU check's runs as the planner tests read them: its 270M model, one-GPU clusters and
single-stage plans, and every measured H200 step of a plan the planner predicts."""

import importlib.util
import json
import statistics

from conftest import REPO
from planner.cluster import load_cluster_dict
from planner.plan import build_plan


def _gpu_check_cases():
    """tools/bench/_gpu_check_cases.py, the GPU check's own cases and presets."""
    path = REPO / "tools" / "bench" / "_gpu_check_cases.py"
    spec = importlib.util.spec_from_file_location("gpu_check_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CHECK = _gpu_check_cases()
# The GPU check's 270M model (its correctness cases, batch 2 x 4).
GPU_CHECK_MODEL = _CHECK.PRESETS["cuda"]["model"]
# The plan settings of the GPU check's cases that the planner predicts: its correctness plans
# and this runtime's performance cases with the default fusions (every-fusion-off `eager` is a
# run flag the plan does not carry; plain megatron-core runs no plan of this project).
PREDICTED_CASES = {
    "bf16": {},
    "distopt": {"use_distributed_optimizer": True},
    "recompute": {"recompute": True},
    "hexi-fused-1x8": {"attention_backend": "auto"},
    "hexi-fused-8x1": {"attention_backend": "auto"},
    "hexi-graphs-1x8": {"attention_backend": "auto", "cuda_graph_impl": "local"},
    "hexi-graphs-8x1": {"attention_backend": "auto", "cuda_graph_impl": "local"},
}
# The two H200 runs made before result files were kept (docs/benchmarks.md, GPU check).
EARLIER_H200_MEDIANS = {
    "bf16": (0.3227, 0.279),
    "distopt": (0.2341, 0.319),
    "recompute": (0.3611, 0.477),
}
RESULTS = REPO / "docs" / "results" / "gpu"
# hexi-profile of the GPU check's two models on one H200 (the local spec with the default
# fusions, bf16, attention `auto`; docs/benchmarks.md, "GPU check"), by model name.
H200_PROFILES = {
    "gpu-check-270m": RESULTS / "profiles" / "2026-12-04-nvidia-h200-gpu-check-270m.json",
    "gpu-check-1.1b": RESULTS / "profiles" / "2026-12-04-nvidia-h200-gpu-check-1.1b.json",
}


def one_gpu_cluster(gpu: str, per: int = 1, profile=None) -> object:
    """One machine of `per` GPUs of type `gpu` (measured by the device profile `profile`)."""
    node = {
        "name": "a",
        "gpu": gpu,
        "gpus_per_node": per,
        "intra_node": "nvlink",
        "nic": "10 Gbit/s",
    }
    if profile is not None:
        node["profile"] = str(profile)
    return load_cluster_dict({"name": "one", "nodes": [node]})


def single_stage_plan(gpu, model, mbs, nmb, profile=None, **kw):
    """The whole model on one GPU of type `gpu` (measured by `profile`), in `nmb`
    micro-batches of `mbs`."""
    pipes = [
        {
            "micro_batch_size": mbs,
            "num_microbatches": nmb,
            "stages": [{"ranks": [0], "layers": [0, model.num_layers]}],
        }
    ]
    return build_plan(one_gpu_cluster(gpu, profile=profile), model, mbs * nmb, pipes, **kw)


def h200_steps():
    """(source, case, model, micro-batch size, micro-batches, measured median step) of every
    H200 step the planner predicts: the earlier runs and every result file (its timed
    iterations: after the warm-up, the profiled one left out)."""
    out = []
    for case, medians in EARLIER_H200_MEDIANS.items():
        for i, median in enumerate(medians):
            out.append((f"earlier run {i + 1}", case, GPU_CHECK_MODEL, 2, 4, median))
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        if result["device"] != "cuda" or "H200" not in result["device_name"]:
            continue
        for case, run in result["cases"].items():
            if case not in PREDICTED_CASES or not run["metrics"]:
                continue
            model, mbs, nmb, _, warmup = _CHECK.case_config(result["config"], case)
            timed = [r["step_time_s"] for r in run["metrics"][warmup:] if not r.get("profiled")]
            out.append((path.name, case, model, mbs, nmb, statistics.median(timed)))
    return out
