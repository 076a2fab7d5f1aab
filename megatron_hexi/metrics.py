"""What a training run reports: Megatron-LM's iteration line averaged over the log interval
(`IntervalLog`), the validation block, the closing summary, the scalar writers' interface
(TensorBoard, wandb) and the peak memory figure.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import resource
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from megatron_hexi import tensorboard_log, wandb_log
from megatron_hexi.run_paths import MetricsFile
from megatron_hexi.tensorboard_log import perplexity
from planner.errors import SpecError

if TYPE_CHECKING:
    from megatron_hexi.config import RunConfig
    from planner.plan import Plan


def peak_memory_gb(device: torch.device) -> float:
    """CUDA allocator peak on GPU; on CPU the process's peak resident set (includes libraries)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class ScalarWriter(Protocol):
    """TensorBoard (megatron_hexi.tensorboard_log) or wandb (megatron_hexi.wandb_log)."""

    def log(
        self, iteration: int, scalars: Mapping[str, float], *, always: bool = False
    ) -> None: ...

    def summary(self, text: str, iteration: int) -> None: ...

    def close(self) -> None: ...


class Evaluation(NamedTuple):
    """One validation loss: the token-weighted mean over `batches` global batches."""

    lm_loss: float
    tokens: int
    batches: int


class IntervalLog:
    """Megatron-LM's iteration line, averaged over the iterations since the last one it printed
    (--log-interval): loss and step time are means, tokens/s and MFU are over the interval's
    total time; learning rate, loss scale and grad norm are the last iteration's. As in
    Megatron-LM, the loss is the mean over the iterations whose step was not skipped (loss
    scaling), and the grad norm is left out after a skipped step."""

    def __init__(self, plan: Plan, train_iters: int, flops: float, log_throughput: bool) -> None:
        self.plan, self.train_iters = plan, train_iters
        self.flops, self.log_throughput = flops, log_throughput
        self.rows: list[Mapping[str, Any]] = []
        self.started = time.monotonic()
        self.first_iteration: int | None = None

    def add(self, m: Mapping[str, Any]) -> None:
        if self.first_iteration is None:
            self.first_iteration = m["iteration"] - 1
        self.rows.append(m)

    def line(self) -> str:
        """The line for the iterations added since the last call."""
        rows, self.rows = self.rows, []
        n, last = len(rows), rows[-1]
        seconds = sum(r["step_time_s"] for r in rows)
        tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in rows)
        mfu = sum(r["mfu"] * r["step_time_s"] for r in rows) / seconds
        it, plan = last["iteration"], self.plan
        elapsed = time.monotonic() - self.started
        done = it - (self.first_iteration or 0)
        eta = elapsed / done * (self.train_iters - it) if done else 0.0
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        text = (
            f" [{stamp}] iteration {it:>8d}/{self.train_iters:>8d} | consumed samples: "
            f"{it * plan.global_batch_size:>12d} | elapsed time per iteration (ms): "
            f"{seconds / n * 1000:.1f} | "
        )
        if self.log_throughput:
            per_gpu = self.flops * n / seconds / plan.world_size / 1e12
            text += f"throughput per GPU (TFLOP/s/GPU): {per_gpu:.4f} | "
        skipped = sum(0 if r["success"] else 1 for r in rows)
        nan = sum(0 if math.isfinite(r["lm_loss"]) else 1 for r in rows)
        advanced = [r["lm_loss"] for r in rows if r["success"]]
        return text + (
            f"learning rate: {last['lr']:.6E} | global batch size: {plan.global_batch_size:>5d} | "
            + (f"lm loss: {sum(advanced) / len(advanced):.6E} | " if advanced else "")
            + f"loss scale: {last.get('loss_scale', 1.0):.1f} | "
            + (f"grad norm: {last['grad_norm']:.3f} | " if last["grad_norm"] is not None else "")
            + (f"params norm: {last['params_norm']:.3f} | " if "params_norm" in last else "")
            + f"number of skipped iterations: {skipped:>3d} | "
            f"number of nan iterations: {nan:>3d} | tokens/s: {tokens / seconds:.1f} | "
            f"MFU: {mfu * 100:.2f}% | "
            + (
                f"grad sync exposed (ms): "
                f"{sum(r['grad_sync_exposed_s'] for r in rows) / n * 1000:.1f} | "
                if plan.training.overlap_grad_reduce
                else ""
            )
            + _outer_text(rows)
            + f"elapsed: {_clock(elapsed)} | ETA: {_clock(eta)} |"
        )


def _outer_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """Islands: the outer steps the interval ran (planner.islands), with their bytes and their
    exposed time; nothing for a plan without `training.outer`."""
    if "outer_step" not in rows[-1]:
        return ""
    ran = [r for r in rows if r["outer_step"] not in (False, None)]
    if not ran:
        return "outer steps: 0 | "
    sent = sum(max(r["outer_sync_bytes"]) for r in ran)
    exposed = sum(r["outer_sync_exposed_s"] for r in rows)
    return (
        f"outer steps: {len(ran)} (last after iteration {ran[-1]['iteration']}) | outer sync "
        f"MB per rank (max): {sent / 1e6:.3f} | outer sync exposed (ms): {exposed * 1000:.1f} | "
    )


def _clock(seconds: float) -> str:
    """H:MM:SS."""
    return str(datetime.timedelta(seconds=round(seconds)))


def validation_lines(where: str, ev: Evaluation) -> str:
    """Megatron-LM's validation block: loss and perplexity between two rules."""
    text = (
        f" validation loss at {where} | lm loss value: {ev.lm_loss:.6E} | lm loss PPL: "
        f"{perplexity(ev.lm_loss):.6E} | "
    )
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"


def wandb_config(plan: Plan, config: RunConfig) -> dict[str, Any]:
    """What the wandb run records as its config: the run's settings and the plan's shape."""
    import dataclasses

    return {
        **dataclasses.asdict(config),
        "launch_rank": dist.get_rank(),
        "plan": {
            "world_size": plan.world_size,
            "pipelines": len(plan.pipelines),
            "global_batch_size": plan.global_batch_size,
        },
    }


def summary(
    history: Sequence[Mapping[str, Any]],
    first: int,
    tokens_per_iter: int,
    flops: float,
    peak: float,
    device: torch.device,
    skip_train: bool,
    saves: Sequence[Mapping[str, Any]],
) -> str:
    """The closing line: iterations and tokens of this run, throughput, MFU, memory, checkpoints
    (`saves`: the run's checkpoint saves, each with its "seconds")."""
    if not history:
        reason = "--skip-train" if skip_train else f"resumed at iteration {first} = --train-iters"
        return f"done: nothing trained ({reason})"
    seconds = sum(h["step_time_s"] for h in history)
    tokens = len(history) * tokens_per_iter
    memory = [
        round(max(h["peak_memory_gb"][r] for h in history), 3)
        for r in range(len(history[0]["peak_memory_gb"]))
    ]
    text = (
        f"done: iterations {first + 1}-{first + len(history)} ({len(history)} this run), "
        f"{tokens} tokens in {seconds:.2f} s of steps, mean {tokens / seconds:.1f} tokens/s, "
        f"MFU {len(history) * flops / (seconds * peak):.2%} "
        f"({'CPU processes' if device.type == 'cpu' else 'plan GPUs'} peak), peak memory per "
        f"rank (GB): {memory}"
    )
    if saves:
        text += f", {len(saves)} checkpoint save(s) in {sum(e['seconds'] for e in saves):.2f} s"
    return text


def open_outputs(
    outputs: contextlib.ExitStack[bool | None], plan: Plan, config: RunConfig, *, append: bool
) -> tuple[MetricsFile | None, list[ScalarWriter]]:
    """This launch rank's outputs, each closed by `outputs` on every way out: the metrics file
    (`append`: a resumed run appends to the history it continues) and TensorBoard on launch
    rank 0, wandb on the last one."""
    log, ckpt = config.logging, config.checkpoint
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics_file = None
    writers: list[ScalarWriter] = []
    if rank == 0:
        if log.metrics_path:
            metrics_file = MetricsFile(log.metrics_path, append=append)
            outputs.callback(metrics_file.close)
        if log.tensorboard_dir:
            writers.append(
                tensorboard_log.TensorBoardLogger(log.tensorboard_dir, log.tensorboard_log_interval)
            )
            outputs.callback(writers[-1].close)
    if rank == world - 1 and log.wandb_project:
        writers.append(wandb_log.WandbLogger(log, ckpt.save, wandb_config(plan, config)))
        outputs.callback(writers[-1].close)
    return metrics_file, writers


def check_finite(metrics: Mapping[str, Any]) -> None:
    """Megatron-LM's --check-for-nan-in-loss-and-grad: stop on a NaN or infinite loss or gradient
    norm. Both are all-reduced values, so every rank stops at the same iteration, before saving
    the diverged weights. A step skipped under loss scaling has no norm: its inf/NaN gradients
    are what loss scaling handles, by skipping."""
    loss, norm = metrics["lm_loss"], metrics["grad_norm"]
    if not (math.isfinite(loss) and (norm is None or math.isfinite(norm))):
        raise SpecError(
            f"iteration {metrics['iteration']}: lm loss {loss}, grad norm {norm}: "
            f"training stopped on a non-finite value (lower --lr, or keep going with "
            f"--no-check-for-nan-in-loss-and-grad); nothing was saved for this "
            f"iteration"
        )
