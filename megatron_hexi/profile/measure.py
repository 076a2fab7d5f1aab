"""Compute measurements on the local device with the runtime's own stage modules.

Every stage is built by megatron_hexi.model.stage_config / build_stage_model (a single rank, so
TP shards are built at their local size and no collective runs): what is timed is what a rank of
that shard computes in training.

Statistic: the mean of a burst of runs back to back after warm-up (and, in hexi-profile, the
fastest of several rounds spread over the run). A shared machine has slow spells of seconds, in
which every run is 30-50 % slower (measured on a 2-core VM); a median taken inside one spell
keeps the whole slowdown, the fastest round over spread-out rounds does not. What is predicted
is the undisturbed cost. Within a round the mean, not the fastest run: a training step is the
sum of its passes, and on that VM the fastest forward plus the fastest backward of a 2-layer
stage, over 8 rounds of 4, was 10 % below the fastest round's mean of the same passes (16.9
against 18.6 ms). The one-rank Trainer steps (runtime_overhead.py) then read the gap as part
of a per-micro-batch overhead (2.5-5.9 ms on the fidelity bench's model, against 0-3.6 ms
since).

Attention: every stage runs the backend it is given (hexi-profile's --attention-backend; by
default DEFAULT_ATTENTION_BACKEND, the one `hexi-plan` plans for by default: fused, torch's
scaled_dot_product_attention). A profile records it (`attention_backend`); the planner charges
unfused attention's extra memory traffic only where it estimates layer times from FLOPs, not on
a profile's measured layers, so a profile should be taken with the backend training will run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from megatron_hexi.config import FusionConfig
from megatron_hexi.fusions import stage_fusions
from megatron_hexi.grad_sync import FP32MainGrads, param_grad
from megatron_hexi.loss import sharded_cross_entropy
from megatron_hexi.model import build_stage_model, stage_config
from megatron_hexi.profile.records import EndRecord, LayerRecord, OptimizerRecord
from planner.attention import CLI_DEFAULT_BACKEND
from planner.plan import Training

DEFAULT_ATTENTION_BACKEND = CLI_DEFAULT_BACKEND

if TYPE_CHECKING:
    import torch.distributed as dist

    from megatron_hexi.model import StageView
    from planner.models import ModelSpec


def _world() -> dist.ProcessGroup:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != 1:
        raise RuntimeError("profile stages need a one-rank process group (Stage(group=...))")
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("profile stages need the default process group to exist")
    return world


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class ProfilePlan:
    """What the stage builders read of a plan (megatron_hexi.model.StagePlan): the model, and a
    plan's training defaults (eager layers, as a profile measures them)."""

    model: ModelSpec
    training: Training


@dataclass(frozen=True)
class ShardView:
    """What the stage builders read of a rank's view (megatron_hexi.model.StageView), for a
    stage built and run on its own: one pipeline stage, no sequence parallelism."""

    tp_size: int
    layers: tuple[int, int]  # [first, last)
    query_groups: tuple[int, int]  # (count, offset), as planner.plan.RankView
    heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int] | None  # held with the embedding or the output layer
    holds_embedding: bool
    holds_output: bool
    sequence_parallel: bool = False
    stage: int = 0
    num_stages: int = 1


def shard_view(
    model: ModelSpec, t: int, layers: int, first: bool = False, last: bool = False
) -> ShardView:
    """The view of TP rank 0 of an even t-way stage, built as a one-rank stage. Query groups and
    FFN columns are 1/t of the model's (at least one)."""
    g, hpg = model.num_query_groups, model.num_attention_heads // model.num_query_groups
    q = max(1, g // t)
    f = max(1, model.ffn_hidden_size // t)
    v = max(1, model.vocab_size // t)
    return ShardView(
        tp_size=1,
        layers=(0, layers),
        query_groups=(q, 0),
        heads=(q * hpg, 0),
        ffn=(f, 0),
        vocab=(v, 0) if (first or last) else None,
        holds_embedding=first,
        holds_output=last,
    )


def splits_evenly(model: ModelSpec, t: int) -> bool:
    """Whether a t-way TP group can hold equal shards of this model (what tp_view builds)."""
    return model.num_query_groups % t == 0 and model.ffn_hidden_size % t == 0


def tp_view(model: ModelSpec, t: int, rank: int, layers: int) -> ShardView:
    """The view of TP rank `rank` of an even t-way middle stage run over a real
    t-process group: the layers run their all-reduces, as in training."""
    g, hpg = model.num_query_groups, model.num_attention_heads // model.num_query_groups
    q, f = g // t, model.ffn_hidden_size // t
    return ShardView(
        tp_size=t,
        layers=(0, layers),
        query_groups=(q, rank * q),
        heads=(q * hpg, rank * q * hpg),
        ffn=(f, rank * f),
        vocab=None,
        holds_embedding=False,
        holds_output=False,
        sequence_parallel=False,  # its layers all-reduce whole activations
    )


class Stage:
    """One single-rank stage: build, then time forward / backward per micro-batch."""

    def __init__(
        self,
        model: ModelSpec,
        view: StageView,
        mbs: int,
        device: torch.device,
        dtype: torch.dtype,
        recompute: bool = False,
        group: dist.ProcessGroup | None = None,
        *,
        attention_backend: str,
    ) -> None:
        plan = ProfilePlan(model, Training(global_batch_size=mbs))
        bf16 = dtype == torch.bfloat16
        # the fused kernels training runs on this device (megatron_hexi.fusions)
        fusions = stage_fusions(
            FusionConfig(),
            device.type == "cuda",
            model,
            bf16=bf16,
            transformer_impl="local",
            holds_output=view.holds_output,
        )
        self.cfg = stage_config(
            plan, view, params_dtype=dtype, recompute=recompute, fusions=fusions
        )
        self.net = build_stage_model(
            plan, view, group or _world(), self.cfg, device, attention_backend=attention_backend
        )
        with torch.no_grad():
            for p in self.net.parameters():
                p.normal_(0.0, 0.02) if p.ndim > 1 else p.fill_(1.0)
        # bf16: gradients accumulate in fp32 `main_grad`, as in training (and as the gradient-
        # accumulation fusion needs)
        self.main_grads = FP32MainGrads(self.net.parameters()) if bf16 else None
        self.view, self.model, self.device, self.dtype = view, model, device, dtype
        s, h = model.seq_length, model.hidden_size
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(s, mbs, h, generator=gen).to(device, dtype)
        self.grad = torch.randn(s, mbs, h, generator=gen).to(device, dtype) * 1e-3
        self.tokens = torch.randint(
            0, view.vocab[0] if view.vocab else 1, (mbs, s), generator=gen
        ).to(device)
        self.positions = torch.arange(s, device=device).unsqueeze(0).expand(mbs, s)
        self.labels = self.tokens.clone()
        self.net.train()
        self.host_runs: list[tuple[float, float]] = []  # per run() (forward, backward) host s
        # the last run()'s clock readings: its start, the forward's end, the backward's end
        self.last_bounds: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def forward(self) -> torch.Tensor:
        v = self.view
        if v.holds_embedding:
            out = self.net(self.tokens, self.positions, None)
        else:
            x = self.x.detach().requires_grad_(True)
            self.net.set_input_tensor(x)
            out = self.net(None, None, None)
        if v.holds_output:
            per_token = sharded_cross_entropy(out.float(), self.labels, 0, None, 1)
            return per_token.sum()
        return out

    def backward(self, out: torch.Tensor) -> None:
        if out.dim() == 0:
            out.backward()
        else:
            out.backward(self.grad)

    def run(self) -> tuple[float, float]:
        """(forward s, backward s) of one micro-batch. Also records in `host_runs` the host's
        part: until the forward call and the backward call return, before the device is waited
        for (kernel launches are asynchronous on CUDA; on a CPU the host is the device, and the
        host time is the whole pass)."""
        self.net.zero_grad(set_to_none=False)
        sync(self.device)
        t0 = time.perf_counter()
        out = self.forward()
        hf = time.perf_counter() - t0
        sync(self.device)
        t1 = time.perf_counter()
        self.backward(out)
        hb = time.perf_counter() - t1
        sync(self.device)
        t2 = time.perf_counter()
        self.host_runs.append((hf, hb))
        self.last_bounds = (t0, t1, t2)
        return t1 - t0, t2 - t1

    def time(self, reps: int, warmup: int = 2) -> tuple[float, float]:
        """(forward s, backward s) of a micro-batch: the mean of `reps` runs back to back after
        `warmup`, as training runs its micro-batches (the module docstring says why not their
        fastest)."""
        runs = [self.run() for _ in range(warmup + reps)][warmup:]
        return statistics.fmean(r[0] for r in runs), statistics.fmean(r[1] for r in runs)

    def host_time(self, reps: int) -> tuple[float, float]:
        """(fastest forward, fastest backward) host seconds of the last `reps` runs."""
        runs = self.host_runs[-reps:]
        return min(r[0] for r in runs), min(r[1] for r in runs)


def warm_up(
    model: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    seconds: float,
    *,
    attention_backend: str,
) -> None:
    """Run a stage for `seconds` before anything is timed: a process's first passes are slower
    (allocator growth, lazy initialisation, clock ramp-up) and would inflate the first point."""
    st = Stage(
        model, shard_view(model, 1, 1), 1, device, dtype, attention_backend=attention_backend
    )
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        st.run()


def layer_entry(
    model: ModelSpec,
    t: int,
    mbs: int,
    device: torch.device,
    dtype: torch.dtype,
    reps: int,
    layers: int = 2,
    *,
    attention_backend: str,
) -> LayerRecord:
    """Per-layer seconds of a 1/t shard: forward, backward, forward and backward under full
    recompute, and the host's part of the forward and backward (`Stage.run`; the planner's host
    time per layer pass, planner.host). The forward under recompute saves no activations for
    backward, so it is faster than the plain one (5 % at micro-batch 1 and 11 % at 2 on the
    fidelity bench's model on a 2-core VM)."""
    view = shard_view(model, t, layers)
    stage = Stage(model, view, mbs, device, dtype, attention_backend=attention_backend)
    f, b = stage.time(reps)
    hf, hb = stage.host_time(reps)
    frc, brc = Stage(
        model, view, mbs, device, dtype, recompute=True, attention_backend=attention_backend
    ).time(reps)
    return {
        "tp": t,
        "query_groups": view.query_groups[0],
        "ffn": view.ffn[0],
        "mbs": mbs,
        "fwd_s": f / layers,
        "bwd_s": b / layers,
        "bwd_recompute_s": brc / layers,
        "fwd_recompute_s": frc / layers,
        "host_fwd_s": hf / layers,
        "host_bwd_s": hb / layers,
    }


def end_entries(
    model: ModelSpec,
    t: int,
    mbs: int,
    device: torch.device,
    dtype: torch.dtype,
    reps: int,
    warmup: int = 2,
    *,
    attention_backend: str,
) -> dict[str, EndRecord]:
    """Embedding stage and head stage costs: a one-layer first / last stage minus a one-layer
    middle stage (same stage machinery, so per-stage overheads cancel). The three stages run in
    turn and each difference is taken within one round, so a slow spell of the machine hits both
    sides of it; the median over rounds is kept."""
    views = {
        "middle": shard_view(model, t, 1),
        "embedding": shard_view(model, t, 1, first=True),
        "head": shard_view(model, t, 1, last=True),
    }
    stages = {
        kind: Stage(model, view, mbs, device, dtype, attention_backend=attention_backend)
        for kind, view in views.items()
    }
    diffs: dict[str, list[list[float]]] = {"embedding": [], "head": []}
    for i in range(warmup + reps):
        times = {k: st.run() for k, st in stages.items()}
        if i >= warmup:
            for kind in diffs:
                diffs[kind].append([a - b for a, b in zip(times[kind], times["middle"])])
    out: dict[str, EndRecord] = {}
    for kind, d in diffs.items():
        vocab = views[kind].vocab
        assert vocab is not None  # shard_view: a first or last stage holds vocabulary rows
        out[kind] = {
            "tp": t,
            "vocab": vocab[0],
            "mbs": mbs,
            "fwd_s": max(statistics.median(x[0] for x in d), 0.0),
            "bwd_s": max(statistics.median(x[1] for x in d), 0.0),
        }
    return out


def matmul_tflops(
    model: ModelSpec, mbs: int, device: torch.device, dtype: torch.dtype, seconds: float = 0.5
) -> float:
    """Achieved throughput of the layer's largest GEMM shape ([s*b, h] x [h, ffn])."""
    m, k, n = model.seq_length * mbs, model.hidden_size, model.ffn_hidden_size
    a = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ w
    sync(device)
    count, t0 = 0, time.perf_counter()
    while True:
        a @ w
        count += 1
        if count % 4 == 0:
            sync(device)
            if time.perf_counter() - t0 > seconds:
                break
    dt = time.perf_counter() - t0
    return 2.0 * m * k * n * count / dt / 1e12


class _AllOwned:
    """The gradient sync of a rank that owns every gradient (megatron_hexi.optimizer.OwnedGrads,
    what the optimizer's exact norm reads): a single rank holds the whole stage."""

    norm_group: dist.ProcessGroup | None = None  # the world, which is this one rank

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = params

    def owned_grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self.params:
            g = param_grad(p)
            if g is None:
                raise RuntimeError("optimizer_entry sets every parameter's gradient")
            grads.append(g)
        return grads


def optimizer_entry(
    model: ModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    reps: int,
    layer_counts: Sequence[int] = (1, 3),
) -> OptimizerRecord:
    """The runtime's optimizer step (megatron-core FP32Optimizer/Float16 wrapper around AdamW,
    exact grad norm over the world, clipping) on stage models of two sizes: fit fixed + per param.
    Needs an initialised process group (one rank is enough)."""
    from megatron_hexi.config import (
        LRScheduleConfig,
        OptimizerConfig,
        PrecisionConfig,
        RunConfig,
        TrainingConfig,
    )
    from megatron_hexi.optimizer import build_optimizer

    config = RunConfig(
        training=TrainingConfig(train_iters=100),
        optimizer=OptimizerConfig(lr=1e-4),
        lr_schedule=LRScheduleConfig(lr_decay_style="constant"),
        precision=PrecisionConfig(bf16=dtype == torch.bfloat16),
    )
    points = []
    for n in layer_counts:
        # attention does not change the optimizer's cost: any backend builds the same parameters
        st = Stage(
            model,
            shard_view(model, 1, n),
            1,
            device,
            dtype,
            attention_backend=DEFAULT_ATTENTION_BACKEND,
        )
        params = [p for p in st.net.parameters()]
        bf16 = dtype == torch.bfloat16
        for p in params:  # bf16: gradients live in fp32 main_grad, as in the runtime
            g = torch.randn(p.shape, dtype=torch.float32, device=p.device) * 1e-3
            if bf16:
                p.main_grad = g
            else:
                p.grad = g

        opt, _ = build_optimizer(st.net, _AllOwned(params), config)
        times = []
        for i in range(reps + 2):
            sync(device)
            t0 = time.perf_counter()
            opt.step()
            sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        points.append((sum(p.numel() for p in params), min(times)))
    (n1, t1), (n2, t2) = points
    per = max((t2 - t1) / (n2 - n1), 1e-15)
    return {
        "fixed_s": max(t1 - per * n1, 0.0),
        "s_per_param": per,
        "points": [{"params": n, "s": t} for n, t in points],
    }


# the time fields of each record (the rest say which point it is)
LAYER_TIMES: tuple[
    Literal["fwd_s", "bwd_s", "bwd_recompute_s", "fwd_recompute_s", "host_fwd_s", "host_bwd_s"],
    ...,
]
LAYER_TIMES = ("fwd_s", "bwd_s", "bwd_recompute_s", "fwd_recompute_s", "host_fwd_s", "host_bwd_s")
END_TIMES: tuple[Literal["fwd_s", "bwd_s"], ...] = ("fwd_s", "bwd_s")
Statistic = Callable[[Iterable[float]], float]


def combine_layers(entries: Sequence[LayerRecord], statistic: Statistic) -> LayerRecord:
    """One grid entry from several rounds' entries of the same point: `statistic` (min for the
    layer times) of each time."""
    out = entries[0].copy()
    for k in LAYER_TIMES:
        out[k] = statistic(e[k] for e in entries)
    return out


def combine_ends(entries: Sequence[EndRecord], statistic: Statistic) -> EndRecord:
    """combine_layers for the embedding/head entries (median: their differences are taken within
    a round, so a spell is mostly divided out)."""
    out = entries[0].copy()
    for k in END_TIMES:
        out[k] = statistic(e[k] for e in entries)
    return out


def sizes_for(model: ModelSpec, tp_widths: Iterable[int]) -> list[int]:
    """TP widths that give distinct, non-empty shards of this model."""
    out = []
    for t in tp_widths:
        if t >= 1 and t <= model.num_query_groups and t not in out:
            out.append(t)
    return out or [1]
