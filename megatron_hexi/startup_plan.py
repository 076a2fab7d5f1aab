"""Plan at start-up (--hetero-cluster): every start plans for the processes that are there.

An elastic run starts again whenever a node is lost or joins. Each start the processes share who
they are (one all-gather), launch rank 0 runs the planner on the cluster file cut down to the
nodes that run processes (planner.membership), and broadcasts the plan or the planner's error;
every rank validates what it receives, so a plan that fits nowhere is the same clear error on
every rank. With --islands sites or auto the start plans islands as `hexi-plan plan --islands`
does (planner.search_islands.plan_islands) on the nodes present: a start that finds a whole site
gone plans the remaining sites as islands, and the checkpoint's islands continue by site
(planner.island_match). With --save the plan is kept as SAVE/plans/plan_<iteration>.json (written
atomically), iteration being the checkpoint this start resumes from, so a run's history shows
the plan of each of its starts.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from megatron_hexi.arguments import PlanningInputs
from megatron_hexi.config import CheckpointConfig
from megatron_hexi.rank_mapping import Identity, LaunchError, local_identity
from megatron_hexi.report import AgreedError, shown
from planner.cluster import ClusterSpec
from planner.errors import SpecError
from planner.membership import present_cluster
from planner.plan import Plan, plan_from_dict, save_plan
from planner.search_islands import IslandRequest, plan_islands

PLANS_DIR = "plans"


@dataclass(frozen=True)
class StartedPlan:
    """The plan this start trains under, and the name its metrics record (None: not written)."""

    plan: Plan
    file_name: str | None


def processes_per_node(cluster: ClusterSpec, device_name: str) -> dict[str, int]:
    """node -> processes on it, from one all-gather of every process's identity; a process that
    names no node of the file is a LaunchError on every rank."""
    gathered: list[Identity | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local_identity(cluster, device_name))
    everyone = [i for i in gathered if i is not None]
    unnamed = [i for i in everyone if not i.node]
    if unnamed:
        first = unnamed[0]
        raise LaunchError(
            f"process {first.launch_rank} (host {shown(first.hostname)}) could not be placed on "
            f"a node of cluster {cluster.name!r}: set HEXI_PLAN_NODE to its node name, or list the "
            f"host in the cluster file's hostname(s)"
        )
    return dict(Counter(i.node for i in everyone))


def resume_iteration(config: CheckpointConfig) -> int:
    """The iteration this start resumes from (0 for a fresh start), from --load's pointer as the
    load will read it, without loading anything: it names the plan file."""
    if not config.load or config.finetune:
        return 0
    if config.ckpt_step is not None:
        return config.ckpt_step
    from megatron_hexi.checkpoint import CheckpointError, pointed_step

    try:
        return pointed_step(config.load) or 0  # `release`: a model imported at iteration 0
    except CheckpointError:  # none yet (--hetero-load-if-exists), or one the load will refuse
        return 0


def present_request(inputs: PlanningInputs, present: ClusterSpec) -> IslandRequest:
    """--islands for the nodes present: as hexi-plan plan's, except that `sites` with one site
    of the file's several left plans synchronously (as `auto` does there): one island has no
    other to meet, and an outer step on it alone would only cost the outer state's memory."""
    request = inputs.islands

    def sites(cluster: ClusterSpec) -> int:
        return len({g.site for g in cluster.groups})

    if request.mode == "sites" and sites(present) < 2 <= sites(inputs.cluster):
        return replace(request, mode="off")
    return request  # a file of one site: hexi-plan's error, naming the cluster


@dataclass(frozen=True)
class _Decision:
    """What launch rank 0 broadcasts: the plan (as JSON) or the problems, and the file name."""

    plan: dict[str, Any] | None = None
    problems: tuple[str, ...] = ()
    file_name: str | None = None


def _decide(
    inputs: PlanningInputs, checkpoint: CheckpointConfig, present: dict[str, int]
) -> _Decision:
    """Launch rank 0: plan for `present` and keep the plan under --save."""
    nodes = ", ".join(f"{shown(n)} ({k})" for n, k in present.items())
    try:
        cut = present_cluster(inputs.cluster, present)
        plan = plan_islands(cut, inputs.model, inputs.options, present_request(inputs, cut))
    except SpecError as e:
        where = f"planning at start-up for {sum(present.values())} process(es) on nodes {nodes}"
        return _Decision(problems=tuple(f"{where}: {p}" for p in e.problems))
    if not checkpoint.save:
        return _Decision(plan.to_dict())
    name = f"plan_{resume_iteration(checkpoint)}.json"
    plans = os.path.join(checkpoint.save, PLANS_DIR)
    if os.path.islink(plans) or (os.path.lexists(plans) and not os.path.isdir(plans)):
        return _Decision(
            problems=(
                f"--save {checkpoint.save}: {plans} is "
                f"{'a symbolic link' if os.path.islink(plans) else 'not a folder'}; start-up "
                f"plans are kept only in a folder of that name inside the checkpoint folder",
            )
        )
    try:
        os.makedirs(plans, exist_ok=True)
        save_plan(plan, os.path.join(plans, name))
    except OSError as e:
        return _Decision(problems=(f"--save {checkpoint.save}: cannot write the plan ({e})",))
    return _Decision(plan.to_dict(), file_name=name)


def plan_at_start(
    inputs: PlanningInputs, checkpoint: CheckpointConfig, device_name: str
) -> StartedPlan:
    """Plan for the processes present (collective: every rank returns the same plan or raises
    the same SpecError)."""
    present = processes_per_node(inputs.cluster, device_name)
    message: list[_Decision | None] = [
        _decide(inputs, checkpoint, present) if dist.get_rank() == 0 else None
    ]
    dist.broadcast_object_list(message, src=0)
    decision = message[0]
    assert decision is not None  # rank 0 always sends one
    if decision.problems or decision.plan is None:
        raise AgreedError(list(decision.problems))
    return StartedPlan(plan_from_dict(decision.plan, "start-up plan"), decision.file_name)


__all__ = [
    "StartedPlan",
    "plan_at_start",
    "processes_per_node",
    "resume_iteration",
    "PLANS_DIR",
]
