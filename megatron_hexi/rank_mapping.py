"""Map launched processes to plan ranks, and check them against the plan before any group exists.

Processes may start in any order (torchrun, Slurm). Each one describes itself as (node, local rank,
device); one all-gather on the default group shares these, and every rank derives the same mapping
from the same list, so a mismatch is the same clear error on every rank and nothing hangs.
A process's node is HEXI_PLAN_NODE when set (the launchers set it), else its host name matched
against the cluster's `hostname(s)`, else its launch order: launch rank = plan rank.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_hexi.report import shown
from planner.errors import SpecError

if TYPE_CHECKING:
    from planner.cluster import ClusterSpec
    from planner.plan import Plan


class LaunchError(SpecError):
    """The processes that were started do not match the plan."""


@dataclass(frozen=True)
class Identity:
    launch_rank: int
    node: str  # plan node name, or "" when mapping by launch order
    hostname: str
    local_rank: int
    device: str  # what torch reports ("cpu" when emulating)


def check_world_size(plan: Plan, world_size: int) -> None:
    """Fails identically on every rank (no collective needed)."""
    if world_size != plan.world_size:
        raise LaunchError(
            f"world size {world_size} does not match the plan's {plan.world_size} "
            f"ranks; launch {plan.world_size} processes (e.g. torchrun "
            f"--nproc-per-node ... so that nodes x processes = {plan.world_size})"
        )


def local_identity(cluster: ClusterSpec, device_name: str) -> Identity:
    """This process's Identity (its node in `cluster`), before any collective."""
    node = os.environ.get("HEXI_PLAN_NODE", "")
    host = socket.gethostname()
    if not node:
        by_host: dict[str, str] = {}
        for n in cluster.nodes:
            if n.hostname:
                by_host[n.hostname] = n.name
        node = by_host.get(host) or by_host.get(host.split(".")[0], "")
    return Identity(
        dist.get_rank(), node, host, int(os.environ.get("LOCAL_RANK", "0")), device_name
    )


def resolve_ranks(
    plan: Plan, identities: Sequence[Identity], check_devices: bool
) -> dict[int, int]:
    """launch rank -> plan rank from everyone's Identity; one LaunchError on any mismatch."""
    named = [i for i in identities if i.node]
    if not named:
        mapping = {i.launch_rank: i.launch_rank for i in identities}
    elif len(named) != len(identities):
        missing = sorted(i.launch_rank for i in identities if not i.node)
        raise LaunchError(
            f"processes {missing} (host {shown(identities[missing[0]].hostname)}) could not "
            f"be placed on a plan node: set HEXI_PLAN_NODE or list their host in "
            f"the cluster's hostname(s)"
        )
    else:
        slot = {(e.node, e.local_rank): e.rank for e in plan.ranks}
        nodes = {n.name for n in plan.cluster.nodes}
        mapping = {}
        for i in identities:
            if i.node not in nodes:
                raise LaunchError(
                    f"process {i.launch_rank} (host {shown(i.hostname)}) says node "
                    f"'{shown(i.node)}', which is not a node of cluster "
                    f"{plan.cluster.name!r}"
                )
            if (i.node, i.local_rank) not in slot:
                raise LaunchError(
                    f"process {i.launch_rank} on node {shown(i.node)} has local rank "
                    f"{i.local_rank}, but the plan uses no such GPU there"
                )
            mapping[i.launch_rank] = slot[i.node, i.local_rank]
        if len(set(mapping.values())) != len(mapping):
            raise LaunchError(
                "two processes claim the same plan GPU (node, local rank): check "
                "HEXI_PLAN_NODE and --nproc-per-node"
            )
    if check_devices:
        from planner.catalog import match_device_name

        for i in identities:
            want = plan.ranks[mapping[i.launch_rank]].gpu
            got = match_device_name(i.device)
            if got is None or got.name != want:
                raise LaunchError(
                    f"plan rank {mapping[i.launch_rank]} (process {i.launch_rank} "
                    f"on {shown(i.hostname)}) expects {want}, but the device is "
                    f"'{shown(i.device)}'; re-plan for this cluster or use the plan made "
                    f"for it"
                )
    return mapping


def map_processes(plan: Plan, device_name: str, check_devices: bool) -> dict[int, int]:
    """All-gather identities and return {launch rank: plan rank} (same on every rank)."""
    mine = local_identity(plan.cluster, device_name)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return resolve_ranks(plan, everyone, check_devices)
