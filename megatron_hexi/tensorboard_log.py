"""Optional TensorBoard scalars (--tensorboard-dir), through torch.utils.tensorboard.

Launch rank 0 writes them: it holds every all-reduced metric of the iteration. Names follow
Megatron-LM's where it has one ("lm loss", "learning-rate", "grad-norm", "iteration-time",
"batch-size"), plus tokens per second, MFU, each pipeline's step time and each rank's peak memory.
"""

import os
from collections.abc import Mapping
from typing import Any

from planner.errors import SpecError


def check_available() -> None:
    """Raise a one-line SpecError if torch.utils.tensorboard cannot be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise SpecError(
            f"--tensorboard-dir needs the tensorboard package ({e}); install it with "
            f"pip install 'megatron-hexi[tensorboard]' (or pip install tensorboard)"
        )


class TensorBoardLogger:
    def __init__(
        self, log_dir: str | os.PathLike[str], global_batch_size: int, log_interval: int = 1
    ) -> None:
        check_available()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)
        self.global_batch_size = global_batch_size
        self.log_interval = max(1, log_interval)

    def log(self, iteration: int, m: Mapping[str, Any]) -> None:
        if iteration % self.log_interval:
            return
        w = self.writer
        w.add_scalar("lm loss", m["lm_loss"], iteration)
        w.add_scalar("learning-rate", m["lr"], iteration)
        w.add_scalar("grad-norm", m["grad_norm"], iteration)
        w.add_scalar("iteration-time", m["step_time_s"], iteration)
        w.add_scalar("batch-size", self.global_batch_size, iteration)
        w.add_scalar("tokens-per-second", m["tokens_per_s"], iteration)
        w.add_scalar("mfu", m["mfu"], iteration)
        for p, t in enumerate(m["pipelines"]):
            w.add_scalar(f"pipeline-step-time/pipeline-{p}", t, iteration)
        for r, gb in enumerate(m["peak_memory_gb"]):
            w.add_scalar(f"peak-memory-gb/rank-{r}", gb, iteration)

    def summary(self, text: str, iteration: int) -> None:
        self.writer.add_text("summary", text, iteration)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
