"""The runtime's own overheads, from timed steps of a single-rank Trainer on the profiled model.

A one-rank plan (all layers, micro-batch 1) is trained with 1 and with k micro-batches. The step
time minus the compute the profile predicts for it (layers + embedding + head per micro-batch,
optimizer step) leaves what the runtime adds: per micro-batch (1F1B schedule bookkeeping, data,
loss, Python) and per step (zero_grad, token all-reduce and gradient finalize, grad norm, stats
all-reduce, scheduler).
"""
import tempfile

from megatron_hexi.profile import measure


def _steps(model, device, mbs, nmb, iters, pipelines=1):
    """Fastest step time of a plan of `pipelines` one-stage pipelines (one per process of the
    current process group), and the parameters of one rank."""
    from megatron_hexi.arguments import parse_args
    from megatron_hexi.training import Trainer
    from planner.cluster import load_cluster_dict
    from planner.plan import build_plan, save_plan
    cluster = load_cluster_dict({"name": f"profile-{pipelines}", "nodes": [
        {"name": "local", "gpu": "CPU" if device.type == "cpu" else "A100-SXM-80GB",
         "gpus_per_node": pipelines, "intra_node": "host", "nic": "10 Gbit/s"}]})
    plan = build_plan(cluster, model, mbs * nmb * pipelines, [
        {"micro_batch_size": mbs, "num_microbatches": nmb,
         "stages": [{"ranks": [r], "layers": [0, model.num_layers]}]} for r in range(pipelines)])
    import torch.distributed as dist
    with tempfile.TemporaryDirectory(prefix="hexi-profile-") as tmp:
        path = f"{tmp}/plan.json"      # every rank writes the same plan to its own directory
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
        if pipelines > 1:
            dist.barrier()
    return min(times[2:]), params


def data_parallel_step(model, device, reps, procs, k=4):
    """Fastest step of `procs` one-stage pipelines training at once (k micro-batches of 1 each),
    run inside a `procs`-process group: against the one-rank step with the same micro-batches it
    gives the slowdown of the runtime itself when `procs` ranks share the node."""
    step, params = _steps(model, device, 1, k, 2 * reps + 2, pipelines=procs)
    return {"procs": procs, "microbatches": k, "step_s": step, "params": params}


def step_points(model, device, reps, k=4):
    """{micro-batches: fastest one-rank step} for 1 and k micro-batches of 1, and the params."""
    t1, params = _steps(model, device, 1, 1, reps + 2)
    tk, _ = _steps(model, device, 1, k, reps + 2)
    return {1: t1, k: tk}, params


def measure_runtime(model, device, reps, optimizer, earlier=None):
    """{"per_microbatch_s", "per_step_s", "points"}: overheads beyond the profiled compute and
    the profiled optimizer step (`optimizer`: fixed_s + s_per_param x params). `earlier`: step
    points measured before (hexi-profile takes them once before the grid and once after, and
    keeps the faster of each, so a slow spell during one burst does not stick)."""
    import torch
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    f1, b1 = measure.Stage(model, measure.shard_view(model, 1, model.num_layers, True, False), 1,
                           device, dtype).time(reps)
    f2, b2 = measure.Stage(model, measure.shard_view(model, 1, 1, False, True), 1,
                           device, dtype).time(reps)
    # a whole model's compute ~ (first stage with all layers) + (head stage minus its one layer)
    lf, lb = measure.Stage(model, measure.shard_view(model, 1, 1), 1, device, dtype).time(reps)
    compute = f1 + b1 + max(f2 - lf, 0) + max(b2 - lb, 0)
    points, params = step_points(model, device, reps)
    if earlier:
        points = {n: min(t, earlier[n]) for n, t in points.items()}
    (n1, t1), (k, tk) = sorted(points.items())
    per_mb = max((tk - t1) / (k - 1) - compute, 0.0)
    opt = optimizer["fixed_s"] + optimizer["s_per_param"] * params
    return {"per_microbatch_s": per_mb, "per_step_s": max(t1 - compute - per_mb - opt, 0.0),
            "points": [{"microbatches": n, "step_s": t} for n, t in sorted(points.items())],
            "compute_per_microbatch_s": compute,
            "optimizer_s": opt, "params": params}
