"""The records of a device profile's JSON (megatron_hexi.profile lists the format), as the
profiler builds them: typed, so that a misspelt or missing field is a type error rather than a
profile the planner misreads."""

from __future__ import annotations

from typing import TypedDict


class LayerRecord(TypedDict):
    """One `layer` entry: per-layer seconds of a 1/t shard at one micro-batch size."""

    tp: int
    query_groups: int
    ffn: int
    mbs: int
    fwd_s: float
    bwd_s: float
    bwd_recompute_s: float
    fwd_recompute_s: float  # the forward under full recompute (no activations saved)
    host_fwd_s: float
    host_bwd_s: float


class EndRecord(TypedDict):
    """One `embedding` or `head` entry: that end stage's seconds beyond a middle stage's."""

    tp: int
    vocab: int
    mbs: int
    fwd_s: float
    bwd_s: float


class OptimizerPoint(TypedDict):
    params: int
    s: float


class OptimizerRecord(TypedDict):
    """The `optimizer` entry: step seconds fit as fixed_s + s_per_param x params."""

    fixed_s: float
    s_per_param: float
    points: list[OptimizerPoint]


class RuntimePoint(TypedDict):
    microbatches: int
    step_s: float
    predicted_s: float


class _RuntimeFit(TypedDict):
    per_microbatch_s: float
    per_step_s: float
    points: list[RuntimePoint]
    params: int


class RuntimeRecord(_RuntimeFit, total=False):
    """The `runtime` entry: overheads beyond the planner's prediction of one-rank steps."""

    bursts: list[dict[str, float]]  # each burst's {micro-batches: step s}


class _TPLayerRow(TypedDict):
    tp: int
    mbs: int
    fwd_s: float
    bwd_s: float
    bwd_recompute_s: float
    compute_fwd_s: float
    compute_bwd_s: float
    compute_bwd_recompute_s: float
    allreduce_ready_s: float  # one activation's all-reduce, the others waiting in it (median call)


class TPLayerRow(_TPLayerRow, total=False):
    """One `tp_layer` entry: per-layer seconds of a `tp`-way middle stage over a real group,
    with its all-reduces, and of the same shard computed on every process at once.

    On a CPU also the seconds per layer pass a rank of the real group spent inside its
    all-reduce calls (mean over ranks), to compare with what training spends in them (the
    planner does not use it: planner.measured_costs.skew_absorbed says why). Not on a GPU, where
    a call only queues the collective and a late partner is waited for on the device."""

    in_allreduce_fwd_s: float
    in_allreduce_bwd_s: float
    in_allreduce_bwd_recompute_s: float


class _TrainingStep(TypedDict):
    procs: int
    microbatches: int
    step_s: float
    params: int


class TrainingStep(_TrainingStep, total=False):
    """`procs` one-stage pipelines training at once (runtime_overhead.data_parallel_step): the
    fastest step of the bursts (`bursts_s`), and what hexi-profile's `contention()` derives."""

    bursts_s: list[float]
    one_rank_step_s: float
    one_rank_measured_s: float
    grad_allreduce_s: float


class _ContentionProbe(TypedDict):
    procs: int
    tp: int
    mbs: int
    together_s: float


class ContentionProbe(_ContentionProbe, total=False):
    """What the comm job measures of contention (hexi-profile's `contention()` makes the
    profile's entry of it): a layer stage timed on every process at once, and the runtime's
    data-parallel step (megatron_hexi.profile.runtime_overhead.data_parallel_step)."""

    training: TrainingStep
    alone_s: float  # the grid's time of the same layer, where it was measured


class _Slowdown(TypedDict):
    slowdown: float


class ContentionRecord(_Slowdown, ContentionProbe, total=False):
    """The profile's `contention` entry (hexi-profile's `contention()`)."""

    probe_slowdown: float | None


class LayerRuns(TypedDict, total=False):
    """The comm job's layer timings (megatron_hexi.profile.comm), each where it was measured."""

    contention: ContentionProbe
    tp_layer: list[TPLayerRow]


class CurvePoint(TypedDict):
    bytes: int
    s: float


class _Curves(TypedDict):
    allreduce: list[CurvePoint]
    allgather: list[CurvePoint]
    p2p: list[CurvePoint]


class CommResult(_Curves, LayerRuns):
    """What the comm job's rank 0 writes: time vs bytes per collective, and its layer runs."""


class BurstDone(TypedDict):
    """The comm job's answer to a burst: its data-parallel step (None: the job trains none)."""

    step_s: float | None


class _CommHead(_Curves):
    procs: int
    backend: str
    fit: dict[str, dict[str, float] | None]  # per collective (comm.fit_ring)


class CommRecord(_CommHead, LayerRuns):
    """The comm job's result (CommJob.finish); the profile's `comm` is it without the layer
    runs, which the profile keeps in `contention` and `tp_layer`."""


class _ProfileHead(TypedDict):
    """What a profile records before anything is measured."""

    format: str
    device: str
    dtype: str
    attention_backend: str
    threads: int
    cpu_cores: int | None
    host: str
    torch: str
    date: str
    model: dict[str, object]
    layer: list[LayerRecord]
    embedding: list[EndRecord]
    head: list[EndRecord]


class Profile(_ProfileHead, total=False):
    """A device profile, as hexi-profile writes it. The comm job's entries (`comm`,
    `contention`, `tp_layer`) are passed on as the job's processes wrote them (JSON)."""

    matmul_tflops: float
    optimizer: OptimizerRecord
    runtime: RuntimeRecord
    comm: CommRecord
    contention: ContentionRecord
    tp_layer: list[TPLayerRow]
    complete: bool
    seconds: float
    source: str
