"""What the simulator reports: the plan's `estimate` (Estimate) and per-stage rows (StageReport).

Its own module so that the islands' estimate (planner.island_estimate) builds one without the
simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageReport:
    pipeline: int
    stage: int
    ranks: tuple[int, ...]
    fwd: float  # per micro-batch, incl. the all-gather of received activations
    bwd: float
    compute: float
    tp_comm: float
    p2p_in: float  # transfer + gather, fwd + bwd, of the boundary before this stage
    host_wait: float = 0.0  # the part of `compute` spent waiting for the host (planner.host)


@dataclass
class Estimate:
    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    peak_memory_gb: list[float]
    memory_capacity_gb: list[float]
    memory_terms_gb: list[dict[str, float]]  # per rank {term: GB}
    pipeline_time_s: list[float]
    grad_sync_time_s: float  # exposed: what the gradient sync adds to the iteration
    optimizer_step_time_s: float
    bottleneck: str
    fits_memory: bool
    stages: list[StageReport] = field(default_factory=list)
    # all gradient collectives one after another (= grad_sync_time_s when nothing overlaps)
    grad_sync_serial_s: float = 0.0
    overlapped: bool = False  # whether the sync was modelled as overlapped
    # islands (planner.islands): the slowest island's step, the outer sync's exposed seconds
    # amortised per step, and the bytes crossing sites per step (amortised); None without
    inner_step_time_s: float | None = None
    outer_sync_time_s: float | None = None
    cross_site_bytes_per_step: float | None = None
    island_step_time_s: list[float] | None = None  # each island's own step

    def to_dict(self) -> dict[str, Any]:
        """The plan's `estimate` object (JSON keys are a contract)."""
        return {
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "peak_memory_gb": self.peak_memory_gb,
            "memory_capacity_gb": self.memory_capacity_gb,
            "fits_memory": self.fits_memory,
            "pipeline_time_s": self.pipeline_time_s,
            "grad_sync_time_s": self.grad_sync_time_s,
            "optimizer_step_time_s": self.optimizer_step_time_s,
            "bottleneck": self.bottleneck,
            # written only for an overlapped sync, so that serial plans' estimates keep their keys
            **(
                {
                    "grad_sync_exposed_s": self.grad_sync_time_s,
                    "grad_sync_serial_s": self.grad_sync_serial_s,
                }
                if self.overlapped
                else {}
            ),
            # written only for plans with islands or outer steps
            **(
                {
                    "inner_step_time_s": self.inner_step_time_s,
                    "outer_sync_time_s": self.outer_sync_time_s,
                    "cross_site_bytes_per_step": self.cross_site_bytes_per_step,
                    "island_step_time_s": self.island_step_time_s,
                }
                if self.inner_step_time_s is not None
                else {}
            ),
        }
