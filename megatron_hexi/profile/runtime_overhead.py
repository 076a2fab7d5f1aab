"""The runtime's own overheads, from timed steps of a single-rank Trainer on the profiled model.

A one-rank plan (all layers, micro-batch 1) is trained with 1 and with k micro-batches. What the
steps take beyond what the planner predicts for the same plans from the rest of the profile
(layers, embedding, head, optimizer step) is what the runtime adds: per micro-batch (1F1B schedule
bookkeeping, data, loss, Python) and per step (zero_grad, token all-reduce and gradient finalize,
grad norm, stats all-reduce, scheduler). Asking the planner itself, rather than re-adding stage
times here, makes the planner reproduce these one-rank steps.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from megatron_hexi.config import RunConfig
    from megatron_hexi.profile.records import Profile, RuntimeRecord, TrainingStep
    from planner.cluster import ClusterSpec
    from planner.models import ModelSpec
    from planner.plan import Plan


def _node_gpu(device_type: str) -> str:
    """The catalog entry the one-node plans name (the plan format needs one; on CUDA any GPU
    with room for the model will do: the Trainer runs on the local device)."""
    return "CPU" if device_type == "cpu" else "A100-SXM-80GB"


def _cluster(device_type: str, procs: int, profile_path: str | None = None) -> ClusterSpec:
    from planner.cluster import load_cluster_dict

    node = {
        "name": "local",
        "gpu": _node_gpu(device_type),
        "gpus_per_node": procs,
        "intra_node": "host",
        "nic": "10 Gbit/s",
    }
    if profile_path:
        node["profile"] = profile_path
    return load_cluster_dict({"name": f"profile-{procs}", "nodes": [node]})


def _one_stage_plans(
    cluster: ClusterSpec,
    model: ModelSpec,
    mbs: int,
    nmb: int,
    pipelines: int,
    attention_backend: str,
) -> Plan:
    from planner.plan import build_plan

    return build_plan(
        cluster,
        model,
        mbs * nmb * pipelines,
        [
            {
                "micro_batch_size": mbs,
                "num_microbatches": nmb,
                "stages": [{"ranks": [r], "layers": [0, model.num_layers]}],
            }
            for r in range(pipelines)
        ],
        attention_backend=attention_backend,  # as the profile's layer stages
    )


def step_config(iters: int) -> RunConfig:
    """The RunConfig of the timed steps: mock data, constant lr, no dropout."""
    from megatron_hexi.config import (
        DataConfig,
        DropoutConfig,
        LRScheduleConfig,
        OptimizerConfig,
        RunConfig,
        TrainingConfig,
    )

    return RunConfig(
        training=TrainingConfig(train_iters=iters),
        optimizer=OptimizerConfig(lr=1e-4),
        lr_schedule=LRScheduleConfig(lr_decay_style="constant"),
        dropout=DropoutConfig(attention_dropout=0.0, hidden_dropout=0.0),
        data=DataConfig(mock_data=True),
    )


def _steps(
    model: ModelSpec,
    device: torch.device,
    mbs: int,
    nmb: int,
    iters: int,
    attention_backend: str,
    pipelines: int = 1,
) -> tuple[float, int]:
    """Fastest step time of a plan of `pipelines` one-stage pipelines (one per process of the
    current process group), and the parameters of one rank."""
    import torch.distributed as dist

    from megatron_hexi.training import Trainer

    cluster = _cluster(device.type, pipelines)
    plan = _one_stage_plans(cluster, model, mbs, nmb, pipelines, attention_backend)
    trainer = Trainer(plan, step_config(iters), device)
    times = [trainer.train_step(i)["step_time_s"] for i in range(iters)]
    params = sum(p.numel() for p in trainer.model.parameters())
    if pipelines > 1:
        dist.barrier()
    return min(times[2:]), params


def data_parallel_step(
    model: ModelSpec,
    device: torch.device,
    reps: int,
    procs: int,
    attention_backend: str,
    k: int = 4,
) -> TrainingStep:
    """Fastest step of `procs` one-stage pipelines training at once (k micro-batches of 1 each),
    run inside a `procs`-process group: against the one-rank step with the same micro-batches it
    gives the slowdown of the runtime itself when `procs` ranks share the node."""
    step, params = _steps(model, device, 1, k, 2 * reps + 2, attention_backend, pipelines=procs)
    return {"procs": procs, "microbatches": k, "step_s": step, "params": params}


def step_points(
    model: ModelSpec, device: torch.device, reps: int, attention_backend: str, k: int = 4
) -> tuple[dict[int, float], int]:
    """{micro-batches: fastest one-rank step} for 1 and k micro-batches of 1, and the params.
    hexi-profile takes several such bursts spread over the profile and keeps the fastest of each
    point: a slow spell of the machine during one burst does not stick."""
    t1, params = _steps(model, device, 1, 1, reps + 2, attention_backend)
    tk, _ = _steps(model, device, 1, k, reps + 2, attention_backend)
    return {1: t1, k: tk}, params


def predicted_steps(
    profile: Profile, model: ModelSpec, device_type: str, microbatches: Iterable[int]
) -> dict[int, float]:
    """{k: the planner's step time for the one-rank plan of k micro-batches of 1}, from this
    profile without its runtime overheads (pure planner code; no torch)."""
    from planner.profiles import _profile_of
    from planner.simulator import simulate

    bare = {key: v for key, v in profile.items() if key not in ("runtime", "contention")}
    bare["device"] = _node_gpu(device_type)  # the figures are the profile's own
    with tempfile.TemporaryDirectory(prefix="hexi-profile-") as tmp:
        path = os.path.join(tmp, "profile.json")
        with open(path, "w") as fh:
            json.dump(bare, fh)
        cluster = _cluster(device_type, 1, path)
        out = {
            k: simulate(
                _one_stage_plans(cluster, model, 1, k, 1, profile["attention_backend"])
            ).iteration_time_s
            for k in microbatches
        }
        _profile_of.cache_clear()
    return out


def overheads(
    points: Mapping[int, float], predicted: Mapping[int, float], params: int
) -> RuntimeRecord:
    """The profile's `runtime` entry: {"per_microbatch_s", "per_step_s", ...} from measured
    one-rank steps `points` {k: s} and the planner's `predicted` {k: s} for the same plans. Both
    terms are clamped at zero: where the planner predicts more than ran, it stays conservative."""
    (n1, t1), (k, tk) = sorted(points.items())
    r1, rk = t1 - predicted[n1], tk - predicted[k]
    per_mb = max((rk - r1) / (k - n1), 0.0)
    return {
        "per_microbatch_s": per_mb,
        "per_step_s": max(r1 - per_mb * n1, 0.0),
        "points": [
            {"microbatches": n, "step_s": t, "predicted_s": predicted[n]}
            for n, t in sorted(points.items())
        ],
        "params": params,
    }
