"""--exit-duration-in-mins, --manual-gc and the loop's other stops (`stop_line`: a signal,
--exit-interval), as Megatron-LM's training loop does them.

The duration counts from the earliest start-up of any rank (megatron_hexi.start_time, imported
by megatron_hexi.entry before the command line is parsed); after each iteration the ranks agree
with one all-reduce whether any has passed it, so every rank stops (and saves) at the same
iteration. Manual GC turns Python's automatic collection off, so that no rank pauses for it in
the middle of a collective while the others wait; every rank collects at the same iterations
instead.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_hexi.start_time import STARTED as START

if TYPE_CHECKING:
    from megatron_hexi.exit_signal import ExitSignal


class ExitDuration:
    """`passed()` is True on every rank once any rank's wall time since the earliest start
    exceeds the limit (collective; call it on every rank after each iteration)."""

    def __init__(self, minutes: float, device: torch.device) -> None:
        self.minutes = minutes
        start = torch.tensor([START], dtype=torch.float64, device=device)
        dist.all_reduce(start, op=dist.ReduceOp.MIN)
        self.start = float(start.item())
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)

    def elapsed_minutes(self) -> float:
        return (time.time() - self.start) / 60.0

    def passed(self) -> bool:
        self._flag.fill_(int(self.elapsed_minutes() > self.minutes))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item())


class ManualGC:
    """gc.disable() for the run (restored after it), gc.collect() every `interval` iterations
    and around each evaluation."""

    def __init__(self, on: bool, interval: int) -> None:
        self.on, self.interval = on, interval
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> ManualGC:
        if self.on:
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    def around_evaluation(self) -> None:
        if self.on:
            gc.collect()


def stop_line(
    iteration: int,
    stop: ExitSignal | None,
    duration: ExitDuration | None,
    exit_interval: int | None,
) -> tuple[str, bool] | None:
    """Whether the loop ends after `iteration`: (the line rank 0 prints, whether the run was
    signalled or ran out of time: it saves, then goes without evaluating), or None to go on.
    Collective (the signal and the duration are agreed on by all-reduce), in this order: every
    rank calls it after every iteration."""
    if stop is not None and stop.agreed():
        return (
            f" received signal {stop.signum.name} at iteration {iteration}: saving and exiting "
            f"(--exit-signal-handler)",
            True,
        )
    if duration is not None and duration.passed():
        return (
            f" exiting program after {duration.elapsed_minutes():.2f} minutes at iteration "
            f"{iteration} (--exit-duration-in-mins {duration.minutes:g})",
            True,
        )
    if exit_interval and iteration % exit_interval == 0:
        return f" exiting at iteration {iteration} (--exit-interval {exit_interval})", False
    return None
