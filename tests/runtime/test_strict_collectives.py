"""HEXI_STRICT_COLLECTIVES=1: every tensor a training step hands to a collective is checked
against the run's device, and the check sees every kind of collective the step makes.

On CPU every tensor is on the run's device, so here the check passes by construction; it is the
GPU check (tools/bench/gpu_check.py) that runs it where a CPU tensor would crash NCCL. This test
proves the wrapper is in the path of the tensor collectives of a step with tensor parallelism,
a TP-changing stage boundary, the weighted gradient sync and the distributed optimizer, and that
it refuses a tensor on another device.
"""

import torch

from harness import run_distributed
from runtime.plans import PLANS, write_plan


def _train_strictly(plan_path):
    import torch.distributed as dist

    from megatron_hexi import strict_collectives
    from runtime.workers import train

    out = train(plan_path)
    calls = dict(strict_collectives.calls)
    try:
        dist.all_reduce(torch.zeros(2, device="meta"))
        refused = None
    except strict_collectives.CollectiveDeviceError as e:
        refused = str(e)
    return {"calls": calls, "refused": refused, "losses": out["losses"]}


def test_every_step_collective_is_checked(tmp_path):
    model, world, pipelines = PLANS["two_pipelines_uneven_tp2"]
    path = write_plan(tmp_path, "strict", model, world, pipelines, use_distributed_optimizer=True)
    results = run_distributed(
        _train_strictly, world, path, timeout=400, env={"HEXI_STRICT_COLLECTIVES": "1"}
    )
    for rank, r in enumerate(results):
        assert r["refused"] == (
            "torch.distributed.all_reduce: a (2,) torch.float32 tensor on "
            "meta, but this run's device is cpu (NCCL takes only tensors on "
            "the run's device)"
        ), (rank, r["refused"])
        assert r["calls"].get("all_reduce", 0) > 0, (rank, r["calls"])
    kinds = set().union(*(r["calls"] for r in results))
    # TP all-reduces and the boundary all-gather, pipeline sends and receives, the sharded
    # optimizer's all-gather of updated parameters.
    assert {"all_reduce", "all_gather", "isend", "irecv"} <= kinds, kinds
    sends = sum(r["calls"].get("isend", 0) for r in results)
    assert sends == sum(r["calls"].get("irecv", 0) for r in results) > 0
    assert len(results[0]["losses"]) == 3
