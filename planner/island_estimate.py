"""The estimate of a plan with islands: each island's step, then the outer sync on top.

Each island is simulated as a plan of its own pipelines (the weighted sync inside the island
only); the iteration is the slowest island's step plus the outer sync's exposed seconds
amortised over H steps (planner.outer_sync). Every rank keeps the fp32 outer parameters and
momentum of the elements whose optimizer state it keeps (the simulator's `outer_state`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from planner.estimate import Estimate, StageReport
from planner.flops import model_flops_per_sample
from planner.outer_sync import outer_sync

if TYPE_CHECKING:
    from planner.plan import Plan
    from planner.topology import Topology


def simulate_islands(
    plan: Plan, topo: Topology, island: Callable[[Sequence[int]], Estimate]
) -> Estimate:
    """The estimate of `plan` (with islands or outer steps); `island(pipes)`: the estimate of
    the pipelines `pipes` synchronised among themselves, outer state counted in memory."""
    islands = plan.island_pipelines()
    ests = [island(p) for p in islands]
    inner = max(e.iteration_time_s for e in ests)
    slow = max(range(len(ests)), key=lambda i: ests[i].iteration_time_s)
    windows = [max(e.pipeline_time_s) + inner - e.iteration_time_s for e in ests]
    osync = outer_sync(plan, topo, windows)
    iteration = inner + osync.time_per_step
    per_rank: dict[int, tuple[float, float, dict[str, float]]] = {}
    ptimes = [0.0] * len(plan.pipelines)
    reports: list[StageReport] = []
    for pipes, e in zip(islands, ests):
        ranks = sorted(r for p in pipes for r in plan.pipelines[p].ranks)
        per_rank.update(zip(ranks, zip(e.peak_memory_gb, e.memory_capacity_gb, e.memory_terms_gb)))
        for p, t in zip(pipes, e.pipeline_time_s):
            ptimes[p] = t
        reports += [replace(st, pipeline=pipes[st.pipeline]) for st in e.stages]
    reports.sort(key=lambda st: (st.pipeline, st.stage))
    rows = [per_rank[r] for r in sorted(per_rank)]
    samples = plan.global_batch_size
    peak = sum(topo.device_of(r).peak_flops for r in per_rank)
    fits = all(e.fits_memory for e in ests)
    worst = ests[slow] if fits else next(e for e in ests if not e.fits_memory)
    i = ests.index(worst)
    label = "" if len(ests) == 1 else f"island {i} of {len(ests)}: "
    # the island's text numbers its pipelines within the island: the plan's numbers instead
    text = re.sub(
        r"\bpipeline (\d+)(?![\d.])",
        lambda m: f"pipeline {islands[i][int(m[1])]}",
        worst.bottleneck,
    )
    outer = plan.training.outer
    if fits and osync.time_per_step > 0.5 * iteration:
        assert outer is not None
        why = (
            f"communication-bound: outer sync {osync.time_per_step:.3g} s per step exposed of "
            f"{iteration:.3g} s (H={outer.interval}, {outer.fragments} fragment(s), "
            f"{outer.compression}); slowest island {slow}: {text}"
        )
    else:
        why = f"{label}{text}; outer sync {osync.time_per_step:.3g} s per step"
    return Estimate(
        iteration,
        samples * plan.model.seq_length / iteration,
        samples * model_flops_per_sample(plan.model) / (iteration * peak),
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        ptimes,
        ests[slow].grad_sync_time_s,
        ests[slow].optimizer_step_time_s,
        why,
        fits,
        reports,
        ests[slow].grad_sync_serial_s,
        ests[slow].overlapped,
        inner,
        osync.time_per_step,
        osync.bytes_per_step,
        [e.iteration_time_s for e in ests],
    )
