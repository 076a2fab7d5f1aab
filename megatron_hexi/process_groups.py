"""Process groups built once from the plan: stage TP groups and gradient-segment groups.

Every rank creates every group in the same order (torch.distributed requires it), at start-up;
no group is ever created inside the training step. Plan ranks are translated to launch ranks
here, so the rest of the runtime speaks plan ranks only.
"""
from dataclasses import dataclass, field

import torch.distributed as dist


def group_order(ranks, launch_of):
    """The plan ranks of a group in the order torch numbers its members: `new_group` sorts the
    launch ranks, and launch order need not follow the plan. Collectives that cut a buffer into
    per-member chunks (reduce-scatter, all-gather, boundary parts) must lay it out in this order."""
    return sorted(ranks, key=launch_of.__getitem__)


class StagePosition:
    """Stands in for a pipeline group where megatron-core only asks for rank() and size().

    Stages of one pipeline may have different TP degrees, so no real group spans "the same TP
    rank in every stage"; the 1F1B schedule only needs the stage index and the stage count.
    """

    def __init__(self, stage, num_stages):
        self._stage, self._num = stage, num_stages

    def rank(self):
        return self._stage

    def size(self):
        return self._num


class SingleRank:
    """A size-1 group stand-in for dimensions this runtime does not split (context parallel)."""

    def rank(self):
        return 0

    def size(self):
        return 1


@dataclass
class HeteroGroups:
    plan_rank: int
    launch_of: dict                        # plan rank -> launch rank
    tp: object = None                      # this rank's stage TP group
    segment_groups: dict = field(default_factory=dict)   # rank set (plan ranks) -> group
    world: object = None

    def launch_rank(self, plan_rank):
        return self.launch_of[plan_rank]


def build_groups(plan, mapping, rank_sets, timeout):
    """Create the stage TP groups and one group per gradient rank set, in one global order."""
    plan_rank = mapping[dist.get_rank()]
    launch_of = {p: l for l, p in mapping.items()}
    groups = HeteroGroups(plan_rank, launch_of, world=dist.group.WORLD)
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
    return groups
