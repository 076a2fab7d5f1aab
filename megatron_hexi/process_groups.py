"""Process groups built once from the plan: stage TP groups and gradient-segment groups.

Every rank creates every group in the same order (torch.distributed requires it), at start-up;
no group is ever created inside the training step. Plan ranks are translated to launch ranks
here, so the rest of the runtime speaks plan ranks only.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from planner.layout import island_ranks

if TYPE_CHECKING:
    from planner.plan import Plan


def group_order(ranks: Iterable[int], launch_of: Mapping[int, int]) -> list[int]:
    """The plan ranks of a group in the order torch numbers its members: `new_group` sorts the
    launch ranks, and launch order need not follow the plan. Collectives that cut a buffer into
    per-member chunks (reduce-scatter, all-gather, boundary parts) must lay it out in this order."""
    return sorted(ranks, key=launch_of.__getitem__)


class StagePosition:
    """Stands in for a pipeline group where megatron-core only asks for rank() and size().

    Stages of one pipeline may have different TP degrees, so no real group spans "the same TP
    rank in every stage"; the 1F1B schedule only needs the stage index and the stage count.
    """

    def __init__(self, stage: int, num_stages: int) -> None:
        self._stage, self._num = stage, num_stages

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self._num


class SingleRank:
    """A size-1 group stand-in for dimensions this runtime does not split (context parallel)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


@dataclass
class HeteroGroups:
    plan_rank: int
    launch_of: dict[int, int]  # plan rank -> launch rank
    tp: dist.ProcessGroup | None = None  # this rank's stage TP group
    # rank set (plan ranks) -> group
    segment_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    # this rank's island (planner.islands): its gradient norm is taken over it; None: the world
    # (a plan of one island)
    island: dist.ProcessGroup | None = None


def build_groups(
    plan: Plan,
    mapping: Mapping[int, int],
    rank_sets: Iterable[tuple[int, ...]],
    timeout: datetime.timedelta,
) -> HeteroGroups:
    """Create the stage TP groups, one group per gradient rank set and one per island (when the
    plan has several), in one global order."""
    plan_rank = mapping[dist.get_rank()]
    launch_of = {p: launch for launch, p in mapping.items()}
    groups = HeteroGroups(plan_rank, launch_of)
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            g = dist.new_group([launch_of[r] for r in stage.ranks], timeout=timeout)
            if plan_rank in stage.ranks:
                groups.tp = g
    for ranks in rank_sets:
        if len(ranks) < 2:
            continue
        g = dist.new_group([launch_of[r] for r in ranks], timeout=timeout)
        if plan_rank in ranks:
            groups.segment_groups[ranks] = g
    islands = island_ranks(plan)
    if len(islands) > 1:
        for ranks in islands:
            g = dist.new_group([launch_of[r] for r in ranks], timeout=timeout)
            if plan_rank in ranks:
                groups.island = g
    return groups
