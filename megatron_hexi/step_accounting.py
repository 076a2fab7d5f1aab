"""A training step without host reads inside it: its batches, its clock and its one read.

CUDA runs asynchronously: every value the host reads from the device (`.item()`, `float(t)`,
`.tolist()`, `synchronize()`) waits for all the work queued before it, and the GPU then idles
while the host dispatches the next kernels. So a step:

- copies the batches of all its micro-batches to the device once, before the schedule starts,
  from pinned memory without blocking (`batches_to_device`);
- counts its loss-masked tokens on the device (`loss_mask_tokens`) and keeps the global count,
  the loss sum and the gradient norm there;
- times itself with CUDA events (`StepClock`), read once the step's work is done;
- reads everything it reports at its end, in one transfer (`Trainer.train_step`).

On CPU the clock is the host's: CPU work is done when the call returns.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch


def batches_to_device(
    batches: Sequence[Mapping[str, torch.Tensor]], device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of one step on `device`: on CUDA copied from pinned host memory
    without blocking the host (the copies queue ahead of the step's kernels)."""
    if device.type != "cuda":
        return [dict(b) for b in batches]
    return [
        {k: v.pin_memory().to(device, non_blocking=True) for k, v in b.items()} for b in batches
    ]


def loss_mask_tokens(
    batches: Sequence[Mapping[str, torch.Tensor]],
    device: torch.device,
    slot: int = 0,
    slots: int = 1,
) -> torch.Tensor:
    """The number of loss-masked tokens in `batches`, as a float64 tensor [slots] on `device`
    holding it at `slot` (this rank's island; zeros elsewhere), so that one all-reduce gives
    every island's count (integers: exact in any order)."""
    out = torch.zeros(slots, dtype=torch.float64, device=device)
    if batches:
        sums = torch.stack([b["loss_mask"].sum(dtype=torch.float64) for b in batches])
        out[slot] = sums.sum().to(device)
    return out


class StepClock:
    """Named instants of one step; `seconds` between two of them once the step has ended.

    On CUDA each instant is an event recorded on the current stream, so marking costs no wait;
    `wait` blocks until the last one has passed (the step's one wait for the device). On CPU an
    instant is the host's clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: dict[str, torch.cuda.Event | float] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks[name] = event
        else:
            self._marks[name] = time.perf_counter()

    def wait(self, name: str) -> None:
        """Block until instant `name` has passed on the device (nothing to wait for on CPU)."""
        mark = self._marks[name]
        if isinstance(mark, torch.cuda.Event):
            mark.synchronize()

    def seconds(self, start: str, end: str) -> float:
        """Seconds from instant `start` to instant `end` (both passed: after `wait(end)`)."""
        a, b = self._marks[start], self._marks[end]
        if isinstance(a, torch.cuda.Event) and isinstance(b, torch.cuda.Event):
            return a.elapsed_time(b) / 1e3
        assert isinstance(a, float) and isinstance(b, float)
        return b - a
