"""--exit-signal-handler: SIGTERM ends the run after the current step, with a checkpoint.

Torch elastic's agent and Slurm send SIGTERM before they stop workers (a planned restart, a
node joining, preemption), then wait before SIGKILL (torch elastic: 30 s). The handler only
records the signal; after each step the ranks agree on it with one small all-reduce (a rank
that has not received it yet stops with the others), so every rank saves the same iteration and
exits 0, and the next start resumes with no step lost.
"""

from __future__ import annotations

import signal
import types

import torch
import torch.distributed as dist


class ExitSignal:
    """Records SIGTERM; `agreed` says whether any rank has received it (collective)."""

    def __init__(self, device: torch.device, signum: signal.Signals = signal.SIGTERM) -> None:
        self.signum = signum
        self.received = False
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._previous = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.received = True

    def agreed(self) -> bool:
        """True on every rank once any rank has received the signal."""
        self._flag.fill_(int(self.received))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item())

    def restore(self) -> None:
        """Put back the handler that was there before."""
        signal.signal(self.signum, self._previous)


__all__ = ["ExitSignal"]
