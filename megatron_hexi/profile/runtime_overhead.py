"""The runtime's own overheads, from timed steps of a single-rank Trainer on the profiled model.

A one-rank plan (all layers, micro-batch 1) is trained with 1 and with k micro-batches. The step
time minus the compute the profile predicts for it (layers + embedding + head per micro-batch,
optimizer step) leaves what the runtime adds: per micro-batch (1F1B schedule bookkeeping, data,
loss, Python) and per step (zero_grad, token all-reduce and gradient finalize, grad norm, stats
all-reduce, scheduler).
"""
import statistics
import tempfile

from megatron_hexi.profile import measure


def _steps(model, device, mbs, nmb, iters):
    from megatron_hexi.arguments import parse_args
    from megatron_hexi.training import Trainer
    from planner.cluster import load_cluster_dict
    from planner.plan import build_plan, save_plan
    cluster = load_cluster_dict({"name": "profile-1", "nodes": [
        {"name": "local", "gpu": "CPU" if device.type == "cpu" else "A100-SXM-80GB",
         "gpus_per_node": 1, "intra_node": "host", "nic": "10 Gbit/s"}]})
    plan = build_plan(cluster, model, mbs * nmb, [{"micro_batch_size": mbs,
                                                   "num_microbatches": nmb,
                                                   "stages": [{"ranks": [0], "layers":
                                                               [0, model.num_layers]}]}])
    with tempfile.TemporaryDirectory(prefix="hexi-profile-") as tmp:
        path = f"{tmp}/plan.json"
        save_plan(plan, path)
        args = parse_args(["--hetero-plan-path", path, "--mock-data", "--train-iters",
                           str(iters), "--lr", "1e-4", "--lr-decay-style", "constant",
                           "--attention-dropout", "0", "--hidden-dropout", "0",
                           "--log-interval", "100000"])
        from planner.plan import load_plan
        plan = load_plan(path)
        trainer = Trainer(args, plan, device)
        times = [trainer.train_step(i)["step_time_s"] for i in range(iters)]
        params = sum(p.numel() for p in trainer.model.parameters())
    return statistics.median(times[2:]), params


def measure_runtime(model, device, reps, optimizer, k=4):
    """{"per_microbatch_s", "per_step_s", "points"}: overheads beyond the profiled compute and
    the profiled optimizer step (`optimizer`: fixed_s + s_per_param x params)."""
    import torch
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    f1, b1 = measure.Stage(model, measure.shard_view(model, 1, model.num_layers, True, False), 1,
                           device, dtype).time(reps)
    f2, b2 = measure.Stage(model, measure.shard_view(model, 1, 1, False, True), 1,
                           device, dtype).time(reps)
    # a whole model's compute ~ (first stage with all layers) + (head stage minus its one layer)
    lf, lb = measure.Stage(model, measure.shard_view(model, 1, 1), 1, device, dtype).time(reps)
    compute = f1 + b1 + max(f2 - lf, 0) + max(b2 - lb, 0)
    t1, params = _steps(model, device, 1, 1, reps + 2)
    tk, _ = _steps(model, device, 1, k, reps + 2)
    per_mb = max((tk - t1) / (k - 1) - compute, 0.0)
    opt = optimizer["fixed_s"] + optimizer["s_per_param"] * params
    return {"per_microbatch_s": per_mb, "per_step_s": max(t1 - compute - per_mb - opt, 0.0),
            "points": [{"microbatches": 1, "step_s": t1}, {"microbatches": k, "step_s": tk}],
            "compute_per_microbatch_s": compute,
            "optimizer_s": opt, "params": params}
