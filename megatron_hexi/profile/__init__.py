"""`hexi-profile`: measure this device's training costs with the runtime's own modules.

The JSON it writes is referenced by a cluster file's node group (`profile: path.json`) and read by
the planner (planner/profiles.py). Format "hexi-device-profile/1":

- `device` (catalog GPU name; "CPU" on CPU), `matmul_tflops` (achieved GEMM throughput),
  `memory_gb`, `memory_bandwidth_gbs`, `source`, `threads`, `cpu_cores`, `dtype`, `model`;
- `layer`: per-layer forward / backward / backward-with-full-recompute seconds of one transformer
  layer holding a 1/t shard (query groups and FFN columns), for each TP width t and micro-batch
  size b measured; compute only (the TP all-reduces come from `comm`); `fwd_recompute_s`, the
  forward under full recompute, which saves no activations and so runs faster (profiles without
  it stay valid: the planner takes the plain forward); `host_fwd_s` and
  `host_bwd_s`, the host's part of each (until the forward and the backward call return, before
  the device is waited for: the planner's host time per layer pass, planner/host.py; on a CPU
  the whole pass). Profiles without them stay valid;
- `embedding`, `head`: the embedding and the final norm + LM head + vocab-parallel cross entropy,
  per vocabulary shard 1/t and micro-batch size;
- `optimizer`: the runtime's optimizer step (megatron-core wrapper, exact grad norm, AdamW), fit
  as `fixed_s + s_per_param x params`;
- `runtime`: the runtime's own per-micro-batch and per-step overheads (1F1B schedule, data,
  loss, gradient finalize, stats): what timed single-rank Trainer steps (`points`, the fastest
  of `bursts` spread over the profile) take beyond the planner's prediction for the same plans;
- `comm`: all-reduce, all-gather and p2p time vs bytes on `procs` local processes (gloo on CPU,
  NCCL on CUDA), with a ring-model (bandwidth, latency) fit per collective;
- `contention` (CPU; they share cores and memory bandwidth): `slowdown`, the compute slowdown
  when `procs` processes train at once: the runtime's own `procs`-rank data-parallel step (the
  fastest of bursts spread over the profile, `training.bursts_s`) less its gradient
  all-reduce, over the one-rank step with the same micro-batches; `probe_slowdown`, the same
  layer run by all processes at once (`together_s`) over the grid's (`alone_s`);
- `tp_layer`: per-layer times of an even `tp`-way middle stage run over a real group of the
  `procs` comm processes, per micro-batch size, with its all-reduces (`fwd_s`, `bwd_s`,
  `bwd_recompute_s`) and the same shard computed on every process at once (`compute_*`); one
  activation's all-reduce with the partners already waiting in it (`allreduce_ready_s`, the
  median call); on a CPU, the time the ranks spent inside the layer's all-reduce calls
  (`in_allreduce_fwd_s`, `in_allreduce_bwd_s`, `in_allreduce_bwd_recompute_s`; recorded to
  compare with training, not used by the planner). The planner charges a TP group of that width
  what the layer takes beyond its compute estimate, less, on uneven shards of a GPU, the wait
  for a late partner that the imbalance absorbs.

Times are the fastest of runs spread over the profile (measure.py says why).
"""

FORMAT = "hexi-device-profile/1"
